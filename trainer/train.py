"""`memtrain`: train a character-level transformer LM with memory layers (product keys, LSH
sketch memory, KIF knowledge fetch, Engram hashed n-grams) whose tables live in the memserver cluster (`--memory
remote`), in this process (`--memory local`) or nowhere (`--memory none`). One JSON object per
log step with --log-json.

    memtrain --memory remote --steps 1000 --mem-layers 2 --n-keys 128 --log-json run.jsonl
    memtrain --memory local --memory-kind lsh --steps 1000
    memtrain --memory remote --memory-kind pkm,kif          # KIF over the corpus's own sentences
    memtrain --memory remote --memory-kind engram --engram-slots 1048576  # hashed n-grams, reads prefetched
    memtrain --memory local --device cuda --dtype bf16   # on a GPU, the dense part in bf16 autocast
    memtrain trace --checkpoint ckpt --table memtrain-values  # record slots' trigger contexts (trace --help)
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import math
import operator
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch

from memserver.api.errors import InvalidArgumentError, MemserverError
from memserver.cli import quiet_libraries
from memserver.cli.common import (
    FAILED,
    WRONG_COMMAND,
    DefaultsHelp,
    cache_size,
    exit_status,
    one_line,
    parse_args,
    print_json_error,
    retry_window,
    seconds,
)
from memserver.core.table import set_threads
from memserver.storage.checkpoint import extras_digest
from trainer.checkpoints import prune_checkpoints, trainer_file
from trainer.data import DEFAULT_DATA, Corpus, get_batch, load_corpus, read_texts, text_digest
from trainer.device import CPU, DEVICES, DTYPES, autocast, dist_backend, resolve_device
from trainer.memory import (
    KINDS,
    KnowledgeSource,
    LocalKnowledge,
    LocalValues,
    MemoryConfig,
    RemoteKnowledge,
    RemoteValues,
    UsageCounter,
    ValueBackend,
)
from trainer.memory.backends import check_remote_save, to_device
from trainer.memory.engram import MAX_ORDER
from trainer.memory.knowledge import check_encoder_name, corpus_sentences, encode_cached, make_encoder, upload_source
from trainer.memory.lsh import MAX_BITS
from trainer.model import GPT, ModelConfig, value_key

log = logging.getLogger("memtrain")


class _Help(DefaultsHelp, argparse.RawDescriptionHelpFormatter):
    """memtrain's description keeps its own lines (the module's docstring)."""
MAX_LSH_ROWS = 1 << 31  # buckets per LSH table (hashes x 2^bits): far beyond any table this machine could hold


def client_waits(args: argparse.Namespace) -> dict[str, float]:
    """The MemoryClient's timeout and retry_seconds that --timeout and --retry-seconds give (the
    client's own defaults where they are not given)."""
    return {k: v for k, v in (("timeout", args.timeout), ("retry_seconds", args.retry_seconds)) if v is not None}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="memtrain", description=__doc__, formatter_class=_Help,
                                epilog="Exit status: 0 trained; 2 the command was wrong (a flag, a checkpoint to resume "
                                "that does not fit it, no cluster for --memory remote); 1 training failed (the "
                                "cluster's error; it names the latest checkpoint and the --resume that goes on; or "
                                "the loss went NaN: the run diverged).")
    p.add_argument("-v", "--debug", action="store_true", help="a failing call's traceback instead of its one-line error")
    d = p.add_argument_group("data and run")
    d.add_argument("--data", default=str(DEFAULT_DATA), help="text file (split 90/10) or WikiText-2 folder (default: tiny Shakespeare)")
    d.add_argument("--steps", type=int, default=1000, help="optimizer steps")
    d.add_argument("--batch-size", type=int, default=32, help="sequences per step")
    d.add_argument("--block-size", type=int, default=128, help="tokens per sequence")
    d.add_argument("--seed", type=int, default=0, help="seed of the initial weights, the batches and dropout")
    d.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate of the dense part")
    d.add_argument("--eval-every", type=int, default=100, help="evaluate every N steps (and at the end)")
    d.add_argument("--eval-iters", type=int, default=20, help="validation batches per evaluation")
    d.add_argument("--log-every", type=int, default=10, help="log every N steps")
    d.add_argument("--log-json", help="append one JSON object per log step to this file")
    d.add_argument("--threads", type=int, default=0, help="CPU threads of torch and of the compiled kernels (numba) "
                   "in this process (0: torch's default)")
    d.add_argument("--device", default="auto", help=f"where the model, the memory's addressing, local values and the "
                   f"dense optimizer run: {DEVICES} (auto: CUDA when torch sees a GPU; data-parallel: the LOCAL_RANK's)")
    d.add_argument("--dtype", choices=list(DTYPES), default="fp32",
                   help="fp32, or bf16 autocast of the dense part (memory addressing and values stay float32)")
    m = p.add_argument_group("model")
    m.add_argument("--n-layer", type=int, default=4, help="transformer blocks")
    m.add_argument("--n-head", type=int, default=4, help="attention heads per block")
    m.add_argument("--n-embd", type=int, default=128, help="model width")
    m.add_argument("--dropout", type=float, default=0.0, help="dropout probability of the dense part")
    mem = p.add_argument_group("memory")
    mem.add_argument("--memory", choices=["none", "local", "remote"], default="remote",
                     help="where the memory values live (default remote: tables in the cluster `memserver up` "
                          "started, or --endpoint's; local: in this process)")
    mem.add_argument("--endpoint", help="memserver coordinator HOST:PORT (default: the endpoint file of `memserver up`)")
    mem.add_argument("--timeout", type=seconds, help="each cluster call's deadline in seconds; an attempt past it is "
                     "sent again within --retry-seconds (default: 60)")
    mem.add_argument("--retry-seconds", type=retry_window, help="how long a call keeps retrying while a shard or the "
                     "coordinator restarts before the run stops with its error; a lost host takes Ray about 30 s to "
                     "notice, then the shard reloads its slice elsewhere, so give large tables more; 0: no retries "
                     "(default: 60)")
    mem.add_argument("--table", default="memtrain-values", help="name of the remote value table (re-created at start)")
    mem.add_argument("--mem-layers", default="2", help="comma-separated block indices that get a memory layer")
    mem.add_argument("--mem-mode", choices=["parallel", "replace"], default="parallel", help="memory beside the FFN, or instead of it")
    mem.add_argument("--memory-kind", default="pkm", metavar="KINDS",
                     help="comma-separated kinds of memory at each --mem-layers block: pkm (product keys), lsh (LSH "
                          "sketch memory), kif (kNN fetch over fixed sentence encodings), engram (hashed n-grams); "
                          "several are summed")
    mem.add_argument("--shared-values", action="store_true", help="one value table for all memory layers")
    mem.add_argument("--n-keys", type=int, default=128, help="sub-keys per half: n_keys^2 memory slots")
    mem.add_argument("--heads", type=int, default=4, help="memory heads")
    mem.add_argument("--k-dim", type=int, default=64, help="key dimension (two halves of k_dim/2)")
    mem.add_argument("--knn", type=int, default=32, help="slots read per head")
    mem.add_argument("--no-query-bn", action="store_true", help="no BatchNorm on memory queries")
    mem.add_argument("--mem-plus", action="store_true", help="Memory+: SiLU-gated output projection")
    mem.add_argument("--value-optimizer", choices=["adam", "adagrad", "sgd"], default="adam",
                     help="sparse optimizer of the memory values (applied where they live)")
    mem.add_argument("--value-lr", type=float, default=1e-2, help="learning rate of the memory values")
    mem.add_argument("--sharding", choices=["rows", "cols"], default=None, help="remote table sharding (default: server's)")
    mem.add_argument("--staleness", type=int, choices=[0, 1], default=0,
                     help="0: a step's value update is applied before its backward returns; 1: the shards answer "
                          "first and apply it while the next step starts (reads still never see a table without it). "
                          "Token-addressed layers (engram): 1 also sends step t+1's prefetched reads while step t "
                          "computes, so they read rows one update old (local and remote alike)")
    mem.add_argument("--no-prefetch", action="store_true",
                     help="token-addressed layers (engram) read when the forward reaches them instead of as soon as "
                          "the batch is drawn (same losses at --staleness 0; for measuring the prefetch; a resume "
                          "takes the checkpoint's where both are left out)")
    mem.add_argument("--prefetch", dest="no_prefetch", action="store_false", default=False,
                     help="the prefetch on (the default): for a resume of a --no-prefetch run")
    mem.add_argument("--no-warm", action="store_true",
                     help="token-addressed layers on disk tables (--tier disk): no read-ahead hint of step t+1's rows "
                          "once step t's forward is done (same losses; for measuring the hint). The hint is sent only "
                          "with --staleness 0 and the prefetch on (not --no-prefetch)")
    mem.add_argument("--tier", choices=["ram", "disk"], default="ram",
                     help="remote value tables: rows in the shards' RAM, or (disk) in files on the shards' data "
                          "directories under a RAM cache of hot rows (a table many times the cluster's memory)")
    mem.add_argument("--cache-bytes", type=cache_size, default=None, metavar="SIZE",
                     help="--tier disk: each table's RAM cache, over all its shards, e.g. 512M (default: the "
                          "cluster's, 1/8 of the table's rows and optimizer state)")
    mem.add_argument("--sync-commit", action="store_true",
                     help="remote tables: wait for each step's commit before going on, instead of overlapping it "
                          "with the dense optimizer step and the next step's first work (same losses; for measuring "
                          "the overlap)")
    mem.add_argument("--wal", action="store_true",
                     help="remote tables log every update before acknowledging it, so a restarted shard loses none "
                          "(without it, a shard restart returns the table to its latest checkpoint)")
    lsh = p.add_argument_group("LSH sketch memory (--memory-kind lsh)")
    lsh.add_argument("--lsh-hashes", type=int, default=4, help="hash functions, one bucket read from each")
    lsh.add_argument("--lsh-bits", type=int, default=12, help="hyperplanes per hash: 2^bits buckets per hash "
                     "(4 x 2^12 = 16384 slots, as many as 128^2 product keys)")
    lsh.add_argument("--lsh-seed", type=int, default=0, help="seed of the fixed hash planes and sketch matrices")
    eng = p.add_argument_group("Engram hashed n-gram memory (--memory-kind engram)")
    eng.add_argument("--engram-orders", default="2,3", help="n-gram orders hashed at each position (2..8)")
    eng.add_argument("--engram-heads", type=int, default=4, help="hash heads per order, each its own table segment")
    eng.add_argument("--engram-slots", type=int, default=65536,
                     help="rows of each Engram value table, split evenly into orders x heads segments (rounded down "
                          "to a multiple of that)")
    eng.add_argument("--engram-dim", type=int, default=32, help="floats per row (a position reads orders x heads rows)")
    eng.add_argument("--engram-seed", type=int, default=0, help="seed of the n-gram hashes (block i uses seed + i)")
    eng.add_argument("--no-engram-conv", action="store_true", help="no short causal convolution after the gate")
    kif = p.add_argument_group("KIF knowledge memory (--memory-kind kif)")
    kif.add_argument("--kif-source", action="append", default=[], metavar="NAME",
                     help="an index table in the cluster (metric ip, payload = the encodings) to read; repeatable. "
                          "Without one, a source is built from the training text's sentences")
    kif.add_argument("--kif-encoder", default="minilm", help="encoder of the built source: minilm (all-MiniLM-L6-v2, "
                     "from the pinned package, offline) or hash[N] (character trigrams, instant)")
    kif.add_argument("--kif-sentences", type=int, default=4096, help="sentences of the training text in the built source")
    kif.add_argument("--kif-knn", type=int, default=8, help="hits fetched per position and source")
    tr = p.add_argument_group("live tracing of trigger contexts (--memory remote; see `memtrain trace`)")
    tr.add_argument("--trace-every", type=int, default=0, metavar="N",
                    help="every N steps, send the batch's memory reads as trigger records to the shards (0: off)")
    tr.add_argument("--trace-sample", type=float, default=0.05, metavar="F",
                    help="fraction of the batch's positions traced (default 0.05)")
    ck = p.add_argument_group("checkpoints")
    ck.add_argument("--checkpoint-dir", help="save the trainer's state here (and checkpoint the remote tables under "
                    "<dir>/memory); with --resume DIR, default: DIR (after a --resume file: none, since its "
                    "directory may hold later checkpoints)")
    ck.add_argument("--checkpoint-every", type=int, default=0,
                    help="checkpoint every N steps (0: only at the end); needs --checkpoint-dir or a --resume directory")
    ck.add_argument("--keep-checkpoints", type=int, default=0, metavar="N",
                    help="keep only the newest N checkpoints, removing older ones (the trainer file, then its "
                    "tables' folders under memory/) after each new one (0, the default: keep all)")
    ck.add_argument("--resume", metavar="DIR", help="continue from the latest checkpoint in DIR (trainer state and "
                    "memory), or from that trainer-step-*.pt file; the text, model, memory, optimizer, batch and seed "
                    "flags left out are the checkpoint's (a different one given is refused by name), and so are "
                    "--checkpoint-every, --keep-checkpoints, --staleness, --micro-batches, --threads, --dtype and the "
                    "evaluation and logging "
                    "flags (these it may change); --steps is the total to reach")
    mem.add_argument("--micro-batches", type=int, default=1, help="split memory lookups so one chunk's call overlaps the next chunk's addressing")
    return p


