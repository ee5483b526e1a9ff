"""Sampler tests against small NumPy references; the logits are fixed, so results are exact."""

from __future__ import annotations

from typing import TypeVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from runtime.sampling import (
    SampleOutput,
    SamplingBatch,
    apply_penalties,
    draft_sample,
    sample,
    update_token_counts,
    verify_draft,
)

Tree = TypeVar("Tree")


def _logits(batch: int, vocab: int, seed: int = 0, scale: float = 2.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((batch, vocab)) * scale).astype(np.float32)


def _rows(tree: Tree, index: np.ndarray | list[int]) -> Tree:
    """Rows `index` of every array in a pytree, e.g. a (logits, params, counts, mask) case."""
    return jax.tree.map(lambda a: np.asarray(a)[index], tree)


def _sample(
    logits: np.ndarray,  # [B, V]
    params: SamplingBatch,
    counts: np.ndarray | None = None,  # [B, V] i32
    prompt_mask: np.ndarray | None = None,  # [B, V] bool
    **static: int | bool,
) -> SampleOutput:
    if counts is None:
        counts = np.zeros(logits.shape, np.int32)
    if prompt_mask is None:
        prompt_mask = np.zeros(logits.shape, bool)
    # Row i reads slot i of the per-slot state.
    out = sample(jnp.asarray(logits), params, jnp.asarray(counts), jnp.asarray(prompt_mask),
                 jnp.arange(len(logits), dtype=jnp.int32), **static)
    return jax.tree.map(np.asarray, out)


def _reference_probs(
    row: np.ndarray,  # [V] penalized logits
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
) -> np.ndarray:
    """Float64 distribution after temperature, top-k, renormalized top-p and min-p."""
    z = row.astype(np.float64) / temperature  # [V]
    keep = np.ones(len(z), bool)
    if 0 < top_k < len(z):
        keep &= z >= np.sort(z)[::-1][top_k - 1]
    p = np.where(keep, np.exp(z - z.max()), 0.0)  # [V]
    p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        above = np.cumsum(p[order]) - p[order]  # mass ranked above each token
        keep &= z >= z[order[max(np.sum(above < top_p), 1) - 1]]
    if min_p > 0.0:
        keep &= p >= min_p * p.max()
    p = np.where(keep, p, 0.0)
    return p / p.sum()


def _reference_penalties(
    logits: np.ndarray,  # [B, V]
    counts: np.ndarray,  # [B, V]
    prompt_mask: np.ndarray,  # [B, V]
    frequency: list[float],
    presence: list[float],
    repetition: list[float],
) -> np.ndarray:
    out = logits.astype(np.float64).copy()
    for b in range(out.shape[0]):
        for t in range(out.shape[1]):
            if prompt_mask[b, t] or counts[b, t] > 0:
                r = repetition[b]
                out[b, t] = out[b, t] / r if out[b, t] > 0 else out[b, t] * r
            out[b, t] -= frequency[b] * counts[b, t] + presence[b] * (counts[b, t] > 0)
    return out


@pytest.mark.parametrize("all_greedy", [True, False])
def test_greedy_is_argmax_with_ties_to_lowest_id(all_greedy: bool) -> None:
    """Greedy rows take the argmax both on the all-greedy fast path and on the general
    path (one row with a temperature sends the whole batch there)."""
    logits = _logits(6, 1000)
    logits[2, [300, 260, 999]] = logits[2].max() + 1.0  # a tie within and across blocks
    temperature = [0.0] * 5 + [0.0 if all_greedy else 1.0]
    out = _sample(logits, SamplingBatch.create(6, temperature=temperature, seed=range(6)))
    expected = np.argmax(logits, axis=-1)
    expected[5] = out.next_tokens[5]  # the sampled row, if any
    assert expected[2] == 260
    np.testing.assert_array_equal(out.next_tokens, expected)


