"""Compiled CPU kernels (numba) for the value table's backward: the expensive call.

PyTorch's path for dL/dweights plus a sparse optimizer step gathers `n x d` temporaries several
times (index_select, multiply, index_add, then the optimizer's gathers and scatters). These kernels
do the floor instead: one pass reads each entry's row once for dL/dw, then per distinct row one
pass sums its gradient in a d-float buffer and applies the optimizer in place. Used for float32
tables on the CPU; `memserver.table` keeps the torch path for CUDA and half-precision storage,
and the tests check both give the same numbers.
"""

from __future__ import annotations

import numba as nb
import numpy as np

SGD, ADAGRAD, ADAM = 0, 1, 2


@nb.njit(parallel=True, nogil=True, cache=True, fastmath=True)
def grad_weights(weight, ids, src_index, src, out):  # pragma: no cover - compiled
    """out[i] = <weight[ids[i]], src[src_index[i]]>, i.e. dL/dw_i with src = grad_out."""
    d = weight.shape[1]
    for i in nb.prange(ids.shape[0]):
        r = ids[i]
        b = src_index[i]
        acc = np.float32(0.0)
        for c in range(d):
            acc += weight[r, c] * src[b, c]
        out[i] = acc


@nb.njit(parallel=True, nogil=True, cache=True, fastmath=True)
def sparse_step(
    weight, ids, src_index, scale, src, kind, lr, eps, beta1, beta2, acc, exp_avg, exp_avg_sq, updates, last_update, now, nthreads
):  # pragma: no cover - compiled
    """For each distinct id r: g = sum over its entries i of scale[i] * src[src_index[i]], then
    one optimizer step on weight[r]. Entries are grouped by sorting ids; each distinct row is
    owned by one thread, so no two threads write the same row. `nthreads` is
    numba.get_num_threads() (passed in: reading it inside would stop the kernel being cached)."""
    n = ids.shape[0]
    d = weight.shape[1]
    order = np.argsort(ids)
    # group boundaries of equal ids in sorted order
    is_start = np.empty(n, np.bool_)
    for j in range(n):
        is_start[j] = j == 0 or ids[order[j]] != ids[order[j - 1]]
    starts = np.flatnonzero(is_start)
    num_rows = starts.shape[0]
    per = (num_rows + nthreads - 1) // nthreads
    for t in nb.prange(nthreads):
        g = np.empty(d, np.float32)
        lo = t * per
        hi = min(num_rows, lo + per)
        for u in range(lo, hi):
            s0 = starts[u]
            s1 = starts[u + 1] if u + 1 < num_rows else n
            r = ids[order[s0]]
            g[:] = 0.0
            for e in range(s0, s1):
                i = order[e]
                w = scale[i]
                b = src_index[i]
                for c in range(d):
                    g[c] += w * src[b, c]
            updates[r] += 1
            last_update[r] = now
            if kind == SGD:
                for c in range(d):
                    weight[r, c] -= lr * g[c]
            elif kind == ADAGRAD:
                sq = np.float32(0.0)
                for c in range(d):
                    sq += g[c] * g[c]
                a = acc[r] + sq / d
                acc[r] = a
                step = np.float32(lr) / (np.float32(np.sqrt(a)) + np.float32(eps))
                for c in range(d):
                    weight[r, c] -= step * g[c]
            else:
                k = updates[r]
                bc1 = np.float32(1.0 - beta1**k)
                bc2 = np.float32(1.0 - beta2**k)
                for c in range(d):
                    m = np.float32(beta1) * exp_avg[r, c] + np.float32(1.0 - beta1) * g[c]
                    v = np.float32(beta2) * exp_avg_sq[r, c] + np.float32(1.0 - beta2) * g[c] * g[c]
                    exp_avg[r, c] = m
                    exp_avg_sq[r, c] = v
                    weight[r, c] -= np.float32(lr) * (m / bc1) / (np.float32(np.sqrt(v / bc2)) + np.float32(eps))
    return num_rows
