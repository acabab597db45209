"""Compiled CPU kernels (numba) for the value table's backward: the expensive call.

PyTorch's path for dL/dweights plus a sparse optimizer step gathers `n x d` temporaries several
times (index_select, multiply, index_add, then the optimizer's gathers and scatters). These kernels
do the floor instead: one pass reads each entry's row once for dL/dw, then per distinct row one
pass sums its gradient in a d-float buffer and applies the optimizer in place. Used for float32
tables on the CPU; `memserver.core.table` keeps the torch path for CUDA and half-precision storage,
and the tests check both give the same numbers.
"""

from __future__ import annotations

import numba as nb
import numpy as np

SGD, ADAGRAD, ADAM = 0, 1, 2

#: fastmath without "reassoc" and "contract" for the optimizer step: LLVM may still assume no NaN,
#: infinity or signed zero, but may neither reorder a sum nor fuse a multiply and an add into an
#: FMA, so a row's update rounds as the source says whatever machine code numba picks (it compiles
#: one specialization per argument type, and the vector width follows the CPU). Nor "arcp" and
#: "afn": with them a vector lane divided by a reciprocal and took an approximate square root where
#: the scalar tail did not, so a column's Adam step depended on where a cols slice cut the row (a
#: walkthrough: resharding moved 10% of an Adam table's rows by ~7e-9). Costs little here: the
#: step's sums run over entries, column by column, and vectorise without reordering
#: (docs/architecture.md, "Bit-exact paths").
EXACT_FASTMATH = {"nnan", "ninf", "nsz"}


@nb.njit(parallel=True, nogil=True, cache=True, fastmath=True)
def grad_weights(weight, ids, src_index, src, out):  # pragma: no cover - compiled
    """out[i] = <weight[ids[i]], src[src_index[i]]>, i.e. dL/dw_i with src = grad_out. Full
    fastmath: the dot product's sum is vectorised (4x faster than in source order); its rounding
    is fixed for a given compiled kernel, and the shards make sure every path runs the same one
    (memserver.core.table.ValueTable.on_device: one argument type whatever the path)."""
    d = weight.shape[1]
    for i in nb.prange(ids.shape[0]):
        r = ids[i]
        b = src_index[i]
        acc = np.float32(0.0)
        for c in range(d):
            acc += weight[r, c] * src[b, c]
        out[i] = acc


@nb.njit(nogil=True, cache=True)
def _radix_pass(keys, order, shift, bits, keys_out, order_out):  # pragma: no cover - compiled
    """One stable counting-sort pass of (keys, order) by the digit (key >> shift) & (2^bits - 1)."""
    mask = (np.int64(1) << bits) - 1
    counts = np.zeros((1 << bits) + 1, np.int64)
    for i in range(keys.shape[0]):
        counts[((keys[i] >> shift) & mask) + 1] += 1
    for j in range(1 << bits):
        counts[j + 1] += counts[j]
    for i in range(keys.shape[0]):
        k = keys[i]
        digit = (k >> shift) & mask
        f = counts[digit]
        keys_out[f] = k
        order_out[f] = order[i]
        counts[digit] = f + 1


