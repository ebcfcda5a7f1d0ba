"""The running batch's KV cache: rows are slots in buffers that outlive the batch's changes.

Per layer one K and one V buffer ``[row capacity, kv heads, column capacity, head dim]``.
Active rows are ``[0, rows)`` and active columns ``[c0, c1)``; every row is left-padded so
that its last token sits in column ``c1 - 1``, and a decode step writes column ``c1`` of
all rows at once. A change moves only what changed:

- rows joining (a prefill) are written into free slots, right-aligned at ``c1``; the window
  widens to the left into spare columns when they are longer than the batch;
- rows leaving are replaced by the last rows (one row copy each, not a compaction);
- columns that are padding in every row are dropped by moving ``c0``.

The buffers are reallocated (one copy of the window) only when rows, left room or right
room run out, sized to the batch of the moment plus spare; the right room grows with the
window, so a long generation reallocates O(log) times (what full-batch copies on every
join and finish would cost: docs/performance.md). When the batch empties they are kept for
the next wave, until the KV is released. Buffers start zeroed and are only ever
written with real K/V, so the columns a row masks out hold finite numbers (0 * NaN would
poison attention scores).

The K and V buffers of all layers are one tensor ``[2, layers, rows, kv heads, columns,
head dim]``, so moving a row, copying a finished row out for the prefix cache and
reallocating are one op each rather than one per layer and per K/V. Every attention
layer's K and V must therefore have one shape (true of every architecture the engine runs).
"""

from __future__ import annotations

from typing import Optional

import torch
from transformers import DynamicCache

from rollout.engines.hf.fast_kernels import GrowingLayer


