"""Inspecting a trained memory, live against the cluster: what triggers a slot, what it stores,
how the memory is used. `memserver inspect/top/usage/search-token/web` and `memtrain trace` are
thin over this module.

- `Inspector.load(checkpoint, client)` rebuilds a memtrain model (eval mode) whose product-key
  and LSH layers read their tables in the cluster through `PeekValues`: uncounted lookups, so
  inspecting never changes the slots' statistics, and never writes.
- Trigger contexts (Geva et al. 2021's "top trigger examples"): `trace` runs text through the
  model and sends, for every slot read, (weight, the tokens ending at the position, the next
  token) to the shards, which keep each slot's best few (memserver.core.triggers); memtrain's
  `--trace-every` sends the same records from training batches (`trigger_records`).
- What a slot stores: its value as it reaches the residual stream (`MemoryLayer.slot_output`)
  through the output embedding, softmax(W_out v) (Geva et al.; no final LayerNorm), and the
  agreement of those tokens with the triggers' next tokens, against random slots.
- An Engram slot's name: the n-grams of the training text that hash to it, with their counts
  (`engram_names`), computed from the text and the layer's seed alone: no trace needed.
"""

from __future__ import annotations

import json
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from memserver.api.errors import TableNotFoundError, first_line
from memserver.cli.common import GLYPHS
from memserver.core.triggers import CAPACITY, best_per_slot, record_keys
from trainer.checkpoints import latest_trainer_file
from trainer.data import DATA_DIR, Corpus, load_corpus
from trainer.memory import EngramMemory, MemoryConfig, MemoryLayer, RemoteKnowledge
from trainer.memory.engram import PAD, slot_ngrams
from trainer.memory.lsh import bucket_address
from trainer.memory.pkm import slot_address
from trainer.model import GPT, ModelConfig, value_key

#: Context tokens a trigger record keeps (the shards keep the last 16: memserver.core.triggers).
CONTEXT = 16


class ClusterMismatch(ValueError):
    """A checkpoint that loads no model against the cluster as it is now (a table it reads missing,
    not a value table, or of another shape), though the file is fine: worth trying again once the
    tables change, where a bad file is not."""


class PeekValues:
    """A read-only value backend over a cluster table: a bag is an uncounted lookup of its
    distinct ids and a weighted sum here (inspection leaves hits and mass as training left them)."""

    def __init__(self, client: Any, name: str) -> None:
        meta = client.table(name, refresh=True)
        if meta.kind != "value":
            raise ClusterMismatch(f"table {name!r} is {meta.a_kind}, not a value table")
        self.client, self.name, self.num_rows, self.dim = client, name, meta.num_rows, meta.dim
        self.layout = (meta.layout_id, meta.num_rows, meta.dim)  # the incarnation the model was built against
        self.version = 0  # never updated

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.as_tensor(self.client.lookup(self.name, ids.reshape(-1).cpu(), count=False)).view(*ids.shape, self.dim)

    def bag(self, ids: torch.Tensor, weights: torch.Tensor, *, count: bool = True) -> torch.Tensor:
        """(Never counted, whatever `count` says.)"""
        uniq, inv = torch.unique(ids, return_inverse=True)
        rows = self.rows(uniq)
        return torch.einsum("nk,nkd->nd", weights.float(), rows[inv])

    def submit_bag(self, ids: torch.Tensor, weights: torch.Tensor, *, count: bool = True) -> Future[torch.Tensor]:
        done: Future[torch.Tensor] = Future()
        done.set_result(self.bag(ids, weights))
        return done

    def bag_backward(self, ids: torch.Tensor, weights: torch.Tensor, grad_out: torch.Tensor, *,
                     weight_grad: bool = True) -> torch.Tensor | None:
        raise RuntimeError("PeekValues is read-only (inspection)")

    def warm(self, ids: torch.Tensor) -> Future | None:
        return None  # inspection reads a few rows, each once: nothing to read ahead

    grad_scale = 1.0  # (read-only: no backward ever reaches it)

    def begin_step(self, step: int, *, grad_scale: float = 1.0) -> None:
        pass

    def deliver(self) -> None:
        pass

    def to(self, device: torch.device | str) -> PeekValues:
        return self  # the values stay in the cluster (inspection models run on the CPU)

    def end_step(self, step: int, *, wait: bool = True) -> None:
        pass

    def settle(self) -> None:
        pass

    trace_table = None  # inspection reads; it records no triggers

    def record_triggers(self, records: tuple[Any, ...], info: str = "") -> None:
        raise RuntimeError("PeekValues is read-only (inspection)")

    def save(self, directory: Path, step: int) -> dict[str, Any]:
        raise RuntimeError("PeekValues is read-only (inspection)")

    def load(self, directory: Path, step: int, saved: dict[str, Any]) -> None:
        raise RuntimeError("PeekValues is read-only (inspection)")


