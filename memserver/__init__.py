"""memserver: a distributed memory server for memory-augmented transformers.

Value tables live sharded over Ray actors behind a gRPC API (protos/memserver/v1); trainers use
`client.MemoryClient` / `client.AsyncMemoryClient` to look rows up, compute weighted bags on the
shards and push sparse gradients back.
"""

__version__ = "0.1.0"