class BatchKV:
    def __init__(self, spare_cols: int = 64, spare_rows: int = 16):
        self.spare_cols = spare_cols
        self.spare_rows = spare_rows
        self.buf: Optional[torch.Tensor] = None  # [2, layers, row cap, heads, col cap, dim]
        self.k: list[torch.Tensor] = []  # per layer its K buffer, a view of buf[0]
        self.v: list[torch.Tensor] = []
        self.rows = 0
        self.c0 = self.c1 = 0
        self.cache: Optional[DynamicCache] = None  # views of the active window, for forward()
        self._expect = (0, 0)  # (rows, width) of the wave joining: see expect()

    def expect(self, rows: int, width: int) -> None:
        """A wave of prefills is about to join: the batch will have up to ``rows`` rows,
        the longest ``width`` columns. The next reallocation makes room for all of it, so
        a wave prefilled in several chunks reallocates once, not once per chunk."""
        self._expect = (rows, width)

    @property
    def width(self) -> int:
        return self.c1 - self.c0

    def _reserve(self, rows: int, width: int, right: int, like: list[torch.Tensor]) -> None:
        """Make room for ``rows`` rows, a row ``width`` columns long ending at ``c1``, and
        ``right`` more columns; reallocate (copying the active window) if needed. ``like``:
        per layer its K and V, the shapes and dtype to allocate for."""
        cap_rows = self.buf.shape[2] if self.buf is not None else 0
        cap_cols = self.buf.shape[4] if self.buf is not None else 0
        if rows <= cap_rows and width <= self.c1 and self.c1 + right <= cap_cols:
            return
        # Size for the rest of the wave now joining too, not one chunk at a time.
        rows, width = max(rows, self._expect[0]), max(width, self._expect[1])
        self._expect = (0, 0)
        x = like[0]
        if any(y.shape[1:2] + y.shape[3:] != x.shape[1:2] + x.shape[3:] for y in like):
            raise ValueError("BatchKV needs one K/V shape for every attention layer")
        # Sized from what is needed now (plus spare), not from the old capacity: a batch
        # that shrank gives memory back at its next reallocation.
        old, w = self.buf, self.width
        c1 = max(width, w) + self.spare_cols  # left room for longer rows joining later
        # Right room grows with the window: a long generation reallocates O(log) times.
        cols = c1 + max(right, self.spare_cols, w // 2)
        n = rows + self.spare_rows
        self.buf = x.new_zeros(2, len(like) // 2, n, x.shape[1], cols, x.shape[3])
        self.k, self.v = list(self.buf[0].unbind(0)), list(self.buf[1].unbind(0))
        if self.rows and w:
            self.buf[:, :, :self.rows, :, c1 - w:c1] = old[:, :, :self.rows, :, self.c0:self.c1]
        self.c0, self.c1 = c1 - w, c1

    def _layer_views(self) -> list[GrowingLayer]:
        return [GrowingLayer.from_buffers(k[:self.rows, :, self.c0:], v[:self.rows, :, self.c0:],
                                          self.width) for k, v in zip(self.k, self.v)]

    def _views(self) -> None:
        cache = DynamicCache()
        cache.layers = self._layer_views()
        self.cache = cache

    def add_cache(self, cache, rows: Optional[torch.Tensor] = None) -> None:
        """Append the rows of a prefill's ``cache`` (or its rows ``rows``)."""
        self.add(cache.layers, rows)

    def row_kv(self, i: int, runs: list[tuple[int, int]]) -> torch.Tensor:
        """Row ``i``'s K and V of every layer at the active columns ``[a, b)`` of each run
        in ``runs``, concatenated: a copy ``[2, layers, kv heads, columns, head dim]`` (for
        the prefix cache). Runs, not an index: a slice copy moves these strided rows 3x
        faster than index_select, and a row's real columns are one or two runs (a cached
        past, then the suffix prefilled over it and its decoded tokens)."""
        row = self.buf[:, :, i, :, self.c0:self.c1]
        out = row.new_empty(*row.shape[:3], sum(b - a for a, b in runs), row.shape[4])
        at = 0
        for a, b in runs:
            out[:, :, :, at:at + b - a] = row[:, :, :, a:b]
            at += b - a
        return out

    def row_states(self, i: int) -> list:
        """Row ``i``'s recurrent states, for the prefix cache (none: KV only)."""
        return []

    def add(self, layers, rows: Optional[torch.Tensor] = None) -> None:
        """Append rows (``layers``: per layer a cache layer with ``keys``/``values``
        ``[n, kv heads, t, head dim]``, left-padded, or the rows ``rows`` of them)."""
        like = [x for layer in layers for x in (layer.keys, layer.values)]
        t = like[0].shape[2]
        n = like[0].shape[0] if rows is None else len(rows)
        self._reserve(self.rows + n, t, 1, like)
        if t > self.width:
            self.c0 = self.c1 - t
        r0, r1 = self.rows, self.rows + n
        for dst, src in zip([x for pair in zip(self.k, self.v) for x in pair], like):
            dst[r0:r1, :, self.c1 - t:self.c1] = src if rows is None else src.index_select(0, rows)
        self.rows = r1
        self._views()

    def keep(self, keep: list[int]) -> list[int]:
        """Keep rows ``keep`` (ascending): rows past the new end fill the holes of rows
        that left. Returns, for each new row, the old row it came from."""
        n = len(keep)
        order = list(range(n))
        kept = set(keep)
        holes = [i for i in range(n) if i not in kept]
        movers = [i for i in keep if i >= n]
        for hole, src in zip(holes, movers):
            order[hole] = src
        if holes:
            self._move_rows(holes, movers)
        self.rows = n
        if n == 0 and self.buf is not None:
            self._empty()
        self._views()
        return order

    def _move_rows(self, dst: list[int], src: list[int]) -> None:
        # One slice copy per row: 4x faster than index_select + index_copy_ on these
        # strided rows, and rows leave a few at a time.
        window = self.buf[:, :, :, :, self.c0:self.c1]
        for d, s in zip(dst, src):
            window[:, :, d] = window[:, :, s]

    def _empty(self) -> None:
        """The batch emptied: keep the buffers for the next wave, all but the spare right
        room as left room. Their pages are mapped: a fresh buffer costs a page fault per
        page (tiny-qwen3's 57 MB: 31 ms, against 4.5 ms to zero it again), and on the
        multi-turn shape two such allocations a run took 5% of the scheduler's time.
        Released with the rest of the KV (Batcher.reset_batch makes a new BatchKV)."""
        self.c0 = self.c1 = max(self.buf.shape[4] - self.spare_cols, 0)

    def trim_left(self, first: int) -> None:
        """Drop the first ``first`` active columns (padding in every row)."""
        self.c0 += first
        self._views()

    def reserve_step(self) -> None:
        """Room for one decode step (call before the forward)."""
        if self.c1 + 1 > self.buf.shape[4]:
            like = [x for pair in zip(self.k, self.v) for x in pair]
            self._reserve(self.rows, 0, self.spare_cols, like)
            self._views()

    def stepped(self) -> None:
        """The forward wrote column ``c1`` of every row (through the views)."""
        self.c1 += 1


class HybridKV(BatchKV):
    """The running batch of a hybrid model (rollout/engines/hf/hybrid.py): BatchKV for the
    attention layers, and per GDN layer each row's conv and recurrent state in a row slot
    of buffers that, like the KV's, outlive the batch's changes (rows joining are written
    into free slots, rows leaving are replaced by the last rows)."""

    def __init__(self, spare_cols: int = 64, spare_rows: int = 16):
        super().__init__(spare_cols, spare_rows)
        self.states: list[tuple[torch.Tensor, torch.Tensor]] = []  # [row capacity, ...]

    def add_cache(self, cache, rows: Optional[torch.Tensor] = None) -> None:
        n = cache.states[0][0].shape[0] if rows is None else len(rows)
        r0 = self.rows
        if not self.states or r0 + n > self.states[0][0].shape[0]:
            cap = r0 + n + self.spare_rows
            old = self.states
            self.states = [(c.new_zeros(cap, *c.shape[1:]), r.new_zeros(cap, *r.shape[1:]))
                           for c, r in cache.states]
            for (c, r), (c0, r0_) in zip(self.states, old):
                c[:r0], r[:r0] = c0[:r0], r0_[:r0]
        for (c, r), (cn, rn) in zip(self.states, cache.states):
            c[r0:r0 + n] = cn if rows is None else cn.index_select(0, rows)
            r[r0:r0 + n] = rn if rows is None else rn.index_select(0, rows)
        super().add_cache(cache, rows)

    def _views(self) -> None:
        from rollout.engines.hf.hybrid import HybridCache

        self.cache = HybridCache(self._layer_views(),
                                 [(c[:self.rows], r[:self.rows]) for c, r in self.states])

    def _move_rows(self, dst: list[int], src: list[int]) -> None:
        super()._move_rows(dst, src)
        for buf in (x for pair in self.states for x in pair):
            for d, s in zip(dst, src):
                buf[d] = buf[s]

    def row_states(self, i: int) -> list:
        return [(c[i].clone(), r[i].clone()) for c, r in self.states]