@dataclass
class Run:
    model: GPT
    corpus: Corpus
    values: dict[int, ValueBackend]
    client: Any = None
    device: torch.device = CPU

    def close(self) -> None:
        if self.client is not None:
            self.client.close()


def _world_size() -> int:
    """How many trainers this run was launched as (torchrun's WORLD_SIZE; 1 without it)."""
    import os

    return int(os.environ.get("WORLD_SIZE", "1"))


def trainer_client_id() -> str:
    """This trainer's client id: its rank first (torchrun's RANK), so the shards, which sum a sync
    table's contributions in client-id order, sum the trainers' in rank order, the same in every
    run (random ids made two runs of one command differ in the last bits); a random tail keeps it
    unique."""
    import os
    import uuid

    return f"memtrain-rank{int(os.environ.get('RANK', '0')):06d}-{uuid.uuid4().hex[:16]}"


def distributed(backend: str = "gloo") -> tuple[int, int]:
    """(rank, world size); joins the process group (`backend`: gloo on the CPU, nccl between GPUs)
    when launched with WORLD_SIZE > 1 (torchrun, or RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set by hand)."""
    import torch.distributed as dist

    world = _world_size()
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend)
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


#: Flags a run records in its checkpoints and a resumed run must give alike, or leave out to take
#: the checkpoint's (as it does the model's and the memory's shapes, which the checkpoint's config
#: and memory record): the dense and value optimizers, the batch, the seed, where the values live,
#: the dropout rate and how the KIF source was built. What a resume may change: steps, device,
#: tracing and RESUMED_TAKEN's.
RESUMED_ALIKE = ("memory", "lr", "value_optimizer", "value_lr", "sharding", "wal", "tier", "cache_bytes", "table",
                 "batch_size", "seed", "shared_values", "dropout", "kif_knn", "kif_sentences", "kif_encoder")
#: Flags a resumed run takes from its checkpoint where they are left out, and may change: how often
#: it checkpoints (in the folder it resumed from, or --checkpoint-dir), and how its steps reach the
#: values (a resume that left --staleness 1 or --micro-batches 2 out trained on at the defaults,
#: unsaid, and its losses left the uninterrupted run's: a walkthrough). --no-prefetch too: at
#: --staleness 1 it changes the losses (--prefetch turns it back on; a hunt). (--sync-commit changes
#: no number, and as a switch with no opposite it could not be undone.)
#: --threads too: the sums of a step's ops are split by thread, so a resume on other threads is
#: close to the uninterrupted run, not bit-exact (a walkthrough: 2.4e-7 apart). And what it
#: evaluates and logs: a resume that left --eval-iters out evaluated on the default 20 batches, so
#: its val_loss was not the uninterrupted run's (a walkthrough: 3.9569 against 3.9494). And
#: --keep-checkpoints, with --checkpoint-every: a resume kept checkpointing and stopped pruning (a hunt).
#: And --dtype: a bf16 run's resume that left it out went on in fp32, unsaid (a hunt).
RESUMED_TAKEN = ("checkpoint_every", "keep_checkpoints", "staleness", "micro_batches", "threads", "eval_every",
                 "eval_iters", "log_every", "no_prefetch", "dtype")


def checkpoint_dir_of(args: argparse.Namespace) -> str | None:
    """Where the run's checkpoints go: --checkpoint-dir, else a --resume directory (a resumed run
    goes on checkpointing where it came from; not after a --resume file, whose directory may hold later ones)."""
    if args.checkpoint_dir:
        return args.checkpoint_dir
    return args.resume if args.resume and Path(args.resume).is_dir() else None


#: Largest --seed, --lsh-seed, --engram-seed (2^53).
MAX_SEED = 1 << 53


