"""Every data-plane call of the client, as an *op*: validation, routing and reassembly, with no I/O.

An op is a generator: it validates the input (so a write is rejected whole before any shard sees
it), routes ids to their shards by the table's `ShardLayout`, yields the shard requests
`[(address, method, request)]` all at once, receives their answers in that order and returns
the assembled result in the caller's order. Whoever sends the requests decides how:
`AsyncMemoryClient` with grpc.aio, `MemoryClient` with blocking stubs from the caller's thread,
the load test's users under gevent. One implementation of each call for all of them.

One module, one role:

- `base`: what every op shares (`Op`, `Plan`, `OpOptions`, `finish`, `like`, the request size rule);
- `sessions`: `ClientSession` and `WriteTags`, the client's side of exactly-once writes;
- `routing`: which shard gets which ids (the rule itself is `memserver.api.types.ShardLayout`);
- `checks`: the client's input checks;
- `values`, `steps`, `index`, `product_keys`, `inspect`: the ops of value tables, a training
  step's commit, index tables, product-key tables, and the slots' statistics.

The names the clients, the load test, the benchmarks and the tests use are re-exported here.
"""

from client.ops.base import MAX_REQUEST_BYTES, Op, OpOptions, Plan, finish, like
from client.ops.index import add_op, remove_op, search_op
from client.ops.inspect import SLOT_STATS, record_triggers_op, slot_stats_op, top_slots_plan, triggers_op, usage_op
from client.ops.product_keys import address_op, load_product_keys_op, slots_table
from client.ops.routing import route_bags, route_ids, route_owned
from client.ops.sessions import ClientSession, StepParts, WriteTags
from client.ops.steps import CommitPlan, commit_step_plan, drop_open_steps_op, settle_interrupted, step_phase_op
from client.ops.values import (
    aggregate,
    backward_requests,
    bag_backward_op,
    bag_op,
    ids_fit_int32,
    lookup_op,
    push_op,
    warm_op,
    wire_ids,
    write_rows_op,
)

__all__ = [
    "MAX_REQUEST_BYTES",
    "SLOT_STATS",
    "ClientSession",
    "CommitPlan",
    "Op",
    "OpOptions",
    "Plan",
    "StepParts",
    "WriteTags",
    "add_op",
    "address_op",
    "slots_table",
    "aggregate",
    "backward_requests",
    "bag_backward_op",
    "bag_op",
    "commit_step_plan",
    "drop_open_steps_op",
    "finish",
    "like",
    "load_product_keys_op",
    "lookup_op",
    "push_op",
    "record_triggers_op",
    "remove_op",
    "route_bags",
    "route_ids",
    "route_owned",
    "search_op",
    "settle_interrupted",
    "slot_stats_op",
    "step_phase_op",
    "top_slots_plan",
    "triggers_op",
    "usage_op",
    "warm_op",
    "ids_fit_int32",
    "wire_ids",
    "write_rows_op",
]
