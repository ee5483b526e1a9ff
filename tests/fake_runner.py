"""A deterministic fake model runner that really uses the paged KV layout, plus drivers.

The fake "KV cache" stores token ids: every fed token is written at its cache slot, and a
row's next token is a hash of all tokens read back through the row's pages for positions
[0, end). So the output is a function of the true sequence only when every page table,
allocation, eviction and slot lookup is right; any bug changes the tokens. With a sliding
`window` the hash covers only the row's last `window` positions, as attention over a
window does, and pages wholly before the window may be PAD_PAGE (freed by the scheduler).
"""

from __future__ import annotations

import dataclasses
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence

import numpy as np

from models.forward_mode import ForwardMode
from runtime.kv_cache import PAD_PAGE, pages_for
from runtime.prefix_cache import PrefixCache
from runtime.request import ReqStatus
from runtime.schedule_batch import PREV_TOKEN, ScheduleBatch, StepOutput
from runtime.scheduler import ReqEvent, Scheduler

VOCAB = 1000
EOS = 2
EOS_EVERY = 23  # about one token in 23 is EOS, so finish-on-EOS is exercised
MAX_POS = 1 << 14
_MULT = np.random.default_rng(0).integers(1, 1 << 62, MAX_POS, dtype=np.uint64) | np.uint64(1)


