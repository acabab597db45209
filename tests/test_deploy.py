"""deploy/ and docs/deploy.md, checked statically (no cloud, Kubernetes or Docker engine here):
the YAML parses, carries what Ray's cluster launcher and KubeRay require, and every `memserver`
and `memtrain` command the files run is accepted by the real CLI parsers."""

from __future__ import annotations

import copy
import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

import memserver.cli as cli
import trainer.train as train
from memserver.cluster import PLACEMENT_STRATEGIES

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
SEPARATORS = {";", "&&", "||", "|", "&", "(", ")", "<", ">", ">>"}
PROGRAMS = {"memserver": cli.build_parser, "memtrain": train.build_parser}
MODULES = {"memserver.cli": "memserver", "trainer.train": "memtrain"}


def run_strings(node: Any) -> list[str]:
    """The shell text a parsed YAML document runs: Ray's `*_commands` lists, a container's
    `command` + `args`, a RayJob's `entrypoint` (found at any depth)."""
    out: list[str] = []
    if isinstance(node, list):
        for v in node:
            out += run_strings(v)
    elif isinstance(node, dict):
        argv = [*node.get("command", []), *node.get("args", [])] if isinstance(node.get("command", []), list) else []
        if argv:
            out.append(shlex.join(argv))
        for key, v in node.items():
            if key.endswith("_commands") and isinstance(v, list):
                out += [c for c in v if isinstance(c, str)]
            elif key == "entrypoint" and isinstance(v, str):
                out.append(v)
            elif key not in ("command", "args"):
                out += run_strings(v)
    return out


def commands(text: str) -> list[tuple[str, list[str]]]:
    """(program, argv) of every memserver / memtrain invocation in shell text, including quoted
    ones (`ray exec cfg "memserver status"`) and `python -m memserver.cli ...`."""
    found = []
    text = re.sub(r"\\\n", " ", text)  # line continuations
    for line in text.splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        try:
            tokens = list(lexer)
        except ValueError:  # not shell (prose with an apostrophe)
            continue
        segment: list[str] = []
        for tok in [*tokens, ";"]:
            if tok not in SEPARATORS:
                segment.append(tok)
                continue
            found.extend(_invocation(segment))
            for word in segment:
                if " " in word and re.search(r"\b(memserver|memtrain)\b", word):
                    found.extend(commands(word))
            segment = []
    return found


def _invocation(segment: list[str]) -> list[tuple[str, list[str]]]:
    """The program a simple shell command runs, if it is ours: `[VAR=x ...] [path/bin/]memserver
    ARGS`, `... -- memserver ARGS` (kubectl exec) or `python -m memserver.cli ARGS`."""
    words = list(segment)
    while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
        words.pop(0)
    if "--" in words and words[0] != "memserver":  # kubectl exec POD -- memserver ...
        words = words[words.index("--") + 1:]
    if not words:
        return []
    program = words[0]
    if program in PROGRAMS or program.endswith(("/bin/memserver", "/bin/memtrain")):
        return [(program.rsplit("/", 1)[-1], words[1:])]
    if re.search(r"(^|/)python[0-9.]*$", program) and words[1:2] == ["-m"] and words[2:3] and words[2] in MODULES:
        return [(MODULES[words[2]], words[3:])]
    return []


def parse(program: str, argv: list[str]) -> Any:
    try:
        return PROGRAMS[program]().parse_args(argv)
    except SystemExit as exc:
        if exc.code == 0:  # --help
            return None
        pytest.fail(f"`{program} {shlex.join(argv)}` is rejected by the {program} CLI (exit {exc.code})")


def yaml_docs(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d is not None]


def test_command_extraction_finds_what_it_should():
    text = 'a && memserver up --shards 2; FOO=1 .venv/bin/memtrain --steps 3 | tee x\nray exec c.yaml "memserver status"'
    assert commands(text) == [("memserver", ["up", "--shards", "2"]), ("memtrain", ["--steps", "3"]),
                              ("memserver", ["status"])]
    assert commands("python -m memserver.cli down --timeout 5") == [("memserver", ["down", "--timeout", "5"])]


def test_tables_config_loads_with_the_cli():
    cfg = cli.load_config(str(DEPLOY / "tables.yaml"))
    assert cfg["shards"] >= 1 and cfg["shard_gpus"] > 0 and cfg["placement"] in PLACEMENT_STRATEGIES
    [table] = cfg["tables"]
    assert table["name"] and table["num_rows"] > 0 and table["dim"] % cfg["shards"] == 0


