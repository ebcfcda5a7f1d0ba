"""Continuous batching over a KV cache for small transformers models on CPU.

One scheduler thread owns the model. Between decode steps it
1. runs queued control commands (weight updates, flush, release/resume) — so a weight
   update never lands in the middle of a forward pass;
2. admits waiting requests: batched, left-padded prefills of similar-length requests,
   whose KV is then written into free row slots of the running batch's cache
   (``BatchKV``), right-aligned with the running rows;
3. decodes every active row together, one token per step;
4. drops finished rows (the last rows move into their slots) and trims cache columns that
   are padding in every remaining row, so a long finished prompt stops costing attention.

A hybrid model (Qwen3.5: Gated DeltaNet layers) runs hybrid.py's forward, and each row
also carries its recurrent states, which move with it as rows join and leave (HybridKV);
the prefix cache then keeps the states at the end of each finished sequence, reused by a
prompt that extends that sequence exactly.

Positions are explicit per row (count of real tokens), so left padding and merging never
shift RoPE; pad columns are masked out, so a row's log-probs equal a fresh forward pass
of that row alone (up to float rounding).

Why not transformers' own continuous batching (``generate_batch`` /
ContinuousBatchingManager, paged attention): it runs on CPU and carries log-probs, but its
scheduling and paged-cache bookkeeping are built for GPUs and dominate on small CPU models
(docs/performance.md, "Design figures"). One padded batch of rows is simple, exact, and
fast for ~1M-135M-parameter models.

Log-probs (matching SGLang's default, see sglang/srt/layers/sampler.py): the log-prob of
the sampled token under the temperature-scaled distribution, log_softmax(logits / T),
before top-k/top-p filtering; greedy (T == 0) uses the unscaled logits. SGLang returns the
unscaled ones only when SGLANG_RETURN_ORIGINAL_LOGPROB is set; this engine honours the
same environment variable.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from rollout.engines.hf import hybrid, lean
from rollout.engines.hf.batch_kv import BatchKV, HybridKV
from rollout.engines.hf.fast_kernels import GrowingLayer
from rollout.models import cache_kwarg

RETURN_ORIGINAL_LOGPROB = os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "").lower() in (
    "1", "true", "yes")


@dataclass
class Request:
    rid: str
    input_ids: list[int]
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: frozenset = frozenset()
    stop: tuple = ()  # stop strings (need detokenization; only checked when set)
    ignore_eos: bool = False
    seed: Optional[int] = None
    return_logprob: bool = False
    # Filled by the scheduler.
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: Optional[dict] = None
    aborted: bool = False
    generator: Optional[torch.Generator] = None
    weight_version: str = ""
    # Every weight version this request's forward passes ran under, in order: the version
    # at submission, then one entry per update applied while it was in flight ("N+partial"
    # for a bucket that was not the last, i.e. a forward pass on half-updated weights).
    weight_versions: list[str] = field(default_factory=list)
    on_done: Optional[Callable[["Request"], None]] = None
    matched_stop: Optional[str] = None  # the stop string that ended generation
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    # Padding columns between the cached past and the prompt's suffix in this row's KV
    # (the prefill's layout: see Batcher._prefill); with cached_tokens, where its real
    # columns are, counted from the right, for the prefix cache (Batcher._store_prefix).
    kv_hole: int = 0
    group_rid: Optional[str] = None  # the client's rid when n > 1 made several requests


def draw(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token per row of ``probs`` [B, vocab], by inverse CDF: a uniform draw per row
    located in the row's cumulative sum (as torch.multinomial does with replacement, but
    that one spends as long as the draw without). Each token's share of the float32 sum
    is exact up to one rounding of the running sum (<= 6e-8 absolute)."""
    return _locate(probs.cumsum(-1), generator)


