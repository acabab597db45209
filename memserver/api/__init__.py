"""The API both sides share: the generated protobuf code (`v1/`, from protos/), the types a client
and a server both reason with (`types`: table metadata and the shard layout) and the one table of
errors (`errors`). Nothing here imports Ray, numba or server code, so clients stay light."""