@nb.njit(nogil=True, cache=True)
def group_by_row(ids):  # pragma: no cover - compiled
    """Group n entries by row in O(n) time and memory, whatever the table's row count.

    Returns (slot, starts, rows): entry i goes to position slot[i] of the grouped order; `rows`
    are the distinct ids, ascending, and rows[k] owns positions starts[k] .. starts[k + 1] - 1,
    which hold its entries in their original order (a stable sort: a row's entries are summed
    in the order given, the kernels' determinism). A position per entry rather than an entry
    per position, so callers scatter (sequential reads) instead of gathering (random reads).

    An LSD radix sort of (id - min id) with digits of at most B = min(16, max(8, bits(n) + 2))
    bits (2^B <= max(8n, 256) counters, at most 64 Ki, which stay in cache): one counting sort
    over the ids' span (the former counting sort over all rows, restricted to [min id, max id])
    when the span is below 2^B, else ceil(bits(span) / B) passes (at most 8), each O(n + 2^B),
    for ids spread over a large table. It is given the ids only, never the table's row count."""
    n = ids.shape[0]
    if n == 0:
        return np.empty(0, np.int64), np.zeros(1, np.int64), np.empty(0, np.int64)
    lo = np.int64(ids[0])
    hi = lo
    for i in range(1, n):
        x = np.int64(ids[i])
        if x < lo:
            lo = x
        elif x > hi:
            hi = x
    span = hi - lo
    bits = 0
    while bits < 63 and (span >> bits) > 0:
        bits += 1
    nbits = 0
    while (n >> nbits) > 0:
        nbits += 1
    maxb = min(16, max(8, nbits + 2))
    if bits <= maxb:
        # One counting sort over the span: group starts come from the counts, no keys needed.
        counts = np.zeros(span + 2, np.int64)
        for i in range(n):
            counts[np.int64(ids[i]) - lo + 1] += 1
        num_rows = 0
        for j in range(span + 1):
            if counts[j + 1] > 0:
                num_rows += 1
            counts[j + 1] += counts[j]
        starts = np.empty(num_rows + 1, np.int64)
        rows = np.empty(num_rows, np.int64)
        k = 0
        for j in range(span + 1):
            if counts[j + 1] > counts[j]:
                starts[k] = counts[j]
                rows[k] = j + lo
                k += 1
        starts[num_rows] = n
        slot = np.empty(n, np.int64)
        for i in range(n):
            j = np.int64(ids[i]) - lo
            f = counts[j]
            slot[i] = f
            counts[j] = f + 1
        return slot, starts, rows
    passes = (bits + maxb - 1) // maxb
    b = (bits + passes - 1) // passes
    keys = np.empty(n, np.int64)
    order = np.empty(n, np.int64)
    for i in range(n):
        keys[i] = np.int64(ids[i]) - lo
        order[i] = i
    keys2 = np.empty(n, np.int64)
    order2 = np.empty(n, np.int64)
    for p in range(passes):
        if p % 2 == 0:
            _radix_pass(keys, order, p * b, b, keys2, order2)
        else:
            _radix_pass(keys2, order2, p * b, b, keys, order)
    if passes % 2 == 1:
        keys, order = keys2, order2
    num_rows = 1
    for e in range(1, n):
        if keys[e] != keys[e - 1]:
            num_rows += 1
    starts = np.empty(num_rows + 1, np.int64)
    rows = np.empty(num_rows, np.int64)
    starts[0] = 0
    rows[0] = keys[0] + lo
    k = 1
    for e in range(1, n):
        if keys[e] != keys[e - 1]:
            starts[k] = e
            rows[k] = keys[e] + lo
            k += 1
    starts[num_rows] = n
    slot = np.empty(n, np.int64)
    for e in range(n):
        slot[order[e]] = e
    return slot, starts, rows


@nb.njit(parallel=True, nogil=True, cache=True, fastmath=EXACT_FASTMATH)
def sparse_step(
    weight, ids, src_index, scale, src, kind, lr, eps, beta1, beta2, acc, exp_avg, exp_avg_sq, updates, last_update, now, nthreads
):  # pragma: no cover - compiled
    """For each distinct id r: g = sum over its entries i of scale[i] * src[src_index[i]], then
    one optimizer step on weight[r]. Entries are grouped by row (`group_by_row`: O(n), nothing
    here is sized by the table's rows); each distinct row is owned by one thread, so no two
    threads write the same row; within a row, entries are summed in their original order
    (deterministic). `nthreads` is numba.get_num_threads() (passed in: reading it inside would
    stop the kernel being cached)."""
    n = ids.shape[0]
    d = weight.shape[1]
    slot, starts, rows = group_by_row(ids)
    num_rows = rows.shape[0]
    # Scatter each entry's (source row, scale) into its row's group once, so the summing pass
    # below reads them sequentially instead of chasing an index per entry (random reads of two
    # n-long arrays were most of this kernel's time).
    sorted_src = np.empty(n, np.int64)
    sorted_scale = np.empty(n, np.float32)
    for i in nb.prange(n):
        f = slot[i]
        sorted_src[f] = src_index[i]
        sorted_scale[f] = scale[i]
    per = (num_rows + nthreads - 1) // nthreads
    for t in nb.prange(nthreads):
        g = np.empty(d, np.float32)
        lo = t * per
        hi = min(num_rows, lo + per)
        for u in range(lo, hi):
            r = rows[u]
            g[:] = 0.0
            for e in range(starts[u], starts[u + 1]):
                w = sorted_scale[e]
                b = sorted_src[e]
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


@nb.njit(inline="always")
def _splitmix64(x):  # pragma: no cover - compiled
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


@nb.njit(parallel=True, nogil=True, cache=True)
def init_normal(rows, col_start, total_dim, std, key, out):  # pragma: no cover - compiled
    """out[r, j] = std * N(0,1) drawn from (key, rows[r], col_start + j): the same counter-based
    draw as memserver.core.init.init_values' numpy code, without its temporaries."""
    c = out.shape[1]
    inv53 = 1.0 / 9007199254740992.0
    two = np.uint64(2)
    for r in nb.prange(rows.shape[0]):
        base = np.uint64(rows[r]) * np.uint64(total_dim) + np.uint64(col_start)
        for j in range(c):
            counter = (base + np.uint64(j)) * two
            a = _splitmix64(counter ^ key)
            b = _splitmix64((counter + np.uint64(1)) ^ key)
            u1 = (np.float64(a >> np.uint64(11)) + 0.5) * inv53
            u2 = np.float64(b >> np.uint64(11)) * inv53
            out[r, j] = np.float32(std * np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2))


