"""What each call of the API is, as the proto declares it on its rpc (the MethodOptions
`read_only`, `request_views` and `answer_views` of protos/memserver/api/v1/memserver.proto).
The facts are written there once; the token check (memserver.api.auth.READ_METHODS), the
servers' request parsing (memserver.server.grpcserver) and the clients' answer parsing
(client.transport) read them from the descriptor through `marked`."""

from __future__ import annotations

from google.protobuf.descriptor import FieldDescriptor, MethodDescriptor

from memserver.api.v1 import memserver_pb2 as pb

#: The services of the API by name: DataPlane (every shard), ControlPlane (the coordinator).
SERVICES = pb.DESCRIPTOR.services_by_name


def methods(service: str | None = None) -> list[MethodDescriptor]:
    """The methods of `service`, or of every service."""
    return [m for name, svc in SERVICES.items() if service in (None, name) for m in svc.methods]


def marked(option: FieldDescriptor, service: str | None = None) -> frozenset[str]:
    """The names of the methods (of `service`, else of every service) whose `option` is true."""
    return frozenset(m.name for m in methods(service) if m.GetOptions().Extensions[option])
