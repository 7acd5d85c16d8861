"""The inner levels' banded min-max (planner._Level), every unit count of a first layer at once; pure numpy.

For one first layer i, every range end j and every w of a level: the best split of [i, j) into a first stage on
w' units and the rest on w - w' units (the recurrence of PipeDream SOSP'19 §3.1, exactly, with rows cut by bounds).
"""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from partitioner.costmodel import INF

WIDTH = 32  # columns per block: narrower blocks give narrower bands but more rows
GUESS_SLACK = 0.01  # Bands.minmax's first caps: the guesses grown by this much (any value above -1)
CHUNK_ROWS = 400  # rows of WIDTH columns gathered at once (Bands._gather_min): 100 KiB, in a core's cache
SMALL = 12_000  # values in a temporary: 96 KiB, below malloc's mmap threshold (128 KiB)


class Bands:
    """best[w, i, j] = min(itself, min over (w', k) of max(left[w', k], best[w - w', k, j])) for j > i + 1 and
    every w of a level at once (they read rows k > i only; one call per i, not per (i, w): the numpy calls'
    own cost was half the time).

    Row t of left is the split k = i + 1 + t; w' = a + 1 for row a. Columns j are taken in blocks of
    `width`, and only a band of rows per (w, w', block) can improve one: `base[a]` bounds left[a] from below
    and never decreases with k, so rows with base >= the block's largest cap are cut; the rest costs at
    least its work spread over its workers, (work[j] - work[k]) / workers (`work` the prefix sums of
    m * compute, the workers those of w - w' units), which never increases with k, so rows before the first
    that can reach the cap of some column are cut. The caps are first the current values lowered to a guess
    (the value of [i + 1, j) on w units, grown as the range's work, plus GUESS_SLACK): a block whose values
    all end at most at their caps is exact, since every row cut could only reach its cap; the other blocks
    then gather the rows that the bands of their own values add. The bands, about a block wide, are gathered
    in pieces of CHUNK_ROWS rows: O(L^2 n^2 width) per level in practice instead of O(L^3 n^2). A block
    with a column still infinite (its one-stage plan over memory) would cut nothing by its own value: it is
    first seeded with the splits next to the balanced one, where the two bounds meet."""

    def __init__(self, best: np.ndarray, work: np.ndarray, per_unit: float) -> None:
        self.best, self.work = best, work
        self.width = best.shape[2] - best.shape[1]
        self.windows = sliding_window_view(best.reshape(-1), self.width)  # a view: every run of `width` values
        self.n1 = best.shape[0] - 2  # the w of a split: 2 .. n (index w - 2); a = w' - 1: 0 .. n - 2
        # The pairs (w, w') of a split, by w then w': lo and hi are per pair and block.
        self.pw, self.pa = np.nonzero(np.arange(self.n1)[None, :] < np.arange(1, self.n1 + 1)[:, None])
        self.by_a = [np.nonzero(self.pa == a)[0] for a in range(self.n1)]
        self.workers = (self.pw + 1 - self.pa) * per_unit  # the rest's: w - w' units
        self.total = (self.pw + 2) * per_unit  # w units' workers
        self.slack = 1e-12 * abs(float(work[-1]))  # the prefix sums' rounding
        self.orders: dict[int, tuple[np.ndarray, ...]] = {}
        self.pos = np.arange(0)  # 0, 1, 2, ...: the gathered rows' positions, grown as needed

    def minmax(self, i: int, left: np.ndarray, base: np.ndarray) -> None:
        best, work, width = self.best, self.work, self.width
        L1 = best.shape[1]
        n_j = L1 - 2 - i  # columns j = i + 2 .. L, rows k = i + 1 .. L - 1
        nb = -(-n_j // width)
        out = np.full((self.n1, nb * width), -INF)
        out[:, :n_j] = best[2:, i, i + 2:L1]
        seg = out.reshape(-1, nb, width)
        ends = np.minimum(n_j, np.arange(1, nb + 1) * width)  # rows t <= column c: non-empty rests only
        if left.ndim == 3:  # a left per w (memory): rows past a pair's last finite first stage are cut too
            fin = np.isfinite(left[self.pw, self.pa])
            ends = np.minimum(ends, ((n_j - np.argmax(fin[:, ::-1], axis=1)) * fin.any(axis=1))[:, None])
        unset = np.isinf(seg.max(axis=2))
        if unset.any():
            rows, w2, total = work[i + 1:L1 - 1], self.workers[:, None], self.total[:, None]
            first_j = work[i + 2 + np.arange(nb) * width]
            last_j = work[i + 1 + ends]
            # The split where w' and w - w' units get work in proportion: work[k] = (w'' work[i] + w' work[j]) / w.
            lo = np.maximum(np.searchsorted(rows, (w2 * work[i] + (total - w2) * first_j) / total) - 1, 0)
            hi = np.minimum(np.searchsorted(rows, (w2 * work[i] + (total - w2) * last_j) / total) + 1, ends)
            self._gather_min(i, left, lo, np.where(unset[self.pw], hi, 0), seg)
        # First with each column capped by a guess, range [i + 1, j)'s value grown as its work: narrower bands.
        # A block whose columns all end at most at their caps is exact (a row cut could only reach the cap);
        # the others then gather the rows left out by the bands of their own values.
        grow = work[i + 2:] - work[i + 1]
        guess = np.full((self.n1, nb * width), INF)
        ratio = np.divide(work[i + 2:] - work[i], grow, out=np.ones(n_j), where=grow > 0)
        np.multiply(best[2:, i + 1, i + 2:L1], (1 + GUESS_SLACK) * ratio, out=guess[:, :n_j], where=grow > 0)
        cap = np.minimum(seg, guess.reshape(seg.shape))
        lo, hi = self._band(i, cap, base, ends)
        self._gather_min(i, left, lo, hi, seg)
        again = np.any(seg > cap, axis=2)
        if again.any():
            lo2, hi2 = self._band(i, seg, base, ends)
            hi2 = np.where(again[self.pw], hi2, 0)
            self._gather_min(i, left, lo2, np.minimum(lo, hi2), seg)
            self._gather_min(i, left, np.maximum(hi, lo2), hi2, seg)
        best[2:, i, i + 2:L1] = out[:, :n_j]

    def _band(self, i: int, cap: np.ndarray, base: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rows [lo, hi) per pair (w, w') and block that may give some column of the block a value below its cap
        (hi at most `ends`, per block or per pair and block)."""
        work, (_, nb, width) = self.work, cap.shape
        wk = np.full(nb * width, work[-1])
        wk[:work.size - i - 2] = work[i + 2:]
        wk3, kw = wk.reshape(1, nb, width), (1 + 1e-9) * self.workers[:, None, None]
        thr = np.empty((len(self.pw), nb))
        step = max(1, SMALL // (nb * width))  # pairs at a time: temporaries below malloc's mmap threshold
        for p in range(0, len(self.pw), step):
            thr[p:p + step] = (wk3 - cap[self.pw[p:p + step]] * kw[p:p + step]).min(axis=2)
        lo = np.searchsorted(work[i + 1:-1], (thr - self.slack).ravel(), side="right").reshape(thr.shape)
        hi = np.empty_like(lo)
        ub = cap.max(axis=2)
        for a, pairs in enumerate(self.by_a):
            hi[pairs] = np.searchsorted(base[a], ub[self.pw[pairs]])
        return lo, np.minimum(hi, ends)

    def _order(self, nb: int) -> tuple[np.ndarray, ...]:
        """The (pair, block) cells ordered by w, block, w' (a group per (w, block)), and each one's w, block, w'."""
        got = self.orders.get(nb)
        if got is None:
            cell_w, cell_b = np.repeat(self.pw, nb), np.tile(np.arange(nb), len(self.pw))
            cell_a = np.repeat(self.pa, nb)
            order = np.lexsort((cell_a, cell_b, cell_w))
            got = self.orders[nb] = (order, cell_w[order], cell_b[order], cell_a[order])
        return got

    def _gather_min(self, i: int, left: np.ndarray, lo: np.ndarray, hi: np.ndarray, seg: np.ndarray) -> None:
        """seg[w, b] = min(seg[w, b], max(left[a, t], best[w - 1 - a, i + 1 + t, block b's columns])) over the
        pairs (w, w' = a + 1) and the rows lo <= t < hi of each pair and block b, in place (gathered in pieces)."""
        (L1, row), width = self.best.shape[1:], self.width
        n1, nb = seg.shape[:2]
        order, sw, sb, sa = self._order(nb)
        cnt = np.maximum(hi - lo, 0).ravel()[order]
        total = int(cnt.sum())
        if total == 0:
            return
        # Per cell (pair and block): where its first row starts in `best` and in `left`, less its offset in the
        # gathered list, so that each gathered row's index is that plus its position (few numpy calls in all).
        through = np.cumsum(cnt)  # rows through each cell
        shift = lo.ravel()[order] - (through - cnt)
        in_best = ((sw + 1 - sa) * L1 + i + 1 + shift) * row + (i + 2) + sb * width
        n_a, n_k = left.shape[-2:]
        in_left = (sw * n_a + sa if left.ndim == 3 else sa) * n_k + shift
        left_flat, flat = left.reshape(-1), seg.reshape(n1 * nb, width)
        group = sw * nb + sb  # cells in order of group (w, block)
        per_group = np.bincount(group, cnt, minlength=n1 * nb).astype(np.int64)
        some = np.nonzero(per_group)[0]
        firsts = (np.cumsum(per_group) - per_group)[some]
        if self.pos.size < total:
            self.pos = np.arange(max(total, 2 * self.pos.size))
        # In pieces of whole groups of about CHUNK_ROWS rows: the gathered rows stay in the core's cache and
        # each piece's temporaries below malloc's mmap threshold (no page faults).
        cut = np.searchsorted(firsts, np.arange(0, total, CHUNK_ROWS), side="right") - 1
        cut = np.append(np.unique(cut), len(some))
        cell_cut = np.searchsorted(group, np.append(some, n1 * nb)[cut])
        for g0, g1, c0, c1 in zip(cut[:-1], cut[1:], cell_cut[:-1], cell_cut[1:]):
            r0, r1 = firsts[g0], (firsts[g1] if g1 < len(some) else total)
            pos = self.pos[r0:r1]
            vals = self.windows[np.repeat(in_best[c0:c1], cnt[c0:c1]) + pos * row]  # rows of `width` columns
            np.maximum(vals, left_flat[np.repeat(in_left[c0:c1], cnt[c0:c1]) + pos][:, None], out=vals)
            red = np.minimum.reduceat(vals, firsts[g0:g1] - r0, axis=0)
            mine = some[g0:g1]
            np.minimum(flat[mine], red, out=red)
            flat[mine] = red