def test_top_k_one_and_tiny_top_p_equal_greedy() -> None:
    logits = _logits(8, 700, seed=1)
    top_k_one = SamplingBatch.create(8, temperature=[1.5] * 8, top_k=[1] * 8, seed=range(8))
    tiny_top_p = SamplingBatch.create(8, temperature=[1.5] * 8, top_p=[1e-6] * 8, seed=range(8))
    expected = np.argmax(logits, axis=-1)
    np.testing.assert_array_equal(_sample(logits, top_k_one).next_tokens, expected)
    np.testing.assert_array_equal(_sample(logits, tiny_top_p).next_tokens, expected)


def test_same_seed_and_step_repeat_other_seeds_and_steps_differ() -> None:
    logits = np.repeat(_logits(1, 500, seed=2, scale=0.5), 16, axis=0)  # a flat distribution
    params = SamplingBatch.create(16, temperature=[1.0] * 16, seed=[7] * 8 + list(range(8)))
    tokens = _sample(logits, params).next_tokens
    again = _sample(logits, params).next_tokens
    np.testing.assert_array_equal(tokens, again)
    assert len(set(tokens[:8])) == 1  # seed 7 at step 0 eight times
    assert len(set(tokens[8:])) > 4  # eight different seeds
    later = _sample(logits, params.replace(step=np.full(16, 3, np.int32))).next_tokens
    assert len(set(later[:8])) == 1 and later[0] != tokens[0]


def _mixed_rows(vocab: int) -> tuple[np.ndarray, SamplingBatch, np.ndarray, np.ndarray]:
    """Ten rows covering every parameter, including rows beyond the 64 candidates."""
    n = 10
    logits = _logits(n, vocab, seed=3, scale=3.0)
    rng = np.random.default_rng(4)
    counts = (rng.random((n, vocab)) < 0.02).astype(np.int32) * rng.integers(1, 4, (n, vocab))
    prompt_mask = rng.random((n, vocab)) < 0.05
    params = SamplingBatch.create(
        n,
        temperature=[0.0, 0.7, 1.0, 1.0, 0.9, 1.2, 0.0, 0.8, 1.0, 1.0],
        top_k=[0, 0, 20, 0, 0, 0, 0, 10, 200, 0],
        top_p=[1.0, 1.0, 1.0, 0.7, 1.0, 1.0, 1.0, 0.9, 1.0, 0.99],
        min_p=[0.0, 0.0, 0.0, 0.0, 0.1, 0.0, 0.0, 0.05, 0.0, 0.0],
        frequency_penalty=[0.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.3, 0.0, 0.0, 0.0],
        presence_penalty=[0.0, 0.0, 0.0, 0.0, 0.0, 0.4, 0.0, 0.2, 0.0, 0.0],
        repetition_penalty=[1.0, 1.0, 1.0, 1.0, 1.0, 1.3, 1.2, 1.1, 1.0, 1.0],
        seed=[11, 12, 13, 14, 15, 16, 17, 18, 19, 20],
        step=[0, 1, 2, 3, 4, 5, 6, 7, 8, 9],
        logprobs=[True] * n,
    )
    return logits, params, counts, prompt_mask


def test_each_row_of_a_mixed_batch_equals_the_row_alone() -> None:
    case = _mixed_rows(vocab=3000)
    batch = _sample(*case, num_top_logprobs=5)
    # The same rows reversed, then padded with six neutral rows into a bigger bucket.
    order = np.arange(9, -1, -1)
    neutral = (
        np.zeros((6, 3000), np.float32),
        SamplingBatch.create(6),
        np.zeros((6, 3000), np.int32),
        np.zeros((6, 3000), bool),
    )
    bigger = jax.tree.map(lambda a, pad: np.concatenate([a, pad]), _rows(case, order), neutral)
    shuffled = _sample(*bigger, num_top_logprobs=5)
    for i in range(10):
        alone = _sample(*_rows(case, [i]), num_top_logprobs=5)
        position = int(np.flatnonzero(order == i)[0])
        for out, j in ((alone, 0), (shuffled, position)):
            assert out.next_tokens[j] == batch.next_tokens[i], f"row {i}"
            np.testing.assert_array_equal(out.logprobs[j], batch.logprobs[i])
            np.testing.assert_array_equal(out.top_ids[j], batch.top_ids[i])


