"""The math of the tables, with no RPC, Ray or storage in it: `ValueTable` (lookup, bag, bag
backward, slot statistics), the sparse optimizers, the compiled kernels and the seeded
initialisation. A shard hosts one `ValueTable` per table slice; the trainer's local memory
backend runs the very same class in-process."""
