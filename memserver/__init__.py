"""memserver: a distributed memory server for memory-augmented transformers.

Value tables live sharded over Ray actors behind a gRPC API (protos/memserver/v1); trainers use
`client.MemoryClient` / `client.AsyncMemoryClient` to look rows up, compute weighted bags on the
shards and push sparse gradients back.
"""

import os as _os

__version__ = "0.1.0"

# gRPC's C core runs fork handlers (on by default) that crash a forked child, such as a
# DataLoader worker that never calls gRPC, while the parent has a call in flight, which a
# client's shared-memory region always has (its attach stream lives as long as the region): a
# walkthrough's children died of SIGSEGV in 5 to 9 forks of 20. Off, no child died in 20. Set
# before grpc is imported (its core reads it then; `client` imports this package first); an
# explicit setting wins. A forked child's own client was never supported (docs/library.md).
_os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")