def cache_slots(pages: Sequence[int], start: int, end: int, page_size: int) -> np.ndarray:
    """Cache slots of positions [start, end) of a request with this page list."""
    pos = np.arange(start, end)  # [end - start]
    return np.asarray(pages, np.int64)[pos // page_size] * page_size + pos % page_size


def next_token(seq: np.ndarray, start: int = 0) -> int:
    """The fake model: a position-sensitive hash of the sequence (positions start, ...)."""
    h = int(((seq.astype(np.uint64) + np.uint64(1)) * _MULT[start:start + len(seq)]).sum())
    h = ((h ^ (h >> 31)) * 0x9E3779B97F4A7C15) & ((1 << 64) - 1)
    h ^= h >> 29
    return EOS if h % EOS_EVERY == 0 else (h >> 7) % VOCAB


def fake_decode(ids: list[int]) -> str:
    """A toy detokenizer: one letter per token."""
    return "".join(chr(ord("a") + t % 26) for t in ids)


class FakeRunner:
    """Executes a ScheduleBatch on a host array of token ids laid out like the KV pool."""

    def __init__(self, num_pages: int, page_size: int, max_slots: int, window: int = 0):
        self.page_size = page_size
        self.window = window
        self.kv = np.full(num_pages * page_size, -1, np.int64)  # -1: never written
        self.last = np.full(max_slots, -1, np.int64)  # token each req_slot sampled last
        self.num_batches = 0

    def forward(self, batch: ScheduleBatch) -> StepOutput:
        """Write every row's tokens, then read every row's sequence (like one layer of a
        forward), failing on anything a real device could get wrong."""
        if batch.steps > 1:
            return self._forward_steps(batch)
        if batch.mode is ForwardMode.TARGET_VERIFY:
            return self._forward_verify(batch)
        writer: dict[int, int] = {}  # cache slot -> row that writes it in this batch
        for i, row in enumerate(batch.rows):
            prev = int(self.last[row.req.req_slot])
            ids = [prev if t == PREV_TOKEN else t for t in row.input_ids]
            assert min(ids) >= 0, "PREV_TOKEN with nothing sampled in this slot"
            assert len(row.pages) == pages_for(row.end_pos, self.page_size), "page count"
            first = max(row.start_pos - self.window + 1, 0) if self.window else 0
            assert all((i + 1) * self.page_size <= first
                       for i, p in enumerate(row.pages) if p == PAD_PAGE), \
                "a row uses the reserved page inside its window"
            new = cache_slots(row.pages, row.start_pos, row.end_pos, self.page_size)
            assert writer.keys().isdisjoint(new.tolist()), "two rows write one slot"
            writer.update(dict.fromkeys(new.tolist(), i))
            self.kv[new] = ids
        tokens = []
        for i, row in enumerate(batch.rows):
            lo = max(row.end_pos - self.window, 0) if self.window else 0
            slots = cache_slots(row.pages, lo, row.end_pos, self.page_size)
            # Rows of one batch may run as separate micro-batches: no cross-row reads.
            assert all(writer.get(s, i) == i for s in slots.tolist()), "reads another row's KV"
            seq = self.kv[slots]
            assert (seq >= 0).all(), "read a slot nothing wrote"
            tok = next_token(seq, lo)
            if row.sample:
                self.last[row.req.req_slot] = tok
            tokens.append(tok)
        self.num_batches += 1
        return StepOutput(np.asarray(tokens, np.int64))


    def _forward_steps(self, batch: ScheduleBatch) -> StepOutput:
        """A multi-step DECODE batch as the device runs it: step j feeds each row with more
        than j steps the token its slot sampled in step j - 1. Tokens [rows, K]; a row's
        steps past its num_steps stay -1 (the host must not read them)."""
        assert batch.mode is ForwardMode.DECODE and not batch.extend_rows
        tokens = np.full((len(batch.rows), batch.steps), -1, np.int64)
        for row in batch.rows:
            assert 1 <= row.num_steps <= batch.steps
            assert len(row.pages) == pages_for(row.start_pos + row.num_steps,
                                               self.page_size), "pages for every step"
        for j in range(batch.steps):
            live = [i for i, r in enumerate(batch.rows) if r.num_steps > j]
            rows = [dataclasses.replace(
                r, input_ids=r.input_ids if j == 0 else [PREV_TOKEN], start_pos=r.start_pos + j,
                pages=r.pages[:pages_for(r.start_pos + j + 1, self.page_size)], num_steps=1)
                for r in (batch.rows[i] for i in live)]
            out = self.forward(ScheduleBatch(ForwardMode.DECODE, [], rows))
            tokens[live, j] = out.next_token_ids
            self.num_batches -= 1
        self.num_batches += 1
        return StepOutput(tokens)

    def _forward_verify(self, batch: ScheduleBatch) -> StepOutput:
        """A TARGET_VERIFY batch: every row's tokens written, then a token per position
        from the sequence read back up to it. Tokens [rows, width] (-1 past a row's)."""
        width = max(len(r.input_ids) for r in batch.rows)
        tokens = np.full((len(batch.rows), width), -1, np.int64)
        for i, row in enumerate(batch.rows):
            assert min(row.input_ids) >= 0, "a verify row's tokens are known on the host"
            assert len(row.pages) == pages_for(row.end_pos, self.page_size), "page count"
            self.kv[cache_slots(row.pages, row.start_pos, row.end_pos, self.page_size)] = \
                row.input_ids
            for j in range(len(row.input_ids)):
                seq = self.kv[cache_slots(row.pages, 0, row.start_pos + j + 1, self.page_size)]
                assert (seq >= 0).all(), "read a slot nothing wrote"
                tokens[i, j] = next_token(seq)
        self.num_batches += 1
        return StepOutput(tokens)


def reference_output(prompt: list[int], max_new_tokens: int, ignore_eos: bool = False,
                     window: int = 0) -> list[int]:
    """What any correct schedule must produce for a request (no KV cache involved)."""
    seq, out = list(prompt), []
    while len(out) < max_new_tokens:
        lo = max(len(seq) - window, 0) if window else 0
        tok = next_token(np.asarray(seq[lo:]), lo)
        out.append(tok)
        seq.append(tok)
        if tok == EOS and not ignore_eos:
            break
    return out


def drive(
    sched: Scheduler,
    runner: FakeRunner,
    overlap: bool = False,
    on_step: Callable[[int], None] | None = None,
    max_steps: int = 100_000,
) -> dict[str, list[int]]:
    """Run until idle; returns the tokens streamed per rid.

    With overlap, batch N+1 is launched before process_results(N), like the real engine.
    """
    streamed: dict[str, list[int]] = defaultdict(list)
    pending = None
    for step in range(max_steps):
        if on_step is not None:
            on_step(step)
        batch = sched.next_batch()
        if batch is None and pending is None:
            if sched.is_idle():
                return streamed
            raise RuntimeError("scheduler stuck: nothing runnable and nothing in flight")
        launched = (batch, runner.forward(batch)) if batch is not None else None
        done, pending = (pending, launched) if overlap else (launched, None)
        if done is not None:
            _collect(streamed, sched.process_results(*done))
    raise RuntimeError(f"not idle after {max_steps} steps")


def _collect(streamed: dict[str, list[int]], events: list[ReqEvent]) -> None:
    for ev in events:
        streamed[ev.req.rid] += ev.new_token_ids


def check_invariants(sched: Scheduler) -> None:
    """Every page reference is accounted for by a running request or the prefix cache."""
    alloc, cache = sched.allocator, sched.prefix_cache
    alloc.check()
    cache.check()
    assert alloc.num_free + alloc.num_used == alloc.capacity
    owners = Counter(p for r in sched.running for p in r.pages)
    cached = set(_cached_pages(cache)) if isinstance(cache, PrefixCache) else set()
    for p in range(1, alloc.num_pages):
        want = owners[p] + (p in cached)
        assert alloc.refcount(p) == want, f"page {p}: refcount {alloc.refcount(p)} != {want}"
        assert owners[p] <= 1 or p in cached, f"page {p} owned twice outside the cache"
    slots = [r.req_slot for r in sched.running]
    assert len(set(slots)) == len(slots), "two running requests share a slot"
    assert all(0 <= s < sched.config.max_running_requests for s in slots)
    for r in sched.running:
        assert r.status is ReqStatus.RUNNING
        assert len(r.pages) == pages_for(r.kv_len, sched.page_size), f"{r.rid}: page count"
    for r in sched.waiting:
        assert r.status is ReqStatus.WAITING and not r.pages and r.req_slot == -1


def _cached_pages(cache: PrefixCache) -> list[int]:
    pages, stack = [], list(cache.root.children.values())
    while stack:
        node = stack.pop()
        pages.append(node.page)
        stack.extend(node.children.values())
    return pages