def check_flags(args: argparse.Namespace) -> None:
    """Every number in range and no flag that the run would ignore, before anything is built (an
    error naming the flag, not a traceback from deep inside, or a run that silently does something else)."""
    kinds = set(memory_kinds(args))
    for flag, value, lo, hi in (
            ("--steps", args.steps, 1, 1 << 40), ("--batch-size", args.batch_size, 1, 1 << 20),
            ("--block-size", args.block_size, 1, 1 << 16), ("--eval-every", args.eval_every, 1, 1 << 40),
            ("--eval-iters", args.eval_iters, 1, 1 << 20), ("--log-every", args.log_every, 1, 1 << 40),
            ("--threads", args.threads, 0, 4096), ("--n-layer", args.n_layer, 1, 1024), ("--n-head", args.n_head, 1, 1024),
            ("--n-embd", args.n_embd, 1, 1 << 16), ("--n-keys", args.n_keys, 1, 1 << 16), ("--heads", args.heads, 1, 1024),
            ("--k-dim", args.k_dim, 2, 1 << 16), ("--knn", args.knn, 1, args.n_keys if "pkm" in kinds else 1 << 16),
            ("--micro-batches", args.micro_batches, 1, 1024), ("--checkpoint-every", args.checkpoint_every, 0, 1 << 40),
            ("--keep-checkpoints", args.keep_checkpoints, 0, 1 << 40),
            ("--lsh-hashes", args.lsh_hashes, 1, 1024), ("--lsh-bits", args.lsh_bits, 1, MAX_BITS),
            ("--kif-knn", args.kif_knn, 1, 4096), ("--kif-sentences", args.kif_sentences, 1, 1 << 24),
            # (the seeds derived from them, seed * 1000 + a table's and seed + a block's, stay int64: a
            # larger one failed in a traceback or named the table's seed, not the flag: a hunt)
            ("--seed", args.seed, 0, MAX_SEED), ("--lsh-seed", args.lsh_seed, 0, MAX_SEED),
            ("--engram-seed", args.engram_seed, 0, MAX_SEED)):
        if not lo <= value <= hi:
            extra = " (--n-keys: a head reads at most n_keys slots of each half)" if flag == "--knn" else ""
            raise SystemExit(f"memtrain: error: {flag}: must be in [{lo}, {hi}], got {value}{extra}")
    if args.k_dim % 2:
        raise SystemExit(f"memtrain: error: --k-dim: must be even (two halves of k_dim/2), got {args.k_dim}")
    if args.n_embd % args.n_head:
        raise SystemExit(f"memtrain: error: --n-embd {args.n_embd} must be a multiple of --n-head {args.n_head}")
    if not 0 <= args.dropout < 1:
        raise SystemExit(f"memtrain: error: --dropout: must be in [0, 1), got {args.dropout}")
    for flag, value in (("--lr", args.lr), ("--value-lr", args.value_lr)):
        if not 0 < value < math.inf:
            raise SystemExit(f"memtrain: error: {flag}: must be a positive number, got {value}")
    for flag, given in (("--checkpoint-every", args.checkpoint_every), ("--keep-checkpoints", args.keep_checkpoints)):
        if given and not checkpoint_dir_of(args):
            raise SystemExit(f"memtrain: error: {flag}: give --checkpoint-dir (where the checkpoints go)")
    remote_only = [flag for flag, given in (("--wal", args.wal), ("--sharding", args.sharding is not None),
                                            ("--sync-commit", args.sync_commit)) if given]
    if args.memory != "remote" and remote_only:
        raise SystemExit(f"memtrain: error: {', '.join(remote_only)}: for tables in the cluster (--memory remote); "
                         f"this run is --memory {args.memory}")
    if args.memory == "local" and "kif" not in kinds and "table" in (getattr(args, "given", None) or ()):
        # (taken and unread: only a local KIF source is named after it; a hunt)
        raise SystemExit(f"memtrain: error: --table {args.table}: names this run's tables in the cluster, and with "
                         f"--memory local its values live in this process; drop it, or give --memory remote")
    for flag, given in (("--endpoint", args.endpoint), ("--timeout", args.timeout is not None),
                        ("--retry-seconds", args.retry_seconds is not None)):
        if given and args.memory != "remote" and not args.kif_source:
            raise SystemExit(f"memtrain: error: {flag}: this run uses no cluster (--memory {args.memory}, no --kif-source)")
    if args.memory == "none" and args.memory_kind != "pkm":
        raise SystemExit(f"memtrain: error: --memory-kind {args.memory_kind}: this run trains without memory "
                         "(--memory none); give --memory local or remote")
    given = getattr(args, "given", None)  # the flags the command line set (main's parse; None: unknown)
    if args.memory == "none" and (ignored := _memory_flags(given or frozenset())):
        raise SystemExit(f"memtrain: error: {', '.join(ignored)}: shape memory layers, and this run trains without "
                         "memory (--memory none); drop them, or give --memory local or remote")
    if args.memory != "none" and (unread := _other_kinds_flags(given or frozenset(), kinds)):
        raise SystemExit(f"memtrain: error: {', '.join(unread)}: "
                         f"{'shapes' if len(unread) == 1 else 'shape'} layers this run has none of (--memory-kind "
                         f"{args.memory_kind}); drop {'it' if len(unread) == 1 else 'them'}, or add the kind")
    if args.memory != "none" and (unread := _value_flags_unread(given or frozenset(), kinds)):
        raise SystemExit(f"memtrain: error: {unread}")
    # (a resume's --staleness taken from its checkpoint was allowed when that was written)
    if args.staleness and args.memory == "local" and "engram" not in kinds and (given is None or "staleness" in given):
        raise SystemExit(f"memtrain: error: --staleness {args.staleness}: with --memory local it changes only the "
                         f"reads of token-addressed layers (engram), and --memory-kind {args.memory_kind} has none; "
                         "with --memory remote it lets the shards apply a step while the next one starts")
    if args.trace_sample != 0.05 and not args.trace_every:
        raise SystemExit("memtrain: error: --trace-sample: samples what --trace-every traces; give --trace-every N")
    if args.trace_every and args.memory != "none" and not set(kinds) - {"kif"}:  # (taken, and nothing traced: a hunt)
        raise SystemExit(f"memtrain: error: --trace-every: records the slots of value tables, and --memory-kind "
                         f"{args.memory_kind} reads none (a KIF layer searches an index); drop it, or add a kind that "
                         "reads values")
    if ("pkm" in kinds and args.memory != "none" and args.mem_layers.strip() and not args.no_query_bn
            and args.batch_size * args.block_size < 2):
        raise SystemExit(f"memtrain: error: --batch-size {args.batch_size} x --block-size {args.block_size}: a "
                         "training step's product-key queries are one position, and their BatchNorm normalises "
                         "over a step's positions; give more, or --no-query-bn")
    if args.mem_plus and not kinds & {"pkm", "lsh"}:
        raise SystemExit("memtrain: error: --mem-plus: Memory+ gates the product-key and LSH layers' output; "
                         f"--memory-kind {args.memory_kind} has neither")


def memory_kinds(args: argparse.Namespace) -> tuple[str, ...]:
    """--memory-kind's kinds, refused by the flag where one is not a kind (before the checks that
    read them: a misspelt kind was said as its flags shaping layers the run had none of, a hunt)."""
    kinds = tuple(k.strip() for k in args.memory_kind.split(",") if k.strip())
    if not kinds or any(k not in KINDS for k in kinds) or len(set(kinds)) != len(kinds):
        raise SystemExit(f"memtrain: error: --memory-kind {args.memory_kind}: a comma-separated list of distinct "
                         f"kinds from {', '.join(KINDS)}")
    return kinds


def memory_config(args: argparse.Namespace) -> MemoryConfig:
    """The memory layers' settings from the flags, refused by flag name where out of range: what
    setup builds, and what a resumed run is compared with before anything is built."""
    kinds = memory_kinds(args)
    mem_layers: tuple[int, ...] = ()
    if args.memory != "none":
        try:
            mem_layers = tuple(int(x) for x in args.mem_layers.split(",") if x.strip())
        except ValueError:
            mem_layers = (-1,)  # refused below, by the flag's name
        if not mem_layers or len(set(mem_layers)) != len(mem_layers) or any(not 0 <= i < args.n_layer
                                                                            for i in mem_layers):
            raise SystemExit(f"memtrain: error: --mem-layers {args.mem_layers!r}: comma-separated distinct block "
                             f"indices in [0, {args.n_layer}) (--memory {args.memory} needs at least one; "
                             "--memory none trains without)")
    try:
        given_orders = [int(n) for n in args.engram_orders.split(",") if n.strip()]
    except ValueError:
        given_orders = []
    orders = tuple(sorted(set(given_orders)))
    if not orders or len(orders) != len(given_orders) or not all(2 <= n <= MAX_ORDER for n in orders):
        raise SystemExit(f"memtrain: error: --engram-orders {args.engram_orders}: comma-separated distinct orders in "
                         f"[2, {MAX_ORDER}]")
    if not 1 <= args.engram_heads <= 64 or not 1 <= args.engram_dim <= 4096:
        raise SystemExit("memtrain: error: --engram-heads must be in [1, 64] and --engram-dim in [1, 4096]")
    segments = len(orders) * args.engram_heads
    engram_rows = args.engram_slots - args.engram_slots % segments
    if "engram" in kinds and not segments <= engram_rows <= MAX_LSH_ROWS:
        raise SystemExit(f"memtrain: error: --engram-slots {args.engram_slots}: at least one row per segment "
                         f"({segments}) and at most {MAX_LSH_ROWS:,}")
    if "lsh" in kinds and args.lsh_hashes << args.lsh_bits > MAX_LSH_ROWS:
        raise SystemExit(f"memtrain: error: --lsh-hashes {args.lsh_hashes} x 2^--lsh-bits {args.lsh_bits} buckets: "
                         f"at most {MAX_LSH_ROWS:,} per table")
    return MemoryConfig(layers=mem_layers, mode=args.mem_mode, kinds=kinds, n_keys=args.n_keys, heads=args.heads,
                        k_dim=args.k_dim, knn=args.knn, query_bn=not args.no_query_bn, mem_plus=args.mem_plus,
                        micro_batches=args.micro_batches, lsh_hashes=args.lsh_hashes, lsh_bits=args.lsh_bits,
                        lsh_seed=args.lsh_seed, kif_knn=args.kif_knn, engram_orders=orders,
                        engram_heads=args.engram_heads, engram_slots=engram_rows, engram_dim=args.engram_dim,
                        engram_seed=args.engram_seed, engram_conv=not args.no_engram_conv)


def check_paths(args: argparse.Namespace) -> None:
    """The files a run writes, before step 1 (they failed after the whole run, or mixed runs):
    --log-json's folder exists; --checkpoint-dir is no file, and a fresh run's holds no other
    run's checkpoints (a later --resume would take the other run's latest)."""
    if args.log_json and not Path(args.log_json).resolve().parent.is_dir():
        raise SystemExit(f"memtrain: error: --log-json {args.log_json}: no folder {Path(args.log_json).parent}")
    if args.log_json and Path(args.log_json).is_dir():
        raise SystemExit(f"memtrain: error: --log-json {args.log_json}: a folder, not a file")
    where = args.checkpoint_dir
    if where and Path(where).exists() and not Path(where).is_dir():
        raise SystemExit(f"memtrain: error: --checkpoint-dir {where}: a file, not a folder")
    if where and not Path(where).exists():  # made at the first save: what is above it must let it be (a file
        above = Path(where).resolve()  # on the way failed there, after the training it was to keep: a hunt)
        while not above.exists():
            above = above.parent
        if not above.is_dir() or not os.access(above, os.W_OK | os.X_OK):
            raise SystemExit(f"memtrain: error: --checkpoint-dir {where}: {above} is "
                             f"{'a file' if not above.is_dir() else 'a folder this user may not write'}, so the folder "
                             "cannot be made")
    if where and not args.resume and Path(where).is_dir() and (held := sorted(Path(where).glob("trainer-step-*.pt"))):
        raise SystemExit(f"memtrain: error: --checkpoint-dir {where}: it holds another run's checkpoints ({held[0].name} "
                         f".. {held[-1].name}), which this run's would mix with; give another folder, or --resume "
                         f"{where} to continue that run")


