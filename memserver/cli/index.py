"""`memserver index build`: create an index table and bulk-load it from .npy files.
`memserver index load-pkm`: serve a trained product-key memory layer of a memtrain checkpoint."""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from memserver.api.errors import InvalidArgumentError
from memserver.api.types import a_kind, fmt_bytes
from memserver.cli.common import CliError, cli_client, cluster_flags, counted, one_line
from memserver.wire import INDEX_ID_SPACE, check_norms, train_sample_limit

FLOAT32_MAX = float(np.finfo(np.float32).max)

log = logging.getLogger("memserver.cli")

#: Vectors sent per add call while loading (each call is split further below the request limit).
LOAD_BATCH = 65536


def _load(path: str | None, flag: str, ndim: int) -> np.ndarray | None:
    if path is None:
        return None
    p = Path(path)
    if p.is_dir():
        raise CliError(f"{flag}: {path} is a directory; name a .npy file")
    if not p.is_file():
        raise CliError(f"{flag}: no such file {path}")
    try:
        a = np.load(p, mmap_mode="r", allow_pickle=False)  # mapped: a large file is read as it is sent
    except ValueError as exc:
        raise CliError(f"{flag}: {path} is not a .npy array ({exc})") from None
    if not isinstance(a, np.ndarray):  # an .npz archive: several arrays, which one is not ours to guess
        raise CliError(f"{flag}: {path} is not a .npy array (an .npz archive? save the one array with np.save)")
    if a.ndim != ndim:
        raise CliError(f"{flag}: expected a {ndim}-D array, {path} has shape {list(a.shape)}")
    return a


def _check_dtype(a: np.ndarray | None, flag: str, ids: bool = False) -> None:
    """A file's dtype, checked before anything is made: ids cast to int64 only where exact (a cast
    would turn 0.5 into 0 or 2^64-1 into -1 silently), vectors and payload from any number type."""
    if a is None:
        return
    if ids and not np.can_cast(a.dtype, np.int64, "safe"):  # (uint8/16/32 and int8/16 are exact in int64)
        raise CliError(f"{flag}: dtype must be an integer type int64 holds exactly (int64, int32, uint32, ...), "
                       f"got {a.dtype}")
    if not ids and a.dtype.kind not in "fiu":  # integer vectors (uint8 SIFT/BIGANN files) become float32
        raise CliError(f"{flag}: dtype must be a number type, got {a.dtype}")


def _check_contents(ids: np.ndarray | None, arrays: list[tuple[np.ndarray | None, str]]) -> None:
    """What the shards would refuse part-way (a --replace having dropped the table by then, or a
    duplicate accepted or refused by where the load's batches fell: a walkthrough), checked
    before anything is made: distinct ids, finite vectors and payload. A pass over each file, in
    LOAD_BATCH rows at a time (the files stay mapped, not read whole into memory)."""
    if ids is not None:
        uniq, counts = np.unique(np.asarray(ids, dtype=np.int64), return_counts=True)
        for bad, why in ((uniq[:1][uniq[:1] < 0], "negative: ids are >= 0"),
                         (uniq[-1:][uniq[-1:] >= INDEX_ID_SPACE], f"above the largest id an index takes ({INDEX_ID_SPACE - 1})")):
            if bad.size:  # (refused by the shards part-way: a --replace had dropped the old table by then)
                row = int(np.flatnonzero(np.asarray(ids) == bad[0])[0])
                raise CliError(f"--ids: id {int(bad[0])} (row {row}) is {why}")
        if (dup := np.flatnonzero(counts > 1)).size:
            i = int(uniq[dup[0]])
            rows = np.flatnonzero(np.asarray(ids) == i)[:3].tolist()
            raise CliError(f"--ids: id {i} is given {int(counts[dup[0]])} times (rows {rows}, ...): an index holds one "
                           "vector per id")
    for a, flag in arrays:
        if a is None:
            continue
        for s in range(0, len(a), LOAD_BATCH):
            part = a[s : s + LOAD_BATCH]
            if a.dtype.kind != "f":  # integers are finite, and their norms are checked as float32 all the same
                if flag == "--vectors":  # (an int64 row of 2^62 was refused by the shards after a --replace: a hunt)
                    try:
                        check_norms(torch.from_numpy(np.asarray(part, dtype=np.float32)), flag, first=s)
                    except InvalidArgumentError as exc:
                        raise CliError(exc.details) from None
                continue
            bad = ~np.isfinite(part).all(axis=1)
            if bad.any():
                raise CliError(f"{flag}: row {s + int(np.flatnonzero(bad)[0])} holds NaN or infinite values")
            if part.dtype.itemsize > 4 and (big := np.abs(part).max(axis=1) > FLOAT32_MAX).any():  # (loaded as float32: inf)
                raise CliError(f"{flag}: row {s + int(np.flatnonzero(big)[0])} holds values beyond float32's range, "
                               "which the index stores")
            if flag == "--vectors":  # (the payload is stored, never compared)
                try:
                    check_norms(torch.from_numpy(np.asarray(a[s : s + LOAD_BATCH], dtype=np.float32)), flag, first=s)
                except InvalidArgumentError as exc:
                    raise CliError(exc.details) from None


