"""`memserver web`: serve the read-only inspection page (memserver.web) for the running cluster."""

from __future__ import annotations

import argparse
import errno
import logging
import os
import re
import secrets
import socket

from memserver.cli.common import CliError, cli_client, endpoint_of, seconds

log = logging.getLogger("memserver.web")
DEFAULT_PORT = 8377
#: The environment variable `memserver web` takes the page's key from (else it makes one per run).
KEY_ENV = "MEMSERVER_WEB_KEY"


def cmd_web(args: argparse.Namespace) -> int:
    """Check the cluster answers, the checkpoint exists and the port is free before serving, so a
    typo fails at once."""
    from memserver.web import create_app
    from memserver.web.app import KEY_PARAM

    if not 1 <= args.port <= 65535:  # (0 would print a URL nobody can open)
        raise CliError(f"--port must be in [1, 65535], got {args.port}")
    from client.channels import read_token
    from memserver.cluster.secure import is_loopback

    endpoint = endpoint_of(args)
    # the page's key: other users of the machine reach a loopback port too (docs/security.md). From
    # the environment, not a flag: a command line is every local user's to read (ps)
    own = os.environ.get(KEY_ENV, "").strip()
    if own and not re.fullmatch(r"[A-Za-z0-9_.~-]{16,}", own):
        raise CliError(f"{KEY_ENV}: at least 16 letters, digits or -_.~ (it travels in an address and a cookie)")
    key = own or secrets.token_urlsafe(32)
    # the read token (the page reads only), and on a loopback address only its own names as Host
    with cli_client(args, endpoint, token=read_token(endpoint)) as client:  # --timeout bounds a page's calls
        client.list_tables()  # an unreachable cluster is an error now, not on the first page view
        app = create_app(client, checkpoint=args.checkpoint,
                         loopback_only=is_loopback(args.host), key=key)
        if args.checkpoint:  # a missing file or one not memtrain's: now, not a note on every page (and loaded once)
            try:
                app.state.models.load(args.checkpoint)
            except (FileNotFoundError, ValueError) as exc:
                raise CliError(f"--checkpoint: {exc}") from None
        sock = listen(args.host, args.port)  # before saying where: a port in use is an error, not a wrong URL
        host = f"[{args.host}]" if ":" in args.host else args.host
        log.info("inspection page of the cluster at %s: http://%s:%d/?%s=%s (Ctrl-C stops it)", endpoint, host,
                 args.port, KEY_PARAM, f"${KEY_ENV}" if own else key)  # (a key of the user's own is not printed)
        if not is_loopback(args.host):
            log.warning("listening on %s: anyone who can reach it and holds the key can read the tables' "
                        "statistics (plain HTTP: the key crosses the network in the clear)", args.host)
        verbose = getattr(args, "verbose", False)  # memserver -v: uvicorn's access log too
        serve(app, sock, "info" if verbose else "warning")
    return 0


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to host:port, or a CliError naming --port / --host."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as exc:
        raise CliError(f"--host {host}: {exc.strerror}") from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT, not one in use
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        flag = f"--host {host}" if exc.errno == errno.EADDRNOTAVAIL else f"--port {port}"  # not this machine's
        raise CliError(f"{flag}: cannot listen on {host}:{port}: {exc.strerror}") from None
    return sock


def serve(app: object, sock: socket.socket, log_level: str) -> None:
    """uvicorn on the bound socket until Ctrl-C."""
    import uvicorn

    uvicorn.Server(uvicorn.Config(app, log_level=log_level)).run(sockets=[sock])


def add_parser(sub: argparse._SubParsersAction) -> None:
    """`web`."""
    w = sub.add_parser(
        "web", help="serve a read-only web page for inspecting the memory slots of value tables",
        description="Serve an inspection page for the running cluster: its tables and shards; per value table the "
        "slot usage (metrics and plot), the hottest and coldest slots by hits, weight mass, updates or value norm; "
        "per slot its statistics, address, top trigger contexts and the tokens its value writes; search slots by "
        "the token they write, and run your own text through the model to see which slots it reads. Projecting "
        "slots needs the model: --checkpoint, else the checkpoint `memtrain trace` recorded for the table. Every "
        "read is uncounted (slot statistics do not change). Each page's data is also JSON under /api/.",
        epilog="Example: memserver web --port 8377, then open the address it prints (http://127.0.0.1:8377/?key=...) "
        "in a browser: the key is kept in a cookie. Scripts send it as `Authorization: Bearer KEY` to /api/. "
        f"{KEY_ENV}: the key to ask for instead of a new one per run.")
    w.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port to listen on (default {DEFAULT_PORT})")
    w.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only). The page asks for a key, "
                   f"made per run and printed in its address at start (or ${KEY_ENV})")
    w.add_argument("--checkpoint", metavar="DIR",
                   help="memtrain --checkpoint-dir (its latest step) or a trainer-step-*.pt to project slots through "
                   "(default: the one `memtrain trace` recorded for each table)")
    w.add_argument("--endpoint", help="coordinator HOST:PORT (default: from the endpoint file)")
    w.add_argument("--timeout", type=seconds, default=30.0,
                   help="how long a page waits for the cluster, each call with its retries, seconds (default 30)")
    w.set_defaults(func=cmd_web)