def setup(args: argparse.Namespace, client: Any = None) -> Run:
    check_flags(args)
    check_paths(args)
    try:
        device = resolve_device(args.device)
    except ValueError as exc:
        raise SystemExit(f"memtrain: error: --device {args.device}: {exc}") from None
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL and the default stream of this process: its GPU
    rank, world = distributed(dist_backend(device))
    if world > 1 and args.memory == "local":
        raise SystemExit("memtrain: error: --memory local with several trainers would give each its own copy of the "
                         "values; use --memory remote (a sync_updates table)")
    if world > 1 and not args.no_query_bn and "pkm" in {k.strip() for k in args.memory_kind.split(",")} \
            and args.mem_layers.strip():
        log.warning("data-parallel run with query BatchNorm: its statistics are per trainer, so the result "
                    "differs slightly from one trainer on the combined batch (use --no-query-bn for equality)")
    # torch's and numba's threads alike (0: torch's default count): numba's pool, started lazily by
    # its first parallel kernel, sets the OpenMP count it shares with torch back to every core,
    # mid-run; set_threads starts it here, before anything computes
    set_threads(args.threads or torch.get_num_threads())
    try:
        corpus = load_corpus(args.data)
    except FileNotFoundError as exc:
        raise SystemExit(f"memtrain: error: {exc}") from None
    if args.block_size + 1 >= min(len(corpus.train), len(corpus.val)):
        raise SystemExit(f"memtrain: error: --block-size {args.block_size}: {corpus.name}'s validation text has "
                         f"{len(corpus.val):,} tokens; a window and its next token must fit in it")
    memory = memory_config(args)
    kinds, mem_layers = memory.kinds, memory.layers
    if args.tier == "disk" and args.memory != "remote":
        raise SystemExit("memtrain: error: --tier disk: disk tables live in the cluster; use --memory remote")
    if args.cache_bytes is not None and args.tier != "disk":
        raise SystemExit("memtrain: error: --cache-bytes sizes a disk table's cache: add --tier disk")
    if args.trace_every and (args.memory != "remote" or args.trace_every < 0 or not 0 < args.trace_sample <= 1):
        raise SystemExit("memtrain: error: --trace-every needs --memory remote, N >= 1 and --trace-sample in (0, 1]")
    if args.kif_source and "kif" not in kinds:
        raise SystemExit("memtrain: error: --kif-source: add kif to --memory-kind")
    if "kif" in kinds and not args.kif_source:
        try:
            check_encoder_name(args.kif_encoder)  # on every rank, before rank 0 builds anything
        except ValueError as exc:
            raise SystemExit(f"memtrain: error: --kif-encoder: {exc}") from None
    own_client = False
    wants_cluster = args.memory == "remote" or ("kif" in kinds and args.kif_source)
    if wants_cluster and mem_layers and client is None:
        from client import MemoryClient

        try:
            client = MemoryClient(args.endpoint, client_id=trainer_client_id(), **client_waits(args))
        except FileNotFoundError as exc:  # no endpoint file: no cluster started here
            raise SystemExit(f"memtrain: error: --memory {args.memory} needs a memserver cluster and found none ({exc}); "
                             "start one with `memserver up`, give --endpoint HOST:PORT, or train with --memory local"
                             ) from None
        own_client = True
    try:
        model, values = _build(args, client, device, rank, world, corpus, memory)
    except BaseException:  # refused while the tables or the model were made: the client made here goes too
        if own_client:
            client.close()
        raise
    return Run(model, corpus, values, client if own_client else None, device)


def _build(args: argparse.Namespace, client: Any, device: torch.device, rank: int, world: int, corpus: Corpus,
           memory: MemoryConfig) -> tuple[GPT, dict[str, ValueBackend]]:
    """setup's model and value backends (remote tables made anew by rank 0), on `client`."""
    kinds, mem_layers, engram_rows = memory.kinds, memory.layers, memory.engram_slots
    if world > 1 and rank > 0:
        import torch.distributed as dist

        try:
            dist.barrier()  # rank 0 has created the tables (and uploaded the KIF source): attached below
        except RuntimeError:  # (gloo's "Connection closed by peer ... GLHF!": rank 0 refused, and said why)
            raise SystemExit(f"memtrain: error: trainer {rank}: trainer 0 stopped while it made the tables or the "
                             "knowledge source (its error says why); this one stops too") from None
    # each value table once (--shared-values: one per kind, every layer's key naming it): its key,
    # then (rows, width, the backends' common arguments, its table name where remote)
    planned: dict[str, str] = {}  # key -> the key of the table it reads
    tables: dict[str, tuple[int, int, dict[str, Any], str]] = {}
    first_of: dict[str, str] = {}  # kind -> its first table's key (--shared-values)
    for i in mem_layers:
        for kind in kinds:
            if kind == "kif":
                continue
            key = value_key(kind, i)
            if args.shared_values and kind in first_of:
                planned[key] = first_of[kind]
                continue
            first_of.setdefault(kind, key)
            rows = {"pkm": args.n_keys**2, "lsh": args.lsh_hashes << args.lsh_bits, "engram": engram_rows}[kind]
            width = args.engram_dim if kind == "engram" else args.n_embd
            seed = args.seed * 1000 + i + {"pkm": 0, "lsh": 500, "engram": 700}[kind]  # each table its own initial values
            common = dict(optimizer=args.value_optimizer, lr=args.value_lr, seed=seed)
            if kind == "lsh":  # a sketch of random buckets is noise at the residual's own scale: start at zero
                common["init_std"] = 0.0
            base = args.table if kind == "pkm" else f"{args.table}-{kind}"
            tables[key] = (rows, width, common, base if args.shared_values or len(mem_layers) == 1 else f"{base}-{i}")
            planned[key] = key
    checkpoint_dir = checkpoint_dir_of(args)
    if args.memory == "remote" and checkpoint_dir and rank == 0:  # refused before any table is made anew
        for _, _, _, name in tables.values():
            check_remote_save(client, name, Path(checkpoint_dir))
    made: dict[str, ValueBackend] = {}
    for key, (rows, width, common, name) in tables.items():
        if args.memory == "local":
            made[key] = LocalValues(rows, width, device=device, **common)
        else:
            # a resume's restore replaces the table only once the checkpoint is checked: made anew first,
            # a resume whose restore was refused left the live table zeroed
            made[key] = RemoteValues(client, name, rows, width, sharding=args.sharding, defer_apply=args.staleness > 0,
                                     create=rank == 0, restoring=bool(args.resume), sync_workers=world if world > 1 else 0,
                                     wal=args.wal, tier=args.tier, cache_bytes=args.cache_bytes or 0, **common)
    values = {key: made[table] for key, table in planned.items()}
    knowledge: list[KnowledgeSource] = []
    if "kif" in kinds and mem_layers and rank == 0 and not args.kif_source:  # built and uploaded before the barrier
        knowledge = knowledge_sources(args, corpus, client, rank, device)
    if world > 1 and rank == 0:
        import torch.distributed as dist

        dist.barrier()  # the tables and the KIF source are there: the other trainers attach to them
    if "kif" in kinds and mem_layers and (rank > 0 or args.kif_source):  # every rank resolves named sources
        knowledge = knowledge_sources(args, corpus, client, rank, device)
    memory.kif_sources = tuple(s.name for s in knowledge)
    cfg = ModelConfig(vocab_size=corpus.vocab_size, block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head,
                      n_embd=args.n_embd, dropout=args.dropout, memory=memory)
    torch.manual_seed(args.seed)
    model = GPT(cfg, values, knowledge).to(device)  # built on the CPU: the same initial weights on every device
    return model, values


def knowledge_sources(args: argparse.Namespace, corpus: Corpus, client: Any, rank: int,
                      device: torch.device = CPU) -> list[KnowledgeSource]:
    """The KIF layers' sources: the named index tables, or one built from the training text's
    sentences (encoded once and cached on disk; in the cluster for --memory remote, else faiss here)."""
    if args.kif_source:
        from client import TableNotFoundError

        try:
            return [RemoteKnowledge(client, name) for name in args.kif_source]
        except (TableNotFoundError, ValueError) as exc:
            raise SystemExit(f"memtrain: error: --kif-source: {exc}") from None
    name = f"{args.table}-kif"
    if rank > 0:  # rank 0 built and uploaded it
        return [RemoteKnowledge(client, name)]
    encoder = make_encoder(args.kif_encoder)  # the name was checked in setup
    sentences = corpus_sentences(corpus.decode(corpus.train.tolist()), args.kif_sentences)
    if not sentences:
        raise SystemExit(f"memtrain: error: --memory-kind kif: {corpus.name} has no sentence of 20 characters or more "
                         "to build a knowledge source from; give --kif-source")
    log.info("KIF source: %d sentences of %s encoded with %s", len(sentences), corpus.name, encoder.name)
    e = encode_cached(encoder, sentences)
    if args.memory == "local":  # faiss where the run is (--device cpu: the CPU, even where faiss sees GPUs)
        return [LocalKnowledge(name, e, device=str(device))]
    return [upload_source(client, name, e)]


@torch.no_grad()
def evaluate(run: Run, args: argparse.Namespace, gen: torch.Generator) -> dict[str, float]:
    """Validation loss, and the memory usage metrics of XLM over the same batches."""
    model = run.model
    model.eval()
    losses = []
    layers = run.model.memories()
    usage = {name: UsageCounter(layer.num_slots) for name, layer in layers.items()}
    gates: dict[str, list[float]] = {name: [] for name, layer in layers.items() if hasattr(layer, "last_gate")}
    _, world = distributed()
    for _ in range(args.eval_iters):
        x, y = get_batch(run.corpus.val, args.batch_size * world, args.block_size, gen)  # the combined batch
        with autocast(run.device, args.dtype):
            _, loss = model(to_device(x, run.device), to_device(y, run.device))
        losses.append(float(loss))
        for name, counter in usage.items():
            counter.add(*layers[name].last_access)
        for name, got in gates.items():
            got.append(float(layers[name].last_gate.mean()))
    model.train()
    out: dict[str, float] = {"val_loss": sum(losses) / len(losses)}
    for name, counter in usage.items():
        for k, v in counter.metrics().items():
            out[f"{name}_{k}"] = v
    for name, got in gates.items():  # KIF: how open each source's gate is, on average
        out[f"{name}_gate"] = sum(got) / len(got)
    return out


def average_across_trainers(tensors: list[torch.Tensor], world: int) -> None:
    """Mean over the data-parallel trainers (the dense part; the memory's mean is the shards')."""
    import torch.distributed as dist

    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat)
    flat /= world
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


def _block_order(key: str) -> tuple[str, int]:
    kind, _, block = key.rpartition("-")  # "2" -> ("", 2), "lsh-10" -> ("lsh", 10)
    return kind, int(block)


def _unique(values: dict[str, ValueBackend]) -> dict[str, ValueBackend]:
    """Each backend once, under the first layer (by kind, then block number) that reads it
    (shared values are one table)."""
    seen: dict[str, ValueBackend] = {}
    for i, b in sorted(values.items(), key=lambda kv: _block_order(kv[0])):
        if all(b is not other for other in seen.values()):
            seen[i] = b
    return seen


