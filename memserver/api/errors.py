"""The errors of the API: one exception class per gRPC status a caller may want to handle.

This is the project's one table between exceptions and statuses. Servers raise these classes
(the error interceptor of `memserver.server.grpcserver` turns each into its status, with the
exception's `details` as the status text); the client turns a status back into the same class
(`from_rpc_error`), and raises the same classes for input it rejects itself before sending.
"""

from __future__ import annotations

import re

import grpc


class MemserverError(RuntimeError):
    """A call failed. `code` is the gRPC status, `details` the server's (or the client's) text and
    `target` where the call went; str() reads "CODE: details (target)"."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, details: str, code: grpc.StatusCode | None = None, *, target: str = "") -> None:
        super().__init__(details)  # args stay (details,): Ray pickles exceptions by their args
        self.details = details
        self.target = target
        if code is not None:
            self.code = code

    def __str__(self) -> str:
        where = f" ({self.target})" if self.target else ""
        return f"{self.code.name}: {self.details}{where}"


class InvalidArgumentError(MemserverError, ValueError):
    """Bad shapes, dtypes, ids, non-finite values, bad table specs: rejected whole, nothing changed."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class TableNotFoundError(MemserverError, LookupError):
    code = grpc.StatusCode.NOT_FOUND


class TableExistsError(MemserverError):
    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPreconditionError(MemserverError):
    """The request is well formed but the server's state does not allow it: the client's shard map
    is of an earlier incarnation of the table (it refreshes the map and retries once), a retry from
    a session the shard no longer remembers, a commit of a step that is not prepared."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class StepAbortedError(MemserverError):
    """A training step's commit was aborted on every shard of the table: a shard did not hold every
    part the client sent it (the message names the shard and the parts). Nothing of the client's
    step is applied anywhere; the table stays at the previous step."""

    code = grpc.StatusCode.ABORTED


class DataLossError(MemserverError):
    """A table slice cannot be served as it should be: e.g. its write-ahead log has a gap after
    the checkpoint it recovered from. The slice refuses requests until an operator restores it."""

    code = grpc.StatusCode.DATA_LOSS


class TableRolledBackError(DataLossError):
    """A table without `wal` came back from its checkpoint while a trainer trained it (a shard
    restarted; its siblings rolled back with it), or the table was made anew under it (another
    run of its name, a restore): the updates acknowledged since are lost and the trainer's model
    is ahead of its values. Raised by the client's side (trainer.memory's
    RemoteValues, at the end of the step that found it); load the model and the values from one
    checkpoint to go on."""


class ResourceExhaustedError(MemserverError):
    """Too large or too much (gRPC itself sends it for a message above the size limit)."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


#: How every refusal of a server at one of its limits begins (memserver.server.admission).
OVERLOADED = "server overloaded"

#: How a server's own UNAVAILABLE for a lost or restarting shard begins (its Ray error follows,
#: which may say "Connection reset": the client must not read it as no connection to the server).
SHARD_UNAVAILABLE = "a shard is unavailable"


class OverloadedError(ResourceExhaustedError):
    """A server refused the call because it has as much work in progress as its limits allow
    (memserver.server.config.Limits). Refused before the request was parsed, so nothing of it was
    applied there: the clients retry it with backoff. A RESOURCE_EXHAUSTED of any other kind (a
    message above gRPC's size limit) stays a plain ResourceExhaustedError: retrying cannot help."""


class UnavailableError(MemserverError, ConnectionError):
    """A server is down or restarting: idempotent calls (every data-plane call) are retried."""

    code = grpc.StatusCode.UNAVAILABLE


class TlsError(UnavailableError):
    """The TLS handshake failed: the server's certificate is not one the client trusts, does not
    name the address dialled, or the server does not speak TLS. A retry cannot change that, so
    clients raise it at once (grpc says UNAVAILABLE; `tls_problem` tells it apart), with the fix."""


class NotGrpcError(UnavailableError):
    """The address answers, but not with HTTP/2 (a metrics or web page's port, another service):
    no retry can change that, so clients raise it at once, saying so."""


#: grpc core's words for a peer that answered with something that is not HTTP/2 (matched by part).
NOT_HTTP2 = "Failed parsing HTTP/2"

