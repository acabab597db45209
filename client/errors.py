"""Exceptions the client raises: one per gRPC status a caller may want to handle."""

from __future__ import annotations

import grpc


class MemserverError(RuntimeError):
    """A call failed; `code` is the gRPC status code, the message is the server's text."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code


class InvalidArgumentError(MemserverError, ValueError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class TableNotFoundError(MemserverError, LookupError):
    code = grpc.StatusCode.NOT_FOUND


class TableExistsError(MemserverError):
    code = grpc.StatusCode.ALREADY_EXISTS


class ResourceExhaustedError(MemserverError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class UnavailableError(MemserverError, ConnectionError):
    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceededError(MemserverError, TimeoutError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


_BY_CODE = {
    cls.code: cls
    for cls in (
        InvalidArgumentError,
        TableNotFoundError,
        TableExistsError,
        ResourceExhaustedError,
        UnavailableError,
        DeadlineExceededError,
    )
}


def from_rpc_error(err: grpc.aio.AioRpcError | grpc.RpcError, target: str = "") -> MemserverError:
    code = err.code()
    where = f" ({target})" if target else ""
    return _BY_CODE.get(code, MemserverError)(f"{code.name}: {err.details()}{where}", code)