def save_checkpoint(run: Run, opt: torch.optim.Optimizer, gen: torch.Tensor, step: int, directory: str,
                    flags: dict[str, Any], next_counted: bool = False) -> None:
    """The trainer's state and, at the same step barrier, the memory (each backend saves its own:
    remote tables are checkpointed by the cluster under <dir>/memory/<table>, local ones go into
    the trainer file). `gen`: the batch generator's state before the next step's batch.
    `next_counted`: the next step's reads left before the save (a stale prefetch), so the slot
    statistics saved hold them: a resume reads them again uncounted."""
    from memserver.storage.fsutil import atomic_write

    root = Path(directory)
    values = _on_cpu({key: b.save(root, step) for key, b in _unique(run.values).items()})
    cfg = {k: v for k, v in asdict(run.model.cfg).items() if k != "memory"}
    rng = {"cpu": torch.get_rng_state()}  # dropout's draws: a resume continues them (it restarted them)
    if run.device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(run.device)
    blob = {"step": step, "model": _on_cpu(run.model.state_dict()), "opt": _on_cpu(opt.state_dict()), "gen": gen,
            "rng": rng,
            "values": values, "memory": asdict(run.model.cfg.memory),  # the layers' shape, for serving them
            "config": cfg, "vocab": run.corpus.vocab, "data": run.corpus.name,  # enough to rebuild it (trainer.inspection)
            "data_path": run.corpus.path, "data_digest": run.corpus.digest,  # the text, wherever it lies
            "flags": flags,  # RESUMED_ALIKE: what a resume must give alike
            "next_reads_counted": next_counted}
    blob["digest"] = extras_digest(blob)  # a flipped bit in the weights or the optimizer's moments: refused at --resume
    atomic_write(trainer_file(directory, step), lambda f: torch.save(blob, f))  # written last: marks it complete
    log.info("checkpoint at step %d in %s", step, directory)


def _on_cpu(obj: Any) -> Any:
    """A checkpoint's tensors on the CPU, whatever the run's device: the file loads anywhere (a GPU
    run resumes on the CPU and back: `load_state_dict` copies onto the model's device, the dense
    optimizer's state follows its parameters, LocalValues copies into its table's device)."""
    if isinstance(obj, torch.Tensor):
        return obj.cpu()
    if isinstance(obj, dict):
        return {k: _on_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_on_cpu(v) for v in obj)
    return obj


#: The flag of a recorded setting where it is not `--` + the setting's name.
_FLAG_OF = {"layers": "--mem-layers", "kinds": "--memory-kind", "mode": "--mem-mode", "query_bn": "--no-query-bn",
            "engram_conv": "--no-engram-conv", "kif_sources": "--kif-source", "vocab_size": "--data"}


def resume_file(path: str) -> Path:
    """--resume's trainer file: the latest in a directory, or the file named."""
    from trainer.inspection import checkpoint_file

    try:
        return checkpoint_file(path)
    except FileNotFoundError as exc:
        raise SystemExit(f"memtrain: error: --resume {path}: {exc}") from None


def _memory_mode(saved_values: dict[str, Any]) -> str | None:
    """Where a checkpoint's values were: "local" (their state in the trainer file) or "remote"."""
    kinds = {"local" if "state" in v else "remote" for v in saved_values.values()}
    return kinds.pop() if len(kinds) == 1 else None


def _difference(key: str, was: Any, now: Any) -> str | None:
    """How a resumed run's setting `key` differs from the checkpoint's, by flag name (None: alike)."""
    if isinstance(was, (list, tuple)):
        was, now = tuple(was), tuple(now)
    if key == "sharding":  # left out is the cluster's, which has one (a resume giving it was refused: a hunt)
        from memserver.api.types import DEFAULT_SHARDING, SHARDINGS

        default = next(name for name, code in SHARDINGS.items() if code == DEFAULT_SHARDING)
        was, now = (default if v is None else v for v in (was, now))
    if was == now:
        return None
    flag = _FLAG_OF.get(key, "--" + key.replace("_", "-"))

    def said(v: Any) -> str:  # None: the flag left out, the cluster's or memtrain's default
        return "its default (left out)" if v is None else repr(v)

    return f"the checkpoint was trained with {key} = {said(was)}, this run gives {said(now)} ({flag})"


def _refuse(resume: str, differences: list[str]) -> None:
    """Refuse a resumed run whose settings differ from the checkpoint's, naming every one at once."""
    if differences:
        raise SystemExit(f"memtrain: error: --resume {resume}: {'; '.join(differences)}; a resumed run continues the "
                         "checkpoint's: leave those flags out (a flag left out is the checkpoint's) or give its values")


#: A checkpoint's shapes, compared with the run's: the memory's settings and the model's.
_MEMORY_SHAPE = ("layers", "kinds", "mode", "n_keys", "heads", "k_dim", "knn", "query_bn", "mem_plus", "lsh_hashes",
                 "lsh_bits", "lsh_seed", "kif_sources", "engram_orders", "engram_heads", "engram_slots", "engram_dim",
                 "engram_seed", "engram_conv")
_MODEL_SHAPE = ("vocab_size", "block_size", "n_layer", "n_head", "n_embd")


def _shape_differences(blob: dict[str, Any], memory: dict[str, Any], model: dict[str, Any]) -> list[str]:
    """How the run's shapes differ from the checkpoint's `blob`, among those `memory` and `model`
    give (before setup, the ones the flags alone decide)."""
    saved_memory, saved_model = blob.get("memory", {}), blob.get("config", {})
    out = []
    for saved, now, keys in ((saved_memory, memory, _MEMORY_SHAPE), (saved_model, model, _MODEL_SHAPE)):
        for key in keys:
            if key in saved and key in now and _in_use(key, now):  # (absent: written before the setting existed)
                out += [d] if (d := _difference(key, saved[key], now[key])) else []
    return out


def _refuse_other_shapes(resume: str, blob: dict[str, Any], memory: dict[str, Any], model: dict[str, Any]) -> None:
    """Refuse, by flag name, a run whose shapes differ from the checkpoint's `blob` (every one at once)."""
    _refuse(resume, _shape_differences(blob, memory, model))


def _joined(values: Any) -> str:
    return ",".join(map(str, values))


#: The shapes a resume takes from its checkpoint where their flags are left out: the saved key ->
#: (the flag's dest, the flag's value for a saved one). (The KIF sources are named once built.)
_SHAPE_FLAGS: dict[str, tuple[str, Callable[[Any], Any]]] = {
    **{k: (k, int) for k in ("n_layer", "n_head", "n_embd", "block_size", "n_keys", "heads", "k_dim", "knn",
                             "lsh_hashes", "lsh_bits", "lsh_seed", "engram_heads", "engram_slots", "engram_dim",
                             "engram_seed")},
    "layers": ("mem_layers", _joined), "kinds": ("memory_kind", _joined), "mode": ("mem_mode", str),
    "query_bn": ("no_query_bn", operator.not_), "mem_plus": ("mem_plus", bool), "engram_orders": ("engram_orders", _joined),
    "engram_conv": ("no_engram_conv", operator.not_),
}


#: The memory settings only some kinds read: a resume does not compare those of kinds neither run has
#: (`--lsh-bits` left out of a resume of a pkm,engram run was refused).
_KIND_KEYS = {"n_keys": ("pkm",), "heads": ("pkm",), "k_dim": ("pkm",), "knn": ("pkm",), "query_bn": ("pkm",),
              "mem_plus": ("pkm", "lsh"), "lsh_hashes": ("lsh",), "lsh_bits": ("lsh",), "lsh_seed": ("lsh",),
              "kif_sources": ("kif",), "engram_orders": ("engram",), "engram_heads": ("engram",),
              "engram_slots": ("engram",), "engram_dim": ("engram",), "engram_seed": ("engram",),
              "engram_conv": ("engram",)}


def _in_use(key: str, memory: dict[str, Any]) -> bool:
    """Whether a memory setting matters to a run of these `kinds` (compared first: equal here)."""
    kinds = memory.get("kinds")
    return key not in _KIND_KEYS or kinds is None or any(k in kinds for k in _KIND_KEYS[key])