@pytest.mark.parametrize("tiers", [(), (2,), (2, 30)])
def test_every_candidate_ladder_gives_the_same_tokens(tiers: tuple[int, ...]) -> None:
    # () sorts every row; (2,) resolves almost nothing from candidates; (2, 30) adds a rung.
    case = _mixed_rows(vocab=3000)
    default = _sample(*case)
    np.testing.assert_array_equal(
        _sample(*case, candidate_tiers=tiers).next_tokens, default.next_tokens
    )


def test_tokens_stay_in_the_reference_kept_set() -> None:
    case = _mixed_rows(vocab=3000)
    logits, params, counts, prompt_mask = case
    penalized = np.asarray(apply_penalties(logits, params, counts, prompt_mask))
    n = 256  # each sampled row repeated under n seeds
    for i in np.flatnonzero(params.temperature > 0):
        logits_i, params_i, counts_i, mask_i = _rows(case, np.full(n, i))
        params_i = params_i.replace(seed=np.arange(n, dtype=np.uint32))
        tokens = _sample(logits_i, params_i, counts_i, mask_i).next_tokens
        probs = _reference_probs(
            penalized[i], params.temperature[i], params.top_k[i], params.top_p[i], params.min_p[i]
        )
        assert np.all(probs[tokens] > 0), f"row {i} drew a filtered token"
        assert len(set(tokens.tolist())) > 1, f"row {i} never varied"


CASES = {
    "temperature": dict(temperature=0.7),
    "top_k": dict(temperature=1.0, top_k=4),
    "top_p": dict(temperature=1.0, top_p=0.8),
    "min_p": dict(temperature=1.3, min_p=0.2),
    "all_filters": dict(temperature=0.9, top_k=6, top_p=0.9, min_p=0.05),
}


@pytest.mark.parametrize("case", CASES)
def test_empirical_distribution_matches_reference(case: str) -> None:
    # Ten live tokens spread over three blocks of the two-level draw (V = 600 is padded).
    vocab, n = 600, 4000
    live = np.array([3, 90, 255, 256, 300, 411, 512, 513, 555, 599])
    row = np.full(vocab, -40.0, np.float32)
    row[live] = np.linspace(1.5, -1.0, len(live))
    kw = CASES[case]
    params = SamplingBatch.create(
        n, **{k: [v] * n for k, v in kw.items()}, seed=np.arange(n) * 7919, step=np.arange(n) % 5
    )
    tokens = _sample(np.repeat(row[None], n, axis=0), params).next_tokens
    probs = _reference_probs(row, **kw)
    observed = np.bincount(tokens, minlength=vocab)
    assert observed[probs == 0].sum() == 0
    expected = probs[probs > 0] * n
    chi2 = np.sum((observed[probs > 0] - expected) ** 2 / expected)
    assert chi2 < 30.0, f"chi-square {chi2:.1f} over {len(expected)} tokens"  # p ~ 1e-3 at df 9


