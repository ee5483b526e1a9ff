"""Host scheduler: waiting and running queues, admission, chunked prefill, retraction.

Plain Python (no jax). The engine loop is

    batch = scheduler.next_batch()          # None: nothing runnable now
    output = runner.forward(batch)
    events = scheduler.process_results(batch, output)

In overlap mode the engine launches batch N+1 before it calls process_results for batch N,
so at most one batch is pending when next_batch() runs. A decode row whose previous token is
still on the device feeds PREV_TOKEN; a request found finished when batch N's results arrive
may already sit in batch N+1, and that row's token is discarded. Pages and slots are freed
on the host at once: every batch that could reuse them is launched later, and the device
runs batches in launch order.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable, Iterable

from models.forward_mode import ForwardMode
from runtime.config import SchedulerConfig
from runtime.kv_cache import PAD_PAGE, PageAllocator, pages_for
from runtime.prefill_policy import YOUNG_STREAM_TOKENS, PrefillPolicy
from runtime.prefix_cache import make_prefix_cache
from runtime.request import FinishReason, Req, ReqStatus
from runtime.schedule_batch import PREV_TOKEN, BatchRow, ScheduleBatch, StepOutput
from runtime.spec_decode import SpecDecoding

# Past this queue length "lpm" falls back to fcfs: matching every waiting prompt costs too much.
LPM_MAX_QUEUE = 128
# next_batch's "nothing until the batch in flight is back" from the verify scheduling.
_WAIT = object()


@dataclasses.dataclass(frozen=True)
class ReqEvent:
    """What one sampled row did to its request: new_token_ids is [] or [token] (up to
    the row's num_steps tokens for a multi-step batch)."""

    req: Req
    new_token_ids: list[int]
    finished: bool


@dataclasses.dataclass(frozen=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_used_pages: int  # includes cached pages, evictable or not
    num_total_pages: int
    num_cached_pages: int
    num_evictable_pages: int
    prompt_tokens: int  # prompt tokens of first admissions
    prefix_hit_tokens: int  # of those, tokens served from the prefix cache
    num_retractions: int

    @property
    def token_usage(self) -> float:
        """Fraction of the pool in use, not counting what eviction could free."""
        return (self.num_used_pages - self.num_evictable_pages) / self.num_total_pages


class Scheduler:
    """Decides what runs each step and owns every request's pages and slot.

    With a `policy` (runtime/prefill_policy.py, the engine's default) decode comes first:
    every step carries the running decode rows and the policy sizes the prefill chunk
    beside them; with nothing decoding a prefill runs as a whole EXTEND batch. Without
    one, prefill has priority over decode (a step with extend rows has no decode rows)
    unless `enable_mixed_chunk`, where the running decode rows ride along in a MIXED
    batch whatever the chunk costs.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        eos_token_ids: Iterable[int],
        decode_fn: Callable[[list[int]], str] | None = None,
        first_slot: int = 0,
        policy: PrefillPolicy | None = None,
        spec: SpecDecoding | None = None,
    ):
        """first_slot: requests take slots [first_slot, first_slot + max_running_requests)
        (a data-parallel rank's share of the runner's slots, runtime/dp_attention.py).
        spec: speculative decoding (TARGET_VERIFY batches) where it pays; None: off."""
        if policy is not None and (config.enable_mixed_chunk or config.chunk_size is None):
            raise ValueError("the prefill policy sizes token-axis chunks: it needs chunked "
                             "prefill and no enable_mixed_chunk")
        self.config = config
        self.policy = policy
        self.spec = spec
        self.page_size = config.cache.page_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.decode_fn = decode_fn
        self.allocator = PageAllocator(config.cache.num_pages)
        self.prefix_cache = make_prefix_cache(
            self.allocator, self.page_size, not config.disable_prefix_cache
        )
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []  # admission order: the last is the newest
        self._reqs: dict[str, Req] = {}  # every unfinished request
        self._free_slots = list(range(first_slot + config.max_running_requests - 1,
                                      first_slot - 1, -1))
        self._chunked: Req | None = None  # the one request that is mid chunked prefill
        self._inflight = 0  # batches handed out whose results are not processed yet
        # Requests of the split prefill in flight (next_prefill .. release_prefill), each
        # with the tokens whose KV was complete before it: they decode only once its last
        # interval has sampled, are never retracted, and if aborted mid-way cache only
        # those tokens' pages (the later intervals skip an aborted row).
        self._held: dict[Req, int] = {}
        # Requests of the TARGET_VERIFY batch in flight: how many tokens they keep is known
        # only once its results are back, so no other batch takes them before that.
        self._verifying: set[Req] = set()
        self._prompt_tokens = 0
        self._prefix_hit_tokens = 0
        self._num_retractions = 0

    # ---- public verbs ----

    def add(self, req: Req) -> None:
        """Queue a request; raises ValueError if it can never run."""
        if req.rid in self._reqs:
            raise ValueError(f"duplicate request id {req.rid!r}")
        if not req.prompt_ids:
            raise ValueError("empty prompt: at least one input token is needed")
        if req.sampling.stop and self.decode_fn is None:
            raise ValueError("stop strings need a tokenizer (the scheduler has no decode_fn)")
        self._check_fits(len(req.prompt_ids), req.sampling.max_new_tokens)
        req.status = ReqStatus.WAITING
        self._reqs[req.rid] = req
        self.waiting.append(req)

    def abort(self, rid: str, message: str = "aborted") -> Req | None:
        """Finish a request in any state and free what it holds; None if rid is unknown."""
        req = self._reqs.get(rid)
        if req is not None:
            self._finish(req, FinishReason("abort", message=message))
        return req

    def is_idle(self) -> bool:
        return not self.waiting and not self.running

    def flush_cache(self) -> bool:
        """Drop every cached prefix (SGLang's /flush_cache); only when idle, since running
        requests hold cached pages. Returns whether it flushed."""
        if not self.is_idle():
            return False
        self.prefix_cache.evict(self.prefix_cache.evictable_pages)
        return True

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_used_pages=self.allocator.num_used,
            num_total_pages=self.allocator.capacity,
            num_cached_pages=self.prefix_cache.num_pages,
            num_evictable_pages=self.prefix_cache.evictable_pages,
            prompt_tokens=self._prompt_tokens,
            prefix_hit_tokens=self._prefix_hit_tokens,
            num_retractions=self._num_retractions,
        )

    def next_batch(self) -> ScheduleBatch | None:
        """The next batch to run, or None when nothing can run until results arrive."""
        self._check_inflight()
        if self.spec is not None:
            verify = self._verify_batch()
            if verify is not None:
                return None if verify is _WAIT else verify
        steps = self._decode_steps()
        if steps > 1:
            rows = self._schedule_decode(steps)
            if not rows:
                return None
            self._inflight += 1
            return ScheduleBatch(ForwardMode.DECODE, [], rows, steps)
        if self.policy is not None:
            return self._decode_first_batch()
        if self.config.enable_mixed_chunk:
            decode = self._schedule_decode()
            extend = self._schedule_extend(len(decode))
        else:
            extend = self._schedule_extend(0)
            decode = [] if extend else self._schedule_decode()
        if not extend and not decode:
            return None
        if extend:
            mode = ForwardMode.MIXED if decode else ForwardMode.EXTEND
        else:
            mode = ForwardMode.DECODE
        self._inflight += 1
        return ScheduleBatch(mode, extend, decode)

    def _decode_first_batch(self) -> ScheduleBatch | None:
        """The policy's step: the decode rows, and beside them the prefill the policy
        budgets (a whole EXTEND batch when nothing decodes)."""
        policy = self.policy
        assert policy is not None
        decode = self._schedule_decode()
        if not decode:
            extend = self._schedule_extend(0)
            if not extend:
                return None
            decision = policy.whole(0, sum(len(r.input_ids) for r in extend), policy.target_s)
            self._inflight += 1
            return ScheduleBatch(ForwardMode.EXTEND, extend, [], decision=decision)
        chunked = self._chunked
        young = (len(self.waiting) <= len(self._free_slots)
                 and all(r.req.num_generated <= YOUNG_STREAM_TOKENS for r in decode))
        decision = policy.plan(
            len(decode), young, chunked.kv_len if chunked else 0,
            chunked.fill_len - chunked.kv_len if chunked else None, self._queued_tokens())
        extend = (self._schedule_extend(0, decision.chunk_tokens, decision.max_rows)
                  if decision.chunk_tokens else [])
        self._inflight += 1
        if not extend:
            return ScheduleBatch(ForwardMode.DECODE, [], decode)
        if decision.path == "interval":
            # The loop runs the decode rows as a DECODE step and starts a split prefill of
            # the extend rows, held (as next_prefill's) until release_prefill.
            self._held = {r.req: r.start_pos for r in extend}
        return ScheduleBatch(ForwardMode.MIXED, extend, decode, decision=decision)

    def _queued_tokens(self) -> int:
        """Prompt tokens waiting for admission, counted up to the largest chunk (all a step
        can take); an over-estimate where the prefix cache holds part of a prompt."""
        total, cap = 0, self.config.chunk_size or 0
        for req in self.waiting:
            total += len(req.all_ids)
            if total >= cap:
                break
        return total

    # ---- split prefill (runtime/multiplexing.py) ----

    def next_prefill(self) -> ScheduleBatch | None:
        """An extend batch to run as a split prefill (mode SPLIT_PREFILL), or None. Its
        requests are held out of decode batches and retraction until release_prefill().
        Only one is in flight at a time; it is not counted against the overlap limit."""
        if self._held:
            raise RuntimeError("a split prefill is already in flight")
        rows = self._schedule_extend(0)
        if not rows:
            return None
        self._held = {r.req: r.start_pos for r in rows}
        return ScheduleBatch(ForwardMode.SPLIT_PREFILL, rows, [])

    def release_prefill(self) -> None:
        """The held batch's last interval and its sampling are launched: its requests may
        decode from the next batch on (their first token is the slot's PREV_TOKEN)."""
        self._held = {}

    def batch_growth(self) -> tuple[int, int]:
        """(running requests that can decode now, requests that will join them: those
        prefilling or held, plus as many waiting ones as there are free slots)."""
        ready = sum(1 for r in self.running if not r.is_prefilling and r not in self._held)
        return ready, len(self.running) - ready + min(len(self.waiting), len(self._free_slots))

    def next_decode(self) -> ScheduleBatch | None:
        """A DECODE batch of the running requests that are not held, or None."""
        self._check_inflight()
        rows = self._schedule_decode()
        if not rows:
            return None
        self._inflight += 1
        return ScheduleBatch(ForwardMode.DECODE, [], rows)

    def process_results(self, batch: ScheduleBatch, output: StepOutput) -> list[ReqEvent]:
        """Apply a batch's sampled tokens; returns one event per sampled, still-live row."""
        rows, steps = batch.rows, batch.steps
        tokens = output.next_token_ids.tolist()
        if len(tokens) != len(rows):
            raise ValueError(f"{len(tokens)} tokens for {len(rows)} rows")
        if batch.mode is not ForwardMode.SPLIT_PREFILL:
            self._inflight -= 1
        if batch.mode is ForwardMode.TARGET_VERIFY:
            return self._accept_verified(batch, tokens, output)
        events = []
        for i, row in enumerate(rows):
            req = row.req
            if i < len(batch.extend_rows) and req.status is ReqStatus.RUNNING:
                self._cache_prefilled(req)
            if not row.sample:
                continue
            if steps > 1:
                events.extend(self._accept_steps(req, row.num_steps, tokens[i], output, i))
                continue
            req.num_pending -= 1
            if req.finished:  # aborted, or finished while this batch was in flight
                continue
            events.append(self._accept(req, tokens[i], output, (i,)))
        return events

    def _check_inflight(self) -> None:
        limit = 1 if self.config.overlap else 0
        if self._inflight > limit:
            raise RuntimeError(
                f"{self._inflight} batches await process_results (overlap={self.config.overlap})"
            )

    # ---- results ----

    def _accept_steps(self, req: Req, n: int, tokens: list[int], output: StepOutput,
                      i: int) -> list[ReqEvent]:
        """A multi-step row's first n tokens, taken one by one as single steps would be:
        those after its finish (or an abort) are dropped. One event for all of them."""
        new, done = [], False
        for j in range(n):
            req.num_pending -= 1
            if req.finished:
                continue
            ev = self._accept(req, tokens[j], output, (i, j))
            new += ev.new_token_ids
            done = ev.finished
        return [ReqEvent(req, new, done)] if new or done else []

    def _accept(self, req: Req, token: int, output: StepOutput, at: tuple[int, ...]
                ) -> ReqEvent:
        """Take one sampled token; `at` indexes its row (and step) in output's arrays."""
        if len(req.output_ids) >= req.sampling.max_new_tokens:  # max_new_tokens == 0
            self._finish(req, FinishReason("length"))
            return ReqEvent(req, [], True)
        req.output_ids.append(token)
        if req.sampling.logprobs and output.logprobs is not None:
            req.output_logprobs.append(float(output.logprobs[at]))
        k = req.sampling.top_logprobs
        if k and output.top_logprobs is not None:
            ids, lps = output.top_logprobs
            req.output_top_logprobs.append((ids[at][:k].tolist(), lps[at][:k].tolist()))
        reason = req.check_finished(self.eos_token_ids, self.decode_fn)
        if reason is not None:
            self._finish(req, reason)
        return ReqEvent(req, [token], reason is not None)

    def _finish(self, req: Req, reason: FinishReason) -> None:
        if req.status is ReqStatus.RUNNING:
            self._release(req)
            self.running.remove(req)
        elif req.status is ReqStatus.WAITING:
            self.waiting.remove(req)
        req.status = ReqStatus.FINISHED
        req.finish_reason = reason
        del self._reqs[req.rid]

    def _cacheable(self, req: Req, pages: int) -> int:
        """Of req's first `pages` pages, how many may enter the prefix cache: a cached path
        runs from the root, so none past a page freed out of the window."""
        return pages if req.cacheable_pages is None else min(pages, req.cacheable_pages)

    def _cache_prefilled(self, req: Req) -> None:
        """Share a running request's whole prefilled pages, so concurrent requests with the
        same prefix hit the cache. Called when the batch's results arrive: every batch that
        writes those pages is launched by then, and a batch that reads them only later (a row
        must never read KV that another row of the same batch writes). The lock moves to the
        new deepest node, new before old, so no shared page is ever unlocked in between."""
        full = self._cacheable(req, min(req.kv_len, req.num_known) // self.page_size)
        result = self.prefix_cache.insert(req.all_ids[: full * self.page_size], req.pages[:full])
        self.prefix_cache.lock(result.node)
        self.prefix_cache.unlock(req.prefix_node)
        req.prefix_node = result.node

    # ---- extend ----

    def _schedule_extend(self, decode_tokens: int, budget: int | None = None,
                         max_rows: int | None = None) -> list[BatchRow]:
        """Extend rows: the chunk under way first, then admissions. `budget`, `max_rows`:
        the policy's token and row limits (default: the chunked-prefill budget less
        `decode_tokens`, and max_extend_seqs)."""
        cfg = self.config
        if budget is None:
            budget = min(cfg.max_prefill_tokens, cfg.chunk_size or cfg.max_prefill_tokens)
            budget -= decode_tokens
        max_rows = cfg.max_extend_seqs if max_rows is None else min(max_rows,
                                                                    cfg.max_extend_seqs)
        rows: list[BatchRow] = []
        if self._chunked is not None:
            row = self._next_chunk(self._chunked, budget)
            if row is not None:
                rows.append(row)
                budget -= len(row.input_ids)
        for req in self._admission_order():
            if budget <= 0 or len(rows) >= max_rows or not self._free_slots:
                break
            if req.num_pending:  # retracted while its last token was in flight
                continue
            row = self._admit(req, budget, first=not rows)
            if row is None:
                break
            rows.append(row)
            budget -= len(row.input_ids)
        return rows

    def _admission_order(self) -> list[Req]:
        if self.config.schedule_policy == "lpm" and len(self.waiting) <= LPM_MAX_QUEUE:
            match = self.prefix_cache.match_prefix
            return sorted(self.waiting, key=lambda r: -match(r.all_ids[:-1]).num_tokens)
        return list(self.waiting)

    def _admit(self, req: Req, budget: int, first: bool) -> BatchRow | None:
        """Move req from waiting to running with its first extend row, or None if it can't."""
        seq = req.all_ids
        # Match on seq[:-1]: the last token must be fed to get the logits that sample.
        match = self.prefix_cache.match_prefix(seq[:-1])
        todo = len(seq) - match.num_tokens
        if self.config.chunk_size is None:
            n = todo
            if n > budget and not first:
                return None
        else:
            n = min(todo, budget)
            if n < todo and self._chunked is not None:
                return None
        self.prefix_cache.lock(match.node)
        need = pages_for(match.num_tokens + n, self.page_size) - len(match.pages)
        # Keep a page per running request free, so admission does not force a retraction.
        if not self._can_get(need + len(self.running)):
            self.prefix_cache.unlock(match.node)
            return None
        self.allocator.incref(match.pages)
        req.pages = match.pages + self._allocate(need)
        req.prefix_node = match.node
        req.kv_len = match.num_tokens
        req.fill_len = len(seq)
        req.req_slot = self._free_slots.pop()
        req.status = ReqStatus.RUNNING
        if req.num_retractions == 0:
            req.cached_tokens = match.num_tokens
            self._prompt_tokens += len(seq)
            self._prefix_hit_tokens += match.num_tokens
        self.waiting.remove(req)
        self.running.append(req)
        if n < todo:
            self._chunked = req
        return self._extend_row(req, n, new_slot=True)

    def _next_chunk(self, req: Req, budget: int) -> BatchRow | None:
        self._free_out_of_window(req)
        n = min(req.fill_len - req.kv_len, budget)
        need = pages_for(req.kv_len + n, self.page_size) - len(req.pages)
        if n <= 0 or not self._can_get(need):
            return None
        req.pages += self._allocate(need)
        if req.kv_len + n == req.fill_len:
            self._chunked = None
        return self._extend_row(req, n, new_slot=False)

    def _extend_row(self, req: Req, n: int, new_slot: bool) -> BatchRow:
        start, end = req.kv_len, req.kv_len + n
        req.kv_len = end
        sample = end == req.fill_len
        req.num_pending += sample
        ids = req.all_ids[start:end]
        return BatchRow(req, ids, start, req.pages[:], sample, new_slot)

    # ---- speculative decoding (runtime/spec_decode.py) ----

    def _verify_batch(self) -> ScheduleBatch | object | None:
        """A TARGET_VERIFY batch of every decodable row (those with no draft verify their
        last token alone), _WAIT while a batch is in flight (drafting needs the rows' last
        tokens), or None: decode plainly (something to prefill, a batch the cost model or
        the verify programs rule out, no row drafting)."""
        spec = self.spec
        assert spec is not None
        if self._chunked is not None or (self.waiting and self._free_slots):
            return None
        ready = [r for r in self.running if not r.is_prefilling and r not in self._held
                 and r.num_generated < r.sampling.max_new_tokens]
        if not ready or not any(spec.eligible(r) for r in ready) \
                or not spec.batch_on(len(ready)):
            return None
        if self._inflight:
            return _WAIT
        drafts = spec.draft_all(ready)
        drafting = sum(1 for d in drafts if d)
        if not drafting or not spec.worth(len(ready), drafting):
            return None
        rows: list[BatchRow] = []
        scheduled: set[Req] = set()
        for req, draft in zip(ready, drafts, strict=True):
            # An earlier row's pages may have retracted it.
            if req.status is not ReqStatus.RUNNING:
                continue
            if not self._reserve_decode_pages(req, scheduled, len(draft) + 1):
                continue
            assert req.kv_len == req.num_known - 1 and not req.num_pending, "verify row out of step"
            rows.append(BatchRow(req, [req.all_ids[-1], *draft], req.kv_len, req.pages[:],
                                 sample=True))
            self._verifying.add(req)
            req.kv_len += len(draft) + 1
            req.num_pending += 1
            scheduled.add(req)
        if not rows:
            return None
        self._inflight += 1
        return ScheduleBatch(ForwardMode.TARGET_VERIFY, [], rows)

    def _accept_verified(self, batch: ScheduleBatch, tokens: list[list[int]],
                         output: StepOutput) -> list[ReqEvent]:
        """Each verify row keeps the tokens sampled at its positions up to the first that
        differs from its draft (that one included). The KV of the rejected drafts is rolled
        back: kv_len ends after the last kept input, and pages past it are freed (never
        cached: only known tokens' pages ever reach the prefix cache)."""
        assert self.spec is not None
        events = []
        for i, row in enumerate(batch.decode_rows):
            req = row.req
            req.num_pending -= 1
            self._verifying.discard(req)
            if req.finished:  # aborted while in flight
                continue
            draft, sampled = row.input_ids[1:], tokens[i]
            n = 1
            while n <= len(draft) and sampled[n - 1] == draft[n - 1]:
                n += 1
            self.spec.observe(req, len(draft), n - 1)
            if req.status is ReqStatus.RUNNING:  # else retracted in flight: nothing held
                req.kv_len = row.start_pos + n
                keep = pages_for(req.kv_len, self.page_size)
                self.allocator.free(req.pages[keep:])
                del req.pages[keep:]
            new, done = [], False
            for j in range(n):
                ev = self._accept(req, sampled[j], output, (i, j))
                new += ev.new_token_ids
                if ev.finished:
                    done = True
                    break
            events.append(ReqEvent(req, new, done))
        return events

    # ---- decode and retraction ----

    def _decode_steps(self) -> int:
        """num_scheduler_steps when this batch may run them all on the device: nothing to
        prefill (no chunk under way, no waiting request a free slot could admit, so a new
        request's first token never waits for them) and no grammar-constrained request
        (its mask needs each token first); else 1."""
        k = self.config.num_scheduler_steps
        if k == 1 or self._chunked is not None or (self.waiting and self._free_slots):
            return 1
        if any(r.grammar is not None or r.is_prefilling for r in self.running):
            return 1
        return k

    def _schedule_decode(self, steps: int = 1) -> list[BatchRow]:
        """The running requests' decode rows, each of min(steps, tokens it has left)
        steps."""
        rows: list[BatchRow] = []
        scheduled: set[Req] = set()
        for req in list(self.running):  # oldest first: the newest get retracted
            if (req.status is not ReqStatus.RUNNING or req.is_prefilling or req in self._held
                    or req in self._verifying):
                continue
            if req.num_generated >= req.sampling.max_new_tokens:  # last token in flight
                continue
            n = min(steps, req.sampling.max_new_tokens - req.num_generated)
            if not self._reserve_decode_pages(req, scheduled, n):
                continue
            rows.append(self._decode_row(req, n))
            scheduled.add(req)
        return rows

    def _reserve_decode_pages(self, req: Req, scheduled: set[Req], n: int) -> bool:
        """Make sure positions kv_len .. kv_len + n - 1 have pages, retracting the newest
        unscheduled requests if the pool is out of pages. False if req itself had to be
        retracted."""
        self._free_out_of_window(req)
        need = pages_for(req.kv_len + n, self.page_size) - len(req.pages)
        if need <= 0:
            return True
        while not self._can_get(need):
            victim = next(r for r in reversed(self.running)
                          if r not in scheduled and r not in self._held)
            self._retract(victim)
            if victim is req:
                return False
        req.pages += self._allocate(need)
        return True

    def _decode_row(self, req: Req, n: int = 1) -> BatchRow:
        pos = req.kv_len
        assert pos == req.num_known + req.num_pending - 1, "decode row out of step"
        token = PREV_TOKEN if req.num_pending else req.output_ids[-1]
        req.kv_len += n
        req.num_pending += n
        return BatchRow(req, [token], pos, req.pages[:], sample=True, num_steps=n)

    def _retract(self, req: Req) -> None:
        """Send a running request back to the front of the queue; it keeps its tokens and
        resumes by prefilling prompt + output so far (mostly from the prefix cache)."""
        self._release(req)
        self.running.remove(req)
        req.status = ReqStatus.WAITING
        req.kv_len = req.fill_len = 0
        req.num_retractions += 1
        self._num_retractions += 1
        self.waiting.appendleft(req)

    # ---- pages ----

    def _check_fits(self, prompt_len: int, max_new_tokens: int) -> None:
        total = prompt_len + max_new_tokens
        what = f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) = {total}"
        limit = self.config.max_context_len
        if limit is not None and total > limit:
            raise ValueError(f"{what} exceeds the context length {limit}")
        # A request must fit the pool alone, or retraction could not guarantee progress.
        need, have = pages_for(total, self.page_size), self.allocator.capacity
        if need > have:
            raise ValueError(f"{what} needs {need} KV pages, the pool has {have}")

    def _can_get(self, n: int) -> bool:
        return n <= self.allocator.num_free + self.prefix_cache.evictable_pages

    def _allocate(self, n: int) -> list[int]:
        if n > self.allocator.num_free:
            self.prefix_cache.evict(n - self.allocator.num_free)
        return self.allocator.allocate(n)

    def _free_out_of_window(self, req: Req) -> None:
        """Sliding-window models: free the pages wholly before the window of req's next
        query (at kv_len), which no later query of req reads, and mark them PAD_PAGE in its
        page list (the kernels mask, or skip, positions outside the window). Only pages req
        owns alone: a page the prefix cache holds frees nothing and stays valid for others.
        Batches in flight may still read a freed page; whatever reuses it is launched later
        (PageAllocator's contract)."""
        window = self.config.sliding_window
        if not window:
            return
        dead = min(max(req.kv_len - window + 1, 0) // self.page_size, len(req.pages))
        for i in range(req.window_checked_pages, dead):
            page = req.pages[i]
            if page != PAD_PAGE and self.allocator.refcount(page) == 1:
                self.allocator.free([page])
                req.pages[i] = PAD_PAGE
                if req.cacheable_pages is None:
                    req.cacheable_pages = i
        req.window_checked_pages = max(req.window_checked_pages, dead)

    def _release(self, req: Req) -> None:
        """Return a running request's pages and slot; whole pages of known tokens whose KV is
        written (or in flight) go into the prefix cache first."""
        cached = min(req.kv_len, req.num_known, self._held.get(req, req.kv_len)) // self.page_size
        cached = self._cacheable(req, cached)
        self.prefix_cache.insert(req.all_ids[: cached * self.page_size], req.pages[:cached])
        self.prefix_cache.unlock(req.prefix_node)
        self.allocator.decref(req.pages[:cached])
        # Pages past the cached ones were allocated for this request alone, unless a page
        # was freed out of the window (now PAD_PAGE): the cache may then hold some past it
        # (where another request's copy of a page was cached first, req's went unused).
        rest = [p for p in req.pages[cached:] if p != PAD_PAGE]
        if req.cacheable_pages is None:
            self.allocator.free(rest)
        else:
            self.allocator.decref(rest)
        self._free_slots.append(req.req_slot)
        req.pages, req.prefix_node, req.req_slot = [], None, -1
        req.window_checked_pages, req.cacheable_pages = 0, None
        if self._chunked is req:
            self._chunked = None