def test_ray_cluster_launcher_config():
    from ray.autoscaler._private.util import prepare_config, validate_config

    cfg = yaml.safe_load((DEPLOY / "ray-cluster.yaml").read_text())
    for key in ("cluster_name", "provider", "available_node_types", "head_node_type", "max_workers",
                "setup_commands", "head_start_ray_commands", "worker_start_ray_commands"):
        assert key in cfg, key
    types = cfg["available_node_types"]
    assert cfg["head_node_type"] in types
    for name, t in types.items():
        for key in ("resources", "node_config", "min_workers", "max_workers"):
            assert key in t, f"{name}: {key}"
        assert t["min_workers"] <= t["max_workers"] <= cfg["max_workers"]
    gpu = [n for n, t in types.items() if t["resources"].get("GPU", 0) > 0]
    assert gpu and cfg["head_node_type"] not in gpu
    assert sum(t["min_workers"] for t in types.values()) <= cfg["max_workers"]
    validate_config(prepare_config(copy.deepcopy(cfg)))  # Ray's own schema, with its defaults filled in
    setup = " ".join(cfg["setup_commands"])
    assert "torch==2.13.0" in setup and "ray[default]==2.60.0" in setup and "$HOME/memserver[cpu]" in setup
    assert any("ray start --head" in c for c in cfg["head_start_ray_commands"])
    ups = [argv for c in cfg["head_start_ray_commands"] for prog, argv in commands(c) if argv[:1] == ["up"]]
    assert len(ups) == 1
    up = parse("memserver", ups[0])
    assert up.address == "auto" and up.detach and up.port and up.config and up.auth
    assert Path(up.config).name == "tables.yaml" and (ROOT / "deploy" / "tables.yaml").exists()
    # file_mounts copies the checkout to the path the setup commands install from
    assert cfg["file_mounts"] == {"/home/ubuntu/memserver": "."}
    # A hunt: the data directory (the default checkpoint root, and where `--auth`'s TLS key is
    # made) was tables.yaml's node-local one: checkpoints answered done and could not be restored,
    # and shards on the workers could not read the key. It is on the NFS mount every node makes.
    [mount] = [c for c in cfg["setup_commands"] if "mount -t nfs" in c]
    shared = mount.split(":/ ")[1].split(";")[0]  # (mount ... $SHARED_NFS:/ /shared; ...)
    assert up.data_dir and Path(up.data_dir).is_relative_to(shared)


def test_kuberay_raycluster():
    docs = yaml_docs("kuberay-raycluster.yaml")
    [rc] = [d for d in docs if d["kind"] == "RayCluster"]
    assert rc["apiVersion"] == "ray.io/v1" and rc["metadata"]["name"] == "memserver"
    head = rc["spec"]["headGroupSpec"]
    assert isinstance(head["rayStartParams"], dict) and head["template"]["spec"]["containers"]
    groups = rc["spec"]["workerGroupSpecs"]
    assert groups
    for spec in [head, *groups]:
        # KubeRay's CRD: rayStartParams is map[string]string
        assert all(isinstance(v, str) for v in spec["rayStartParams"].values()), spec["rayStartParams"]
        for c in spec["template"]["spec"]["containers"]:
            assert c["name"] and c["image"]
    for g in groups:
        for key in ("groupName", "replicas", "minReplicas", "maxReplicas", "rayStartParams", "template"):
            assert key in g, f"{g.get('groupName')}: {key}"
        assert g["minReplicas"] <= g["replicas"] <= g["maxReplicas"]
    gpu = [g for g in groups if any("nvidia.com/gpu" in c["resources"]["limits"] for c in g["template"]["spec"]["containers"])]
    assert gpu, "a GPU worker group"
    [head_c] = head["template"]["spec"]["containers"]
    assert 50051 in [p["containerPort"] for p in head_c["ports"]]  # the coordinator, on the head service
    # the tables ConfigMap is mounted on the head and says the same as deploy/tables.yaml
    [cm] = [d for d in docs if d["kind"] == "ConfigMap"]
    assert yaml.safe_load(cm["data"]["tables.yaml"]) == yaml.safe_load((DEPLOY / "tables.yaml").read_text())
    assert tables_mount()


