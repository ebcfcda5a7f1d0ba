"""BatchKV, the CPU engine's running-batch KV store, against a plain per-row reference under
random joins, decode steps, departures and trims, with spare room small enough that the
buffers are reallocated many times."""

import random

import torch

from rollout.engines.hf.batch_kv import BatchKV

LAYERS, HEADS, DIM = 2, 2, 3


class Rows:
    """What each row's KV must be: its real columns, oldest first, per layer."""

    def __init__(self):
        self.kv: list[list[tuple[torch.Tensor, torch.Tensor]]] = []

    def check(self, kv: BatchKV) -> None:
        assert kv.rows == len(self.kv)
        for layer in range(LAYERS):
            keys = kv.cache.layers[layer].keys
            values = kv.cache.layers[layer].values
            assert keys.shape[0] == kv.rows and keys.shape[2] == kv.width
            for i, row in enumerate(self.kv):
                k, v = row[layer]
                n = k.shape[1]
                assert n <= kv.width
                assert torch.equal(keys[i, :, kv.width - n:], k), (i, layer)
                assert torch.equal(values[i, :, kv.width - n:], v), (i, layer)
            assert torch.isfinite(keys).all() and torch.isfinite(values).all()


def join(kv: BatchKV, ref: Rows, rng: random.Random) -> None:
    n = rng.randint(1, 4)
    lengths = [rng.randint(1, 12) for _ in range(n)]
    t = max(lengths)
    layers, rows = [], [[] for _ in range(n)]
    for _ in range(LAYERS):
        k = torch.zeros(n, HEADS, t, DIM)
        v = torch.zeros(n, HEADS, t, DIM)
        for j, length in enumerate(lengths):
            k[j, :, t - length:] = torch.randn(HEADS, length, DIM)
            v[j, :, t - length:] = torch.randn(HEADS, length, DIM)
        layers.append(type("Layer", (), {"keys": k, "values": v}))
    pick = None
    if rng.random() < 0.5:  # only some of the prefilled rows join (others finished)
        pick = sorted(rng.sample(range(n), rng.randint(1, n)))
    chosen = pick if pick is not None else list(range(n))
    for j in chosen:
        length = lengths[j]
        rows[j] = [(layer.keys[j, :, t - length:].clone(), layer.values[j, :, t - length:].clone())
                   for layer in layers]
    kv.add(layers, None if pick is None else torch.tensor(pick))
    ref.kv.extend(rows[j] for j in chosen)


def step(kv: BatchKV, ref: Rows) -> None:
    kv.reserve_step()
    for layer in range(LAYERS):
        k = torch.randn(kv.rows, HEADS, 1, DIM)
        v = torch.randn(kv.rows, HEADS, 1, DIM)
        kv.cache.layers[layer].update(k, v)
        for i, row in enumerate(ref.kv):
            rk, rv = row[layer]
            row[layer] = (torch.cat([rk, k[i]], 1), torch.cat([rv, v[i]], 1))
    kv.stepped()


def leave(kv: BatchKV, ref: Rows, rng: random.Random) -> None:
    keep = sorted(rng.sample(range(kv.rows), rng.randint(0, kv.rows)))
    order = kv.keep(keep)
    assert sorted(order) == keep
    ref.kv = [ref.kv[i] for i in order]
    if ref.kv:  # the engine trims columns that are padding in every row
        longest = max(row[0][0].shape[1] for row in ref.kv)
        if longest < kv.width:
            kv.trim_left(kv.width - longest)


def test_batch_kv_matches_per_row_reference_through_joins_steps_and_departures():
    rng = random.Random(0)
    kv, ref = BatchKV(spare_cols=2, spare_rows=1), Rows()
    reallocations, buffers = 0, None
    for _ in range(300):
        op = rng.random()
        if not ref.kv or op < 0.25:
            join(kv, ref, rng)
        elif op < 0.85:
            step(kv, ref)
        else:
            leave(kv, ref, rng)
        if kv.k and kv.k[0] is not buffers:
            reallocations, buffers = reallocations + 1, kv.k[0]
        if ref.kv:
            ref.check(kv)
    assert reallocations > 5  # the copy-on-reallocate path ran, and stayed exact


def test_rows_leaving_move_only_the_last_rows():
    kv, ref = BatchKV(), Rows()
    rng = random.Random(1)
    while kv.rows < 8:
        join(kv, ref, rng)
    n = kv.rows
    order = kv.keep([i for i in range(n) if i != 1])
    assert order == [0, n - 1] + list(range(2, n - 1))
    ref.kv = [ref.kv[i] for i in order]
    ref.check(kv)


def test_long_decode_reallocates_geometrically_rarely():
    kv, ref = BatchKV(), Rows()
    join(kv, ref, random.Random(2))
    buffers, reallocations = kv.k[0], 0
    for _ in range(2000):
        kv.reserve_step()
        for layer in kv.cache.layers:
            layer.update(torch.zeros(kv.rows, HEADS, 1, DIM), torch.zeros(kv.rows, HEADS, 1, DIM))
        kv.stepped()
        if kv.k[0] is not buffers:
            buffers, reallocations = kv.k[0], reallocations + 1
    assert kv.width >= 2000
    assert reallocations <= 12  # ~log1.5(2000 / 64); a fixed 64-column step would be 31


def test_row_kv_copies_each_run_of_columns_of_every_layer():
    kv, ref = BatchKV(), Rows()
    rng = random.Random(3)
    while kv.rows < 6:
        join(kv, ref, rng)
    step(kv, ref)
    for i, row in enumerate(ref.kv):
        n = row[0][0].shape[1]
        a = kv.width - n
        runs = [(a, a + 1), (a + 2, kv.width)] if n > 2 else [(a, kv.width)]
        cols = [c - a for s, e in runs for c in range(s, e)]
        got = kv.row_kv(i, runs)
        assert got.shape == (2, LAYERS, HEADS, len(cols), DIM)
        for layer, (k, v) in enumerate(row):
            assert torch.equal(got[0, layer], k[:, cols]) and torch.equal(got[1, layer], v[:, cols])


def test_a_wave_after_the_batch_emptied_reuses_its_buffers():
    """Rows all leave, then a new wave of the same size joins and decodes: no new buffers
    (a fresh one pays a page fault per page), and the new rows' KV is exact."""
    kv, ref = BatchKV(), Rows()
    rng = random.Random(4)
    while kv.rows < 8:
        join(kv, ref, rng)
    for _ in range(10):
        step(kv, ref)
    buffers = kv.buf
    kv.keep([])
    ref.kv = []
    while kv.rows < 8:
        join(kv, ref, rng)
    for _ in range(10):
        step(kv, ref)
    ref.check(kv)
    assert kv.buf is buffers, "the new wave got new buffers"
