"""A step's host inputs travel as one int32 vector each (the forward's packed arrays and
row slots; the sampler's row slots, sample mask and SamplingBatch), and the sampler's is
reused across steps of the same rows. Host tests: no program runs here."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from runtime import runner_sampling, sampling, slot_state
from runtime.batch_builder import (
    BucketShape,
    flatten_inputs,
    input_layout,
    pack_flat,
    pack_rows,
    unflatten_inputs,
)
from runtime.grammar import mask_width
from runtime.request import MAX_LOGIT_BIAS, Req, SamplingParams
from runtime.schedule_batch import BatchRow

VOCAB = 100


def test_flat_forward_inputs_round_trip():
    shape = BucketShape(8, 2, 3, 4)
    extend = [BatchRow(Req("a", [1, 2, 3]), [1, 2, 3], 0, [5], True),
              BatchRow(Req("b", [4, 5]), [4, 5], 0, [6], True)]
    decode = [BatchRow(Req("c", [7]), [9], 6, [7, 8], True)]
    arrays = pack_rows(extend, decode, shape, page_size=4)
    slots = np.arange(5, dtype=np.int32) + 10
    for dp in (1, 2):
        layout = input_layout(shape, dp)
        if dp == 2:  # two ranks' pieces, rank after rank (dp_pack's layout)
            arrays = {k: np.concatenate([v, v + 100]) for k, v in arrays.items()}
            slots = np.concatenate([slots, slots + 100])
        flat = flatten_inputs(arrays, slots, layout)
        assert flat.dtype == np.int32 and flat.ndim == 1
        back = unflatten_inputs(flat, layout)
        np.testing.assert_array_equal(back.pop("row_slots"), slots)
        assert back.keys() == arrays.keys()
        for name, a in arrays.items():
            np.testing.assert_array_equal(back[name], a, err_msg=name)
    with pytest.raises(ValueError, match="page_table"):
        flatten_inputs({**arrays, "page_table": arrays["page_table"][:, :2]}, slots, layout)
    # pack_flat writes the same vector without the arrays in between
    slots = np.arange(5, dtype=np.int32) + 10
    np.testing.assert_array_equal(
        pack_flat(extend, decode, shape, 4, slots),
        flatten_inputs(pack_rows(extend, decode, shape, 4), slots, input_layout(shape)))
    with pytest.raises(ValueError, match="one token"):
        pack_rows([], [BatchRow(Req("d", [7]), [1, 2], 6, [7, 8], True)], shape, 4)


def _batch(b: int) -> sampling.SamplingBatch:
    rng = np.random.default_rng(0)
    return sampling.SamplingBatch.create(
        b, mask_width=4, bias_slots=2,
        temperature=rng.random(b - 1), top_k=rng.integers(-1, 50, b - 1),
        top_p=rng.random(b - 1), min_p=rng.random(b - 1),
        frequency_penalty=-rng.random(b - 1), presence_penalty=rng.random(b - 1),
        repetition_penalty=1 + rng.random(b - 1),
        seed=[2**32 - 1, 0, 2**31, 7][:b - 1], step=[0, 3, 9, 2**30][:b - 1],
        logprobs=[True, False, True, False][:b - 1],
        token_bitmask=rng.integers(-2**31, 2**31, (b - 1, 4), dtype=np.int64).astype(np.int32),
        bias_ids=[[3, -1]] * (b - 1), bias_values=[[-1.5, 0.0]] * (b - 1))


def test_sampling_words_round_trip_every_bit():
    sp = _batch(5)
    words = sp.to_words()
    assert words.dtype == np.int32
    assert len(words) == sampling.word_count(5, 4, 2)
    back = sampling.SamplingBatch.from_words(words, 5, mask_width=4, bias_slots=2)
    for f in dataclasses.fields(sp):
        got, want = np.asarray(getattr(back, f.name)), np.asarray(getattr(sp, f.name))
        assert got.dtype == want.dtype, f.name
        np.testing.assert_array_equal(got, want, err_msg=f.name)


class _Grammar:
    """What constraint_columns reads of a request's grammar, with a mask that moves."""

    def __init__(self) -> None:
        self.allowed = 0


def _fake_fill(grammars, vocab_size):
    mask = np.full((len(grammars), mask_width(vocab_size)), -1, np.int32)
    for i, g in enumerate(grammars):
        if g is not None:
            mask[i] = 0
            mask[i, 0] = 1 << g.allowed
    return mask


class _Launch(runner_sampling.SamplingLaunch):
    """The attributes of ModelRunner that sample_words reads."""

    def __init__(self) -> None:
        self.model_cfg = dataclasses.make_dataclass("Cfg", ["vocab_size"])(VOCAB)
        self.max_running = 8
        self._words_cache = None


