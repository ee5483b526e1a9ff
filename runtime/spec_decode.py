"""Speculative decoding, the host half (no jax): which rows draft, how many tokens, and
whether a batch speculates at all.

A TARGET_VERIFY step feeds each row its last token and k drafted ones; the target samples
a token at every position (the same sampler, seeded by position, as plain decoding), and
the row keeps the longest prefix where the sampled token equals the draft, plus the first
token that differs (or the bonus token after the last draft). For a deterministic draft
(prompt lookup, a draft model's argmax for greedy and grammar rows) q is one-hot and this
is exactly the rejection rule: draft x is kept with probability p(x), and on rejection
the kept token is distributed as p conditioned on != x, i.e. norm(max(0, p - q)); the
tokens are the plain path's. A draft model's sampled rows draw their drafts from the
draft's own q (runtime/paths/draft.py), and the verify program gives their drafted
positions the standard rule instead (runtime/sampling.verify_draft): keep x with
probability min(1, p(x) / q(x)), else draw from norm(max(0, p - q)). That keeps
sum(min(p, q)) of the drafts rather than sum(p q), and the target's distribution, but
not the plain path's seeded tokens. A grammar-constrained row drafts only the prefix
its grammar accepts, and each position samples under the mask of the grammar advanced
over the drafts before it.

Per row the draft length adapts to its acceptance: all drafts kept grows it by one, a
rejection shrinks it to what was kept plus one, and a miss (no draft, or fewer tokens kept
than the verify step costs in decode steps) turns the row off (plain decode, which keeps
overlap scheduling) for a backoff that doubles with every miss in a row. Per batch,
speculation stops while the measured verify step costs more than the plain decode steps
its accepted tokens replace (a big batch's decode is compute-bound), and
is probed again now and then.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from runtime.grammar import valid_draft
from runtime.ngram import NgramDrafter
from runtime.request import Req

# A row off after `misses` misses in a row drafts again after 2**misses tokens (capped).
MAX_BACKOFF_LOG2 = 6
# Scheduling calls between probes while the cost model turns speculation off for the batch.
PROBE_EVERY = 16
# Weight of the newest step in the batch's mean tokens per verify row.
GAIN_SMOOTHING = 0.2
# Scheduling calls without speculation after a batch whose drafts were too few to pay.
COOL_DOWN = 4


class Drafter(Protocol):
    """Proposes up to k tokens after a sequence (prompt lookup: runtime/ngram.py)."""

    def draft(self, tokens: Sequence[int], k: int) -> list[int]: ...


class BatchDrafter(Protocol):
    """Proposes drafts for many requests at once and keeps state per request (a draft
    model: runtime/paths/draft.py), released when the request ends."""

    def draft_batch(self, reqs: Sequence[Req], limits: Sequence[int]) -> list[list[int]]: ...

    def release(self, rid: str) -> None: ...


@dataclasses.dataclass
class RowSpec:
    """One request's speculation state and counters (meta_info reads the counters)."""

    limit: int  # most tokens it may draft next step; 0 while off
    resume_at: int = 0  # num_generated at which an off row drafts again
    misses: int = 0
    verify_steps: int = 0
    drafted: int = 0
    accepted: int = 0

    def to_json(self) -> dict[str, float | int]:
        return {"spec_verify_steps": self.verify_steps, "spec_draft_tokens": self.drafted,
                "spec_accepted_tokens": self.accepted,
                "spec_accept_rate": self.accepted / self.drafted if self.drafted else 0.0,
                # tokens a verify step produced for this request, the bonus token included
                "spec_accept_length": (1 + self.accepted / self.verify_steps
                                       if self.verify_steps else 0.0)}