def _locate(cdf: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Per row of running sums [B, vocab], where a uniform draw of the row's total falls:
    the first entry whose sum exceeds it, so zero-probability entries are never chosen."""
    u = torch.rand(cdf.shape[0], 1, generator=generator, dtype=cdf.dtype) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True)[:, 0].clamp_(max=cdf.shape[1] - 1)


def sample_plain(scaled: torch.Tensor, generator: torch.Generator, want_lp: bool = True):
    """Tokens for rows of temperature-scaled logits [B, vocab] with no top-k/top-p (the RL
    default), and their log-probs (None unless ``want_lp``). One [B, vocab] tensor (exp,
    then its running sum in place, searched like ``draw``) where log-softmax + softmax +
    ``draw`` make three. The log-prob is log-softmax's own formula,
    x - max - log(sum(exp(x - max))), at the sampled token."""
    top = scaled.amax(-1, keepdim=True)
    cdf = (scaled - top).exp_()
    total = cdf.sum(-1, keepdim=True) if want_lp else None
    tokens = _locate(cdf.cumsum_(-1), generator)
    if not want_lp:
        return tokens, None
    return tokens, (scaled.gather(1, tokens[:, None]) - top - total.log())[:, 0]


class PrefixCache:
    """Finished sequences' KV (and a hybrid model's recurrent states at their end), LRU by
    bytes, looked up by longest prefix of a new prompt.

    Multi-turn RL sends prompt_{t+1} = prompt_t + output_t + environment tokens; without
    this, every turn re-prefills the whole conversation. An entry is removed when used
    (the continued sequence is stored again when it finishes). Cleared only by a flush or
    a release of the KV cache, as SGLang's radix cache: after a weight update its KV
    belongs to the old weights until someone flushes (server.py).
    """

    def __init__(self, max_bytes: int):
        from collections import OrderedDict

        self.max_bytes = max_bytes
        self.entries: "OrderedDict[tuple, list]" = OrderedDict()
        self.sizes: dict[tuple, int] = {}
        self.length_counts: dict[int, int] = {}
        # Several finished sequences can have the same tokens (GRPO samples of one prompt
        # that made the same first move): one KV, counted, so each continuation hits.
        self.refs: dict[tuple, int] = {}
        self.bytes = 0
        self.hits = 0
        self.hit_tokens = 0

    def clear(self) -> None:
        self.entries.clear()
        self.sizes.clear()
        self.length_counts.clear()
        self.refs.clear()
        self.bytes = 0

    def _drop(self, key: tuple) -> tuple:
        entry = self.entries.pop(key)
        self.refs.pop(key, None)
        self.bytes -= self.sizes.pop(key)
        n = self.length_counts[len(key)] - 1
        if n:
            self.length_counts[len(key)] = n
        else:
            del self.length_counts[len(key)]
        return entry

    def put(self, tokens: tuple, kv: torch.Tensor, states: list = ()) -> None:
        """``kv``: K and V of every attention layer, [2, layers, kv heads, len(tokens), head
        dim]; ``states``: per recurrent layer its state after ``tokens`` (hybrid models)."""
        size = kv.numel() * kv.element_size() + sum(
            x.numel() * x.element_size() for pair in states for x in pair)
        if size > self.max_bytes:
            return
        if self.add_ref(tokens):
            return
        self.entries[tokens] = (kv, list(states))
        self.sizes[tokens] = size
        self.length_counts[len(tokens)] = self.length_counts.get(len(tokens), 0) + 1
        self.bytes += size
        while self.bytes > self.max_bytes:
            self._drop(next(iter(self.entries)))

    def add_ref(self, tokens: tuple) -> bool:
        """Same tokens, same KV: count one more holder of a cached sequence instead of
        storing it again. False if ``tokens`` is not cached."""
        if tokens not in self.entries:
            return False
        self.refs[tokens] = self.refs.get(tokens, 1) + 1
        self.entries.move_to_end(tokens)
        return True

    def _longest(self, ids: list[int]) -> Optional[tuple]:
        n = len(ids)
        for length in sorted(self.length_counts, reverse=True):
            if length < n and (key := tuple(ids[:length])) in self.entries:
                return key
        return None

    def cached_len(self, ids: list[int]) -> int:
        """Length of the longest cached proper prefix of ``ids`` (0 if none), untouched."""
        key = self._longest(ids) if self.entries else None
        return len(key) if key else 0

    def pop_longest(self, ids: list[int]):
        """(length, kv, states) of the longest cached proper prefix of ``ids`` (at least one
        token must remain to compute: its logits give the first new token), or None. A
        hybrid model's states hold exactly the entry's tokens, which is why entries are
        whole finished sequences and a prompt reuses one only when it extends it."""
        key = self._longest(ids) if self.entries else None
        if key is None:
            return None
        self.hits += 1
        self.hit_tokens += len(key)
        refs = self.refs.get(key, 1)
        if refs > 1:  # shared: readers copy it (prefill), never write it
            self.refs[key] = refs - 1
            return (len(key), *self.entries[key])
        return (len(key), *self._drop(key))


class Batcher:
    def __init__(self, model, tokenizer, eos_ids: set[int], max_context_len: int,
                 max_batch_size: int = 256, weight_version: str = "default",
                 prefix_cache_bytes: int = 256 << 20):
        self.model = model
        self.tokenizer = tokenizer
        self.eos_ids = set(eos_ids)
        self.max_context_len = max_context_len
        self.max_batch_size = max_batch_size
        self.prefill_token_budget = 8192  # padded tokens per prefill forward
        # Uncached prompts run packed in forwards of at most this many tokens: a small
        # model's activations then stay in cache between ops (tiny-qwen3's prefill ~15%
        # faster than in one forward; SmolLM2's the same from 512 tokens up, slower
        # below: docs/performance.md).
        self.packed_token_budget = 1024
        self.prefix_cache = PrefixCache(prefix_cache_bytes)
        # prefill_rows: forward rows of all prefills (each distinct prompt once).
        self.stats = {"prefills": 0, "prefill_rows": 0, "prefill_s": 0.0, "decode_s": 0.0}
        self.coalesce_quiet_s = 0.002
        self.coalesce_max_s = 0.02
        self._wave_holds = 0  # times the forming wave was held for stragglers
        self.weight_version = weight_version
        self.waiting: "queue.SimpleQueue[Request]" = queue.SimpleQueue()
        self.controls: "queue.SimpleQueue[tuple]" = queue.SimpleQueue()
        self.wakeup = threading.Event()
        self.paused = False
        self.partial_update = False  # between a non-final and the final bucket of an update
        self.released = False
        self._stop = False
        self._pending: list[Request] = []  # admitted from `waiting` but not yet prefilled
        # Running batch state.
        self.rows: list[Request] = []
        # A hybrid model (Gated DeltaNet layers) also keeps each row's recurrent states.
        self._hybrid = hybrid.is_hybrid(model.config)
        if self._hybrid and hybrid.refusal(model):
            raise ValueError(hybrid.refusal(model))
        self.kv = self._new_kv()  # the running rows' KV (self.kv.cache: views for forward())
        self.mask: Optional[torch.Tensor] = None  # [B, T] 1 = real token
        self.pos: Optional[torch.Tensor] = None  # [B] position of the next input token
        self.last: Optional[torch.Tensor] = None  # [B] last sampled token (not yet fed)
        self.abort_q: "queue.SimpleQueue[Optional[str]]" = queue.SimpleQueue()  # None = all
        self.default_gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
        self.steps = 0
        self._cache_kw = cache_kwarg(model)
        # transformers' forward without its module stack, where the engine's attention and
        # a Llama-family architecture allow (rollout/engines/hf/lean.py; same results).
        self._lean = lean.LeanForward(model) if lean.runs(model) else None
        if self._hybrid:  # transformers' forward has no per-row states to continue from
            self._lean = hybrid.HybridForward(model)
        self.thread = threading.Thread(target=self._loop, name="hf-batcher", daemon=True)

    # ---- API used by the HTTP layer (any thread) ----
    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self._stop = True
        self.wakeup.set()

    def submit(self, req: Request) -> None:
        req.weight_versions = [self.weight_version]
        self.waiting.put(req)
        self.wakeup.set()

    def call(self, fn: Callable[[], Any], done: Callable[[Any, Optional[BaseException]], None]):
        """Run ``fn`` on the scheduler thread between steps; ``done(result, error)`` after."""
        self.controls.put((fn, done))
        self.wakeup.set()

    def abort(self, rid: Optional[str] = None, abort_all: bool = False) -> None:
        # A queue, not a shared set: the HTTP thread and the scheduler never race on it.
        self.abort_q.put(None if abort_all else rid)
        self.wakeup.set()

    @property
    def num_running(self) -> int:
        return len(self.rows) + len(self._pending) + self.waiting.qsize()

    # ---- scheduler thread ----
    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while not self._stop:
            self._run_controls()
            got = self._drain_waiting()
            if got and not self.paused and self._fresh_batch():
                # Idle engine (or a wave not yet decoding) and a burst arriving (e.g. a
                # rollout step's first wave): gather it for a few ms so it becomes one
                # prefill instead of many small ones that each re-merge the cache. Bounded;
                # never waits while rows are decoding.
                deadline = time.monotonic() + self.coalesce_max_s
                while time.monotonic() < deadline:
                    time.sleep(self.coalesce_quiet_s)
                    if not self._drain_waiting():
                        break
            self._apply_aborts()
            busy = bool(self.rows) or bool(self._pending)
            if not busy or self.paused or self.released:
                self.wakeup.wait(0.5)
                self.wakeup.clear()
                continue
            try:
                if self._pending:
                    room = self.max_batch_size - len(self.rows)
                    if room > 0:
                        t0 = time.perf_counter()
                        admit, self._pending = self._pending[:room], self._pending[room:]
                        self.kv.expect(len(self.rows) + len(admit),
                                       max(len(r.input_ids) for r in admit))
                        for chunk in self._prefill_chunks(admit):
                            if self.partial_update:
                                self._note_partial_pass(chunk)
                            self._prefill(chunk)
                            self.stats["prefills"] += 1
                        self.kv.expect(0, 0)
                        self.stats["prefill_s"] += time.perf_counter() - t0
                if self._wave_still_arriving():
                    continue  # admit the rest of the wave before its first decode step
                if self.rows:
                    t0 = time.perf_counter()
                    if self.partial_update:
                        self._note_partial_pass(self.rows)
                    self._decode()
                    self.stats["decode_s"] += time.perf_counter() - t0
            except Exception as exc:  # never leave clients hanging on an internal error
                self._fail_all(exc)

    def _new_kv(self) -> BatchKV:
        return HybridKV() if self._hybrid else BatchKV()

    def _fresh_batch(self) -> bool:
        """No running row has decoded yet (or there is none): the batch is a wave still
        forming. Holding it for stragglers costs no decode progress."""
        return all(len(r.output_ids) == 1 for r in self.rows)

    def _wave_still_arriving(self) -> bool:
        """Requests came in while a fresh batch was prefilling, e.g. the rest of a burst
        whose first request arrived a few ms early: they join (gathered like a burst on an
        idle engine) before the first decode step, so the wave decodes in step. Otherwise
        the early rows run a step ahead and the batch needs one extra step at the end.
        A full batch is never held, and a wave at most twice, so a steady stream of
        arrivals cannot keep it from decoding."""
        if not self.rows or not self._fresh_batch():
            self._wave_holds = 0
            return False
        if (len(self.rows) < self.max_batch_size and not self.waiting.empty()
                and self._wave_holds < 2):
            self._wave_holds += 1
            return True
        return False

    def _drain_waiting(self) -> int:
        n = 0
        while True:
            try:
                self._pending.append(self.waiting.get_nowait())
                n += 1
            except queue.Empty:
                return n

    def _run_controls(self) -> None:
        while True:
            try:
                fn, done = self.controls.get_nowait()
            except queue.Empty:
                return
            try:
                result, err = fn(), None
            except BaseException as exc:  # reported to the caller, the loop goes on
                result, err = None, exc
            done(result, err)

    def _apply_aborts(self) -> None:
        rids, everything = set(), False
        while True:
            try:
                rid = self.abort_q.get_nowait()
            except queue.Empty:
                break
            if rid is None:
                everything = True
            else:
                rids.add(rid)
        if not (everything or rids):
            return
        keep_pending = []
        for r in self._pending:
            if everything or r.rid in rids or r.group_rid in rids:
                self._finish(r, {"type": "abort", "message": "Abort before prefill"})
            else:
                keep_pending.append(r)
        self._pending = keep_pending
        drop = [i for i, r in enumerate(self.rows) if everything or r.rid in rids or r.group_rid in rids]
        for i in drop:
            self._finish(self.rows[i], {"type": "abort", "message": "Abort in waiting queue"
                                        if not self.rows[i].output_ids else "Abort request"})
        if drop:
            self._keep_rows([i for i in range(len(self.rows)) if i not in set(drop)])

    def _fail_all(self, exc: BaseException) -> None:
        msg = f"internal error: {type(exc).__name__}: {exc}"
        for r in self.rows + self._pending:
            self._finish(r, {"type": "abort", "message": msg})
        self.rows, self._pending = [], []
        self.kv = self._new_kv()
        self.mask = self.pos = self.last = None

    def note_weight_update(self, version: Optional[str]) -> None:
        """Called on the scheduler thread after a bucket is applied. ``version`` None: a
        non-final bucket, the weights are half-updated until the last one lands."""
        self.partial_update = version is None
        if version is not None:
            for r in self.rows + self._pending:
                r.weight_versions.append(version)

    def _note_partial_pass(self, reqs: list[Request]) -> None:
        # A forward pass on half-updated weights: record it on every request it served.
        tag = f"{self.weight_version}+partial"
        for r in reqs:
            if r.weight_versions[-1:] != [tag]:
                r.weight_versions.append(tag)

    def drop_weight_copies(self) -> None:
        """Free the packed matmul weights before the weights are released (weight updates
        need not call it: packed weights are refreshed on their next use). The prefix
        cache is KV, released with the KV cache, as SGLang's."""
        if self._lean is not None:
            self._lean.matmuls.clear()

    def reset_batch(self, reason: str) -> None:
        """Abort everything running (used before releasing memory)."""
        for r in self.rows + self._pending:
            self._finish(r, {"type": "abort", "message": reason})
        self.rows, self._pending = [], []
        self.kv = self._new_kv()
        self.mask = self.pos = self.last = None

    def _finish(self, r: Request, reason: dict) -> None:
        r.finish_reason = reason
        r.weight_version = self.weight_version
        if r.on_done is not None:
            r.on_done(r)

    # ---- model steps ----
    def _forward(self, input_ids, attention_mask, position_ids, cache):
        if self._lean is not None:
            return self._lean(input_ids, attention_mask, position_ids, cache), cache
        out = self.model(input_ids=input_ids, attention_mask=attention_mask,
                         position_ids=position_ids, use_cache=True, logits_to_keep=1,
                         **{self._cache_kw: cache})
        new_cache = out.cache if self._cache_kw == "cache" else out.past_key_values
        return out.logits[:, -1, :].float(), new_cache

    def _prefill_chunks(self, reqs: list[Request]) -> list[list[Request]]:
        """Group requests of similar length: a left-padded prefill computes every pad
        position (MLP) and pad x pad attention, so mixed lengths in one prefill waste up to
        half the work. Sorted greedy chunks keep padding under ~20% (and bound the size of
        one prefill's attention tensors). The length that counts is what will be computed:
        a later turn of an episode brings its cached prefix, so a turn's wave of requests
        (different conversation lengths, similar new tokens) stays one prefill.

        The lean forward runs uncached prompts packed, with per-row causal attention:
        there padding costs no matmul or attention work, and splitting by length would
        only multiply the per-forward overhead, so they share a chunk up to the token
        budget (``packed_token_budget``, and a bound on the padded K/V they are unpacked
        into)."""
        new = {id(r): len(r.input_ids) - self.prefix_cache.cached_len(r.input_ids)
               for r in reqs}
        reqs = sorted(reqs, key=lambda r: new[id(r)])
        budget = self.prefill_token_budget

        def greedy(rs: list[Request], fits: Callable[[int, int, int], bool]):
            # fits(longest new length, rows, new tokens) of a chunk; rs sorted ascending.
            out, cur, tokens = [], [], 0
            for r in rs:
                n = new[id(r)]
                if cur and not fits(n, len(cur) + 1, tokens + n):
                    out.append(cur)
                    cur, tokens = [], 0
                cur.append(r)
                tokens += n
            return out + [cur] if cur else out

        chunks = []
        if self._lean is not None and not self._hybrid:
            fresh = [r for r in reqs if new[id(r)] == len(r.input_ids)]
            reqs = [r for r in reqs if new[id(r)] != len(r.input_ids)]
            chunks = greedy(fresh, lambda n, rows, tokens: tokens <= self.packed_token_budget
                            and n * rows <= 4 * budget)
        return chunks + greedy(reqs, lambda n, rows, tokens: n * rows <= 1.2 * tokens + 16
                               and n * rows <= budget)

    def _prefill(self, reqs: list[Request]) -> None:
        """One forward over the chunk's uncached prompt tokens. A row whose prompt starts
        with a finished sequence in the prefix cache (the previous turn of the same
        episode) brings that KV along and only its new suffix is computed. Columns:
        [past, left-padded to P | suffix, left-padded to S]; pad holes are masked out and
        positions are explicit, so the result equals a fresh full prefill.

        Each distinct prompt is computed once: GRPO sends every prompt n times, and the
        episodes of a group that made the same moves send the same next turn. Rows with
        the same tokens and the same cached prefix have identical inputs (the cache is
        looked up by tokens), so one forward row, expanded to all of them, is exact."""
        from transformers import DynamicCache

        pasts = [self.prefix_cache.pop_longest(r.input_ids) for r in reqs]  # (len, kv, states)
        plen_all = [p[0] if p else 0 for p in pasts]
        slot: dict[tuple, int] = {}
        inv = [slot.setdefault((n, tuple(r.input_ids)), len(slot))
               for r, n in zip(reqs, plen_all)]
        first: dict[int, int] = {}
        for i, j in enumerate(inv):
            first.setdefault(j, i)
        uniq = list(first.values())  # row of each distinct prompt, in slot order
        plen = [plen_all[i] for i in uniq]
        slen = [len(reqs[i].input_ids) - plen_all[i] for i in uniq]
        P, S, b = max(plen), max(slen), len(uniq)
        # Built as lists, one tensor each: per-row tensor writes cost more than the rows.
        ids = torch.tensor([[0] * (S - n) + reqs[i].input_ids[p:]
                            for i, p, n in zip(uniq, plen, slen)], dtype=torch.long)
        mask = torch.tensor([[0] * (P - p) + [1] * p + [0] * (S - n) + [1] * n
                             for p, n in zip(plen, slen)], dtype=torch.long)
        pos = torch.tensor([[0] * (S - n) + list(range(p, p + n))
                            for p, n in zip(plen, slen)], dtype=torch.long)
        for r, p in zip(reqs, plen_all):
            r.cached_tokens = p
            r.kv_hole = S - (len(r.input_ids) - p) if p else 0
        cache = (hybrid.new_cache(self.model, b) if self._hybrid
                 else DynamicCache())
        if P > 0:
            ref = next(p for p in pasts if p)[1]  # [2, layers, kv heads, len, head dim]
            two, n_layers, heads, _, dim = ref.shape
            kv = ref.new_zeros(two, n_layers, b, heads, P + S, dim)  # room for the suffix
            for u, i in enumerate(uniq):
                if pasts[i]:
                    kv[:, :, u, :, P - plen[u]:P] = pasts[i][1]
            cache.layers = [GrowingLayer.from_buffers(kv[0, li], kv[1, li], P)
                            for li in range(n_layers)]
        if self._hybrid:  # each row continues from the states at the end of its past
            for u, i in enumerate(uniq):
                for (conv, rec), (c0, r0) in zip(cache.states, pasts[i][2] if pasts[i] else ()):
                    conv[u].copy_(c0)
                    rec[u].copy_(r0)
        logits, cache = self._forward(ids, mask, pos, cache)
        self.stats["prefill_rows"] += b
        inv_t = torch.tensor(inv, dtype=torch.long)  # request -> forward row
        if b < len(reqs):
            logits = logits.index_select(0, inv_t)
        for r in reqs:
            if r.seed is not None:
                r.generator = torch.Generator().manual_seed(int(r.seed))
        tokens, logps = self._sample(logits, reqs)
        new_pos = torch.tensor([len(r.input_ids) for r in reqs], dtype=torch.long)
        survivors = self._append_tokens(reqs, tokens, logps)
        if not survivors:
            return
        idx = torch.tensor(survivors, dtype=torch.long)
        reqs = [reqs[i] for i in survivors]
        rows = inv_t[idx]  # the forward row of each surviving request: one cache copy
        mask, new_pos, tokens = mask[rows], new_pos[idx], tokens[idx]
        self._merge(reqs, cache, mask, new_pos, tokens,
                    rows if b < len(inv) or len(survivors) < b else None)

    def _decode(self) -> None:
        self.mask = torch.cat([self.mask, torch.ones(len(self.rows), 1, dtype=torch.long)], 1)
        self.kv.reserve_step()
        logits, _ = self._forward(self.last[:, None], self.mask, self.pos[:, None], self.kv.cache)
        self.kv.stepped()
        self.pos = self.pos + 1
        tokens, logps = self._sample(logits, self.rows)
        self.last = tokens
        survivors = self._append_tokens(self.rows, tokens, logps)
        self.steps += 1
        if len(survivors) < len(self.rows):
            if self.prefix_cache.max_bytes > 0:
                keep = set(survivors)
                for i, r in enumerate(self.rows):
                    if i not in keep:
                        self._store_prefix(i, r)
            self._keep_rows(survivors)

    def _store_prefix(self, i: int, r: Request) -> None:
        """Keep a finished row's KV (prompt + all but the last output token, i.e. what was
        fed) so the episode's next turn, whose prompt extends it, skips that prefill."""
        tokens = tuple(r.input_ids) + tuple(r.output_ids[:-1])
        if self.prefix_cache.add_ref(tokens):  # a group mate played the same: no copy
            return
        # Runs [a, b) of the row's real columns: its cached past, then, after a hole of
        # padding, the suffix prefilled over it and the tokens decoded since; rows are
        # right-aligned, so they are known from the prefill's layout without reading the
        # mask (torch ops on it took 5% of the scheduler's time on the multi-turn shape).
        width, fed = self.mask.shape[1], len(tokens) - r.cached_tokens
        if r.kv_hole:
            end = width - fed - r.kv_hole
            runs = [(end - r.cached_tokens, end), (width - fed, width)]
        else:
            runs = [(width - len(tokens), width)]
        self.prefix_cache.put(tokens, self.kv.row_kv(i, runs), self.kv.row_states(i))

    def _append_tokens(self, reqs, tokens, logps) -> list[int]:
        """Record one sampled token per request; return indices of unfinished ones."""
        toks = tokens.tolist()
        lps = logps.tolist() if logps is not None else None
        survivors = []
        for i, (r, tok) in enumerate(zip(reqs, toks)):
            r.output_ids.append(tok)
            if r.return_logprob:
                r.logprobs.append(lps[i])
            reason = None
            if (tok in self.eos_ids and not r.ignore_eos) or tok in r.stop_token_ids:
                reason = {"type": "stop", "matched": tok}
            elif r.stop and self._matches_stop(r):
                reason = {"type": "stop", "matched": r.matched_stop}
            elif len(r.output_ids) >= r.max_new_tokens:
                reason = {"type": "length", "length": len(r.output_ids)}
            elif len(r.input_ids) + len(r.output_ids) >= self.max_context_len:
                reason = {"type": "length", "length": len(r.output_ids)}
            if reason is None:
                survivors.append(i)
            else:
                self._finish(r, reason)
        return survivors

    def _matches_stop(self, r: Request) -> bool:
        # Decode only a tail: a stop string can only end in the newest token.
        longest = max(len(s) for s in r.stop)
        tail = self.tokenizer.decode(r.output_ids[-(longest + 4):], skip_special_tokens=False)
        for s in r.stop:
            if s and s in tail:
                r.matched_stop = s
                return True
        return False

    def _sample(self, logits: torch.Tensor, reqs: list[Request]):
        """Sample one token per row; return (tokens, log-probs of them or None)."""
        temps = [r.temperature for r in reqs]
        want_lp = any(r.return_logprob for r in reqs)
        if all(t == 0 for t in temps):
            tokens = logits.argmax(-1)
            logps = None
            if want_lp:
                logps = torch.log_softmax(logits, -1).gather(1, tokens[:, None])[:, 0]
            return tokens, logps
        scaled = logits
        if any(tt not in (0, 1) for tt in temps):
            t = torch.tensor([tt if tt > 0 else 1.0 for tt in temps], dtype=logits.dtype)
            scaled = logits / t[:, None]
        if not RETURN_ORIGINAL_LOGPROB and all(
                r.temperature > 0 and r.generator is None and r.top_k <= 0 and r.top_p >= 1.0
                for r in reqs):
            return sample_plain(scaled, self.default_gen, want_lp)
        logp_scaled = torch.log_softmax(scaled, -1)
        filt = scaled
        if any(r.top_k > 0 for r in reqs) or any(r.top_p < 1.0 for r in reqs):
            filt = self._filter(scaled.clone(), reqs)
        probs = torch.softmax(filt, -1)
        tokens = torch.empty(len(reqs), dtype=torch.long)
        shared = [i for i, r in enumerate(reqs) if r.generator is None and r.temperature > 0]
        if len(shared) == len(reqs):
            tokens = draw(probs, self.default_gen)
        elif shared:
            idx = torch.tensor(shared)
            tokens[idx] = draw(probs[idx], self.default_gen)
        for i, r in enumerate(reqs):
            if r.temperature == 0:
                tokens[i] = logits[i].argmax()
            elif r.generator is not None:
                tokens[i] = draw(probs[i:i + 1], r.generator)[0]
        logps = None
        if want_lp:
            base = logp_scaled
            greedy_rows = [i for i, r in enumerate(reqs) if r.temperature == 0]
            if RETURN_ORIGINAL_LOGPROB or greedy_rows:
                unscaled = torch.log_softmax(logits, -1)
                if RETURN_ORIGINAL_LOGPROB:
                    base = unscaled
                else:
                    base = logp_scaled.clone()
                    base[greedy_rows] = unscaled[greedy_rows]
            logps = base.gather(1, tokens[:, None])[:, 0]
        return tokens, logps

    @staticmethod
    def _filter(scaled: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        vocab = scaled.shape[-1]
        ks = torch.tensor([r.top_k if 0 < r.top_k < vocab else vocab for r in reqs])
        ps = torch.tensor([r.top_p for r in reqs], dtype=scaled.dtype)
        sorted_logits, order = scaled.sort(-1, descending=True)
        ranks = torch.arange(vocab)[None, :]
        remove = ranks >= ks[:, None]
        probs = torch.softmax(sorted_logits, -1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        remove |= (probs.cumsum(-1) - probs) > ps[:, None]
        sorted_logits[remove] = float("-inf")
        return torch.empty_like(scaled).scatter_(1, order, sorted_logits)

    # ---- batch bookkeeping ----
    def _keep_rows(self, keep: list[int]) -> None:
        if not keep:
            self.rows, self.mask, self.pos, self.last = [], None, None, None
            self.kv.keep([])
            return
        idx = torch.tensor(self.kv.keep(keep), dtype=torch.long)
        self.rows = [self.rows[i] for i in idx.tolist()]
        self.mask, self.pos, self.last = self.mask[idx], self.pos[idx], self.last[idx]
        # Drop columns that are padding in every remaining row (left side only).
        real = self.mask.any(0).nonzero()
        first = int(real[0]) if len(real) else 0
        if first > 0:
            self.mask = self.mask[:, first:]
            self.kv.trim_left(first)

    def _merge(self, reqs, cache, mask, pos, last, rows: Optional[torch.Tensor] = None) -> None:
        """Add prefilled requests to the running batch: their KV (``cache``, or its rows
        ``rows``) goes into free slots, right-aligned with the running rows."""
        t_old = self.kv.width
        self.kv.add_cache(cache, rows)
        width = self.kv.width

        def lpad(m, n):
            return torch.nn.functional.pad(m, (n, 0)) if n else m

        mask = lpad(mask, width - mask.shape[1])
        if not self.rows:
            self.rows, self.mask, self.pos, self.last = list(reqs), mask, pos, last
            return
        self.mask = torch.cat([lpad(self.mask, width - t_old), mask])
        self.pos = torch.cat([self.pos, pos])
        self.last = torch.cat([self.last, last])
        self.rows.extend(reqs)
