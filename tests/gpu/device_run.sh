#!/usr/bin/env bash
# The GPU tests and benchmarks.gpu on a lent GPU machine, in one call (the device tool's `run`;
# its README). That machine's image has a CUDA build of torch, numpy, numba, pytest, rich, tqdm
# and prometheus-client, but not Ray or faiss, nor the small gRPC packages at the versions this
# project's generated code needs. `make gpu-wheels`, run here first, puts those gRPC packages,
# py-spy, faiss-cpu and Ray (its 75.6 MiB wheel pruned to a 19.8 MiB tarball: tests/gpu/pack_ray.py)
# in .whl/ (git-ignored; carried by the call: 48.4 MiB of its 64 MiB) and this installs them. faiss-gpu
# (135 MB, plus a CUDA 12 runtime) does not fit a call: the faiss-GPU tests skip, saying why.
#
#   make gpu-wheels
#   run(command="bash tests/gpu/device_run.sh", carry=[".whl"], timeout_s=600)
#
# Everything is printed and written to $OUT (the device tool brings it back): versions.txt (with
# nvidia-smi's head), test-gpu.log, bench-gpu.log and profile-gpu.log (benchmarks.gpu_profile:
# where a remote memtrain step's time goes). PARTS picks the parts (default "test bench profile");
# BENCH_ARGS (e.g. --quick) go to benchmarks.gpu. Each part has a time limit (TEST_SECONDS, default
# 200; BENCH_SECONDS, 240; PROFILE_SECONDS, 100: 540 s in all) so that its logs come back within
# the call's 10 minutes (on an H200 the tests took 88 s). Exit status: non-zero when a part failed
# or ran out.
set -uo pipefail
OUT=${OUT:-results/gpu}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
if compgen -G "$WHEELS/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl \
        || { echo "device_run: installing $WHEELS/ failed" >&2; exit 2; }
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
for tarball in "$WHEELS"/*.tar.xz; do  # Ray, pruned to fit (tests/gpu/pack_ray.py)
    [ -e "$tarball" ] || continue
    "$PY" -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall('/tmp/site', filter='tar')" "$tarball" \
        || { echo "device_run: unpacking $tarball failed" >&2; exit 2; }
done
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1

"$PY" - <<'PYEOF' 2>&1 | tee "$OUT/versions.txt"
import importlib
import platform

import torch

print("python", platform.python_version(), "| torch", torch.__version__, "| CUDA", torch.version.cuda)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"GPU {p.name}, {p.total_memory / 2**30:.1f} GiB, {p.multi_processor_count} SMs")
else:
    print("GPU: none (torch.cuda.is_available() is False)")
for name in ("numpy", "numba", "grpc", "google.protobuf", "grpc_health", "prometheus_client", "ray", "faiss"):
    try:
        mod = importlib.import_module(name)
        print(name, getattr(mod, "__version__", "(no version)"))
    except Exception as exc:  # what is missing is part of the record
        print(name, "missing:", type(exc).__name__, exc)
PYEOF
nvidia-smi 2>&1 | head -15 >>"$OUT/versions.txt" || true

status=0
PARTS=${PARTS:-test bench profile}  # which parts run (PARTS=test: the tests alone, a shorter call)
if [[ " $PARTS " == *" test "* ]]; then
    timeout "${TEST_SECONDS:-200}" "$PY" -m pytest -m gpu tests/gpu -v -p no:cacheprovider 2>&1 | tee "$OUT/test-gpu.log" \
        || status=1
fi
if [[ " $PARTS " == *" bench "* ]]; then
    # shellcheck disable=SC2086  # BENCH_ARGS: several arguments
    timeout "${BENCH_SECONDS:-240}" "$PY" -m benchmarks.gpu ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench-gpu.log" || status=1
fi
if [[ " $PARTS " == *" profile "* ]]; then
    # where a remote step's time goes on the GPU (py-spy, from the wheels: its binary in /tmp/site/bin)
    PATH="/tmp/site/bin:$PATH" timeout "${PROFILE_SECONDS:-100}" "$PY" -m benchmarks.gpu_profile --device cuda 2>&1 \
        | tee "$OUT/profile-gpu.log" || status=1
fi
exit $status