def open_resume(args: argparse.Namespace) -> tuple[Path, dict[str, Any]]:
    """--resume's trainer file and its contents, with what can be refused before anything is built
    (the model, the connection, the tables made anew): another --memory mode, RESUMED_ALIKE flags
    or shapes that differ, --steps already reached, a --checkpoint-dir holding later checkpoints.
    load_checkpoint compares the shapes again once built (the KIF sources and the vocabulary too)."""
    latest = resume_file(args.resume)
    try:
        blob = torch.load(latest, map_location="cpu", weights_only=False)
    except Exception as exc:  # (a file that is not a checkpoint: pickle, zip or EOF errors of any kind)
        raise SystemExit(f"memtrain: error: --resume {args.resume}: {latest} is not a memtrain checkpoint "
                         f"({type(exc).__name__}: {str(exc)[:120]})") from None
    if not isinstance(blob, dict) or "step" not in blob:
        raise SystemExit(f"memtrain: error: --resume {args.resume}: {latest} is not a memtrain checkpoint")
    if "digest" in blob and blob.pop("digest") != extras_digest(blob):  # (files before it have none)
        raise SystemExit(f"memtrain: error: --resume {args.resume}: {latest} is damaged (its contents do not match "
                         "their checksum); resume from an earlier trainer-step file")
    given = getattr(args, "given", None)  # the flags the command line set (main's parse; None: unknown)
    mode = _memory_mode(blob["values"]) if "values" in blob else None
    if mode is not None and given is not None and "memory" not in given:
        args.memory = mode
    differences, taken = [], []  # (every difference said in one message)
    if mode is not None and args.memory != mode:
        differences.append(f"the checkpoint was written with --memory {mode}, this run is --memory {args.memory} (its "
                           f"values are {'in the trainer file' if mode == 'local' else 'tables in the cluster'})")
    for key, was in blob.get("flags", {}).items():  # (absent: written before checkpoints recorded them)
        if key in (*RESUMED_ALIKE, *RESUMED_TAKEN) and given is not None and key not in given:
            if key in ("checkpoint_every", "keep_checkpoints") and not checkpoint_dir_of(args):
                continue  # (after a --resume file: this run writes no checkpoints)
            if getattr(args, key) != was:  # left out: continued as the checkpoint has it
                taken.append(f"{key} = {was!r}")
            setattr(args, key, was)
        elif key in RESUMED_ALIKE and not (key == "memory" and mode is not None):  # (said above)
            differences += [d] if (d := _difference(key, was, getattr(args, key))) else []
    if given is not None and "data" not in given and (path := blob.get("data_path")) and path != args.data:
        if not Path(path).exists():  # (the default text in its place would train on other batches, unsaid)
            raise SystemExit(f"memtrain: error: --resume {args.resume}: the checkpoint was trained on {path}, which is "
                             "not here: give --data (that text, moved)")
        taken.append(f"data = {path!r}")
        args.data = path
    if want := blob.get("data_digest"):  # (absent: written before checkpoints kept it)
        try:
            _, train_text, val_text = read_texts(args.data)
        except FileNotFoundError:
            pass  # (setup says so, by the flag)
        else:
            if text_digest(train_text, val_text) != want:
                differences.append(f"the checkpoint was trained on another text ({blob.get('data_path') or 'its own'}), "
                                   f"not the one this run reads ({args.data or 'the default'}) (--data)")
    if given is not None:  # the shapes left out: the checkpoint's
        for key, (dest, flag_value) in _SHAPE_FLAGS.items():
            saved = blob.get("config" if key in _MODEL_SHAPE else "memory", {})
            if key in saved and dest not in given and getattr(args, dest) != (value := flag_value(saved[key])):
                taken.append(f"{key} = {saved[key]!r}")
                setattr(args, dest, value)
    # the KIF sources: the checkpoint's named ones where --kif-source is left out (a source built
    # from the text is built again, under its table's name), compared before any is built (a
    # refused resume had replaced an index table named <table>-kif already: a walkthrough)
    saved_kif = tuple(blob.get("memory", {}).get("kif_sources", ()))
    if saved_kif and given is not None and "kif_source" not in given and saved_kif != (f"{args.table}-kif",):
        taken.append(f"kif_sources = {saved_kif!r}")
        args.kif_source = list(saved_kif)
    if taken:
        log.info("--resume: as the checkpoint was trained (flags left out): %s", ", ".join(taken))
    # the shapes the flags alone decide (the vocabulary: once built)
    differences += _shape_differences(blob, {}, {k: getattr(args, k) for k in _MODEL_SHAPE if k != "vocab_size"})
    try:
        memory = asdict(memory_config(args))
    except SystemExit:  # the checkpoint's memory flags against another model or --memory given: say those
        _refuse(args.resume, differences)
        raise
    memory["kif_sources"] = tuple(args.kif_source) if args.kif_source else (f"{args.table}-kif",)  # (as built)
    _refuse(args.resume, differences + _shape_differences(blob, memory, {}))
    step = int(blob["step"])
    if step >= args.steps:
        raise SystemExit(f"memtrain: error: --steps {args.steps}: the checkpoint is at step {step} already (--steps "
                         "is the total to reach); give more to train on")
    checkpoint_dir = checkpoint_dir_of(args)
    if checkpoint_dir and Path(checkpoint_dir).resolve() == latest.parent.resolve() \
            and resume_file(checkpoint_dir) != latest:
        raise SystemExit(f"memtrain: error: --checkpoint-dir {checkpoint_dir}: it holds checkpoints after step "
                         f"{step}, which this run's would mix with; give another directory")
    if checkpoint_dir and Path(checkpoint_dir).resolve() != latest.parent.resolve() and Path(checkpoint_dir).is_dir() \
            and (held := sorted(Path(checkpoint_dir).glob("trainer-step-*.pt"))):  # (a resume into another run's
        # folder mixed with its checkpoints, and --keep-checkpoints removed them, and its own: a hunt)
        raise SystemExit(f"memtrain: error: --checkpoint-dir {checkpoint_dir}: it holds another run's checkpoints "
                         f"({held[0].name} .. {held[-1].name}), which this run's would mix with (and "
                         "--keep-checkpoints remove); give another folder, or leave it out (a resume of a folder goes "
                         "on in it)")
    return latest, blob


def load_checkpoint(run: Run, opt: torch.optim.Optimizer, gen: torch.Generator, latest: Path,
                    blob: dict[str, Any], resume: str) -> int:
    """Continue from the trainer file `latest` (`blob`, from open_resume): refused by flag name
    where the model's or the memory's shape differs from the checkpoint's."""
    directory = latest.parent
    _refuse_other_shapes(resume, blob, asdict(run.model.cfg.memory), asdict(run.model.cfg))
    run.model.load_state_dict(GPT.upgrade_state_dict(blob["model"]))
    opt.load_state_dict(blob["opt"])
    gen.set_state(blob["gen"])
    rng = blob.get("rng", {})  # (absent: written before checkpoints kept it)
    if "cpu" in rng:
        torch.set_rng_state(rng["cpu"])
    if "cuda" in rng and run.device.type == "cuda":
        torch.cuda.set_rng_state(rng["cuda"], run.device)
    step = int(blob["step"])
    if "values" not in blob:  # written before each backend saved itself: one memory/ root for every table
        local = blob["local_values"]
        blob["values"] = {key: {"state": local[key]} if key in local else {"checkpoint": "memory"} for key in run.values}
    for key, b in _unique(run.values).items():
        b.load(directory, step, blob["values"][key])
    log.info("resumed from %s (step %d)", latest, step)
    return step


class LiveTracer:
    """--trace-every: a sample of a training batch's memory reads sent as trigger records
    (trainer.inspection.trigger_records) to each remote table, with contexts from the batch's own
    windows; the table's info (vocabulary, layer) goes with the first records."""

    def __init__(self, run: Run, sample: float, seed: int, checkpoint_dir: str | None = None) -> None:
        """`checkpoint_dir`: recorded in the info, so `memserver inspect` and the page project the
        slots through this run's checkpoints once they exist."""
        from trainer.inspection import CONTEXT

        self.run, self.sample, self.context = run, sample, CONTEXT
        self.checkpoint = str(Path(checkpoint_dir).resolve()) if checkpoint_dir else None
        self.gen = torch.Generator().manual_seed(seed + 7)
        # table name -> the layers reading it, in the model's order (the first's info is sent)
        self.tables: dict[str, list[tuple[str, Any]]] = {}
        for name, layer in run.model.memories().items():
            # the backend says where its reads are recorded, if anywhere (KIF layers have no value table)
            table = layer.values.trace_table if layer.values is not None else None
            if table is not None:
                self.tables.setdefault(table, []).append((name, layer))
        self.info_sent: set[str] = set()
        self.seconds = 0.0

    def send(self, x: torch.Tensor, y: torch.Tensor, step: int) -> None:
        from trainer.inspection import layer_info, table_reads, trigger_records, window_contexts

        t0 = time.perf_counter()
        ctx, nxt = window_contexts(x.cpu(), y.cpu(), self.context)
        keep = torch.rand(ctx.shape[0], generator=self.gen) < self.sample
        for table, layers in self.tables.items():
            reads = [tuple(t.cpu() for t in layer.last_access) for _, layer in layers if layer.last_access is not None]
            if not reads:
                continue
            ids, w = table_reads(reads)
            name, layer = layers[0]
            info = ""
            if table not in self.info_sent:
                info = json.dumps({**layer_info(name, layer), "vocab": self.run.corpus.vocab, "context": self.context,
                                   "data": self.run.corpus.name, "live": True,
                                   **({"checkpoint": self.checkpoint} if self.checkpoint else {})})
                self.info_sent.add(table)
            layer.values.record_triggers(trigger_records(ids, w, ctx, nxt, keep), info=info)
        self.seconds += time.perf_counter() - t0