def tables_mount() -> str:
    """Where the head pod of the RayCluster mounts the tables ConfigMap."""
    docs = yaml_docs("kuberay-raycluster.yaml")
    [cm] = [d for d in docs if d["kind"] == "ConfigMap"]
    [rc] = [d for d in docs if d["kind"] == "RayCluster"]
    pod = rc["spec"]["headGroupSpec"]["template"]["spec"]
    [vol] = [v for v in pod["volumes"] if v.get("configMap", {}).get("name") == cm["metadata"]["name"]]
    [mount] = [m for c in pod["containers"] for m in c.get("volumeMounts", []) if m["name"] == vol["name"]]
    return mount["mountPath"]


def test_kuberay_memserver_job():
    [job] = yaml_docs("kuberay-memserver-job.yaml")
    assert job["apiVersion"] == "ray.io/v1" and job["kind"] == "RayJob" and job["metadata"]["name"]
    [rc] = [d for d in yaml_docs("kuberay-raycluster.yaml") if d["kind"] == "RayCluster"]
    assert job["spec"]["clusterSelector"] == {"ray.io/cluster": rc["metadata"]["name"]}
    assert job["spec"]["shutdownAfterJobFinishes"] is False  # never delete the selected cluster
    [(prog, argv)] = commands(job["spec"]["entrypoint"])
    up = parse(prog, argv)
    assert argv[0] == "up" and up.address == "auto" and not up.detach and up.port == 50051
    assert Path(up.config).parent.as_posix() == tables_mount() and Path(up.config).name == "tables.yaml"
    # tokens and TLS from the Secret, which the head (coordinator) and every worker group (shards) mount
    secret_dirs = set()
    for spec in [rc["spec"]["headGroupSpec"], *rc["spec"]["workerGroupSpecs"]]:
        pod = spec["template"]["spec"]
        [vol] = [v for v in pod["volumes"] if "secret" in v]
        [mount] = [m for c in pod["containers"] for m in c.get("volumeMounts", []) if m["name"] == vol["name"]]
        secret_dirs.add(mount["mountPath"])
    [secret_dir] = secret_dirs
    for path in (up.auth_token_file, up.tls_cert, up.tls_key):
        assert path and Path(path).parent.as_posix() == secret_dir
    for group in rc["spec"]["workerGroupSpecs"]:  # shards: the certificate and key, never the tokens
        [vol] = [v for v in group["template"]["spec"]["volumes"] if "secret" in v]
        files = {item["path"] for item in vol["secret"].get("items", [])}
        assert files == {Path(up.tls_cert).name, Path(up.tls_key).name}, files
    assert up.tls_server_name  # pod addresses change: the certificate names a DNS name
    # A hunt: checkpoints went to the default root, each pod's own data_dir: the shards' slices
    # stayed on their pods and no restore could read the checkpoint. The root is a ReadWriteMany
    # claim that the head (manifest) and every worker group (slices) mount at one path.
    [pvc] = [d for d in yaml_docs("kuberay-raycluster.yaml") if d["kind"] == "PersistentVolumeClaim"]
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    for spec in [rc["spec"]["headGroupSpec"], *rc["spec"]["workerGroupSpecs"]]:
        pod = spec["template"]["spec"]
        [vol] = [v for v in pod["volumes"] if v.get("persistentVolumeClaim", {}).get("claimName") == pvc["metadata"]["name"]]
        [mount] = [m for c in pod["containers"] for m in c.get("volumeMounts", []) if m["name"] == vol["name"]]
        assert up.checkpoint_root and Path(up.checkpoint_root).is_relative_to(mount["mountPath"])


def test_dockerfile():
    text = (DEPLOY / "Dockerfile").read_text()
    lines = re.sub(r"\\\n", " ", text).splitlines()
    instructions = [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1]) for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
    assert instructions[0] == ("FROM", "python:3.11-slim")
    runs = [arg for ins, arg in instructions if ins == "RUN"]
    torch_at = next(i for i, r in enumerate(runs) if "pip install" in r and "torch==2.13.0" in r)
    project_at = next(i for i, r in enumerate(runs) if "pip install" in r and re.search(r"\s\"?\.(\[[^]]+\])?\"?(\s|$)", r))
    assert torch_at < project_at  # torch pinned and installed before the project
    for ins, arg in instructions:  # every COPY source exists in the build context (the repo root)
        if ins == "COPY":
            *sources, _dest = arg.split()
            for src in sources:
                assert (ROOT / src).exists(), f"COPY {src}: not in the repository"
    [cmd] = [json.loads(arg) for ins, arg in instructions if ins == "CMD"]
    assert cmd[0] == "memserver" and cmd[1] == "up"
    parse("memserver", cmd[1:])
    for prog, argv in commands("\n".join(runs)):
        parse(prog, argv)
    assert "up" in cmd and "--address" not in cmd  # alone, the image starts its own Ray head


