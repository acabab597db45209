"""Who may call what: bearer tokens and their two roles, shared by the servers (which check them)
and the clients (which send them).

A token travels as gRPC metadata `authorization: Bearer <token>` (the convention of gRPC's own
examples and Ray's interceptor), so a client in any language can send it. The write token may call
everything; the read token only the calls that change nothing (`READ_METHODS`). Servers keep the
tokens' SHA-256 digests, never the tokens (Ray records actors' constructor arguments), and compare
digests in constant time; nothing here logs a token.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memserver.api.methods import marked
from memserver.api.v1 import memserver_pb2 as pb

HEADER = "authorization"
#: Calls the read token may make: every call that changes nothing (DataPlane and ControlPlane),
#: as the proto marks them (`option (read_only) = true`).
READ_METHODS = marked(pb.read_only)
#: Where a client finds its token when none is given: this variable, then the endpoint file.
TOKEN_ENV = "MEMSERVER_TOKEN"
#: A PEM file of the CA a client trusts when none is given (else the endpoint file's `tls_ca`).
TLS_CA_ENV = "MEMSERVER_TLS_CA"
#: The name a client checks the servers' certificate for, when not the address it dials.
TLS_SERVER_NAME_ENV = "MEMSERVER_TLS_SERVER_NAME"


#: The fewest characters of a token an operator's file gives (generated ones: 43, 256 random bits).
MIN_TOKEN_CHARS = 16


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def generate_token() -> str:
    return secrets.token_urlsafe(32)


@dataclass(frozen=True)
class AuthConfig:
    """The digests a server checks presented tokens against (`read_digest` None: no read role)."""

    write_digest: str
    read_digest: str | None = None

    @classmethod
    def from_tokens(cls, write: str, read: str | None = None) -> AuthConfig:
        if not write or (read is not None and not read):
            raise ValueError("tokens must not be empty")
        for token in (write, read):  # one no client can send (clients strip it; a header is ASCII) opens nothing
            if token is not None and (token != token.strip() or not token.isascii() or not token.isprintable()):
                raise ValueError("a token is printable ASCII without surrounding spaces (what a client can send)")
        if read is not None and read == write:
            raise ValueError("the read token must differ from the write token")
        return cls(digest(write), digest(read) if read else None)

    def role(self, metadata: object) -> str | None:
        """'write', 'read' or None for a call's invocation metadata ((key, value) pairs)."""
        presented = ""
        for key, value in metadata or ():  # type: ignore[attr-defined]
            if key == HEADER and isinstance(value, str) and value.startswith("Bearer "):
                presented = value[len("Bearer "):]
        got = digest(presented)
        is_write = hmac.compare_digest(got, self.write_digest)
        is_read = self.read_digest is not None and hmac.compare_digest(got, self.read_digest)
        if not presented:
            return None
        return "write" if is_write else "read" if is_read else None


def _shape(obj: Any) -> Any:
    """What a JSON value holds, its scalars hidden (tokens are not for an error message), and its
    keys but "write" and "read" (a token put as a key by mistake)."""
    if isinstance(obj, dict):
        return {(k if k in ("write", "read") else f"<key {i + 1}>"): _shape(v) for i, (k, v) in enumerate(obj.items())}
    if isinstance(obj, list):
        return [_shape(v) for v in obj]
    # every scalar by its type alone: a number, even a bool, may be the token written unquoted
    return "<null>" if obj is None else f"<{ {str: 'string', bool: 'bool', int: 'number', float: 'number'}[type(obj)]}>"


def readable_by_others(path: str | os.PathLike[str], what: str, holds: str) -> str | None:
    """What to say when other local users may read a secret's file (None: they may not): it is
    only as secret as the file."""
    if (mode := Path(path).stat().st_mode) & 0o077:
        return f"{what} {path} has mode {mode & 0o777:o}: other local users may read {holds}; chmod 600 it"
    return None


def warn_if_readable(path: str | os.PathLike[str], what: str, holds: str) -> None:
    """Warn (the log) when other local users may read a secret's file (readable_by_others)."""
    if said := readable_by_others(path, what, holds):
        logging.getLogger(__name__).warning("%s", said)


def read_token_file(path: str | os.PathLike[str]) -> tuple[str, str | None]:
    """(write token, read token or None) from a file: a JSON object {"write": ..., "read": ...},
    or the write token on the first line and the read token on an optional second. A file other
    local users may read is said (a warning: the tokens are only as secret as the file)."""
    warn_if_readable(path, "token file", "its tokens")
    text = Path(path).read_text()
    form = ('a JSON object {"write": "...", "read": "..."} ("read" optional), or the write token on the first '
            "line and the read token on an optional second")
    if text.lstrip().startswith(("{", "[", '"')):  # JSON: an object of the two keys, nothing else
        try:
            obj = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc}); a token file is {form}") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("write"), str) or set(obj) - {"write", "read"} or \
                not isinstance(obj.get("read", ""), str | None):
            raise ValueError(f"{path}: a token file is {form}; this one holds {json.dumps(_shape(obj))}")
        write, read = obj["write"].strip(), (obj["read"].strip() if obj.get("read") else None)
    else:
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        if not lines:
            raise ValueError(f"{path}: no token in the file")
        if len(lines) > 2:
            raise ValueError(f"{path}: {len(lines)} lines; a token file is {form}")
        write, read = lines[0], (lines[1] if len(lines) > 1 else None)
    for role, token in (("write", write), ("read", read)):  # a format mistake (YAML's "write: ...", quotes)
        if token is not None and (any(c.isspace() or c in "\"'" for c in token)  # is no token clients send
                                  or token.lower().startswith(("write:", "read:"))):
            raise ValueError(f"{path}: the {role} token holds spaces, quotes or a key (\"{role}: ...\"): a token "
                             f"file is {form}")
    for role, token in (("write", write), ("read", read)):  # an operator's own: a guessable one is refused
        if token is not None and len(token) < MIN_TOKEN_CHARS:
            raise ValueError(f"{path}: the {role} token has {len(token)} characters, fewer than {MIN_TOKEN_CHARS}: "
                             "make one that cannot be guessed (python -c 'import secrets; "
                             "print(secrets.token_urlsafe(32))'), or use --auth to have tokens made")
    try:
        AuthConfig.from_tokens(write, read)  # what the servers would refuse: said now, naming the file
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    return write, read