def train(args: argparse.Namespace, client: Any = None) -> Iterator[dict[str, Any]]:
    """Run training; yields one record per log step (what --log-json writes)."""
    if _world_size() > 1 and (args.checkpoint_dir or args.resume):  # before anything is built or made anew
        raise SystemExit("memtrain: error: --checkpoint-dir/--resume are for single-trainer runs for now")
    resumed = open_resume(args) if args.resume else None
    run = setup(args, client)  # (a remote table's --checkpoint-dir is checked there, before the table is made)
    try:
        model = run.model
        dense = [p for p in model.parameters() if p.requires_grad]
        # on a GPU the fused kernel: one launch for every parameter, where the default (foreach)
        # spends ~2 ms of the host's time per step on a launch-bound model (memtrain's defaults, H200)
        opt = torch.optim.AdamW(dense, lr=args.lr, weight_decay=0.0, fused=True if run.device.type == "cuda" else None)
        gen = torch.Generator().manual_seed(args.seed)
        rank, world = distributed()
        if rank > 0:  # the model was built alike from --seed on every trainer; dropout's masks then came alike
            torch.manual_seed(args.seed + rank)  # too (rank r's sample i got rank 0's): a stream each from here
        flags = {k: getattr(args, k) for k in (*RESUMED_ALIKE, *RESUMED_TAKEN)}
        checkpoint_dir = checkpoint_dir_of(args)
        if args.resume and not checkpoint_dir:
            log.warning("--resume %s is a file: this run writes no checkpoints (its directory may hold later ones); "
                        "give --checkpoint-dir to keep them", args.resume)
        first = load_checkpoint(run, opt, gen, *resumed, args.resume) + 1 if resumed else 1
        tracer = LiveTracer(run, args.trace_sample, args.seed, checkpoint_dir) if args.trace_every else None
        tokens = args.batch_size * args.block_size * world
        window_t, window_steps = 0.0, 0
        read_s: dict[str, float] = {}  # each memory layer's read seconds at the last log record
        batches = Batches(run.corpus.train, args.batch_size, args.block_size, gen, rank, world, run.device)
        # Prefetch: token-addressed layers (Engram) read by the batch alone, so step t+1's reads
        # are sent before its forward. Exact (--staleness 0): after step t's update is committed
        # (every trainer's, past the all-reduce), overlapping the dense optimizer step and the
        # blocks below the layer; a disk table is hinted at step t+1's rows once step t's forward
        # is done (`warm`: their pages read ahead while the backward runs, values unread). Stale (>= 1): when step t starts, overlapping all of step t, so
        # they read rows without step t's update (the table as of step t-1).
        prefetch = not args.no_prefetch and any(m.token_addressed for m in model.memories().values())
        if resumed and resumed[1].get("next_reads_counted") and first <= args.steps:
            # The checkpoint's slot statistics hold step `first`'s reads: the run's stale prefetch left when the
            # step before started, before the save. Read again (fresh: that read is not kept), not counted twice;
            # by what the saving run did, not this run's flags (--staleness and --no-prefetch may change)
            model.prefetch(batches.peek(), max_age=1, count=False)
        args.training = True  # (an error from here on stopped a run on its way: `_go_on`)
        for step in range(first, args.steps + 1):
            x, y = batches.next()
            for backend in _unique(run.values).values():
                backend.begin_step(step)
            t0 = time.perf_counter()
            if prefetch and args.staleness > 0 and step < args.steps:
                model.prefetch(batches.peek(), max_age=1)
            with autocast(run.device, args.dtype):
                _, loss = model(x, y)
            if prefetch and args.tier == "disk" and not args.no_warm and args.staleness == 0 and step < args.steps:
                model.warm(batches.peek())  # step t+1's rows read ahead on disk tables while step t goes on
            opt.zero_grad(set_to_none=True)
            loss.backward()
            for backend in _unique(run.values).values():
                backend.deliver()  # every table's parts arrived (or the step fails here) before any commits
            for backend in _unique(run.values).values():
                # one optimizer step per table; remote: committed while the loop goes on (the
                # backend's next call waits for it, the exact prefetch chains after it)
                backend.end_step(step, wait=args.sync_commit)
            if args.trace_every and step % args.trace_every == 0:
                tracer.send(x, y, step)
            loss = loss.detach()
            if world > 1:
                for backend in _unique(run.values).values():
                    backend.settle()  # every trainer's step applied before any trainer reads again
                average_across_trainers([p.grad for p in dense if p.grad is not None] + [loss], world)
            checkpoint_now = bool(checkpoint_dir) and (step == args.steps or bool(
                args.checkpoint_every and step % args.checkpoint_every == 0))
            if prefetch and args.staleness == 0 and step < args.steps and not checkpoint_now:
                model.prefetch(batches.peek(), max_age=0)  # every trainer has committed step t
            opt.step()
            if run.device.type == "cuda":  # the step's queued kernels count in its own time (float(loss) syncs anyway)
                torch.cuda.synchronize(run.device)
            dt = time.perf_counter() - t0
            window_t, window_steps = window_t + dt, window_steps + 1
            loss_value = float(loss)
            if not math.isfinite(loss_value):
                raise FloatingPointError(f"loss is {loss_value} at step {step}")
            evaluate_now = step % args.eval_every == 0 or step == args.steps
            if step % args.log_every == 0 or evaluate_now or step == 1:
                rec: dict[str, Any] = {
                    "step": step,
                    "loss": loss_value,
                    "tokens_per_s": tokens * window_steps / window_t,
                    "step_ms": 1e3 * window_t / window_steps,
                    "memory": args.memory,
                }
                for name, layer in model.memories().items():  # the steps' reads, not the evaluation's
                    rec[f"{name}_read_ms"] = 1e3 * (layer.read_s - read_s.get(name, 0.0)) / window_steps
                window_t, window_steps = 0.0, 0
                if evaluate_now:
                    rec.update(evaluate(run, args, torch.Generator().manual_seed(args.seed + 1)))
                if tracer is not None:
                    rec["trace_s"] = tracer.seconds  # time spent tracing so far (inside step_ms)
                for name, layer in model.memories().items():
                    read_s[name] = layer.read_s  # after the evaluation: its reads are not the next window's
                    if layer.token_addressed:  # training forwards that used a prefetched read, so far
                        rec[f"{name}_prefetched"] = layer.prefetch_used
                if rank == 0:
                    yield rec
            if checkpoint_now:
                save_checkpoint(run, opt, batches.state(), step, checkpoint_dir, flags,
                                next_counted=prefetch and args.staleness > 0 and step < args.steps)
                if prefetch and args.staleness == 0 and step < args.steps:  # (after the save: its slot statistics
                    model.prefetch(batches.peek(), max_age=0)  # held step t+1's reads, counted again by a resume)
                if args.keep_checkpoints and rank == 0 and (gone := prune_checkpoints(checkpoint_dir,
                                                                                      args.keep_checkpoints)):
                    log.info("checkpoint of step %d written; removed those of step%s %s (--keep-checkpoints %d)",
                             step, "s" if len(gone) > 1 else "", ", ".join(map(str, gone)), args.keep_checkpoints)
        for backend in _unique(run.values).values():
            backend.settle()  # the last step's commit (or its error) before the run counts as done
    finally:
        # a run that stops early (an error, an interrupt, the generator closed at a yield) still
        # waits for a commit in flight, so closing the client never cuts it between its phases,
        # and for the reads and hints it sent ahead
        for layer in run.model.memories().values():
            layer.drop_prefetched()
        for backend in _unique(run.values).values():
            try:
                backend.settle()
            except Exception as exc:  # the run's own error, if any, is the one that propagates
                log.warning("memtrain: a step's commit in flight failed while the run stopped: %s", one_line(exc))
        run.close()


class Batches:
    """The training batches in order, one of them drawn ahead when asked (`peek`: the prefetch)
    without changing which batches come or the generator state a checkpoint records. Every
    trainer draws the same combined batch and takes its own slice of it, so W trainers of batch B
    see exactly what one trainer of batch W*B would."""

    def __init__(self, data: torch.Tensor, batch_size: int, block_size: int, gen: torch.Generator, rank: int = 0,
                 world: int = 1, device: torch.device = CPU) -> None:
        """Drawn on the CPU (the same batches on every device), then moved to `device`."""
        self.data, self.batch_size, self.block_size, self.gen, self.rank, self.world, self.device = (
            data, batch_size, block_size, gen, rank, world, device)
        self.ahead: tuple[torch.Tensor, torch.Tensor] | None = None
        self.before_ahead: torch.Tensor | None = None  # the generator's state before `ahead` was drawn

    def _draw(self) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = get_batch(self.data, self.batch_size * self.world, self.block_size, self.gen)
        part = slice(self.rank * self.batch_size, (self.rank + 1) * self.batch_size)
        return to_device(x[part], self.device), to_device(y[part], self.device)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next batch (x, y) [B, T]."""
        if self.ahead is None:
            return self._draw()
        out, self.ahead, self.before_ahead = self.ahead, None, None
        return out

    def peek(self) -> torch.Tensor:
        """The tokens x of the batch `next` returns next (drawn now if need be)."""
        if self.ahead is None:
            self.before_ahead = self.gen.get_state()
            self.ahead = self._draw()
        return self.ahead[0]

    def state(self) -> torch.Tensor:
        """The generator's state as if no batch had been drawn ahead (what a checkpoint keeps)."""
        return self.before_ahead if self.before_ahead is not None else self.gen.get_state()


def trace_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="memtrain trace", formatter_class=_Help,
        description="Run text through a trained model (a memtrain --memory remote checkpoint) and record, on the "
        "shards, every memory slot's top trigger contexts (the characters ending where the slot was read, and the "
        "next one), kept in bounded per-slot heaps; `memserver inspect TABLE SLOT` then shows them. Reads are not "
        "counted in the slots' statistics.")
    p.add_argument("--checkpoint", required=True, help="memtrain --checkpoint-dir (its latest step) or a trainer-step-*.pt")
    p.add_argument("--table", required=True, help="the value table to trace (a product-key, LSH or Engram layer of the model reads it)")
    p.add_argument("--data", help="text file or WikiText-2 folder (default: the text the checkpoint was trained on)")
    p.add_argument("--split", choices=["train", "val"], default="train", help="which part of the text (default: train)")
    p.add_argument("--tokens", type=int, default=100_000, help="characters to run through the model (0: all)")
    p.add_argument("--batch-size", type=int, default=16, help="windows of block_size per forward")
    p.add_argument("--endpoint", help="memserver coordinator HOST:PORT (default: the endpoint file)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def trace_main(argv: list[str]) -> int:
    parser = trace_parser()
    args = parse_args(parser, argv)

    def fail(status: int, error: str) -> NoReturn:
        """One line on stderr; with --json the error as a JSON object on stdout too, as memserver's
        commands say theirs (it printed nothing there: a walkthrough)."""
        if args.json:
            print_json_error(error)
        parser.exit(status, f"memtrain trace: error: {error}\n")

    if args.tokens < 0:
        fail(WRONG_COMMAND, f"--tokens must be >= 0, got {args.tokens}")
    if args.batch_size < 1:
        fail(WRONG_COMMAND, f"--batch-size must be >= 1, got {args.batch_size}")
    try:  # no cluster, a table that is not there: one line, not a traceback
        return _trace(args)
    except (FileNotFoundError, MemserverError) as exc:
        fail(exit_status(exc), one_line(exc))
    except SystemExit as exc:
        if isinstance(exc.code, str):  # (its own refusals of the checkpoint or text it was given)
            fail(WRONG_COMMAND, exc.code.removeprefix("memtrain trace: error: "))
        raise


def _trace(args: argparse.Namespace) -> int:
    from client import MemoryClient
    from trainer.inspection import Inspector, trace

    with MemoryClient(args.endpoint) as client:
        try:
            given = load_corpus(args.data) if args.data else None
            inspector = Inspector.load(args.checkpoint, client, vocab=given.vocab if given else None)
            inspector.view(args.table)
            corpus = given or inspector.corpus()  # the text the model was trained on, where it was
            if corpus is None:
                raise ValueError(f"the checkpoint's training text ({inspector.data_path or inspector.data or 'not recorded'}) "
                                 "is not here with the model's vocabulary: give the text to trace with --data")
            if inspector.vocab != corpus.vocab:
                raise ValueError(f"--data {args.data}: its characters differ from the model's vocabulary")
        except (FileNotFoundError, ValueError) as exc:
            raise SystemExit(f"memtrain trace: error: {exc}") from None
        stream = corpus.train if args.split == "train" else corpus.val
        if args.tokens:
            stream = stream[: args.tokens + 1]
        t0 = time.perf_counter()
        out = trace(inspector, client, args.table, stream, batch_size=args.batch_size,
                    progress=not args.json and sys.stderr.isatty())
    out["seconds"] = time.perf_counter() - t0
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"traced {out['positions']:,} positions of {corpus.name} ({args.split} split) through {out['layer']} in "
              f"{out['seconds']:.1f}s: "
              f"{out['records_sent']:,} records sent; {out['slots']:,} slots of {args.table} hold trigger contexts"
              + (f" ({out['dropped']:,} records dropped at the slot bound)" if out["dropped"] else ""))
    return 0


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler's stop, `timeout`, `docker stop`), raised where the run is, as Ctrl-C's
    KeyboardInterrupt is: the run stops as Ctrl-C stops it (a commit in flight settled, the client
    closed, how to go on said), where Python's default ended it at once, exit 143, without a word."""


