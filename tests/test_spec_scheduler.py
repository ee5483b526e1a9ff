"""Speculative decoding on the host: TARGET_VERIFY batches through the scheduler and the
fake runner (tests/fake_runner.py), whose tokens are right only if every page, rollback
and slot is; and the draft-length and on/off rules of runtime/spec_decode.py."""

from __future__ import annotations

import random

import numpy as np
import pytest

from models.forward_mode import ForwardMode
from runtime.request import Req, SamplingParams
from runtime.spec_decode import COOL_DOWN, PROBE_EVERY, SpecDecoding
from tests.fake_runner import (
    VOCAB,
    FakeRunner,
    check_invariants,
    drive,
    next_token,
    reference_output,
)
from tests.test_scheduler import assert_drained, make, run, workload


class OracleDrafter:
    """Drafts the fake model's own continuation, wrong from a random position on, so
    verify steps keep anything from none to all of their drafts."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)

    def draft(self, tokens: list[int], k: int) -> list[int]:
        seq, out = list(tokens), []
        for _ in range(k):
            tok = next_token(np.asarray(seq))
            out.append(tok)
            seq.append(tok)
        n = self.rng.randrange(0, k + 1)
        if n < k:
            out[n] = (out[n] + 1) % VOCAB
        return out[:self.rng.randrange(0, k + 1)]


def _spec(k: int = 4, **kw) -> SpecDecoding:
    return SpecDecoding(k, max_rows=8, drafter=OracleDrafter(**kw))


def _count_verify(runner: FakeRunner, monkeypatch) -> list[int]:
    seen: list[int] = []
    forward = runner.forward

    def counted(batch):
        if batch.mode is ForwardMode.TARGET_VERIFY:
            seen.append(len(batch.rows))
        return forward(batch)

    monkeypatch.setattr(runner, "forward", counted)
    return seen


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("pages", [400, 36], ids=["pool", "small_pool"])
def test_verify_batches_give_the_reference_tokens(overlap, pages, monkeypatch):
    sched, runner = make(num_pages=pages, chunked_prefill_size=16, max_running=16)
    sched.spec = _spec()
    seen = _count_verify(runner, monkeypatch)
    reqs = workload()
    streamed = run(sched, runner, reqs, overlap=overlap)
    for r in reqs:
        want = reference_output(r.prompt_ids, r.sampling.max_new_tokens, r.sampling.ignore_eos)
        assert r.output_ids == want, r.rid
        assert streamed[r.rid] == want
    assert seen
    spec = sched.spec
    assert spec.total_accepted > 0 and spec.total_accepted < spec.total_drafted
    if pages == 36:
        assert sched.stats().num_retractions > 0
    assert_drained(sched)


def test_aborts_while_verifying_free_everything(monkeypatch):
    sched, runner = make()
    sched.spec = _spec(seed=1)
    reqs = workload(seed=3)

    def abort_some(step: int) -> None:
        check_invariants(sched)
        if step in (6, 9, 14):
            victim = next((r for r in sched.running if r in sched._verifying), None)
            if victim is not None:
                sched.abort(victim.rid)

    for r in reqs:
        sched.add(r)
    drive(sched, runner, overlap=True, on_step=abort_some)
    assert any(r.finish_reason.kind == "abort" for r in reqs)
    for r in reqs:
        if r.finish_reason.kind != "abort":
            assert r.output_ids == reference_output(r.prompt_ids, r.sampling.max_new_tokens,
                                                    r.sampling.ignore_eos)
    assert_drained(sched)


def test_multi_step_and_speculation_alternate(monkeypatch):
    """With both on, batches whose rows draft nothing run as multi-step decode."""
    sched, runner = make(num_scheduler_steps=4)
    sched.spec = SpecDecoding(4, max_rows=8, drafter=_EveryOther())
    seen = _count_verify(runner, monkeypatch)
    steps = []
    forward = runner.forward
    monkeypatch.setattr(runner, "forward", lambda b: (steps.append(b.steps), forward(b))[1])
    reqs = workload(seed=4, n=6)
    run(sched, runner, reqs, overlap=False)
    for r in reqs:
        assert r.output_ids == reference_output(r.prompt_ids, r.sampling.max_new_tokens,
                                                r.sampling.ignore_eos)
    assert seen and 4 in steps
    assert_drained(sched)


class _EveryOther:
    """Right drafts on odd sequence lengths, none on even ones."""

    def draft(self, tokens: list[int], k: int) -> list[int]:
        return OracleDrafter(seed=len(tokens)).draft(tokens, k) if len(tokens) % 2 else []


def _req(n: int = 0, **sampling) -> Req:
    r = Req("a", [1, 2, 3], SamplingParams(**sampling))
    r.output_ids = [5] * n
    return r


def test_draft_length_adapts_and_backs_off():
    spec = SpecDecoding(4, max_rows=8, drafter=_Fixed())
    r = _req(1)
    assert spec.state(r).limit == 4
    spec.observe(r, 4, 1)  # one kept: next time kept + 1
    assert spec.state(r).limit == 2
    spec.observe(r, 2, 2)  # all kept: grow
    assert spec.state(r).limit == 3
    spec.observe(r, 3, 0)  # none kept: off for 2 tokens
    assert spec.state(r).limit == 0 and not spec.eligible(r)
    r.output_ids += [5, 5]
    assert spec.eligible(r)
    assert spec.draft(r) == [9]  # probing again with one token
    spec.observe(r, 1, 0)  # a second miss: off for 4 tokens
    assert spec.state(r).resume_at == r.num_generated + 4
    assert spec.state(r).to_json()["spec_accept_rate"] == pytest.approx(3 / 10)


def test_penalties_and_max_tokens_limit_drafts():
    spec = SpecDecoding(4, max_rows=8, drafter=_Fixed())
    r = _req(1, max_new_tokens=3)  # 1 generated, the bonus token: one draft at most
    assert spec.draft(r) == [9]
    p = _req(1, repetition_penalty=1.2)
    assert not spec.eligible(p) and spec.draft(p) == []


class _Fixed:
    def draft(self, tokens: list[int], k: int) -> list[int]:
        return [9] * k


def test_cost_model_turns_big_batches_off_and_probes():
    costs = {2: (0.01, 0.012), 8: (0.01, 0.08)}
    spec = SpecDecoding(4, max_rows=8, costs=costs.get)
    assert spec.batch_on(2)  # a verify step costs less than the tokens it yields
    assert not spec.batch_on(9)  # no verify program holds 9 rows
    off = [spec.batch_on(8) for _ in range(PROBE_EVERY)]
    assert not any(off[:-1]) and off[-1]  # compute-bound; probed every PROBE_EVERY calls
    assert spec.batch_on(4)  # unmeasured: on


def test_grammar_cuts_drafts_and_masks_each_position():
    """A grammar row drafts only what its grammar accepts, and each verify position
    samples under the grammar advanced over the drafts before it (then rolled back)."""
    from runtime.grammar import GrammarSpec, draft_bitmasks, fill_bitmask, valid_draft
    from tests.test_grammar import _cache, _ids

    g = _cache().matcher(GrammarSpec("regex", "yes no yes"))
    good = _ids("yes no")
    assert valid_draft(g, good + _ids(" maybe")) == good
    masks = draft_bitmasks(g, good, 49152)  # [len(good) + 1, W]
    assert masks.shape[0] == len(good) + 1
    for j, tok in enumerate(good):
        assert masks[j, tok // 32] >> (tok % 32) & 1  # the draft's own token is allowed
    assert (fill_bitmask([g], 49152)[0] == masks[0]).all()  # the draft was rolled back
    assert not (masks[1] == masks[0]).all()


def test_metrics_export_acceptance():
    from runtime.metrics import ServerMetrics

    spec = SpecDecoding(4, max_rows=8)
    r = _req(1)
    spec.observe(r, 4, 3)
    spec.observe(r, 2, 0)
    m = ServerMetrics()
    m.spec = spec
    text = m.render().decode()
    assert "xlaserve_spec_draft_tokens_total 6.0" in text
    assert "xlaserve_spec_accepted_tokens_total 3.0" in text
    assert "xlaserve_spec_accept_rate 0.5" in text
    assert "xlaserve_spec_accept_length 2.5" in text


def test_a_batch_speculates_only_when_its_drafts_pay():
    costs = {8: (0.1, 0.15)}  # a verify step costs half a decode step more
    spec = SpecDecoding(4, max_rows=8, costs=costs.get)
    assert spec.worth(8, 1)  # unmeasured: on
    assert spec.batch_on(8) and spec.ratio == pytest.approx(1.5)
    assert spec.worth(8, 8)  # 8 rows x 4 expected kept drafts > 8 x 0.5
    spec._gain = 2.0  # one kept draft a drafting row
    assert spec.worth(8, 5) and not spec.worth(8, 3)
    assert [spec.batch_on(8) for _ in range(COOL_DOWN + 1)] == [False] * COOL_DOWN + [True]