class SpecDecoding:
    """Draft lengths and the on/off decisions of one scheduler.

    num_draft_tokens: k, the most tokens a row drafts (the verify programs' k);
    max_rows: the largest batch the verify programs hold;
    costs(rows) -> (decode step s, verify step s) measured for that many rows, or None
    while either is unknown."""

    def __init__(self, num_draft_tokens: int, max_rows: int,
                 drafter: Drafter | BatchDrafter | None = None,
                 costs: Callable[[int], tuple[float, float] | None] | None = None) -> None:
        if num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens={num_draft_tokens} must be >= 1")
        self.k, self.max_rows = num_draft_tokens, max_rows
        self.drafter: Drafter | BatchDrafter = drafter or NgramDrafter()
        self.costs = costs
        self.rows: dict[str, RowSpec] = {}
        self._gain = float(num_draft_tokens + 1)  # mean tokens a drafting row yields
        # Measured verify step / decode step time of the last batch size asked about
        # (None: not measured yet).
        self.ratio: float | None = None
        self._cool = 0
        self._off_steps = 0
        # Totals since start (the /metrics counters): verify rows, drafted and accepted
        # tokens, and host seconds spent drafting (a draft model's steps and readback).
        self.total_steps = self.total_drafted = self.total_accepted = 0
        self.total_draft_s = 0.0

    # ---- rows ----------------------------------------------------------------------------

    def state(self, req: Req) -> RowSpec:
        if req.rid not in self.rows:
            self.rows[req.rid] = RowSpec(limit=self.k)
        return self.rows[req.rid]

    def eligible(self, req: Req) -> bool:
        """Whether req may draft this step. Penalties need the counts of every earlier
        token at each position, so penalised rows decode plainly."""
        sp = req.sampling
        if sp.frequency_penalty or sp.presence_penalty or sp.repetition_penalty != 1:
            return False
        st = self.state(req)
        return st.limit > 0 or req.num_generated >= st.resume_at

    def draft(self, req: Req) -> list[int]:
        return self.draft_all([req])[0]

    def draft_all(self, reqs: Sequence[Req]) -> list[list[int]]:
        """Each req's drafted tokens for this step (maybe []): at most its limit, and never
        past max_new_tokens (the verify step's bonus token is always one more)."""
        limits, rooms, drafting = [], [], []
        for req in reqs:
            rooms.append(req.sampling.max_new_tokens - req.num_generated - 1)
            drafting.append(self.eligible(req))
            if not drafting[-1]:
                limits.append(0)
                continue
            st = self.state(req)
            if st.limit == 0:  # backoff over: probe with one token
                st.limit = 1
            limits.append(max(0, min(st.limit, rooms[-1])))
        t0 = time.perf_counter()
        out = self._propose(reqs, limits)
        self.total_draft_s += time.perf_counter() - t0
        for i, req in enumerate(reqs):
            if not drafting[i]:
                continue
            if req.grammar is not None:
                out[i] = valid_draft(req.grammar, out[i])
            if not out[i] and rooms[i] > 0:
                self._miss(req, self.state(req))
        return out

    def _propose(self, reqs: Sequence[Req], limits: list[int]) -> list[list[int]]:
        d = self.drafter
        if hasattr(d, "draft_batch"):
            return d.draft_batch(reqs, limits)
        return [d.draft(req.all_ids, k) if k > 0 else [] for req, k in zip(reqs, limits,
                                                                              strict=True)]

    def observe(self, req: Req, drafted: int, accepted: int) -> None:
        """A verify step kept `accepted` of req's `drafted` tokens."""
        st = self.state(req)
        st.verify_steps += 1
        st.drafted += drafted
        st.accepted += accepted
        self.total_steps += 1
        self.total_drafted += drafted
        self.total_accepted += accepted
        if drafted == 0:
            return
        self._gain += GAIN_SMOOTHING * (1 + accepted - self._gain)
        # A step that kept fewer tokens than its cost in decode steps lost time: back off.
        if accepted == 0 or 1 + accepted < (self.ratio or 1.0):
            self._miss(req, st)
            return
        st.misses = 0
        st.limit = min(self.k, st.limit + 1) if accepted == drafted else accepted + 1

    def _miss(self, req: Req, st: RowSpec) -> None:
        st.misses += 1
        st.limit = 0
        st.resume_at = req.num_generated + (1 << min(st.misses, MAX_BACKOFF_LOG2))

    def forget(self, req: Req) -> RowSpec | None:
        """req ended (finished or aborted): its state, and the drafter's, let go."""
        release = getattr(self.drafter, "release", None)
        if release is not None:
            release(req.rid)
        return self.rows.pop(req.rid, None)

    # ---- batches -------------------------------------------------------------------------

    def batch_on(self, rows: int) -> bool:
        """Whether a batch of `rows` decode rows speculates: it fits the verify programs,
        and the verify step is measured to cost less than the decode steps it replaces (or
        is not measured yet, or it is time to probe again)."""
        if rows > self.max_rows:
            return False
        if self._cool:
            self._cool -= 1
            return False
        cost = self.costs(rows) if self.costs is not None else None
        if cost is None:
            return True
        decode_s, verify_s = cost
        self.ratio = verify_s / decode_s
        if verify_s < self._gain * decode_s:
            self._off_steps = 0
            return True
        self._off_steps += 1
        if self._off_steps >= PROBE_EVERY:
            self._off_steps = 0
            return True
        return False

    def worth(self, rows: int, drafting: int) -> bool:
        """Whether a verify step of `rows` rows, `drafting` of them with drafts, is expected
        to yield tokens faster than a decode step: the drafts it should keep exceed what
        the verify step costs beyond a decode step, in decode rows (rows x (ratio - 1)).
        If not, speculation pauses for COOL_DOWN scheduling calls (each try drains the
        overlapped pipeline)."""
        if self.ratio is None:
            return True
        if (self._gain - 1) * drafting > rows * (self.ratio - 1):
            return True
        self._cool = COOL_DOWN
        return False
