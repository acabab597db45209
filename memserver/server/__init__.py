"""The servers: a shard (`shard_actor`: a Ray actor hosting `dataplane` over its table `slice`s)
and the coordinator (`coordinator`, with the table `catalog` rules), both served by
`grpcserver` (one way to start a server; errors and metrics as interceptors)."""
