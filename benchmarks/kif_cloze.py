"""KIF on real text: month cloze questions answerable only from the right knowledge.

Knowledge: every WikiText-2 sentence (valid + test splits) that names exactly one month, encoded
with all-MiniLM-L6-v2 (the sentence as written). Questions: the same sentences with the month
replaced by [MASK], encoded the same way; the answer is the month (12 classes). The context rarely
tells which month (the question alone gets near the majority-class rate), but the knowledge
sentence states it. Questions are split 70/30 by sentence: the held-out questions were never
trained on, while their sentences are in the knowledge source, as a fact base a model consults.

The model: the question's encoding q (width 384) feeds a residual MLP trunk and, beside it as
beside a block's FFN, the KIF layers (trainer.memory.KIFMemory: f_E, k nearest by inner
product, softmax-weighted sum, sigmoid gate, projection); their sum goes to an MLP head that
predicts the month. q is already in the sources' space, so f_E starts as the identity plus a
zero MLP and learns from there. Runs, each over --seeds:
- none: no memory (what the question alone gives);
- kif: the WikiText knowledge source;
- kif+unrelated: that source and a second, unrelated one (tiny Shakespeare sentences, same
  encoder) with its own f_E and gate: its gate should close.
Reported on the held-out questions: accuracy, loss on the answer, each source's mean gate, and how
often the question's own sentence is among the hits.

    python -m benchmarks.kif_cloze [--seeds 0,1] [--epochs 40] [--remote] [--json]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from benchmarks.common import cluster_client
from trainer.memory import KIFMemory, KnowledgeSource, LocalKnowledge
from trainer.memory.knowledge import corpus_sentences, encode_cached, make_encoder

DATA = Path(__file__).resolve().parents[1] / "data"
MONTHS = "January February March April May June July August September October November December".split()
RUNS = ("none", "kif", "kif+unrelated")


def month_sentences() -> tuple[list[str], list[str], torch.Tensor]:
    """(sentences, their questions, month labels) from WikiText-2 valid + test."""
    full, masked, labels = [], [], []
    for name in ("valid.txt", "test.txt"):
        for line in (DATA / "wikitext-2" / name).read_text().splitlines():
            line = line.strip()
            if not line or line.startswith("="):
                continue
            for s in re.split(r"(?<= \.) ", line):
                toks = s.split()
                found = [t for t in toks if t in MONTHS]
                if len(found) == 1 and 8 <= len(toks) <= 60:
                    full.append(s)
                    masked.append(" ".join("[MASK]" if t in MONTHS else t for t in toks))
                    labels.append(MONTHS.index(found[0]))
    return full, masked, torch.tensor(labels)


class ClozeModel(nn.Module):
    def __init__(self, dim: int, sources: list[KnowledgeSource], knn: int, dropout: float) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.Dropout(dropout), nn.Linear(dim, dim))
        self.kif = nn.ModuleList([KIFMemory(dim, dim, s, knn=knn, residual_query=True) for s in sources])
        self.head = nn.Sequential(nn.LayerNorm(dim), nn.Dropout(dropout), nn.Linear(dim, dim), nn.GELU(),
                                  nn.Dropout(dropout), nn.Linear(dim, len(MONTHS)))

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        h = q + self.trunk(q)  # the KIF layers sit beside the trunk, as beside a block's FFN
        for layer in self.kif:
            h = h + layer(q)
        return self.head(h)


def run_one(kind: str, seed: int, data: dict[str, Any], args: argparse.Namespace, client: Any) -> dict[str, Any]:
    q, y, tr, te = data["Q"], data["y"], data["train"], data["test"]
    sources = [] if kind == "none" else [data["sources"]["wikitext"]]
    if kind == "kif+unrelated":
        sources.append(data["sources"]["shakespeare"])
    torch.manual_seed(seed)
    model = ClozeModel(q.shape[1], sources, args.knn, args.dropout)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    gen = torch.Generator().manual_seed(seed)
    t0 = time.perf_counter()
    for _ in range(args.epochs):
        perm = tr[torch.randperm(len(tr), generator=gen)]
        for s in range(0, len(perm), args.batch_size):
            idx = perm[s : s + args.batch_size]
            loss = F.cross_entropy(model(q[idx]), y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    seconds = time.perf_counter() - t0
    model.eval()
    with torch.no_grad():
        logits = model(q[te])
    out: dict[str, Any] = {"run": kind, "seed": seed, "accuracy": float((logits.argmax(1) == y[te]).float().mean()),
                           "answer_loss": float(F.cross_entropy(logits, y[te])), "seconds": seconds}
    for layer, source in zip(model.kif, sources):
        out[f"gate_{source.name}"] = float(layer.last_gate.mean())
        if source.name == "wikitext":  # the question's own sentence among the hits (ids = sentence numbers)
            out["own_sentence_hit"] = float((layer.last_access[0] == te[:, None]).any(1).float().mean())
    return out


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--runs", default=",".join(RUNS), help="comma-separated subset of: " + ", ".join(RUNS))
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--dropout", type=float, default=0.1, help="in the trunk and the head (1,274 training questions)")
    p.add_argument("--knn", type=int, default=8, help="hits per question and source")
    p.add_argument("--unrelated", type=int, default=4096, help="tiny Shakespeare sentences in the unrelated source")
    p.add_argument("--encoder", default="minilm", help="minilm (default) or hash[N] (quick, for tests)")
    p.add_argument("--remote", action="store_true", help="the sources are index tables in a local 2-shard cluster")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    runs = [r for r in args.runs.split(",") if r]
    if bad := set(runs) - set(RUNS):
        p.error(f"--runs: unknown {sorted(bad)}; choose from {', '.join(RUNS)}")
    encoder = make_encoder(args.encoder)
    full, masked, y = month_sentences()
    shakespeare = corpus_sentences((DATA / "tinyshakespeare" / "input.txt").read_text(), args.unrelated)
    e_wiki, q = encode_cached(encoder, full), encode_cached(encoder, masked)
    e_shake = encode_cached(encoder, shakespeare)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(1234))
    cut = int(0.7 * len(y))
    data: dict[str, Any] = {"Q": q, "y": y, "train": perm[:cut], "test": perm[cut:]}
    rows = []
    with cluster_client(args.remote) as client:
        if client is not None:
            from trainer.memory.knowledge import upload_source

            data["sources"] = {"wikitext": upload_source(client, "wikitext", e_wiki),
                               "shakespeare": upload_source(client, "shakespeare", e_shake)}
        else:
            data["sources"] = {"wikitext": LocalKnowledge("wikitext", e_wiki),
                               "shakespeare": LocalKnowledge("shakespeare", e_shake)}
        for kind in runs:
            for seed in (int(s) for s in args.seeds.split(",")):
                rows.append(run_one(kind, seed, data, args, client))
                if not args.json:
                    print({k: round(v, 4) if isinstance(v, float) else v for k, v in rows[-1].items()}, flush=True)
    if args.json:
        print(json.dumps(rows))
        return rows
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"KIF month cloze: {len(data['test'])} held-out questions, {len(full)} knowledge sentences, "
                    f"{len(shakespeare)} unrelated (mean ± spread over seeds {args.seeds})")
    for col in ("run", "accuracy", "answer loss", "gate wikitext", "gate shakespeare", "own sentence in hits"):
        t.add_column(col, justify="left" if col == "run" else "right")

    def cell(kind: str, key: str, fmt: str = "{:.3f}") -> str:
        vals = [r[key] for r in rows if r["run"] == kind and key in r]
        if not vals:
            return "-"
        return fmt.format(statistics.fmean(vals)) + (f" ± {(max(vals) - min(vals)) / 2:.3f}" if len(vals) > 1 else "")

    for kind in runs:
        t.add_row(kind, cell(kind, "accuracy"), cell(kind, "answer_loss"), cell(kind, "gate_wikitext"),
                  cell(kind, "gate_shakespeare"), cell(kind, "own_sentence_hit"))
    Console(width=140).print(t)
    print(f"chance (majority month in training): "
          f"{float((y[data['test']] == y[data['train']].mode().values).float().mean()):.3f}")
    return rows


if __name__ == "__main__":
    main()
