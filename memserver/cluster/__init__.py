"""Starting a memory cluster on Ray (`launch`) and finding a running one (`endpoint`).

Importing this package imports no Ray: clients and the CLI's argument checks use `endpoint` and
the constants here; only `launch` starts actors.
"""

#: How shard bundles are laid out over Ray nodes (Ray placement-group strategies).
PLACEMENT_STRATEGIES = ("SPREAD", "STRICT_SPREAD", "PACK")