def checkpoint_file(path: str | Path) -> Path:
    """A trainer-step-*.pt file, or the latest one in a --checkpoint-dir."""
    p = Path(path)
    if p.is_dir():
        return latest_trainer_file(p)
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such checkpoint file or directory")
    return p


@dataclass
class MemoryView:
    """One memory layer of the model and the table it reads."""

    name: str  # "mem2", "lsh2", "engram2"
    kind: str  # "pkm" | "lsh" | "engram"
    block: int
    table: str
    layer: MemoryLayer

    def info(self) -> dict[str, Any]:
        return layer_info(self.name, self.layer)


def layer_kind_block(name: str) -> tuple[str, int]:
    """GPT.memories() names -> (kind, block): "mem2" -> ("pkm", 2), "lsh2" -> ("lsh", 2), "engram2" -> ("engram", 2)."""
    kind = name.rstrip("0123456789")
    return ("pkm" if kind == "mem" else kind), int(name[len(kind):])


def layer_info(name: str, layer: MemoryLayer) -> dict[str, Any]:
    """What a table's trace info says of the layer reading it (its addressing's shape)."""
    kind, block = layer_kind_block(name)
    out: dict[str, Any] = {"layer": name, "kind": kind, "block": block, "slots": layer.num_slots}
    for key in ("n_keys", "heads", "knn", "hashes", "bits", "segment", "seed"):
        if hasattr(layer, key):
            out[key] = int(getattr(layer, key))
    if isinstance(layer, EngramMemory):
        out["orders"] = list(layer.orders)
    return out


