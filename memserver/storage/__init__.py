"""What reaches the disk: the write-ahead log (`wal`), a shard's per-slice records (`store`),
checkpoint files and their manifest (`checkpoint`), and the fsync helpers they share (`fsutil`)."""