def cmd_build(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from client import TableNotFoundError

    vectors = _load(args.vectors, "--vectors", 2)
    assert vectors is not None
    n, dim = vectors.shape
    payload = _load(args.payload, "--payload", 2)
    ids = _load(args.ids, "--ids", 1)
    for a, flag in ((vectors, "--vectors"), (payload, "--payload")):
        _check_dtype(a, flag)
    _check_dtype(ids, "--ids", ids=True)
    if payload is not None and len(payload) != n:
        raise CliError(f"--payload: {len(payload)} rows for {n} vectors")
    if ids is not None and len(ids) != n:
        raise CliError(f"--ids: {len(ids)} ids for {n} vectors")
    _check_contents(ids, [(vectors, "--vectors"), (payload, "--payload")])
    if args.train_sample is not None and args.train_sample < 0:
        raise CliError(f"--train-sample must be >= 0, got {args.train_sample}")
    if args.train:  # an explicit --train: its sample checked before anything is made
        train_rows(n, dim, args.train_sample)
    if args.train is False:  # a kind faiss trains refuses every add untrained: refused before anything is made
        from memserver.core.index import VectorIndex  # (a --replace had dropped the table, then failed: a hunt)
        from memserver.server.catalog import check_factory_sizes

        check_factory_sizes(dim, args.factory)  # (before faiss allocates what the string asks for)
        if VectorIndex(dim, args.factory, args.metric, 0).needs_training:
            raise CliError(f"--no-train: {args.factory!r} is a kind faiss trains before it takes any vector; leave "
                           "--no-train out (index build trains it on a sample of the vectors)")
    out: dict[str, Any] = {"table": args.name, "vectors": n, "dim": dim, "index_factory": args.factory,
                           "metric": args.metric}
    t0 = time.perf_counter()
    with cli_client(args) as client:
        exists_hint(lambda: client.create_index(args.name, dim, index_factory=args.factory, metric=args.metric,
                                                payload_dim=0 if payload is None else payload.shape[1],
                                                num_shards=args.shards, wal=args.wal, replace=args.replace),
                    args.replace, client=client, name=args.name, kind="index")
        try:  # a build that fails leaves no half-built table behind (a rerun would be refused)
            # as the shards built it: faiss says whether its kind needs training
            needs = any(not t.trained for sh in client.status().shards for t in sh.tables if t.table == args.name)
            if args.train and not needs:  # (it said "trained on N" of a kind that trains nothing)
                log.warning("index build %s: %s needs no training; --train is ignored", args.name, args.factory)
            if needs and args.train is not False:
                rows = np.sort(np.random.default_rng(0).choice(n, train_rows(n, dim, args.train_sample), replace=False))
                out["train"] = client.train_index(args.name, np.ascontiguousarray(vectors[rows], dtype=np.float32))
            with tqdm(total=n, unit="vec", desc=f"loading {args.name}", disable=args.json or None) as bar:
                for s in range(0, n, LOAD_BATCH):
                    e = min(n, s + LOAD_BATCH)
                    batch_ids = np.asarray(ids[s:e]) if ids is not None else np.arange(s, e, dtype=np.int64)
                    client.add(args.name, batch_ids, np.ascontiguousarray(vectors[s:e], dtype=np.float32),
                               None if payload is None else np.ascontiguousarray(payload[s:e], dtype=np.float32))
                    bar.update(e - s)
        except BaseException:
            try:
                client.drop_table(args.name)
            except TableNotFoundError:
                pass
            except Exception as exc:  # noqa: BLE001 - the build's own error is the one to raise
                log.warning("index build %s failed, and dropping the table it had made failed too: %s", args.name, exc)
            raise
        st = client.status()
    out["seconds"] = time.perf_counter() - t0
    loads = [t for sh in st.shards for t in sh.tables if t.table == args.name]
    out["bytes"] = sum(t.bytes for t in loads)
    out["held"] = sum(t.vectors for t in loads)
    out["shards"] = len(loads)  # (what the human line says, as --json says it: a hunt)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        trained = f", trained on {out['train']['sample_rows']:,}" if "train" in out else ""
        print(f"index {args.name} ({args.factory}, {args.metric}): {out['held']:,} vectors of dim {dim} over "
              f"{counted(len(loads), 'shard')}{trained}, {fmt_bytes(out['bytes'])}, loaded in {out['seconds']:.1f}s")
    return 0


#: index build's default training sample (rows), when that many fit in one request.
TRAIN_SAMPLE = 100_000


def train_rows(n: int, dim: int, asked: int | None) -> int:
    """The rows `index build` trains on: --train-sample (0: all n), by default TRAIN_SAMPLE or as
    many as one TrainIndex request carries, whichever is fewer; an explicit one that does not fit
    is refused naming the flag."""
    most = train_sample_limit(dim)
    if asked is None:
        return min(n, TRAIN_SAMPLE, most)
    rows = min(n, asked or n)
    if rows > most:
        raise CliError(f"--train-sample: {rows:,} vectors of dim {dim} exceed one request; at most {most:,}")
    return rows


def exists_hint(create: Callable[[], Any], replace: bool = False, *, client: Any = None, name: str = "",
                kind: str = "") -> Any:
    """Run a create of a `kind` table; a table that exists already is refused with the flag that
    replaces it, or, where it is of another kind (which --replace never replaces), with what to do
    instead (it said "add --replace", then refused that: a hunt). With --replace given, the
    refusal of a table of another kind says itself what to do."""
    from client import TableExistsError

    try:
        return create()
    except TableExistsError as exc:
        if replace:
            raise
        if client is not None and (other := _kind_of(client, name)) not in (None, kind):
            raise CliError(f"{exc.details}: it is {a_kind(other)}, which --replace does not replace (only "
                           f"{a_kind(kind)} of that name): choose another name, or drop it first "
                           f"(memserver drop-table {name})") from None
        raise CliError(f"{exc.details}: add --replace to replace it") from None


def _kind_of(client: Any, name: str) -> str | None:
    """The kind of table `name` (TableMeta.kind), None where there is none."""
    return next((m.kind for m in client.list_tables() if m.name == name), None)


def _refuse_other_kind(client: Any, name: str, kind: str, flag: str) -> None:
    """Before anything changes: a table `name` of another kind than `kind` is refused (load-pkm's
    --replace dropped whatever held the name, an index table too: a hunt)."""
    other = _kind_of(client, name)
    if other is not None and other != kind:
        raise CliError(f"{flag} {name}: a table of that name exists and is {a_kind(other)}; --replace replaces only "
                       f"{a_kind(kind)} of that name: choose another name, or drop it first (memserver drop-table "
                       f"{name}); nothing was changed")


#: Value rows written per write_rows call while loading a local run's values.
PKM_ROWS_BATCH = 65536
#: What memtrain's ProductKeyMemory builds its BatchNorm with (nn.BatchNorm1d's default eps;
#: a trainer checkpoint keeps the state_dict, which has no eps).
BN_EPS = 1e-5


def _trainer_checkpoint(directory: str) -> tuple[Path, dict[str, Any]]:
    import torch

    from trainer.checkpoints import latest_trainer_file

    try:
        latest = latest_trainer_file(directory)
    except FileNotFoundError:
        raise CliError(f"CHECKPOINT_DIR: no memtrain checkpoint (trainer-step-*.pt) in {directory}") from None
    try:
        blob = torch.load(latest, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the user's to know about
        raise CliError(f"CHECKPOINT_DIR: {latest} does not load: {exc}") from None
    if not isinstance(blob, dict) or "model" not in blob:
        raise CliError(f"CHECKPOINT_DIR: {latest} is not a memtrain checkpoint (no model state)")
    return latest, blob


def _layer_values(blob: dict[str, Any], layer: int, layers: list[int]) -> dict[str, Any]:
    """What memtrain saved of layer `layer`'s value backend: {"state": ...} (a local run) or
    {"checkpoint": "memory/<table>"} (a remote run). Shared values are saved once, under the
    first layer that reads them."""
    values = blob.get("values")
    if values is None:  # written before each backend saved itself: one memory/ root for every table
        local = blob.get("local_values", {})
        values = {str(i): {"state": local[str(i)]} if str(i) in local else {"checkpoint": "memory"} for i in layers}
    values = {k: v for k, v in values.items() if k.isdigit()}  # product keys' (other kinds are "lsh-2", ...)
    if str(layer) in values:
        return values[str(layer)]
    if len(values) == 1:  # --shared-values: one table for every memory layer
        return next(iter(values.values()))
    raise CliError(f"--layer {layer}: the checkpoint holds the values of layers {sorted(values)} only")


def _saved_table(args: argparse.Namespace, saved: dict[str, Any], step: int) -> str:
    """The value table a remote run's checkpoint holds for the layer, known before anything
    changes: its name as the trainer recorded it, else its folder (memory/<table>), else (the
    oldest checkpoints: one memory/ root for every table) the one value table of that step there
    (a --replace found out only by the restore, which replaced every table of the root: a review)."""
    if saved.get("table"):
        return str(saved["table"])
    where = saved["checkpoint"]
    if where != "memory" and where.startswith("memory/"):
        return where.removeprefix("memory/")
    from memserver.storage.checkpoint import find_checkpoint

    root = Path(args.checkpoint_dir).resolve() / where
    try:
        _, manifest = find_checkpoint(root, step)
    except Exception as exc:  # noqa: BLE001 - any refusal is the user's to read, by the folder
        raise CliError(f"{args.checkpoint_dir}: the values of layer {args.layer} at step {step} are not in {root} "
                       f"({one_line(exc)}); nothing was changed") from None
    tables = sorted(manifest.get("tables", {}))
    if args.values_table in tables or len(tables) == 1:
        return args.values_table or tables[0]
    raise CliError(f"{args.checkpoint_dir}: {root} holds the checkpoints of {tables} at step {step}, and which is layer "
                   f"{args.layer}'s values is not recorded (an older memtrain): give --values-table, one of them; "
                   "nothing was changed")


def cmd_load_pkm(args: argparse.Namespace) -> int:
    import torch
    from tqdm import tqdm

    from client import TableExistsError, TableNotFoundError

    path, blob = _trainer_checkpoint(args.checkpoint_dir)
    from trainer.model import GPT

    sd = GPT.upgrade_state_dict(blob["model"])  # checkpoints of any memtrain version
    layers = sorted({int(k.split(".")[1]) for k in sd if k.startswith("blocks.") and k.endswith(".memory.pkm.keys")})
    prefix = f"blocks.{args.layer}.memory.pkm."
    if prefix + "keys" not in sd:
        raise CliError(f"--layer {args.layer}: no product-key memory there; memory layers: {layers or 'none'}")
    keys = sd[prefix + "keys"].float()
    heads, _, n_keys, half = keys.shape
    k_dim = 2 * half
    weight, bias = sd[prefix + "query.weight"].float(), sd.get(prefix + "query.bias")
    d_in = int(weight.shape[1])
    bn = None
    if prefix + "query_bn.running_mean" in sd:
        bn = {k: sd[prefix + f"query_bn.{k}"].float() for k in ("running_mean", "running_var", "weight", "bias")}
        bn["eps"] = BN_EPS
    saved_knn = blob.get("memory", {}).get("knn")
    if args.knn is None:  # memtrain records its memory config; older checkpoints need --knn
        args.knn = int(saved_knn if saved_knn is not None else 32)
    elif saved_knn is not None and args.knn != int(saved_knn):  # a served layer reads as it was trained
        raise CliError(f"--knn: the checkpoint's layers read {int(saved_knn)} slots per head, not {args.knn}; leave "
                       "--knn out (it is taken from the checkpoint)")
    if args.knn < 1 or args.knn > n_keys:
        raise CliError(f"--knn: must be in [1, {n_keys}] (n_keys of layer {args.layer}), got {args.knn}")
    name = args.name or f"pkm-layer{args.layer}"
    saved = _layer_values(blob, args.layer, layers)
    out: dict[str, Any] = {"table": name, "checkpoint": str(path), "step": int(blob.get("step", 0)), "layer": args.layer,
                           "heads": int(heads), "n_keys": int(n_keys), "knn": args.knn, "k_dim": k_dim, "d_in": d_in,
                           "query_bn": bn is not None, "mem_plus": prefix + "gate.weight" in sd}
    if "state" not in saved:  # a remote run's values, restored from <dir>/memory/<table>: there, before any drop
        where = Path(args.checkpoint_dir).resolve() / saved["checkpoint"]
        if not where.is_dir():
            raise CliError(f"{args.checkpoint_dir}: the checkpoint's values of layer {args.layer} should be in {where}, "
                           "which does not exist (the run's memory/ folder moved or was removed?); nothing was dropped")
    t0 = time.perf_counter()
    with cli_client(args) as client:
        # every refusal before anything changes: a name held by another kind of table (which --replace
        # dropped, whatever it was), or held at all without --replace (the values table was made and
        # filled first, then left behind by the product-key table's refusal: a hunt)
        listed = client.list_tables()
        have = {m.name for m in listed}
        _refuse_other_kind(client, name, "product_keys", "--name")
        if name in have and not args.replace:
            raise CliError(f"--name {name}: a product-key table of that name already exists: add --replace to "
                           "replace it; nothing was changed")
        local = "state" in saved
        if local:
            values = saved["state"]["weight"]  # ValueTable.state(): "weight" is the values
            rows, dim = values.shape
            if rows != n_keys * n_keys:
                raise CliError(f"the checkpoint's values have {rows} rows, n_keys^2 = {n_keys * n_keys}")
        values_name = (args.values_table or f"{name}-values") if local else _saved_table(args, saved, out["step"])
        if not local and args.values_table and args.values_table != values_name:
            raise CliError(f"--values-table: a remote run's values are restored under their own name, {values_name!r}")
        _refuse_other_kind(client, values_name, "value", "--values-table" if args.values_table else "values")
        # other product-key tables reading the values table: it is not made anew under them (the
        # cluster refuses it, and that came after this table's drop: a review)
        readers = sorted(m.name for m in listed if m.kind == "product_keys" and m.values_table == values_name
                         and m.name != name)
        if readers and values_name in have:
            raise CliError(f"{'--values-table ' if args.values_table else ''}{values_name}: product-key table(s) "
                           f"{', '.join(readers)} read their slots' values from it, so it is not made anew under "
                           "them: drop them first, or give another --values-table; nothing was changed")
        made: list[str] = []  # the tables this command made: dropped again if it fails
        try:
            if args.replace and name in have:  # (first: it reads the values table a replace may make anew)
                client.drop_table(name)
            if local:  # a local run: the values are in the trainer file
                values_table = values_name
                exists_hint(lambda: client.create_table(values_table, rows, dim, optimizer="sgd", init_std=0.0,
                                                        dtype=str(values.dtype).removeprefix("torch."),
                                                        replace=args.replace), args.replace)
                made.append(values_table)
                with tqdm(total=rows, unit="row", desc=f"values {values_table}", disable=args.json or None) as bar:
                    for s in range(0, rows, PKM_ROWS_BATCH):
                        e = min(rows, s + PKM_ROWS_BATCH)
                        client.write_rows(values_table, torch.arange(s, e), values[s:e].float())
                        bar.update(e - s)
                out["values_from"] = "trainer file"
            else:  # a remote run: the cluster checkpointed the table under <dir>/memory/<table>
                root = Path(args.checkpoint_dir).resolve() / saved["checkpoint"]
                try:
                    restored = client.restore(str(root), out["step"], replace=args.replace, tables=[values_name])
                except TableExistsError as exc:  # the run's own table, still live: the restore's advice is not
                    if args.replace:  # this command's (a table of another kind of that name: its refusal says what to do)
                        raise
                    raise CliError(f"the run's value table is in the cluster ({exc.details.split(';')[0]}): add "
                                   "--replace to replace it with the checkpoint's values") from None
                made += [m.name for m in restored]
                if len(restored) != 1:
                    raise CliError(f"{root}: expected the checkpoint of one value table, got {[m.name for m in restored]}")
                values_table = restored[0].name
                if args.values_table and args.values_table != values_table:
                    raise CliError(f"--values-table: a remote run's values are restored under their own name, "
                                   f"{values_table!r}")
                out["values_from"] = str(root)
            out["values_table"] = values_table
            client.create_product_keys(name, values_table, int(heads), int(n_keys), args.knn, k_dim, d_in)
            made.append(name)
            out["sub_keys"] = client.load_product_keys(name, keys, weight, None if bias is None else bias.float(), bn)
        except BaseException:
            for table in reversed(made):  # (the product-key table first: it reads the values table)
                try:
                    client.drop_table(table)
                except TableNotFoundError:
                    pass
                except Exception as exc:  # noqa: BLE001 - the command's own error is the one to raise
                    log.warning("load-pkm: dropping table %s, which it had made, failed too: %s", table, exc)
            raise
    out["seconds"] = time.perf_counter() - t0
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        extra = " (Memory+ layer: the served bag is before its gate and projection)" if out["mem_plus"] else ""
        print(f"product-key table {name}: layer {args.layer} of {path.name} (step {out['step']}), {heads} heads x knn "
              f"{args.knn} over {n_keys}^2 slots, query {d_in} -> {heads}x{k_dim}{' + BatchNorm' if bn else ''}; values in "
              f"{values_table}; loaded in {out['seconds']:.1f}s{extra}")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    ix = sub.add_parser("index", help="index tables: build one from files",
                        description="Index tables hold a faiss index of your vectors under your int64 ids, sharded "
                        "by id; clients search them with `MemoryClient.search`.")
    isub = ix.add_subparsers(dest="index_command", required=True, metavar="SUBCOMMAND")
    b = isub.add_parser("build", help="create an index table and load it from .npy files",
                        description="Create index table NAME, train it once on a sample when its kind needs training "
                        "(IVF, PQ, SQ, OPQ, PCA: one quantizer for all shards), then add every vector with a progress "
                        "bar. A build that fails drops the table it made.")
    b.add_argument("name", help="table name")
    b.add_argument("--vectors", required=True, help=".npy file of float vectors [n, dim]")
    b.add_argument("--ids", help=".npy file of int64 ids [n] (default: 0..n-1)")
    b.add_argument("--payload", help=".npy file of float payload rows [n, p], returned with hits")
    b.add_argument("--factory", default="Flat", help="faiss index_factory string, e.g. Flat, IVF1024,Flat, IVF1024,PQ16, "
                   "HNSW32 (default: Flat)")
    b.add_argument("--metric", choices=("ip", "l2"), default="ip", help="inner product (default) or squared L2")
    b.add_argument("--train", action=argparse.BooleanOptionalAction, default=None,
                   help="train before loading (default: when faiss says the factory's index needs training: IVF, "
                   "PQ, SQ, OPQ, PCA)")
    b.add_argument("--train-sample", type=int, default=None, help="vectors to train on (0: all; default: 100,000, or "
                   "as many as one request carries at this dim)")
    b.add_argument("--shards", type=int, default=0, help="shards to spread it over (default: all)")
    b.add_argument("--wal", action="store_true", help="log every add and remove before acknowledging it")
    b.add_argument("--replace", action="store_true", help="drop an index table of that name first (else an existing "
                   "one is refused, as is a table of another kind with it); a build that fails drops the table it made")
    cluster_flags(b, timeout=600.0, json_help="print one JSON object instead of a line")
    b.set_defaults(func=cmd_build)
    p = isub.add_parser("load-pkm", help="serve a trained product-key memory layer of a memtrain checkpoint",
                        description="Read memtrain's latest trainer-step-*.pt in CHECKPOINT_DIR; put layer L's values "
                        "in a value table (a remote run's cluster checkpoint is restored, a local run's values are "
                        "written), then create product-key table NAME and load the layer's sub-keys, query Linear and "
                        "BatchNorm (eval mode). Clients then call `MemoryClient.pkm_lookup(NAME, x)`.")
    p.add_argument("checkpoint_dir", metavar="CHECKPOINT_DIR", help="memtrain's --checkpoint-dir")
    p.add_argument("--layer", type=int, required=True, help="the block index of the memory layer (--mem-layers)")
    p.add_argument("--name", help="product-key table name (default: pkm-layer<L>)")
    p.add_argument("--values-table", help="value table for a local run's values (default: <name>-values); a remote "
                   "run's table keeps its saved name")
    p.add_argument("--knn", type=int, default=None, help="slots per head the layer was trained with (default: as the "
                   "checkpoint records it; 32, memtrain's default, for checkpoints that do not)")
    p.add_argument("--replace", action="store_true", help="replace a product-key table and a value table of the "
                   "same names (a table of another kind is refused, never dropped)")
    cluster_flags(p, timeout=600.0, json_help="print one JSON object instead of a line")
    p.set_defaults(func=cmd_load_pkm)