@dataclass
class Inspector:
    """A memtrain checkpoint rebuilt for inspection (eval mode, values read through PeekValues)."""

    model: GPT
    vocab: list[str]
    views: list[MemoryView]
    step: int
    path: Path
    data: str = ""
    data_path: str = ""  # the training text's path when memtrain recorded it
    index: dict[str, int] = field(default_factory=dict)
    _corpus: Corpus | None = None

    def __post_init__(self) -> None:
        self.index = {ch: i for i, ch in enumerate(self.vocab)}

    @classmethod
    def load(cls, checkpoint: str | Path, client: Any, vocab: list[str] | None = None) -> Inspector:
        """`vocab`: for checkpoints written before memtrain recorded its vocabulary."""
        path = checkpoint_file(checkpoint)
        not_ours = f"{path} is not a memtrain checkpoint (memtrain --checkpoint-dir's trainer-step-*.pt)"
        try:
            blob = torch.load(path, map_location="cpu", weights_only=True)  # tensors and plain data only: no code
        except OSError:
            raise
        except Exception as exc:  # noqa: BLE001 - any other bytes: torch's unpickler fails in many ways (KeyError too)
            with open(path, "rb") as f:  # torch.save writes a zip archive (or, before, a pickle)
                head = f.read(4)
            if not (head == b"PK\x03\x04" or head[:1] == b"\x80"):  # (the unpickler's words for text: "105")
                raise ValueError(f"{not_ours}: it is not a file torch.save writes") from None
            raise ValueError(f"{not_ours}: torch.load says {type(exc).__name__}: {first_line(exc, 200)}") from None
        if not isinstance(blob, dict) or "model" not in blob:
            raise ValueError(f"{not_ours}: it has no model" + (
                " (a table slice of `memserver checkpoint`: those restore tables, they hold no model)"
                if isinstance(blob, dict) and "meta" in blob and "state" in blob else ""))
        sd = GPT.upgrade_state_dict(blob["model"])
        mem = MemoryConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in blob.get("memory", {}).items()})
        vocab = blob.get("vocab") or vocab
        if vocab is None:
            raise ValueError(f"{path}: the checkpoint does not record its vocabulary; give the training text (--data)")
        cfg = dict(blob.get("config") or {})
        if not cfg:  # written before memtrain recorded its shape: read it off the weights (n_head: memtrain's default)
            n_layer = 1 + max(int(k.split(".")[1]) for k in sd if k.startswith("blocks."))
            block_size, n_embd = sd["pos_emb.weight"].shape
            cfg = {"vocab_size": sd["tok_emb.weight"].shape[0], "block_size": block_size, "n_layer": n_layer,
                   "n_head": 4, "n_embd": n_embd}
        if len(vocab) != cfg["vocab_size"]:
            raise ValueError(f"{path}: the model has {cfg['vocab_size']} tokens, the vocabulary {len(vocab)}")
        values: dict[str, Any] = {}
        tables: dict[str, str] = {}
        saved_in: dict[str, Path] = {}  # each table's cluster checkpoint (RemoteValues.save): where to restore it from
        for key, saved in blob.get("values", {}).items():
            name = saved.get("table") or str(saved.get("checkpoint", "")).removeprefix("memory/")
            if "state" in saved or not name:
                raise ValueError(f"{path}: a --memory local checkpoint: its values are not in the cluster "
                                 "(train with --memory remote to inspect them there)")
            tables[key] = name
            # (absolute: `memserver restore --dir` reads a relative one under the cluster's checkpoint
            # root, not where the user is, so the hint run as printed failed: a walkthrough)
            saved_in[name] = (path.parent / str(saved.get("checkpoint") or f"memory/{name}")).resolve()
        for i in mem.layers:  # shared values: the key of the first layer reading the table
            for kind in mem.kinds:
                if kind == "kif":
                    continue
                key = value_key(kind, i)
                name = tables.get(key) or next((tables[k] for k in tables if k.startswith(f"{kind}-") or
                                                (kind == "pkm" and k.isdigit())), None)
                if name is None:
                    raise ValueError(f"{path}: no table recorded for memory layer {key}")
                tables[key] = name
                try:
                    values[key] = PeekValues(client, name)
                except TableNotFoundError:  # (said NOT_FOUND of a table the user never named)
                    at = saved_in.get(name)
                    how = (f"`memserver restore --dir {at} --step {int(blob.get('step', 0))}`" if at and at.is_dir()
                           else f"restore {name!r}")
                    raise ClusterMismatch(f"{path}: its model reads table {name!r}, which the cluster does not hold "
                                     f"(give the checkpoint of the model that reads the table you ask about, or {how})"
                                     ) from None
        config = ModelConfig(memory=mem, **cfg)
        try:  # a KIF source of another kind or empty, a layer refusing its table's shape (a table made anew)
            knowledge = [RemoteKnowledge(client, s) for s in mem.kif_sources] if "kif" in mem.kinds else []
            model = GPT(config, values, knowledge)
        except ValueError as exc:
            raise ClusterMismatch(str(exc)) from None
        model.load_state_dict(sd)
        model.eval()
        views = []
        for name, layer in model.memories().items():
            if layer.values is None:
                continue  # KIF: no slots of a value table
            kind, block = layer_kind_block(name)
            views.append(MemoryView(name, kind, block, tables[value_key(kind, block)], layer))
        return cls(model, list(vocab), views, int(blob.get("step", 0)), path, str(blob.get("data", "")),
                   str(blob.get("data_path", "")))

    def tables_changed(self, client: Any) -> str | None:
        """Why this model no longer fits the cluster: a table it reads was dropped or made anew
        (another layout, rows or dim) since it was loaded; None while each is the one it was built
        against (a model over a table made anew reads rows of another shape: a reshape error)."""
        seen = {v.layer.values.name: v.layer.values.layout for v in self.views
                if isinstance(v.layer.values, PeekValues)}
        for name, layout in seen.items():
            try:
                meta = client.table(name, refresh=True)
            except TableNotFoundError:
                return f"table {name!r} was dropped"
            if (meta.layout_id, meta.num_rows, meta.dim) != layout:
                return f"table {name!r} was made anew ({meta.num_rows} x {meta.dim})"
        return None

    def corpus(self) -> Corpus | None:
        """The training text (its recorded path, else data/<name>), when it is there and has the
        model's vocabulary; read once."""
        if self._corpus is None:
            for p in (self.data_path, DATA_DIR / self.data if self.data else "", DATA_DIR / "tinyshakespeare" / self.data):
                if p and Path(p).exists():
                    c = load_corpus(p)
                    if c.vocab == self.vocab:
                        self._corpus = c
                        break
        return self._corpus

    # -- tokens ----------------------------------------------------------------------------

    def encode(self, text: str) -> torch.Tensor:
        unknown = sorted({c for c in text if c not in self.index})
        if unknown:
            raise ValueError(f"characters not in the model's vocabulary: {''.join(unknown)!r}")
        return torch.tensor([self.index[c] for c in text], dtype=torch.int64)

    def token(self, t: int) -> str:
        return self.vocab[t] if 0 <= t < len(self.vocab) else ""

    def decode(self, ids: Any) -> str:
        return "".join(self.token(int(t)) for t in ids)

    def view(self, table: str) -> MemoryView:
        """The (first) memory layer reading `table`: its addressing and output projection are the
        ones slots are projected through (with --shared-values each layer has its own)."""
        for v in self.views:
            if v.table == table:
                return v
        raise ValueError(f"no memory layer of {self.path.name} reads table {table!r} "
                         f"(it reads {', '.join(sorted({v.table for v in self.views})) or 'none'})")

    # -- what a slot stores ----------------------------------------------------------------

    @torch.no_grad()
    def project(self, table: str, slots: torch.Tensor, values: torch.Tensor | None = None) -> torch.Tensor:
        """Log-probabilities [n, vocab] of softmax(W_out . slot_output(v)) for the slots."""
        view = self.view(table)
        if values is None:
            values = view.layer.values.rows(slots)
        out = view.layer.slot_output(slots, values.float())
        return torch.log_softmax(out @ self.model.head.weight.T, dim=-1)

    def top_tokens(self, table: str, slots: Any, k: int = 10) -> tuple[np.ndarray, np.ndarray]:
        """(token ids [n, k], probabilities [n, k]) each slot's value ranks highest."""
        logp = self.project(table, torch.as_tensor(np.asarray(slots, dtype=np.int64)))
        top = logp.topk(min(k, logp.shape[1]), dim=1)
        return top.indices.numpy(), top.values.exp().numpy()

    # -- what a text triggers --------------------------------------------------------------

    @torch.no_grad()
    def read(self, tokens: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Run [B, T] tokens through the model; per memory layer name, (ids, weights) [B*T, slots]."""
        self.model(tokens)
        return {v.name: v.layer.last_access for v in self.views}

    def activations(self, table: str, text: str, top: int = 5) -> dict[str, Any]:
        """Which slots of `table` a text triggers: per position the `top` slots by weight, and the
        slots by weight summed over the text. Texts longer than the model's context are cut to
        their last block_size characters."""
        tokens = self.encode(text)[-self.model.cfg.block_size :]
        if len(tokens) == 0:
            raise ValueError("the text is empty")
        view = self.view(table)
        ids, w = self.read(tokens[None])[view.name]
        w = w.abs().float()
        positions = []
        for t in range(len(tokens)):  # a slot two heads read is one slot of the position, its weights summed
            uniq, total = _by_slot(ids[t], w[t])
            order = torch.argsort(total, descending=True, stable=True)[:top]
            positions.append({"char": self.token(int(tokens[t])), "slots": uniq[order].tolist(),
                              "weights": [round(float(x), 6) for x in total[order]]})
        uniq, total = _by_slot(ids, w)
        order = torch.argsort(total, descending=True, stable=True)[: max(top * 4, 20)]
        return {"table": table, "layer": view.name, "text": self.decode(tokens), "positions": positions,
                "slots": [{"slot": int(uniq[i]), "weight": float(total[i])} for i in order]}


def _by_slot(ids: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(distinct slots, each one's weights summed, float64) of reads `ids` with weights `w`."""
    uniq, inv = torch.unique(ids.reshape(-1), return_inverse=True)
    return uniq, torch.zeros(len(uniq), dtype=torch.float64).index_add_(0, inv, w.reshape(-1).double())


def inspector_for(client: Any, table: str, checkpoint: str | Path | None = None) -> Inspector | None:
    """The model to project `table`'s slots through: `checkpoint`, else the one `memtrain trace`
    recorded in the table's trace info when that file still exists, else None (statistics and
    trigger contexts need no model)."""
    if checkpoint is None:
        recorded = client.triggers(table, [0])["info"].get("checkpoint")
        if not recorded or not Path(recorded).exists():
            return None
        checkpoint = recorded
    inspector = Inspector.load(checkpoint, client)
    inspector.view(table)  # says which tables it reads when not this one
    return inspector


# ------------------------------------------------------------------ trigger records


def window_contexts(x: torch.Tensor, y: torch.Tensor, length: int = CONTEXT) -> tuple[torch.Tensor, torch.Tensor]:
    """Contexts within training windows: x, y [B, T] -> the `length` tokens ending at each
    position of its own window (-1 before it) [B*T, length] int32, and the next tokens [B*T]."""
    b, t = x.shape
    pad = torch.cat([torch.full((b, length - 1), -1, dtype=x.dtype), x], dim=1)
    ctx = pad.unfold(1, length, 1)  # [B, T, length]
    return ctx.reshape(b * t, length).int(), y.reshape(-1).int()


def table_reads(reads: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Every layer's reads of one table at the same P positions (ids, weights [P, slots_i]) as one
    read [P, sum of slots_i]: with --shared-values a slot is triggered by whichever layer reads it
    (the first layer's alone were traced), and a context two layers share is kept once per slot
    (trigger_records keeps distinct ones)."""
    if len(reads) == 1:
        return reads[0]
    return torch.cat([i for i, _ in reads], dim=1), torch.cat([w for _, w in reads], dim=1)


def trigger_records(ids: torch.Tensor, weights: torch.Tensor, contexts: torch.Tensor, nxt: torch.Tensor,
                    keep: torch.Tensor | None = None) -> tuple[np.ndarray, ...]:
    """A layer's reads at P positions (ids, weights [P, slots]) and those positions' contexts
    [P, L] and next tokens [P] -> the records worth sending: each slot's best CAPACITY distinct
    ones (memserver.core.triggers.best_per_slot, the shards' own selection, so this only saves
    bytes). `keep` [P] bool: sample positions. Returns (ids, weights, positions, contexts, next)
    with positions indexing the returned contexts."""
    p, slots = ids.shape
    if keep is not None:
        rows = keep.nonzero().squeeze(1)
        ids, weights, contexts, nxt = ids[rows], weights[rows], contexts[rows], nxt[rows]
        p = len(rows)
    s = ids.reshape(-1).numpy()
    w = weights.abs().float().reshape(-1).numpy()
    pos = np.repeat(np.arange(p), slots)
    ctx_np, nxt_np = contexts.numpy(), nxt.numpy()
    pick = best_per_slot(s, w, record_keys(ctx_np, nxt_np)[pos], CAPACITY)
    used, local = np.unique(pos[pick], return_inverse=True)
    return s[pick], w[pick], local, ctx_np[used], nxt_np[used]


def trace(inspector: Inspector, client: Any, table: str, stream: torch.Tensor, *, batch_size: int = 16,
          progress: bool = True) -> dict[str, Any]:
    """Run a token stream through the model in windows of block_size and record, on the shards,
    every slot's top trigger contexts in `table` (contexts within each window, as the model saw
    them; live tracing records the same), read by every layer that reads it. Returns what was sent
    and what the shards hold."""
    from tqdm import tqdm

    view = inspector.view(table)
    t = inspector.model.cfg.block_size
    end = max(len(stream) - 1, 0)  # positions with a next token
    full = torch.arange(0, max(end - t + 1, 0), t)  # windows of t positions, in batches; then the short rest alone
    batches = [(full[b : b + batch_size], t) for b in range(0, len(full), batch_size)]
    rest = end - len(full) * t
    if rest > 0:
        batches.append((torch.tensor([len(full) * t]), rest))
    info = json.dumps({**view.info(), "vocab": inspector.vocab, "context": CONTEXT, "checkpoint": str(inspector.path),
                       "step": inspector.step, "data": inspector.data})
    sent = positions = 0
    got: dict[str, int] = {"slots": 0, "dropped": 0}
    with tqdm(total=end, unit="tok", desc=f"trace {table}", disable=not progress) as bar:
        for s, n in batches:
            where = s[:, None] + torch.arange(n)  # [windows, n] positions in the stream
            x = stream[where]
            reads = inspector.read(x)
            ids, w = table_reads([reads[v.name] for v in inspector.views if v.table == table])
            ctx, nxt = window_contexts(x, stream[where + 1])  # what the model saw: its own window
            rec = trigger_records(ids, w, ctx, nxt)
            got = client.record_triggers(table, *rec, info=info)
            info = ""  # sent once
            sent += len(rec[0])
            positions += where.numel()
            bar.update(where.numel())
    return {"table": table, "layer": view.name, "positions": positions, "records_sent": sent, **got}


# ------------------------------------------------------------------ reports


def slot_report(client: Any, table: str, slot: int, inspector: Inspector | None = None, k: int = 10) -> dict[str, Any]:
    """Everything `memserver inspect` shows about one slot."""
    import time

    stats = client.slot_stats(table, np.array([slot]))
    trig = client.triggers(table, np.array([slot]))
    info = trig["info"]
    vocab = inspector.vocab if inspector is not None else info.get("vocab", [])

    def text(ids: Any) -> str:
        """The ids as the vocabulary's text; without one (records sent by a user's own model, no
        `info={"vocab": ...}`), the ids themselves, so a context never shows blank."""
        if not vocab:
            return " ".join(str(int(i)) for i in ids if i >= 0)
        return "".join(vocab[i] if 0 <= i < len(vocab) else "" for i in ids)

    out: dict[str, Any] = {"table": table, "slot": int(slot)}
    for key in ("value_norm", "hits", "weight_mass", "updates", "last_update"):
        v = stats[key][0]
        out[key] = float(v) if key in ("value_norm", "weight_mass", "last_update") else int(v)
    out["last_update_age_s"] = time.time() - out["last_update"] if out["last_update"] else None
    layer_info = {k: v for k, v in info.items() if k not in ("vocab",)}
    view = None
    if inspector is not None:
        try:
            view = inspector.view(table)
        except ValueError:
            view = None
    if view is not None:
        out["address"] = {"layer": view.name, "block": view.block, "kind": view.kind, **view.layer.describe_slot(slot)}
        if isinstance(view.layer, EngramMemory):
            out["address"].update(engram_names(inspector, view.layer, slot))
    elif layer_info.get("kind") == "pkm" and layer_info.get("n_keys"):  # no model: the traced layer's shape
        out["address"] = {"layer": layer_info.get("layer"), "kind": "pkm",
                          **slot_address(slot, int(layer_info["n_keys"]))}
    elif layer_info.get("kind") == "lsh" and layer_info.get("bits"):
        out["address"] = {"layer": layer_info.get("layer"), "kind": "lsh",
                          **bucket_address(slot, int(layer_info["bits"]))}
    triggers = []
    for w, ctx, nx in zip(trig["weights"][0], trig["contexts"][0], trig["next"][0]):
        if w > 0:
            triggers.append({"weight": float(w), "context": text(ctx), "next": text([nx]), "next_id": int(nx),
                             "context_ids": [int(i) for i in ctx if i >= 0]})
    out["triggers"] = triggers
    if inspector is not None and view is not None:
        tok, prob = inspector.top_tokens(table, [slot], k)
        out["top_tokens"] = [{"token": inspector.token(int(t)), "id": int(t), "p": float(p)} for t, p in zip(tok[0], prob[0])]
        top = {int(t) for t in tok[0]}
        if triggers:
            out["agreement"] = sum(r["next_id"] in top for r in triggers) / len(triggers)
    return out


def engram_names(inspector: Inspector, layer: EngramMemory, slot: int, limit: int = 20) -> dict[str, Any]:
    """An Engram slot's n-grams in the training text, most frequent first (`slot_ngrams`): each
    with its text, count, and `window_start` when it begins with PADs (the n-gram of a window's
    first positions, counted once per window of the model's block size). Several n-grams in one
    slot are its collisions."""
    corpus = inspector.corpus()
    if corpus is None:
        return {"ngrams_note": f"the training text {inspector.data or '(unrecorded)'} is not here"}
    got = slot_ngrams(corpus.train, slot, layer.orders, layer.heads, layer.segment, layer.seed, limit=limit,
                      window=inspector.model.cfg.block_size)
    grams = [{"ngram": inspector.decode(t for t in g["tokens"] if t != PAD), "window_start": PAD in g["tokens"],
              "count": g["count"]} for g in got.pop("ngrams")]
    return {"ngrams": grams, "ngrams_distinct": got["distinct"], "ngrams_occurrences": got["occurrences"],
            "ngrams_text": corpus.name, "ngrams_tokens_scanned": got["tokens_scanned"]}


def agreement(inspector: Inspector, client: Any, table: str, *, slots: int = 500, k: int = 5, baselines: int = 10,
              seed: int = 0) -> dict[str, Any]:
    """Geva et al.'s agreement: over those of the `slots` most-hit slots that hold trigger records
    (how many: "slots", of "of"), the mean fraction of a slot's records whose next token is among its value's top-k projected tokens;
    against the same with another random slot's top-k tokens (`baselines` permutations)."""
    ids, _ = client.top_slots(table, "hits", slots)
    of = int(len(ids))  # (fewer than `slots` in a smaller table)
    trig = client.triggers(table, ids)
    have = (trig["weights"] > 0).any(1)
    ids, nxt, valid = ids[have], trig["next"][have], trig["weights"][have] > 0
    if len(ids) == 0:
        return {"table": table, "slots": 0, "of": of, "k": k}
    tok, _ = inspector.top_tokens(table, ids, k)

    def score(top: np.ndarray) -> float:
        hit = (nxt[:, :, None] == top[:, None, :]).any(2) & valid
        return float((hit.sum(1) / valid.sum(1)).mean())

    rng = np.random.default_rng(seed)

    def other_slots() -> np.ndarray:
        """A random cycle through the slots: each scored with another slot's tokens, never its own."""
        order = rng.permutation(len(ids))
        pick = np.empty(len(ids), dtype=np.int64)
        pick[order] = np.roll(order, -1)
        return pick

    base = [score(tok[other_slots()]) for _ in range(baselines)] if len(ids) > 1 else [float("nan")]
    return {"table": table, "slots": int(len(ids)), "of": of, "k": k, "agreement": score(tok),
            "random_slots": float(np.mean(base)), "random_slots_std": float(np.std(base))}


#: How a token that cannot be typed on one line may be written, here and on the page: an escape, or
#: the glyph the page and the CLI draw it with (memserver.cli.common.GLYPHS, read backwards).
TOKEN_ALIASES = {"\\n": "\n", "\\t": "\t", "\\r": "\r", "\\s": " ", "␣": " ", **{g: ch for ch, g in GLYPHS.items()}}


def not_one_character(token: str) -> str:
    """What a search for a token of several characters is told, in the CLI and on the page."""
    return (f"a token of this character-level model is one character, not {token!r} (write a newline as ⏎ or \\n, "
            "a space as ␣ or \\s)")


def parse_token(text: str, index: dict[str, int]) -> str:
    """The vocabulary's token that `text`, as typed to `memserver search-token` or in the page's
    search box, names: one rule for both, so the two find the same token or refuse alike. In order:
    the text itself where the vocabulary has it (a real '·' stays itself), what it stands for
    (TOKEN_ALIASES), a Python escape ('\\x41'), the text without the spaces around it (' e '
    pasted with them). ValueError (the words both say) for no text, a bad escape, or no token of
    the vocabulary."""
    if not text:
        raise ValueError("type one token (a character of the model's vocabulary) to search for")
    token = text if text in index else TOKEN_ALIASES.get(text)
    if token is None and text.startswith("\\"):
        try:
            token = text.encode().decode("unicode_escape")  # \x41, \u00e9
        except UnicodeDecodeError:
            raise ValueError(f"{text!r} is not a valid escape (e.g. '\\n' for a newline)") from None
    if token is None:
        token = text.strip() or text
    check_token(token, index)
    return token


def check_token(token: str, index: dict[str, int]) -> None:
    """ValueError unless `token` is one of the vocabulary's."""
    if token not in index:
        if len(token) != 1 and all(len(k) == 1 for k in index):  # the page's words, not a vocabulary miss
            raise ValueError(not_one_character(token))
        raise ValueError(f"token {token!r} is not in the model's vocabulary")


def search_token(inspector: Inspector, client: Any, table: str, token: str, n: int = 20, chunk: int = 8192,
                 progress: bool = False) -> list[dict[str, Any]]:
    """The slots whose projected values give `token` the highest probability: a scan of every
    slot's value (uncounted lookups of `chunk` rows at a time, O(rows) work and O(chunk + n) memory)."""
    from tqdm import tqdm

    check_token(token, inspector.index)
    t = inspector.index[token]
    view = inspector.view(table)
    rows = view.layer.num_slots
    best_p = torch.empty(0)
    best_ids = torch.empty(0, dtype=torch.int64)
    best_rank = torch.empty(0, dtype=torch.int64)
    for s in tqdm(range(0, rows, chunk), unit="chunk", desc=f"scan {table}", disable=not progress):
        ids = torch.arange(s, min(rows, s + chunk))
        logp = inspector.project(table, ids)
        p = logp[:, t]
        rank = (logp > p[:, None]).sum(1)  # 0 = the slot's top token
        cat_p, cat_ids, cat_rank = torch.cat([best_p, p]), torch.cat([best_ids, ids]), torch.cat([best_rank, rank])
        order = torch.argsort(-cat_p, stable=True)[:n]
        best_p, best_ids, best_rank = cat_p[order], cat_ids[order], cat_rank[order]
    return [{"slot": int(i), "p": float(p.exp()), "rank": int(r)} for i, p, r in zip(best_ids, best_p, best_rank)]