#: grpc core's words for a failed handshake (its details, which vary by version: matched by
#: part) -> what to fix. The first that matches wins.
_TLS_FAILURES = (
    ("certificate has expired",
     "the server's certificate has expired: renew it (or check this host's clock)"),
    ("certificate is not yet valid",
     "the server's certificate is not valid yet: check the clocks of this host and the server's"),
    ("Hostname Verification Check failed",
     "the server's certificate does not name what this client checks (the address dialled, or "
     "$MEMSERVER_TLS_SERVER_NAME / ClientTls.server_name where set): set that to a name the certificate holds, or "
     "give the server a certificate for its address"),
    ("CERTIFICATE_VERIFY_FAILED",
     "the server's certificate is not signed by the CA this client trusts ($MEMSERVER_TLS_CA, ClientTls.ca or "
     "the endpoint file's tls_ca): give the client the CA of the cluster's --tls-cert"),
    ("WRONG_VERSION_NUMBER",
     "the server does not speak TLS (a cluster started without --tls-cert): connect without a CA"),
    ("Tls handshake failed",
     "check that the client's CA ($MEMSERVER_TLS_CA, ClientTls.ca or the endpoint file's tls_ca) signed the "
     "server's certificate and that the certificate names the address dialled"),
)


def tls_problem(details: str) -> str | None:
    """What to fix, when an UNAVAILABLE call's details say its TLS handshake failed; else None."""
    return next((fix for words, fix in _TLS_FAILURES if words in details), None)