@nb.njit(nogil=True, cache=True)
def count_reads(ids, weights, hits, weight_mass):  # pragma: no cover - compiled
    """Slot statistics of one read in a single pass: hits[id] += 1, weight_mass[id] += |w|
    (weights may be empty for a lookup). Replaces two index_add_ calls and their temporaries."""
    with_w = weights.shape[0] == ids.shape[0]
    for i in range(ids.shape[0]):
        count_read(ids[i], weights, i, with_w, hits, weight_mass)


@nb.njit(inline="always")
def count_read(r, weights, i, with_w, hits, weight_mass):  # pragma: no cover - compiled
    """One read of row r (entry i) counted: hits[r] += 1, weight_mass[r] += |weights[i]| when
    with_w. `count_reads`' step, and the disk tier's read pass's (memserver.core.disk)."""
    hits[r] += 1
    if with_w:
        weight_mass[r] += abs(weights[i])


@nb.njit(inline="always")
def _top_positions(keys, m, k, sel, order, out):  # pragma: no cover - compiled
    """out[:k] = the positions of the k largest of keys[:m] (int32 order keys), largest first,
    ties by the smaller position. Branch-light, so it vectorises: the k-th largest key by
    bisection over the key range (count(keys >= t) per step; a t with exactly k keys at or above
    it ends the search early: about 8 steps instead of 31 on continuous scores), the positions
    above it and then those equal to it (in position order) gathered, and each placed by its
    rank among them."""
    lo = np.int64(keys[0])
    hi = lo
    for c in range(1, m):
        x = np.int64(keys[c])
        lo = min(lo, x)
        hi = max(hi, x)
    while lo < hi:  # the largest t with count(keys >= t) >= k
        mid = lo + (hi - lo + 1) // 2
        t32 = np.int32(mid)
        cnt = 0
        for c in range(m):
            cnt += keys[c] >= t32
        if cnt == k:  # mid already parts the k largest from the rest: the same set (ties never stop here)
            lo = mid
            break
        if cnt >= k:
            lo = mid
        else:
            hi = mid - 1
    t32 = np.int32(lo)
    g = 0
    for c in range(m):
        sel[g] = c
        g += keys[c] > t32
    for c in range(m):
        if g < k and keys[c] == t32:
            sel[g] = c
            g += 1
    for i in range(k):
        order[i] = keys[sel[i]]
    for i in range(k):
        ki = order[i]
        r = 0
        for j in range(k):
            r += (order[j] > ki) | ((order[j] == ki) & (j < i))
        out[r] = sel[i]


@nb.njit(inline="always")
def _order_keys(x, m, keys):  # pragma: no cover - compiled
    """keys[:m] = int32 keys of the float32 x[:m] that order as the floats do (flip the magnitude
    bits of negatives)."""
    bits = x.view(np.int32)
    for c in range(m):
        b = bits[c]
        keys[c] = b ^ ((b >> 31) & np.int32(0x7FFFFFFF))


@nb.njit(parallel=True, nogil=True, cache=True)
def pkm_select(scores, cand_i, cand_j, ids, best, nthreads):  # pragma: no cover - compiled
    """Product-key search over precomputed float32 sub-key scores, per (position, head).

    scores [heads, 2, n, n_keys] -> ids [n, heads, knn] (i * n_keys + j) and best [n, heads, knn]
    (the sums, descending): the top knn of each half (`_top_positions`), then the top knn of the
    candidate sums s1[cand_i[p]] + s2[cand_j[p]] (memserver.core.pkm's candidate_pairs). The
    same sums as torch.topk's path (plain float adds, no fastmath), ties to the smaller index."""
    heads, _, n, n_keys = scores.shape
    knn = ids.shape[2]
    pairs = cand_i.shape[0]
    rows = n * heads
    width = max(n_keys, pairs)
    per = (rows + nthreads - 1) // nthreads
    for t in nb.prange(nthreads):
        keys = np.empty(width, np.int32)
        sel = np.empty(width, np.int64)
        order = np.empty(knn, np.int32)
        top1 = np.empty(knn, np.int64)
        top2 = np.empty(knn, np.int64)
        topb = np.empty(knn, np.int64)
        v1 = np.empty(knn, np.float32)
        v2 = np.empty(knn, np.float32)
        cand = np.empty(pairs, np.float32)
        for r in range(t * per, min(rows, (t + 1) * per)):
            a = r // heads
            h = r - a * heads
            _order_keys(scores[h, 0, a], n_keys, keys)
            _top_positions(keys, n_keys, knn, sel, order, top1)
            _order_keys(scores[h, 1, a], n_keys, keys)
            _top_positions(keys, n_keys, knn, sel, order, top2)
            for u in range(knn):
                v1[u] = scores[h, 0, a, top1[u]]
                v2[u] = scores[h, 1, a, top2[u]]
            for p in range(pairs):
                cand[p] = v1[cand_i[p]] + v2[cand_j[p]]
            _order_keys(cand, pairs, keys)
            _top_positions(keys, pairs, knn, sel, order, topb)
            for u in range(knn):
                p = topb[u]
                ids[a, h, u] = top1[cand_i[p]] * n_keys + top2[cand_j[p]]
                best[a, h, u] = cand[p]