def _fresh(launch: _Launch, padded: list[BatchRow | None]) -> np.ndarray:
    slots, mask = launch.slots_of(padded)
    return np.concatenate([slots, mask.astype(np.int32),
                           launch.sampling_batch(len(padded), padded).to_words()])


def test_cached_sampler_words_equal_fresh_ones_step_after_step(monkeypatch):
    monkeypatch.setattr(slot_state, "fill_bitmask", _fake_fill)
    launch = _Launch()

    def req(rid: str, slot: int, **sp) -> Req:
        return Req(rid, [1, 2, 3], SamplingParams(**sp), req_slot=slot, rng_seed=slot + 40)

    a = req("a", 0, temperature=0.7, top_k=5)
    b = req("b", 1, logit_bias=((4, 2.0),), logprobs=True)
    g = req("g", 2, temperature=0.0)
    g.grammar = _Grammar()
    rows = {r.rid: r for r in (a, b, g)}

    def step(pos: int, order: str, sample: bool = True) -> list[BatchRow | None]:
        padded = [None if c == "-" else BatchRow(rows[c], [-1], pos, [1, 2], sample)
                  for c in order]
        got = launch.sample_words(padded)
        np.testing.assert_array_equal(got, _fresh(launch, padded))
        return got

    first = step(5, "ab-")
    cached = launch._words_cache[1]
    second = step(6, "ab-")  # same rows: served from the cache, only the steps move
    assert launch._words_cache[1] is cached
    b_ = len("ab-")
    lay = sampling.word_layout(b_, mask_width(VOCAB), MAX_LOGIT_BIAS)
    s0 = 2 * b_ + lay["step"][0]
    assert list(second[s0:s0 + 3]) == [7, 7, 0] and list(first[s0:s0 + 3]) == [6, 6, 0]
    second[0] = 99  # a caller's vector is its own: the cache never hands out its array
    step(7, "ab-")
    step(7, "ba-")  # the same requests in other rows
    step(8, "abg")
    cached = launch._words_cache[1]
    g.grammar.allowed = 5  # the grammar advanced: the cached rows take its new mask
    step(9, "abg")
    assert launch._words_cache[1] is cached
    step(10, "abg", sample=False)  # a non-sampling chunk of the same requests
    a.req_slot = 3  # resumed in another slot
    step(11, "abg")
    rows["a"] = req("a", 3, temperature=0.2)  # a new request object in the same slot
    step(12, "abg")


def test_multi_step_inputs_list_every_page_their_steps_write():
    """A multi-step batch (runtime/multi_step.py): each row's page table covers the
    positions of all its steps, its step count follows the plain vector, and the bucket's
    sequence length fits its last step's context."""
    from models.forward_mode import ForwardMode
    from runtime.bucket_plan import BucketPlan
    from runtime.config import RunnerConfig
    from runtime.multi_step import pack_steps
    from runtime.schedule_batch import ScheduleBatch

    rows = [BatchRow(Req("a", [1]), [5], 6, [7, 8, 9], True, num_steps=4),  # 6..9
            BatchRow(Req("b", [1]), [-1], 3, [4, 2], True, num_steps=2)]    # 3..4
    plan = BucketPlan(RunnerConfig(decode_buckets=(4,), kv_len_buckets=(8, 16)), page_size=4)
    shape = plan.bucket_for(ScheduleBatch(ForwardMode.DECODE, [], rows, steps=4))
    assert shape == BucketShape(0, 0, 4, 4)  # decode takes the widest table: 16 tokens
    late = [dataclasses.replace(rows[0], start_pos=14, pages=[7, 8, 9, 10, 11])]
    with pytest.raises(ValueError, match="sequence length=17"):  # the last step's context
        plan.bucket_for(ScheduleBatch(ForwardMode.DECODE, [], late, steps=4))
    slots = np.arange(4, dtype=np.int32)
    flat = pack_flat([], rows, shape, 4, slots)
    plain = unflatten_inputs(flat.copy(), input_layout(shape))
    packed = pack_steps(flat, rows, shape, 4)
    n = len(flat)
    np.testing.assert_array_equal(packed[n:], [4, 2, 0, 0])
    arrays = unflatten_inputs(packed[:n], input_layout(shape))
    np.testing.assert_array_equal(arrays["page_table"][:2], [[7, 8, 9, 0], [4, 2, 0, 0]])
    for name in ("input_ids", "positions", "out_cache_loc", "seq_lens", "row_slots"):
        np.testing.assert_array_equal(arrays[name], plain[name], err_msg=name)
    with pytest.raises(ValueError, match="need 3 pages"):
        pack_steps(flat, rows, BucketShape(0, 0, 4, 2), 4)
