"""`memserver loadtest` and `locust -f deploy/locustfile.py`: trainer-like load against a cluster.

- `config`: what to send (`LoadConfig`, read from MEMSERVER_* variables so locust's own command
  line can pass it too);
- `caller`: one bag / lookup / bag_backward made with the client's own ops (client.ops) and sent
  with blocking gRPC, which works under gevent (grpc.aio does not mix with it);
- `recorder`: every response time kept exactly (locust rounds its percentiles);
- `run`: what the CLI runs, a child process around `user`, the locust side.

This package imports nothing here: `user` must import locust (which monkey-patches the whole
process with gevent) before anything else, and only a process that exists to make load does.
"""