class DeadlineExceededError(MemserverError, TimeoutError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class UnauthenticatedError(MemserverError, PermissionError):
    """No token, or not one the cluster knows (memserver.api.auth)."""

    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDeniedError(MemserverError, PermissionError):
    """The token's role may not make this call (the read token on a write), or a path outside
    what the server allows."""

    code = grpc.StatusCode.PERMISSION_DENIED


#: Every status with a class of its own; any other status becomes a plain MemserverError.
ERRORS: tuple[type[MemserverError], ...] = (
    InvalidArgumentError,
    TableNotFoundError,
    TableExistsError,
    FailedPreconditionError,
    StepAbortedError,
    DataLossError,
    ResourceExhaustedError,
    UnavailableError,
    DeadlineExceededError,
    UnauthenticatedError,
    PermissionDeniedError,
)
_BY_CODE = {cls.code: cls for cls in ERRORS}


#: What gRPC's core says of a call whose stream the server reset before it answered (the servers
#: never send CANCELLED themselves to a client that is still there).
RESET = ("CANCELLED", "Received RST_STREAM")


def error_for(code: grpc.StatusCode, details: str, target: str = "") -> MemserverError:
    """The exception for a status: its own class where it has one (a server's overload refusal:
    OverloadedError; a failed TLS handshake: TlsError; a peer that is no gRPC server: NotGrpcError).

    A CANCELLED the client did not ask for (a cancelled grpc.aio call raises CancelledError, not a
    status) is the server resetting the stream: an overloaded server refuses a call before reading
    its request, and its status then races the request's bytes; the client saw the reset instead
    (a walkthrough: 10% of a burst of 2,000 bags failed CANCELLED, never retried). It is retried
    as the refusal it stands for: nothing was applied, or the write's tags answer it once."""
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and details.startswith(OVERLOADED):
        return OverloadedError(details, code, target=target)
    if code == grpc.StatusCode.CANCELLED and details.startswith(RESET):
        return OverloadedError(f"{OVERLOADED}? the server reset the call before answering it ({details}: an "
                               "overloaded server's refusal can arrive so)", code, target=target)
    if code == grpc.StatusCode.UNAVAILABLE and (fix := tls_problem(details)):
        return TlsError(f"the TLS handshake failed: {fix} ({details})", code, target=target)
    if code == grpc.StatusCode.UNAVAILABLE and NOT_HTTP2 in details:
        return NotGrpcError(f"the server there does not speak gRPC (an HTTP/1 server: a metrics or web page's port?): "
                            f"give the coordinator's HOST:PORT (`memserver up` prints it and writes it to the endpoint file) ({details})", code,
                            target=target)
    return _BY_CODE.get(code, MemserverError)(details, code, target=target)


def from_rpc_error(err: grpc.RpcError, target: str = "") -> MemserverError:
    """A failed gRPC call (sync or aio) as the exception of its status."""
    return error_for(err.code(), err.details() or "", target)


class ShardGoneError(UnavailableError):
    """A shard's address, as a table's map gave it, answers, but no memserver shard serves there:
    another gRPC server (UNIMPLEMENTED), a server that is no gRPC one, or a plaintext one where the
    cluster speaks TLS, took its port after the shard's process died (a local Ray's workers bind
    ports from the range the servers' port 0 gives; the restarted shard then serves on a new one).
    Retried with a fresh map, as any shard that is down: it was raised at once, and the write it
    ended said half applied (a CI run, a shard's old port answering UNIMPLEMENTED)."""


def other_server(err: grpc.RpcError, what: str, method: str) -> str | None:
    """What answered `method` at the address of a memserver `what` ("shard", "coordinator") this
    client knows runs, when it is no such server (another gRPC server, one that is no gRPC server,
    a plaintext one where the cluster speaks TLS: the server restarted elsewhere and another took
    its old port), said for the error; None for any other failure."""
    exc = from_rpc_error(err)
    if exc.code == grpc.StatusCode.UNIMPLEMENTED:
        return (f"UNIMPLEMENTED: {exc.details or 'no details'}: another gRPC server has the {what}'s old port (the "
                f"{what} restarted elsewhere?), or the {what} runs an older memserver without {method}")
    if isinstance(exc, NotGrpcError):
        return f"not a gRPC server ({err.details()}): the {what} restarted elsewhere and another server has its old port?"
    if isinstance(exc, TlsError) and "WRONG_VERSION_NUMBER" in (err.details() or ""):
        # (the address came over TLS from this cluster: a plaintext peer is not its server)
        return (f"no TLS there ({err.details()}): the {what} restarted elsewhere and a plaintext server has its old "
                "port?")
    return None


def shard_error(err: grpc.RpcError, address: str, method: str) -> MemserverError:
    """A failed `method` call to the shard at `address` (from a table's map) as its exception:
    as from_rpc_error's, except that a peer that is no memserver shard is one that moved
    (ShardGoneError). A certificate the client does not trust stays a TlsError, raised at once:
    a retry could not change it."""
    exc = from_rpc_error(err, f"shard {address}")
    said = other_server(err, "shard", f"DataPlane/{method}")
    if said is None:
        return exc
    return ShardGoneError(f"the address answers, but not as a memserver shard: {said}", grpc.StatusCode.UNAVAILABLE,
                          target=exc.target)


def retried(exc: BaseException) -> bool:
    """Whether the client sends a call again on this error (within its retry window): the server
    was not reached, not in time, or was too busy. A failed TLS handshake, or a peer that is no
    gRPC server, would answer the same again."""
    return (isinstance(exc, (UnavailableError, DeadlineExceededError, OverloadedError))
            and not isinstance(exc, (TlsError, NotGrpcError)))


def raised(errors: list[BaseException], write: bool) -> BaseException:
    """The one error a call to several shards raises when some failed: the first in shard order,
    except that a write raises a shard it could not reach before another shard's refusal, the
    refusal named in it. The retries then bring the write to that shard too, and a step's
    decision that missed it is kept and re-sent (client.ops.steps), where the other shard's
    refusal ended the decision while that shard still waited for it (until its session expired).
    A read raises the first error; so does a call with an error that is no MemserverError (a
    cancelled one)."""
    if write and all(isinstance(exc, MemserverError) for exc in errors):
        for exc in errors:
            if retried(exc):
                refused = [e for e in errors if not retried(e)]
                if not refused:
                    return exc
                assert isinstance(exc, MemserverError)
                said = "; ".join(f"{e.target or 'a shard'} refused it: {e.code.name}: {e.details}"  # type: ignore[attr-defined]
                                 for e in refused)
                return type(exc)(f"{exc.details}; and {said}", exc.code, target=exc.target)
    return errors[0]


#: A terminal's colour and style codes, as Ray puts them in its exceptions' text ("\x1b[36mray::...").
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def first_line(exc: BaseException, limit: int = 500) -> str:
    """An exception's first line, at most `limit` characters, or its type when it has no text:
    what an error quoting a library's failure (torch's reader, faiss, a recovery, Ray) carries of
    it, without terminal colour codes. A longer line is cut after its last whole word that fits,
    and says so ("...")."""
    line = _ANSI.sub("", (str(exc).splitlines() or [type(exc).__name__])[0])
    if len(line) <= limit:
        return line
    if limit < 8:
        return line[:limit]
    cut = line[: limit - 4]
    word = cut.rfind(" ")
    return (cut[:word] if 0 < word and word >= len(cut) - 30 else cut) + " ..."  # (a long token: cut inside it)
