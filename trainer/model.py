"""A small decoder-only transformer language model with memory layers.

In the style of nanoGPT: one file, read top to bottom. Memory layers sit at chosen blocks,
either replacing the block's feed-forward network ("replace") or beside it ("parallel": the
block adds FFN(x) + Memory(x)); a block may hold several kinds (product keys, LSH, Engram, one KIF
layer per knowledge source), their outputs summed. Blocks pass the token ids on to their memory
layers: Engram addresses by them (and `GPT.prefetch` sends its reads before the forward). Value tables live in a value backend and knowledge
in a knowledge source (local or remote, see trainer.memory); keys, query networks, f_E, gates
and projections are ordinary parameters of this model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from trainer.memory import (
    EngramMemory,
    KIFMemory,
    KnowledgeSource,
    LSHMemory,
    MemoryConfig,
    MemoryLayer,
    ProductKeyMemory,
    ValueBackend,
)


@dataclass
class ModelConfig:
    vocab_size: int  # tokens (characters) in the vocabulary
    block_size: int = 128  # context length
    n_layer: int = 4  # transformer blocks
    n_head: int = 4  # attention heads
    n_embd: int = 128  # model width
    dropout: float = 0.0
    memory: MemoryConfig = field(default_factory=MemoryConfig)  # which blocks get a memory layer, and its shape


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, c))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, memory: dict[str, MemoryLayer] | None = None) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.memory = nn.ModuleDict(memory or {})  # kind ("pkm", "lsh", "kif0", ...) -> layer
        self.mlp = MLP(cfg) if not self.memory or cfg.memory.mode == "parallel" else None

    def forward(self, x: torch.Tensor, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """`tokens` [B, T]: the input's token ids (token-addressed memories read by them)."""
        x = x + self.attn(self.ln1(x))
        h = self.ln2(x)
        out = self.mlp(h) if self.mlp is not None else 0
        for layer in self.memory.values():
            out = out + layer(h, tokens)
        return x + out


def value_key(kind: str, block: int) -> str:
    """The key of a value backend in GPT's `values` (and in memtrain checkpoints): product keys
    keep the block number alone, as before other kinds existed."""
    return str(block) if kind == "pkm" else f"{kind}-{block}"


class GPT(nn.Module):
    """Decoder-only LM. `values` maps `value_key(kind, block)` to the value backend of each
    product-key or LSH layer (the same backend object under several layers shares one table,
    as in Memory Layers at Scale); a block with KIF gets one KIF layer per source in `knowledge`."""

    def __init__(self, cfg: ModelConfig, values: dict[str, ValueBackend] | None = None,
                 knowledge: list[KnowledgeSource] | None = None) -> None:
        super().__init__()
        mem = cfg.memory
        if mem.mode not in ("parallel", "replace"):
            raise ValueError(f"memory mode must be 'parallel' or 'replace', got {mem.mode!r}")
        values, knowledge = {str(k): v for k, v in (values or {}).items()}, knowledge or []  # {2: b} as {"2": b}
        wanted = {value_key(k, i) for i in mem.layers for k in mem.kinds if k != "kif"}
        if missing := wanted - set(values):
            raise ValueError(f"no value backend for memory layer(s) {sorted(missing)}")
        if "kif" in mem.kinds and mem.layers and not knowledge:
            raise ValueError("KIF memory needs at least one knowledge source")
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        d = cfg.n_embd
        blocks = []
        for i in range(cfg.n_layer):
            layers: dict[str, MemoryLayer] = {}
            for kind in mem.kinds if i in mem.layers else ():
                if kind == "pkm":
                    layers[kind] = ProductKeyMemory(d, d, values[value_key(kind, i)], n_keys=mem.n_keys, heads=mem.heads,
                                                    k_dim=mem.k_dim, knn=mem.knn, query_bn=mem.query_bn,
                                                    mem_plus=mem.mem_plus, micro_batches=mem.micro_batches)
                elif kind == "lsh":
                    layers[kind] = LSHMemory(d, d, values[value_key(kind, i)], hashes=mem.lsh_hashes, bits=mem.lsh_bits,
                                             seed=mem.lsh_seed + i, mem_plus=mem.mem_plus,
                                             micro_batches=mem.micro_batches)
                elif kind == "engram":
                    layers[kind] = EngramMemory(d, d, values[value_key(kind, i)], orders=mem.engram_orders,
                                                heads=mem.engram_heads, seed=mem.engram_seed + i,
                                                conv=mem.engram_conv, micro_batches=mem.micro_batches)
                elif kind == "kif":
                    for j, source in enumerate(knowledge):
                        layers[f"kif{j}"] = KIFMemory(d, d, source, knn=mem.kif_knn, micro_batches=mem.micro_batches)
                else:
                    raise ValueError(f"unknown memory kind {kind!r}")
            blocks.append(Block(cfg, layers))
        self.blocks = nn.ModuleList(blocks)
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # weight tying
        self.apply(self._init)
        for layer in self.memories().values():
            if isinstance(layer, EngramMemory):
                layer.reset_conv()

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)

    def memories(self) -> dict[str, MemoryLayer]:
        """Every memory layer by a readable name: "mem2" (product keys at block 2, the name the
        metrics had before other kinds), "lsh2", "engram2", "kif0_2" (source 0 at block 2)."""
        out = {}
        for i, b in enumerate(self.blocks):
            for kind, layer in b.memory.items():
                name = f"mem{i}" if kind == "pkm" else f"{kind}{i}" if kind in ("lsh", "engram") else f"{kind}_{i}"
                out[name] = layer
        return out

    @staticmethod
    def upgrade_state_dict(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A checkpoint written when a block held one product-key layer as `blocks.i.memory.*`
        -> today's `blocks.i.memory.pkm.*`."""
        import re

        old = re.compile(r"^(blocks\.\d+\.memory\.)(?!pkm\.|lsh\.|engram\.|kif\d+\.)")
        return {old.sub(r"\1pkm.", k): v for k, v in sd.items()}

    def warm(self, idx: torch.Tensor) -> None:
        """Hint every token-addressed memory layer that a forward on `idx` [B, T] comes soon
        (MemoryLayer.warm: disk tables read its rows' pages ahead)."""
        for layer in self.memories().values():
            layer.warm(idx)

    def prefetch(self, idx: torch.Tensor, max_age: int = 0, count: bool = True) -> int:
        """Send the reads of every token-addressed memory layer for a forward on `idx` [B, T] now
        (see MemoryLayer.prefetch); returns how many layers did."""
        layers = [m for m in self.memories().values() if m.token_addressed]
        for layer in layers:
            layer.prefetch(idx, max_age, count)
        return len(layers)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        b, t = idx.shape
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x, idx)
        logits = self.head(self.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss
