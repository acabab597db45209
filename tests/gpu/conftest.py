"""GPU tests (`make test-gpu`): every test here is marked `gpu` and skips, with the reason, where
torch sees no CUDA device. They compare the CUDA path with the CPU path of the same call.

Nothing here imports Ray or faiss at module level: a GPU machine with only a CUDA build of torch
and the project's small dependencies (numpy, numba, grpcio, protobuf) runs every test that needs
neither, and the tests that do skip with the reason (pytest.importorskip)."""

from __future__ import annotations

import pytest
import torch

CUDA = torch.cuda.is_available()
REASON = "no CUDA device (torch.cuda.is_available() is False): GPU tests run with `make test-gpu` on a GPU machine"


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/gpu/" in item.nodeid.replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
            if not CUDA:
                item.add_marker(pytest.mark.skip(reason=REASON))
