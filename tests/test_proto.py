"""The committed generated code must match protos/: regenerate and compare."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_generated_code_is_fresh(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT / 'protos'}", f"--python_out={tmp_path}",
         f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}", str(ROOT / "protos/memserver/api/v1/memserver.proto")],
        check=True,
    )
    for name in ("memserver_pb2.py", "memserver_pb2.pyi", "memserver_pb2_grpc.py"):
        fresh = (tmp_path / "memserver/api/v1" / name).read_text()
        committed = (ROOT / "memserver/api/v1" / name).read_text()
        assert fresh == committed, f"memserver/api/v1/{name} is stale: run `make proto` and commit"


def test_tensors_are_raw_bytes_not_repeated_floats():
    from memserver.api.v1 import memserver_pb2 as pb

    data = pb.Tensor.DESCRIPTOR.fields_by_name["data"]
    assert data.type == data.TYPE_BYTES