@pytest.mark.parametrize("name", ["ray-cluster.yaml", "kuberay-raycluster.yaml", "kuberay-memserver-job.yaml",
                                  "tables.yaml", "Dockerfile", "../docs/deploy.md"])
def test_every_command_parses(name):
    path = DEPLOY / name
    if path.suffix == ".yaml":
        found = [c for doc in yaml_docs(name) for s in run_strings(doc) for c in commands(s)]
    elif path.suffix == ".md":
        blocks = re.findall(r"```(?:bash|sh)\n(.*?)```", path.read_text(), flags=re.S)
        inline = re.findall(r"`((?:memserver|memtrain) [^`]*)`", path.read_text())
        found = [c for b in blocks for c in commands(b)] + [c for s in inline for c in commands(s)]
    else:
        found = commands("\n".join(ln for ln in path.read_text().splitlines() if not ln.lstrip().startswith("#")))
    minimum = {"ray-cluster.yaml": 2, "kuberay-memserver-job.yaml": 1, "Dockerfile": 1, "../docs/deploy.md": 15}
    assert len(found) >= minimum.get(name, 0), found
    for prog, argv in found:
        parse(prog, argv)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the script where there is no GPU; on a "
                    "GPU machine the script itself is the run (make test-gpu)")
def test_the_gpu_machine_script_records_versions_and_runs_the_gpu_tests(tmp_path):
    """tests/gpu/device_run.sh, as a lent GPU machine runs it, here without CUDA: it records the
    versions, runs tests/gpu (all skipped, saying why), and fails because benchmarks.gpu refuses
    to measure without a GPU (a run that measured nothing must not look like a success)."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable, "BENCH_ARGS": "--quick",
           "WHEELS": str(tmp_path / "no-wheels")}  # .whl/ (make gpu-wheels) holds Python 3.12 wheels
    env.pop("PYTHONPATH", None)
    done = subprocess.run(["bash", "tests/gpu/device_run.sh"], cwd=root, env=env, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 1, done.stdout + done.stderr
    versions = (tmp_path / "versions.txt").read_text()
    assert "torch 2.13.0" in versions and "GPU: none" in versions and "grpc 1.85.1" in versions
    tests = (tmp_path / "test-gpu.log").read_text()
    assert re.search(r"=+ \d+ skipped in ", tests), tests[-2000:]
    assert "SKIPPED" in tests and "no CUDA device" in tests
    assert "no CUDA device: this benchmark measures a GPU" in (tmp_path / "bench-gpu.log").read_text()
    assert "--device cuda: no CUDA device here" in (tmp_path / "profile-gpu.log").read_text()


def test_ray_for_the_gpu_machine_keeps_what_a_shard_actor_loads(tmp_path):
    """tests/gpu/pack_ray.py (make gpu-wheels): Ray's wheel as a tarball without what a shard actor
    never loads; its metadata, its private modules and the dashboard's Python stay (the node agent
    imports it), and the raylet stays executable (a mode lost there, and Ray cannot start it)."""
    import tarfile
    import zipfile

    from tests.gpu.pack_ray import kept, pack

    wheel = tmp_path / "ray-0-cp312-cp312-manylinux2014_x86_64.whl"
    members = {"ray/__init__.py": 0o644, "ray/core/src/ray/raylet/raylet": 0o755, "ray/_private/worker.py": 0o644,
               "ray/dashboard/agent.py": 0o644, "ray-0.dist-info/METADATA": 0o644, "ray/jars/ray_dist.jar": 0o644,
               "ray/rllib/algo.py": 0o644, "ray/dashboard/client/build/main.js": 0o644, "ray/data/dataset.py": 0o644}
    with zipfile.ZipFile(wheel, "w") as zf:
        for name, mode in members.items():
            info = zipfile.ZipInfo(name)
            info.external_attr = mode << 16
            zf.writestr(info, name)
    assert pack(wheel, tmp_path / "ray.tar.xz") == 4
    with tarfile.open(tmp_path / "ray.tar.xz") as tf:
        got = {m.name: m.mode for m in tf.getmembers()}
        assert tf.extractfile("ray/_private/worker.py").read() == b"ray/_private/worker.py"
    assert got == {name: mode for name, mode in members.items() if kept(name)}
    assert set(got) == {"ray/__init__.py", "ray/core/src/ray/raylet/raylet", "ray/_private/worker.py",
                        "ray/dashboard/agent.py", "ray-0.dist-info/METADATA"}
