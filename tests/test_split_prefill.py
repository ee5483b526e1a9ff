"""SPLIT_PREFILL: an extend batch run a few layers per call equals the one-shot EXTEND,
in its logits and in the K/V it leaves in the pool, on every attention backend, fresh or
over a cached prefix, whatever the interval sizes."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from models import llama
from runtime.batch_builder import pack_rows
from runtime.config import CacheConfig, RunnerConfig
from runtime.forward_mode import ForwardMode
from runtime.model_runner import ModelRunner, StepKey
from runtime.request import Req, ReqStatus, SamplingParams
from runtime.schedule_batch import BatchRow, ScheduleBatch
from runtime.split_prefill import interval_sizes, next_interval
from tests.model_utils import TINY

# Nine layers: intervals of 1, 4 (4 + 4 + 1), 7 (7 + 2) and 9 (all) all leave remainders.
CFG = dataclasses.replace(TINY, num_layers=9, max_position_embeddings=256)
PAGE = 4


def test_interval_sizes_cover_any_remainder():
    assert interval_sizes(30) == [1, 2, 4, 8, 16, 30]
    assert interval_sizes(9, fixed=7) == [1, 2, 4, 7, 8, 9]
    with pytest.raises(ValueError, match="split_prefill_layers=10"):
        interval_sizes(9, fixed=10)
    sizes = interval_sizes(30, fixed=7)
    for want in (1, 3, 4, 7, 12, 30):
        left, plan = 30, []
        while left:
            k = next_interval(left, want, sizes)
            assert k in sizes and k <= left
            plan.append(k)
            left -= k
        assert sum(plan) == 30 and max(plan) <= max(want, 1)
    assert [next_interval(2, 7, sizes), next_interval(30, 0, sizes)] == [2, 1]


@pytest.fixture(scope="module", params=[("packed", "cpu"), ("xla", "xla"), ("xla", "pallas")],
                ids=["cpu_kernels", "xla", "pallas"])
def runner(request) -> ModelRunner:
    matmul, attention = request.param
    rcfg = RunnerConfig(decode_buckets=(1,), extend_token_buckets=(64,), extend_seq_buckets=(1, 4),
                        kv_len_buckets=(64,), per_layer_weights=True, cpu_matmul=matmul,
                        attention_backend=attention, enable_split_prefill=True,
                        split_prefill_layers=7, strict_compile=True)
    r = ModelRunner(CFG, llama.init_params(CFG, jax.random.key(3)),
                    CacheConfig(page_size=PAGE, num_pages=80), rcfg, max_running_requests=4)
    r.warmup(progress=False)
    return r


def _rows(lengths: list[int], prefix: int, first_page: int, seed: int) -> list[BatchRow]:
    """Extend rows of the given new-token counts, each over `prefix` cached tokens, on
    pages of their own from first_page."""
    rng = np.random.default_rng(seed)
    rows, page = [], first_page
    for i, n in enumerate(lengths):
        npages = -(-(prefix + n) // PAGE)
        req = Req(rid=f"r{seed}-{i}", prompt_ids=list(range(prefix + n)),
                  sampling=SamplingParams(temperature=0))
        req.req_slot = i
        ids = [int(t) for t in rng.integers(0, CFG.vocab_size, n)]
        rows.append(BatchRow(req, ids, prefix, list(range(page, page + npages)), sample=True))
        page += npages
    return rows


def _extend_logits(r: ModelRunner, batch: ScheduleBatch) -> np.ndarray:
    shape = r.bucket_for(batch)
    arrays = pack_rows(batch.extend_rows, [], shape, PAGE)
    exe = r._executables[StepKey(ForwardMode.EXTEND, shape)]
    slots = r._row_slots(batch, shape)[0]
    logits, r.kv = exe(r.params, r.kv, r.state.last_tokens, arrays, slots)
    return np.asarray(logits)


def _split_logits(r: ModelRunner, batch: ScheduleBatch, want: int) -> tuple[np.ndarray, list]:
    split = r.start_split(batch)
    while not split.done:
        r.run_interval(split, next_interval(split.remaining, want, r.split.sizes))
    return np.asarray(r.split.logits(r.params, split)), split.intervals


def _pool(r: ModelRunner) -> tuple[np.ndarray, np.ndarray]:
    """K and V of every real page ([L, Hkv, P, S, Dh]; page 0 is the padding tokens' sink,
    whose contents mean nothing)."""
    return np.asarray(r.kv.k)[:, :, 1:].copy(), np.asarray(r.kv.v)[:, :, 1:].copy()


@pytest.mark.parametrize("want", [1, 4, 7, 9])
@pytest.mark.parametrize("prefix", [0, 10])
def test_split_prefill_equals_extend(runner, want, prefix):
    if prefix:  # the prefix's own K/V, written by a plain extend first
        for row in _rows([prefix, prefix + 3], 0, 1, seed=1):
            _extend_logits(runner, ScheduleBatch(ForwardMode.EXTEND, [row], []))
    rows = _rows([17, 30, 5], prefix, 1, seed=2)
    batch = ScheduleBatch(ForwardMode.EXTEND, rows, [])
    want_logits = _extend_logits(runner, batch)
    want_k, want_v = _pool(runner)
    got, intervals = _split_logits(runner, batch, want)
    np.testing.assert_allclose(got, want_logits, atol=1e-5, rtol=0)
    got_k, got_v = _pool(runner)
    np.testing.assert_allclose(got_k, want_k, atol=1e-5, rtol=0)
    np.testing.assert_allclose(got_v, want_v, atol=1e-5, rtol=0)
    starts = [s for s, _ in intervals]
    assert sum(k for _, k in intervals) == CFG.num_layers
    assert starts == sorted(starts) and max(k for _, k in intervals) <= want
    assert runner.compiles_after_warmup == 0


def test_aborted_row_writes_only_the_padding_page(runner):
    rows = _rows([12, 9], 0, 1, seed=3)
    batch = ScheduleBatch(ForwardMode.EXTEND, rows, [])
    before_k, _ = _pool(runner)
    split = runner.start_split(batch)
    runner.run_interval(split, 1)
    rows[1].req.status = ReqStatus.FINISHED  # aborted: its pages went back to the pool
    while not split.done:
        runner.run_interval(split, next_interval(split.remaining, 4, runner.split.sizes))
    after_k, _ = _pool(runner)
    pages = [p - 1 for p in rows[1].pages]  # _pool drops page 0
    # Layer 0 ran before the abort; layers 1.. never touch the aborted row's pages.
    np.testing.assert_array_equal(after_k[1:, :, pages], before_k[1:, :, pages])
    live = [p - 1 for p in rows[0].pages]
    assert not np.array_equal(after_k[1:, :, live], before_k[1:, :, live])
