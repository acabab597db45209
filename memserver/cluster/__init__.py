"""Starting a memory cluster on Ray (`launch`) and finding a running one (`endpoint`).

Importing this package imports no Ray: clients and the CLI's argument checks use `endpoint` and
the constants here; only `launch` starts actors.
"""

import math

#: How shard bundles are laid out over Ray nodes (Ray placement-group strategies).
PLACEMENT_STRATEGIES = ("SPREAD", "STRICT_SPREAD", "PACK")

#: A cluster's shape when neither a flag nor the config says: start_cluster's defaults, and
#: `memserver up`'s (its checks and its --help quote them).
DEFAULT_SHARDS = 2
DEFAULT_SHARD_CPUS = 0.5
DEFAULT_THREADS_PER_SHARD = 1
DEFAULT_PLACEMENT = "SPREAD"


def parse_gpus(value: float | str | list[float]) -> float | list[float]:
    """GPUs per shard as a flag or config value: one number for every shard (1, 0.5, "0.5") or one
    per shard ("1,1,0,0", [1, 1, 0, 0]: a mixed cluster). ValueError saying why not."""
    said = value
    if isinstance(value, str):
        try:
            value = [float(x) for x in value.split(",")]
        except ValueError:
            raise ValueError(f"not GPUs: {said!r} (e.g. 1, 0.5, or one per shard: 1,1,0,0)") from None
    items = [value] if isinstance(value, (int, float)) else value if isinstance(value, (list, tuple)) else None
    # (a config's `true` was 1 GPU, `{a: 1}` "could not convert string to float", `[]` "must be >= 0")
    if not items or any(isinstance(g, bool) or not isinstance(g, (int, float)) for g in items):
        raise ValueError(f"not GPUs: {said!r} (e.g. 1, 0.5, or one per shard: 1,1,0,0)")
    gpus = [float(g) for g in items]
    if any(not math.isfinite(g) or g < 0 for g in gpus):  # (nan passed, then failed Ray's start naming no flag)
        raise ValueError(f"GPUs must be finite and >= 0, got {said!r}")
    return gpus[0] if len(gpus) == 1 else gpus


def shard_gpu_list(num_shards: int, shard_gpus: float | str | list[float]) -> list[float]:
    """GPUs of each of `num_shards` shards (see parse_gpus); ValueError on a list of another length."""
    gpus = parse_gpus(shard_gpus)
    if isinstance(gpus, float):
        return [gpus] * num_shards
    if len(gpus) != num_shards:
        raise ValueError(f"one number for every shard, or one per shard ({num_shards}), got {len(gpus)}")
    return gpus


def shard_bundle(shard_cpus: float, shard_gpus: float) -> dict[str, float]:
    """The resources one shard reserves in the placement group (Ray rejects empty bundles)."""
    bundle = {"CPU": float(shard_cpus)} if shard_cpus > 0 else {}
    if shard_gpus > 0:
        bundle["GPU"] = float(shard_gpus)
    if not bundle:
        raise ValueError("a shard needs shard_cpus > 0 or shard_gpus > 0 (they are reserved in its placement bundle)")
    return bundle