def _chi2(observed: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * observed.sum()
    assert observed[probs == 0].sum() == 0
    live = probs > 0
    return float(np.sum((observed[live] - expected[live]) ** 2 / expected[live]))


def test_speculative_rule_keeps_the_target_distribution() -> None:
    """A draft drawn from q (draft_sample), judged by verify_draft: the tokens follow the
    target's p (top-k applied to both), drafts are kept at the rate sum(min(p, q)), and
    the same samples with the residual replaced by p (a wrong rule) fail the test."""
    vocab, n = 12, 20000
    rng = np.random.default_rng(1)
    target, drafter = (rng.standard_normal(vocab) * 1.5).astype(np.float32), \
        (rng.standard_normal(vocab) * 1.5).astype(np.float32)
    kw = dict(temperature=0.9, top_k=7)
    params = SamplingBatch.create(n, **{k: [v] * n for k, v in kw.items()},
                                  seed=np.arange(n) * 7919, step=np.arange(n) % 3 + 5)
    p, q = _reference_probs(target, **kw), _reference_probs(drafter, **kw)
    drafts, q_rows = jax.jit(draft_sample)(np.tile(drafter, (n, 1)), params,
                                           np.ones(n, bool))
    drafts = np.asarray(drafts)
    np.testing.assert_allclose(np.asarray(q_rows[0]), q, atol=1e-6)
    assert _chi2(np.bincount(drafts, minlength=vocab), q) < 32.0  # p ~ 1e-3 at df 6
    tokens = np.asarray(jax.jit(verify_draft)(np.tile(target, (n, 1)), params, q_rows,
                                              drafts))
    assert _chi2(np.bincount(tokens, minlength=vocab), p) < 32.0
    kept = tokens == drafts  # a rejection never redraws the draft: p(x) < q(x) there
    assert abs(kept.mean() - np.minimum(p, q).sum()) < 4 * np.sqrt(0.25 / n)
    wrong = np.where(kept, tokens, rng.choice(vocab, size=n, p=p))
    assert _chi2(np.bincount(wrong, minlength=vocab), p) > 100.0
    # Greedy rows of the draft take the raw argmax and leave q unused.
    greedy, _ = draft_sample(target[None], SamplingBatch.create(1), np.zeros(1, bool))
    assert int(greedy[0]) == int(np.argmax(target))


def test_min_p_keeps_exactly_the_tokens_above_the_threshold() -> None:
    row = np.log(np.array([0.4, 0.2, 0.15, 0.1, 0.07, 0.05, 0.03], np.float32))
    n = 2000
    params = SamplingBatch.create(n, temperature=[1.0] * n, min_p=[0.3] * n, seed=range(n))
    tokens = _sample(np.repeat(row[None], n, axis=0), params).next_tokens
    assert set(tokens.tolist()) == {0, 1, 2}  # p >= 0.3 * 0.4 = 0.12


def test_penalties_match_numpy_reference() -> None:
    batch, vocab = 4, 50
    logits = _logits(batch, vocab, seed=5)
    rng = np.random.default_rng(6)
    counts = rng.integers(0, 3, (batch, vocab)).astype(np.int32) * (
        rng.random((batch, vocab)) < 0.3
    )
    prompt_mask = rng.random((batch, vocab)) < 0.2
    frequency, presence, repetition = (
        [0.0, 0.5, 0.0, 0.2],
        [0.0, 0.0, 0.7, 0.3],
        [1.0, 1.0, 1.5, 0.8],
    )
    params = SamplingBatch.create(
        batch,
        frequency_penalty=frequency,
        presence_penalty=presence,
        repetition_penalty=repetition,
    )
    got = np.asarray(apply_penalties(logits, params, counts, prompt_mask))
    ref = _reference_penalties(logits, counts, prompt_mask, frequency, presence, repetition)
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(got[0], logits[0])  # neutral row: bit-identical
    out = _sample(logits, params, counts, prompt_mask)
    np.testing.assert_array_equal(out.next_tokens, np.argmax(ref, -1))
    # The runner passes every slot's state and each row's slot: rows read their own slot's
    # counts and prompt mask (here in reverse order, among spare slots).
    slots = np.array([5, 3, 1, 0], np.int32)
    all_counts = np.zeros((6, vocab), np.int32)
    all_mask = np.zeros((6, vocab), bool)
    all_counts[slots], all_mask[slots] = counts, prompt_mask
    by_slot = sample(jnp.asarray(logits), params, jnp.asarray(all_counts),
                     jnp.asarray(all_mask), jnp.asarray(slots))
    np.testing.assert_array_equal(np.asarray(by_slot.next_tokens), np.argmax(ref, -1))


def test_logprobs_are_the_raw_log_softmax() -> None:
    logits = _logits(5, 400, seed=8)
    params = SamplingBatch.create(
        5, temperature=[0.0, 1.0, 0.5, 2.0, 1.0], top_k=[0, 0, 3, 0, 0], seed=range(5),
        logprobs=[False, True, False, False, False],  # one row asking computes all rows
    )
    counts = np.ones(logits.shape, np.int32)
    params = params.replace(frequency_penalty=np.full(5, 0.7, np.float32))  # must not matter
    out = _sample(logits, params, counts, num_top_logprobs=20)
    log_softmax = np.asarray(jax.nn.log_softmax(jnp.asarray(logits), axis=-1))
    expected_ids = np.argsort(-log_softmax, axis=-1, kind="stable")[:, :20]
    np.testing.assert_array_equal(out.top_ids, expected_ids)
    top = np.take_along_axis(log_softmax, expected_ids, axis=-1)
    np.testing.assert_allclose(out.top_logprobs, top, rtol=1e-6, atol=1e-6)
    chosen = np.take_along_axis(log_softmax, out.next_tokens[:, None], axis=-1)[:, 0]
    np.testing.assert_allclose(out.logprobs, chosen, rtol=1e-6, atol=1e-6)
    assert _sample(logits, params).top_ids.shape == (5, 0)
    # No row asks: the pass is skipped (zeros), the tokens do not change.
    silent = _sample(logits, params.replace(logprobs=np.zeros(5, bool)), counts,
                     num_top_logprobs=20)
    np.testing.assert_array_equal(silent.next_tokens, out.next_tokens)
    assert not np.asarray(silent.logprobs).any() and not np.asarray(silent.top_ids).any()


def test_changing_parameter_values_does_not_recompile() -> None:
    logits, params, counts, prompt_mask = _mixed_rows(vocab=512)
    _sample(logits, params, counts, prompt_mask, num_top_logprobs=4)
    compiled = sample._cache_size()
    rng = np.random.default_rng(9)
    for trial in range(4):
        varied = SamplingBatch.create(
            10,
            temperature=rng.choice([0.0, 0.5, 1.0], 10),
            top_k=rng.choice([0, 1, 5, 300], 10),
            top_p=rng.choice([1.0, 0.5, 0.999], 10),
            min_p=rng.choice([0.0, 0.1], 10),
            frequency_penalty=rng.random(10),
            presence_penalty=rng.random(10),
            repetition_penalty=1.0 + rng.random(10),
            seed=rng.integers(0, 2**32, 10),
            step=np.full(10, trial),
        )
        _sample(logits, varied, counts, prompt_mask, num_top_logprobs=4)
    assert sample._cache_size() == compiled


def test_update_token_counts_adds_tokens_and_drops_padding_slots() -> None:
    slots_total, vocab = 4, 12
    counts = np.zeros((slots_total, vocab), np.int32)
    counts[1, 5] = 2
    slots = np.array([1, 3, 0, slots_total, slots_total], np.int32)  # two padding rows
    tokens = np.array([5, 0, 11, 7, 7], np.int32)
    got = np.asarray(update_token_counts(jnp.asarray(counts), slots, tokens))
    expected = counts.copy()
    expected[[1, 3, 0], [5, 0, 11]] += 1
    np.testing.assert_array_equal(got, expected)


def test_create_pads_with_greedy_unpenalized_rows() -> None:
    params = SamplingBatch.create(4, temperature=[0.5], top_k=[5], seed=[2**32 - 1])
    np.testing.assert_array_equal(params.temperature, [0.5, 0.0, 0.0, 0.0])
    np.testing.assert_array_equal(params.repetition_penalty, [1.0] * 4)
    assert params.seed.dtype == np.uint32 and params.top_k.dtype == np.int32
    with pytest.raises(TypeError, match="unknown"):
        SamplingBatch.create(2, temprature=[1.0])
    with pytest.raises(ValueError, match="at most 2"):
        SamplingBatch.create(2, top_p=[1.0, 1.0, 1.0])


# ---- grammar bitmask and logit bias ---------------------------------------------------------


def _bitmask(allowed: list[list[int] | None], vocab: int) -> np.ndarray:
    """llguidance's layout: bit t % 32 of int32 word t // 32; None = every token."""
    words = np.full((len(allowed), (vocab + 31) // 32), -1, np.int32)
    for i, ids in enumerate(allowed):
        if ids is not None:
            bits = np.zeros(words.shape[1] * 32, bool)
            bits[ids] = True
            words[i] = np.packbits(bits.reshape(-1, 32)[:, ::-1], axis=1).view(">i4")[:, 0]
    return words


def test_bitmask_restricts_greedy_and_sampled_rows_only():
    vocab = 300  # not a multiple of 32: the last word's spare bits are ignored
    logits = _logits(4, vocab, seed=3)
    allowed = [[5, 77, 299], None, [290], None]
    params = SamplingBatch.create(4, mask_width=10, temperature=[0.0, 0.0, 1.0, 1.0],
                                  seed=[1, 2, 3, 4], token_bitmask=_bitmask(allowed, vocab))
    out = _sample(logits, params)
    assert out.next_tokens[0] == max([5, 77, 299], key=lambda t: logits[0, t])
    assert out.next_tokens[2] == 290
    free = _sample(logits, SamplingBatch.create(4, mask_width=10, temperature=[0.0, 0.0, 1.0, 1.0],
                                                seed=[1, 2, 3, 4]))
    # Unconstrained rows draw what they draw alone: the mask is per row.
    np.testing.assert_array_equal(out.next_tokens[[1, 3]], free.next_tokens[[1, 3]])
    for s in range(20):  # every sampled token of a constrained row is allowed
        p = SamplingBatch.create(4, mask_width=10, temperature=[1.0] * 4, step=[s] * 4,
                                 token_bitmask=_bitmask(allowed, vocab))
        assert _sample(logits, p).next_tokens[0] in (5, 77, 299)


def test_logit_bias_is_sparse_per_row():
    logits = _logits(3, 64, seed=4)
    ids = np.array([[7, -1], [-1, -1], [3, 9]], np.int32)
    values = np.array([[100.0, 0.0], [0.0, 0.0], [-100.0, 100.0]], np.float32)
    params = SamplingBatch.create(3, bias_slots=2, bias_ids=ids, bias_values=values)
    out = _sample(logits, params, num_top_logprobs=1)
    assert out.next_tokens.tolist()[0] == 7 and out.next_tokens.tolist()[2] == 9
    assert out.next_tokens[1] == np.argmax(logits[1])
    # Logprobs stay those of the raw model distribution.
    none = _sample(logits, SamplingBatch.create(3, bias_slots=2), num_top_logprobs=1)
    np.testing.assert_array_equal(out.top_ids, none.top_ids)


def test_mask_and_bias_run_in_one_trace():
    """Constrained, biased and plain batches of one shape share one compiled program."""
    vocab = 96
    logits = jnp.asarray(_logits(2, vocab))
    zeros = jnp.zeros((2, vocab), jnp.int32), jnp.zeros((2, vocab), bool), jnp.arange(2)
    batches = [SamplingBatch.create(2, mask_width=3, bias_slots=2),
               SamplingBatch.create(2, mask_width=3, bias_slots=2,
                                    token_bitmask=_bitmask([[1], None], vocab)),
               SamplingBatch.create(2, mask_width=3, bias_slots=2, bias_ids=[[4, -1]],
                                    bias_values=[[50.0, 0.0]])]
    compiled = sample.lower(logits, batches[0], *zeros).compile()
    got = [int(compiled(logits, b, *zeros).next_tokens[0]) for b in batches]
    assert got[1:] == [1, 4]
