"""Fresh memory: building and serialising large messages with and without `tune_malloc`.

Each side runs in its own child process (MEMSERVER_MALLOC_TUNE=0 or 1, since mallopt settings
are per process and cannot be undone), timing the steps of a memtrain-shaped call: building a
4 MiB two-tensor BagRequest (4096 x 128 int32 ids + float32 weights), serialising it, and
encoding plus serialising a [4096, 128] float32 answer, and a shard reading the request's
tensors with protobuf or as views of its bytes (memserver.wire.parse_views). Also counts minor page faults per
serialisation. glibc adapts its mmap threshold to the blocks a process frees, so whether a given
process hits the slow path depends on what it allocated before; `tune_malloc` makes it never.
See docs/benchmarks.md, "Fresh memory".

    python -m benchmarks.fresh_memory [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any

from rich.console import Console
from rich.table import Table

from benchmarks.common import machine

CHILD = """if True:
    import json, resource, statistics, time, torch
    from memserver.wire import decode, encode, parse_views, tune_malloc
    from memserver.api.v1 import memserver_pb2 as pb
    tuned = tune_malloc()
    ids = torch.randint(0, 1 << 18, (4096, 128), dtype=torch.int32)
    w, out = torch.rand(4096, 128), torch.rand(4096, 128)
    req = pb.BagRequest(table="x", ids=encode(ids), weights=encode(w))

    def ms(fn, n=30):
        fn()
        ts = []
        for _ in range(n):
            t0 = time.perf_counter(); fn(); ts.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(ts)

    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        req.SerializeToString()
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / 20
    r = {"tuned": tuned, "faults_per_serialise": faults,
         "build_request_ms": ms(lambda: pb.BagRequest(table="x", ids=encode(ids), weights=encode(w))),
         "serialise_request_ms": ms(req.SerializeToString),
         "answer_ms": ms(lambda: pb.BagResponse(out=encode(out)).SerializeToString())}
    # A shard reading the request's tensors: protobuf (its parse, then each field's bytes), or
    # as views of the request's bytes (memserver.wire.parse_views, what shards do)
    raw = req.SerializeToString()
    def read(m):
        return decode(m.ids, "ids"), decode(m.weights, "weights")
    r["read_request_protobuf_ms"] = ms(lambda: read(pb.BagRequest.FromString(raw)))
    r["read_request_views_ms"] = ms(lambda: read(parse_views(pb.BagRequest, raw)))
    # Last, because a large free raises glibc's adaptive mmap threshold and would hide the effect.
    parts = [ids.numpy(), w.numpy()]
    r["join_same_bytes_ms"] = ms(lambda: b"".join(memoryview(a).cast("B") for a in parts))
    one = pb.Tensor(data=bytes(4 << 20))
    r["serialise_one_tensor_4mib_ms"] = ms(one.SerializeToString)
    print(json.dumps(r))
"""
STEPS = ("build_request_ms", "serialise_request_ms", "answer_ms", "read_request_protobuf_ms", "read_request_views_ms")
#: Reference points, not steps of a call: the same payload joined as bytes, and a one-tensor message.
REFERENCES = ("join_same_bytes_ms", "serialise_one_tensor_4mib_ms")


def run(tune: bool) -> dict[str, Any]:
    env = {**os.environ, "MEMSERVER_MALLOC_TUNE": "1" if tune else "0"}
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True, timeout=300)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="accepted for benchmarks.run; the run is short anyway")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    off, on = run(False), run(True)
    targets = [{"name": "fresh_memory", "what": f"{k.removesuffix('_ms').replace('_', ' ')}: untuned / tuned ms",
                "target": "info", "value": off[k] / on[k], "measured": f"{off[k] / on[k]:.1f}x", "pass": None}
               for k in STEPS]
    views = on["read_request_views_ms"] / on["read_request_protobuf_ms"]
    targets.append({"name": "fresh_memory", "what": "a shard reading a request: views / protobuf (tuned)", "target": "info",
                    "value": views, "measured": f"{views:.2f}x", "pass": None})
    result = {"benchmark": "fresh_memory", "machine": machine(), "untuned": off, "tuned": on, "targets": targets}
    if args.json:
        print(json.dumps(result, indent=2))
        return result
    tbl = Table(title="4 MiB BagRequest and a [4096, 128] answer: median ms (child processes)")
    for col in ("step", "untuned", "tune_malloc", "untuned / tuned"):
        tbl.add_column(col, justify="left" if col == "step" else "right")
    for k in STEPS:
        tbl.add_row(k.removesuffix("_ms"), f"{off[k]:.2f}", f"{on[k]:.2f}", f"{off[k] / on[k]:.1f}x")
    for k in REFERENCES:
        tbl.add_row(f"(reference) {k.removesuffix('_ms').replace('_', ' ')}", f"{off[k]:.2f}", f"{on[k]:.2f}", "")
    tbl.add_row("minor faults per serialise", f"{off['faults_per_serialise']:.0f}", f"{on['faults_per_serialise']:.0f}", "")
    Console(width=120).print(tbl)
    return result


if __name__ == "__main__":
    main()
