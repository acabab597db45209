"""Ray for a lent GPU machine (`make gpu-wheels`; tests/gpu/device_run.sh unpacks it there).

Ray's Python 3.12 wheel is 75.6 MiB, over the 64 MiB a device call carries, so the Ray-actor GPU
test skipped there. A shard actor never loads Ray's Java jars, RLlib, Data, Train, Tune, LLM or the
dashboard's web client (the dashboard's Python stays: the node agent imports it); without them,
as an xz tarball, Ray is 19.8 MiB (main prints both). Its one dependency the image lacks (jsonschema, with its own) goes
beside it as wheels, at this venv's versions.

    python -m tests.gpu.pack_ray .whl
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

# what a shard actor never imports (paths inside the wheel)
PRUNED = ("ray/jars/", "ray/rllib/", "ray/data/", "ray/train/", "ray/tune/", "ray/llm/", "ray/dashboard/client/build/")
# Ray's requirements that the GPU machine's image lacks (the rest are there: click, aiohttp, ...)
MISSING = ("jsonschema", "jsonschema-specifications", "referencing", "rpds-py")
TARBALL = "ray-py312-pruned.tar.xz"


def kept(name: str) -> bool:
    """Whether a wheel's member goes into the tarball."""
    return not name.startswith(PRUNED)


def pack(wheel: Path, out: Path) -> int:
    """The wheel's kept members as an xz tarball at `out`; returns how many were left out."""
    left = 0
    with zipfile.ZipFile(wheel) as zf, tarfile.open(out, "w:xz", preset=9) as tf:
        for info in zf.infolist():
            if info.is_dir():
                continue
            if not kept(info.filename):
                left += 1
                continue
            member = tarfile.TarInfo(info.filename)
            member.size = info.file_size
            member.mode = (info.external_attr >> 16) & 0o777 or 0o644  # raylet and gcs_server stay executable
            with zf.open(info) as src:
                tf.addfile(member, src)
    return left


def download(names: list[str], dest: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", "--platform", "manylinux2014_x86_64",
                    "--platform", "manylinux_2_17_x86_64", "-d", str(dest), *names], check=True)


def main(argv: list[str]) -> None:
    dest = Path(argv[0] if argv else ".whl")
    dest.mkdir(parents=True, exist_ok=True)
    version = importlib.metadata.version
    download([f"{name}=={version(name)}" for name in MISSING], dest)
    with tempfile.TemporaryDirectory() as scratch:
        download([f"ray=={version('ray')}"], Path(scratch))
        wheel = next(Path(scratch).glob("ray-*.whl"))
        wheel_mib = wheel.stat().st_size / 2**20
        left = pack(wheel, dest / TARBALL)
    carried = sum(f.stat().st_size for f in dest.iterdir() if f.is_file()) / 2**20
    print(f"{dest / TARBALL}: {(dest / TARBALL).stat().st_size / 2**20:.1f} MiB ({left} files of {wheel.name} "
          f"({wheel_mib:.1f} MiB) left out); {dest}/ in all: {carried:.1f} MiB of a device call's 64 MiB")


if __name__ == "__main__":
    main(sys.argv[1:])