def _stop_on_sigterm() -> Any:
    """SIGTERM raises Terminated in the main thread, SIGINT KeyboardInterrupt, also where the run
    started with SIGINT ignored (a script's `memtrain ... &`: Python then raises nothing, and a
    `kill -INT` went unseen while the run trained on to its last step, an operator's walkthrough;
    loadtest stops on it). Returns the handlers it replaced (None: not the main thread, where no
    handler can be installed)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def stop(signum: int, frame: Any) -> None:
        raise Terminated

    return signal.signal(signal.SIGTERM, stop), signal.signal(signal.SIGINT, signal.default_int_handler)


def _restore_signals(before: Any) -> None:
    """Put back what `_stop_on_sigterm` replaced (None: a handler not set from Python, left)."""
    for sig, handler in zip((signal.SIGTERM, signal.SIGINT), before or ()):
        if handler is not None:
            signal.signal(sig, handler)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["trace"]:
        before = _stop_on_sigterm()  # (as a training run's: a backgrounded trace ignored Ctrl-C, said nothing at
        try:  # SIGTERM: a hunt)
            return trace_main(argv[1:])
        except KeyboardInterrupt as exc:
            term = isinstance(exc, Terminated)
            print(f"memtrain trace: {'terminated (SIGTERM)' if term else 'interrupted'}", file=sys.stderr)
            return 128 + signal.SIGTERM if term else 130
        finally:
            _restore_signals(before)
    parser = build_parser()
    args = parse_args(parser, argv)
    args.given = given_flags(parser, argv)
    before = _stop_on_sigterm()
    try:
        return _main(args)
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM: a line and how to go on, not a traceback
        if args.debug:
            raise
        if isinstance(exc, Terminated):
            parser.exit(128 + signal.SIGTERM, f"memtrain: terminated (SIGTERM){_go_on(args)}\n")
        parser.exit(130, f"memtrain: interrupted{_go_on(args)}\n")
    except SystemExit as exc:
        if isinstance(exc.code, str):  # memtrain's own refusal of its command line, a flag named: argparse's status
            parser.exit(WRONG_COMMAND, exc.code + "\n")
        raise
    except FloatingPointError as exc:  # the loss went NaN or inf: one line, not a traceback (no --resume to
        if args.debug:  # suggest: it takes the same --lr and --value-lr, which would diverge again)
            raise
        parser.exit(FAILED, f"memtrain: error: {exc}: the run diverged; run it again with a smaller --lr or "
                            "--value-lr\n")
    except MemserverError as exc:
        if args.debug:
            raise
        field, sep, why = exc.details.partition(": ")
        if field == "optimizer" and why.startswith("lr "):  # the optimizer's settings: its lr is --value-lr's
            field = "lr"
        if isinstance(exc, InvalidArgumentError) and sep and field in _FLAG_OF_FIELD:  # a table spec memtrain made
            parser.exit(WRONG_COMMAND, f"memtrain: error: {_FLAG_OF_FIELD[field]}: {why}\n")
        hint = " (--debug: the traceback)" if exit_status(exc) == FAILED else ""  # (none for the command's mistake)
        parser.exit(exit_status(exc), f"memtrain: error: {one_line(exc)}{hint}{_go_on(args)}\n")
    finally:
        _restore_signals(before)


def _go_on(args: argparse.Namespace) -> str:
    """How a run that failed on its way (after its first step began) goes on: from its checkpoint
    folder's latest trainer file ("" before that, or where it has none). A data-parallel run has
    none to go on from (the rollback's own text, the library's, says --resume, which it refuses)."""
    from trainer.checkpoints import latest_trainer_file

    if getattr(args, "training", False) and _world_size() > 1:
        return ("; a data-parallel run cannot --resume (single-trainer runs only, for now): run it again from the "
                "start, and give its tables --wal, so that a shard's restart loses nothing")
    where = checkpoint_dir_of(args)
    if not getattr(args, "training", False) or not where:
        return ""
    try:
        latest = latest_trainer_file(where)
    except FileNotFoundError:
        return ""
    return f"; its latest checkpoint is {latest}: go on from it with `memtrain --resume {where}` (the same flags)"


#: The remote tables' spec fields (what the cluster's refusal names) that a memtrain flag sets.
_FLAG_OF_FIELD = {"cache_bytes": "--cache-bytes", "tier": "--tier", "optimizer": "--value-optimizer", "lr": "--value-lr"}


#: Groups of build_parser whose flags shape memory layers (the cluster's own flags, checked with
#: their own message in check_flags, are left out by _memory_flags).
_MEMORY_GROUPS = ("memory", "LSH sketch memory", "Engram hashed n-gram memory", "KIF knowledge memory")
_SAID_ELSEWHERE = {"memory", "endpoint", "timeout", "retry_seconds", "memory_kind", "wal", "sharding", "sync_commit",
                   "tier", "cache_bytes"}


def _memory_flags(given: frozenset[str]) -> list[str]:
    """The flags among `given` (dests) that shape memory layers: a --memory none run has none. A
    setting of two flags (--no-prefetch, --prefetch) is named once, as both."""
    named: dict[str, list[str]] = {}
    for g in build_parser()._action_groups:
        if g.title and g.title.startswith(_MEMORY_GROUPS):
            for a in g._group_actions:
                if a.dest in given and a.dest not in _SAID_ELSEWHERE:
                    named.setdefault(a.dest, []).append(a.option_strings[0])
    return ["/".join(flags) for flags in named.values()]


#: The KIF source's build flags, which no memory setting records.
_KIF_BUILD = ("kif_encoder", "kif_sentences", "kif_knn")


def _flag_names() -> dict[str, str]:
    """Each setting (dest) as the command line names it: one setting of two flags as both
    ("--no-prefetch/--prefetch")."""
    named: dict[str, list[str]] = {}
    for a in build_parser()._actions:
        if a.option_strings:
            named.setdefault(a.dest, []).append(a.option_strings[-1])
    return {dest: "/".join(flags) for dest, flags in named.items()}


def _other_kinds_flags(given: frozenset[str], kinds: set[str]) -> list[str]:
    """The flags among `given` that only memory kinds outside `kinds` read (a run with --lsh-bits
    and product keys alone trained on, the flag unread: a hunt), as the command line names them.
    --mem-plus and --kif-source have their own messages (check_flags, setup)."""
    readers = {_SHAPE_FLAGS[k][0]: users for k, users in _KIND_KEYS.items() if k not in ("mem_plus", "kif_sources")}
    readers.update(dict.fromkeys(_KIF_BUILD, ("kif",)))
    flags = _flag_names()
    return [flags[d] for d, users in readers.items() if d in given and not kinds & set(users)]


#: Flags that set the memory values' tables (every kind but kif has one), and those of the
#: prefetch of token-addressed layers (engram): a run without either trained with them unread.
_VALUE_FLAGS = ("shared_values", "value_optimizer", "value_lr", "sharding", "tier", "cache_bytes", "wal", "sync_commit",
                "staleness")
_PREFETCH_FLAGS = ("no_prefetch", "no_warm")


def _value_flags_unread(given: frozenset[str], kinds: set[str]) -> str:
    """What is wrong with flags among `given` that no layer of `kinds` reads ("" none): the value
    tables' for a run of KIF alone (it reads its knowledge source), the prefetch's for a run with
    no token-addressed layer."""
    flags = _flag_names()
    if not kinds - {"kif"} and (unread := [flags[d] for d in _VALUE_FLAGS if d in given]):
        return (f"{', '.join(unread)}: set{'s' if len(unread) == 1 else ''} the memory values' tables, and "
                f"--memory-kind {','.join(sorted(kinds))} has none (KIF reads its knowledge source); drop "
                f"{'it' if len(unread) == 1 else 'them'}")
    if "engram" not in kinds and (unread := [flags[d] for d in _PREFETCH_FLAGS if d in given]):
        return (f"{', '.join(unread)}: the prefetch of token-addressed layers' reads (engram), and --memory-kind "
                f"{','.join(sorted(kinds))} has none; drop {'it' if len(unread) == 1 else 'them'}")
    return ""


def given_flags(parser: argparse.ArgumentParser, argv: list[str]) -> frozenset[str]:
    """The settings `argv` gives itself (its flags' dests), not left at their defaults: a resume
    continues the checkpoint's setting of a flag left out, and refuses one given otherwise."""
    probe = copy.deepcopy(parser)
    for action in probe._actions:
        action.default = argparse.SUPPRESS
    return frozenset(vars(probe.parse_known_args(argv)[0]))


def _main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    quiet_libraries(getattr(args, "debug", False))
    out = None  # --log-json, opened at the first record: after setup's checks (a refused command left
    # an empty file, and a path they refuse failed here first with a traceback: a hunt)
    tty = sys.stderr.isatty()
    bar = None
    if tty:
        from tqdm import tqdm

        bar = tqdm(total=args.steps, unit="step", dynamic_ncols=True)
    t_start = time.perf_counter()
    last: dict[str, Any] = {}
    try:
        for rec in train(args):
            last = rec
            if args.log_json and out is None:
                out = open(args.log_json, "a")  # noqa: SIM115 - (closed below)
            if out is not None:
                out.write(json.dumps(rec) + "\n")
                out.flush()
            msg = f"step {rec['step']:5d} loss {rec['loss']:.4f} {rec['tokens_per_s']:,.0f} tok/s {rec['step_ms']:.0f} ms/step"
            if "val_loss" in rec:
                msg += f" | val {rec['val_loss']:.4f}"
                mem = [k for k in rec if k.endswith("_used_pct")]
                msg += "".join(f" | {k.removesuffix('_used_pct')} used {rec[k]:.1f}%" for k in mem)
            if bar is not None:
                bar.update(rec["step"] - bar.n)
                bar.set_postfix_str(msg.split(" ", 2)[2][:80])
                if "val_loss" in rec:
                    bar.write(msg)
            else:
                log.info(msg)
    finally:
        if bar is not None:
            bar.close()
        if out is not None:
            out.close()
    if "val_loss" in last:
        log.info("done in %.1fs: final val_loss %.4f", time.perf_counter() - t_start, last["val_loss"])
    else:  # a data-parallel trainer other than rank 0: rank 0 logs the run's records
        log.info("done in %.1fs", time.perf_counter() - t_start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
