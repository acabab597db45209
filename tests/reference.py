"""Plain numpy reference implementations, written independently of memserver.core.table, that the
tests compare the shards against. Loops over rows are fine here: clarity over speed."""

from __future__ import annotations

import numpy as np


def bag(table: np.ndarray, ids: np.ndarray, weights: np.ndarray) -> np.ndarray:
    return np.einsum("bk,bkd->bd", weights.astype(np.float64), table[ids].astype(np.float64))


class RefTable:
    """A value table with sgd / row-wise adagrad / lazy adam (per-row step), column blocks
    optionally treated as separate tables (COLS sharding keeps adagrad state per block)."""

    def __init__(self, values: np.ndarray, optimizer: str, lr: float, col_blocks: list[tuple[int, int]] | None = None,
                 eps: float | None = None, betas: tuple[float, float] = (0.9, 0.999)):
        self.w = values.astype(np.float64).copy()
        self.opt, self.lr = optimizer, lr
        self.eps = eps if eps is not None else {"sgd": 0.0, "adagrad": 1e-10, "adam": 1e-8}[optimizer]
        self.b1, self.b2 = betas
        n, d = values.shape
        self.blocks = col_blocks or [(0, d)]
        self.acc = np.zeros((n, len(self.blocks)))
        self.m = np.zeros((n, d))
        self.v = np.zeros((n, d))
        self.steps = np.zeros(n, dtype=np.int64)

    def apply(self, row_grads: dict[int, np.ndarray]) -> None:
        for r, g in row_grads.items():
            self.steps[r] += 1
            if self.opt == "sgd":
                self.w[r] -= self.lr * g
            elif self.opt == "adagrad":
                for j, (c0, c1) in enumerate(self.blocks):
                    gb = g[c0:c1]
                    self.acc[r, j] += np.mean(gb * gb)
                    self.w[r, c0:c1] -= self.lr * gb / (np.sqrt(self.acc[r, j]) + self.eps)
            else:
                t = self.steps[r]
                self.m[r] = self.b1 * self.m[r] + (1 - self.b1) * g
                self.v[r] = self.b2 * self.v[r] + (1 - self.b2) * g * g
                mhat = self.m[r] / (1 - self.b1**t)
                vhat = self.v[r] / (1 - self.b2**t)
                self.w[r] -= self.lr * mhat / (np.sqrt(vhat) + self.eps)

    def bag_backward(self, ids: np.ndarray, weights: np.ndarray, grad_out: np.ndarray) -> np.ndarray:
        grad_w = np.einsum("bd,bkd->bk", grad_out.astype(np.float64), self.w[ids])
        row_grads: dict[int, np.ndarray] = {}
        for b in range(ids.shape[0]):
            for j in range(ids.shape[1]):
                r = int(ids[b, j])
                row_grads[r] = row_grads.get(r, 0) + weights[b, j] * grad_out[b].astype(np.float64)
        self.apply(row_grads)
        return grad_w

    def push(self, ids: np.ndarray, grads: np.ndarray) -> None:
        row_grads: dict[int, np.ndarray] = {}
        for r, g in zip(ids.tolist(), grads.astype(np.float64)):
            row_grads[r] = row_grads.get(r, 0) + g
        self.apply(row_grads)


def initial(meta) -> np.ndarray:
    """A table's initial values, from its metadata (the seeded init every shard computes)."""
    from memserver.core.init import init_values

    return init_values(np.arange(meta.num_rows), 0, meta.dim, meta.dim, meta.init_std, meta.seed).numpy()
