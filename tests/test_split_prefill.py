"""SPLIT_PREFILL: an extend batch run a few layers per call equals the one-shot EXTEND,
in its logits and in the K/V it leaves in the pool, on every attention backend, fresh or
over a cached prefix, whatever the interval sizes."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from models import llama
from models.forward_mode import ForwardMode
from runtime.batch_builder import BucketShape, pack_rows, padded_rows
from runtime.config import CacheConfig, RunnerConfig
from runtime.model_runner import ModelRunner, StepKey
from runtime.request import Req, ReqStatus, SamplingParams
from runtime.schedule_batch import BatchRow, ScheduleBatch
from runtime.split_prefill import interval_sizes, layer_work, next_interval
from tests.model_utils import TINY

# Nine layers: intervals of 1, 4 (4 + 4 + 1), 7 (7 + 2) and 9 (all) all leave remainders.
CFG = dataclasses.replace(TINY, num_layers=9, max_position_embeddings=256)
PAGE = 4


def test_interval_sizes_cover_any_remainder():
    assert interval_sizes(30) == [2, 4, 6, 8, 30]  # no one-layer calls (slow on XLA CPU)
    assert interval_sizes(30, fixed=9) == [1, 2, 4, 6, 8, 9, 30]
    assert interval_sizes(9, fixed=7) == [1, 2, 4, 6, 7, 8, 9]
    assert interval_sizes(4) == [2, 4]
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
    for fixed in (None, 3, 7, 9):
        sizes, left = interval_sizes(30, fixed), 30
        while left:
            left -= next_interval(left, fixed or 5, sizes)
        assert left == 0
    assert [next_interval(2, 7, sizes), next_interval(30, 0, sizes)] == [2, 1]
    assert next_interval(30, 1, interval_sizes(30)) == 2


@pytest.fixture(scope="module", params=[("packed", "cpu"), ("xla", "xla"), ("xla", "pallas")],
                ids=["cpu_kernels", "xla", "pallas"])
def runner(request) -> ModelRunner:
    matmul, attention = request.param
    # One extend bucket of 4 sequences (single rows are padded into it): every interval
    # size still compiles, at half the executables of a (1, 4) bucket pair.
    rcfg = RunnerConfig(decode_buckets=(2,), extend_token_buckets=(64,), extend_seq_buckets=(4,),
                        kv_len_buckets=(64,), per_layer_weights=matmul == "xla", cpu_matmul=matmul,
                        attention_backend=attention, enable_split_prefill=True,
                        split_prefill_layers=7, multiplex_fused=True, strict_compile=True)
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
    logits = r.paths["plain"].run_forward(StepKey(ForwardMode.EXTEND, shape), arrays,
                           r.slots_of(padded_rows([batch], shape))[0])
    return np.asarray(logits)


def _split_logits(r: ModelRunner, batch: ScheduleBatch, want: int) -> tuple[np.ndarray, list]:
    path = r.paths["split_prefill"]
    split = path.start_split(batch)
    while not split.done:
        path.run_interval(split, next_interval(split.remaining, want, path.interval_sizes))
    return np.asarray(path.programs.logits(r.params, split)), split.intervals


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
    path = runner.paths["split_prefill"]
    split = path.start_split(batch)
    path.run_interval(split, 1)
    rows[1].req.status = ReqStatus.FINISHED  # aborted: its pages went back to the pool
    while not split.done:
        path.run_interval(split, next_interval(split.remaining, 4, path.interval_sizes))
    after_k, _ = _pool(runner)
    pages = [p - 1 for p in rows[1].pages]  # _pool drops page 0
    # Layer 0 ran before the abort; layers 1.. never touch the aborted row's pages.
    np.testing.assert_array_equal(after_k[1:, :, pages], before_k[1:, :, pages])
    live = [p - 1 for p in rows[0].pages]
    assert not np.array_equal(after_k[1:, :, live], before_k[1:, :, live])


@pytest.mark.parametrize("start,k", [(0, 4), (2, 4), (1, 8)])
def test_fused_step_equals_decode_then_interval(runner, start, k):
    """Decode rows through all layers and the split's [start, start + k) in one program
    give the two calls' decode logits, split hidden state and pool."""
    rows = _rows([20, 9], 0, 1, seed=4)
    split = runner.paths["split_prefill"].start_split(ScheduleBatch(ForwardMode.EXTEND, rows, []))
    while split.next_layer < start:
        runner.paths["split_prefill"].run_interval(split, 1)
    hidden0 = split.hidden
    dec_rows = []
    for i, row in enumerate(_rows([1, 1], 13, 30, seed=5)):
        row.req.req_slot = 2 + i
        dec_rows.append(row)
    decode = ScheduleBatch(ForwardMode.DECODE, [], dec_rows)
    dec_shape = runner.bucket_for(decode)
    dec_arrays = pack_rows([], dec_rows, dec_shape, PAGE)
    want_logits = runner.paths["plain"].run_forward(
        StepKey(ForwardMode.DECODE, dec_shape), dec_arrays,
        runner.slots_of(padded_rows([decode], dec_shape))[0])
    want_hidden, runner.kv = runner.paths["split_prefill"].programs.interval(
        runner.params, runner.kv, split, k)
    want_pool = _pool(runner)
    mixed = ScheduleBatch(ForwardMode.MIXED, rows, dec_rows)
    shape = BucketShape(64, split.shape.num_extend_seqs, 2, dec_shape.num_pages_per_seq)
    arrays = pack_rows(rows, dec_rows, shape, PAGE)
    got_logits, got_hidden, runner.kv = runner.paths["fused"].programs(
        shape, k, runner.params, runner.kv, runner.state.last_tokens, hidden0, arrays,
        runner.slots_of(padded_rows([mixed], shape))[0], np.int32(start))
    np.testing.assert_allclose(np.asarray(got_logits), np.asarray(want_logits), atol=1e-5, rtol=0)
    real = sum(len(r.input_ids) for r in rows)  # padding tokens' states mean nothing
    np.testing.assert_allclose(np.asarray(got_hidden)[:real], np.asarray(want_hidden)[:real],
                               atol=1e-5, rtol=0)
    for got, want in zip(_pool(runner), want_pool, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    assert runner.compiles_after_warmup == 0


def test_launch_whole_is_the_extend_step(runner):
    """A prefill below split_min_tokens runs whole under the SPLIT_PREFILL identity."""
    rows = _rows([11, 6], 0, 1, seed=6)
    plain = runner.launch(ScheduleBatch(ForwardMode.EXTEND, rows, [])).result()
    whole = runner.launch(ScheduleBatch(ForwardMode.SPLIT_PREFILL, rows, [])).result()
    np.testing.assert_array_equal(whole.next_token_ids, plain.next_token_ids)
    path = runner.paths["split_prefill"]
    assert path.can_split(ScheduleBatch(ForwardMode.SPLIT_PREFILL, rows, []))


def test_layer_work_charges_a_chunk_its_prefix():
    """A chunk's layer work is its matmul tokens plus its attention pairs at their FLOP
    worth: on SmolLM2's shape a 512-token chunk over 1,536 cached tokens is ~1.5x the
    first chunk, and padding rows add nothing but their tokens."""
    cfg = dataclasses.replace(TINY, hidden_size=576, intermediate_size=1536, num_heads=9,
                              num_kv_heads=3, head_dim=64)
    req = Req(rid="r", prompt_ids=[3] * 2048, sampling=SamplingParams())

    def chunk(start: int) -> BatchRow:
        return BatchRow(req, [3] * 512, start, [], sample=False)

    linear = 2 * 576 * (2 * 576 + 2 * 192) + 6 * 576 * 1536
    first = layer_work(cfg, 512, [chunk(0)])
    assert first == pytest.approx(512 + 512 * 256.5 * 4 * 576 / linear)
    assert layer_work(cfg, 512, [chunk(1536)]) / first == pytest.approx(1.46, abs=0.01)
    assert layer_work(cfg, 512, []) == 512


def test_cost_seeds_run_real_tokens_into_the_padding_page(runner):
    """Warm-up times each step full of tokens, not of padding (which the CPU fast path
    skips: a padded seed would tell the multiplexing policy a step is nearly free), and
    those tokens write only page 0."""
    from models.forward_batch import ForwardBatch, real_token_mask

    for shape in (BucketShape(0, 0, 4, 2), BucketShape(32, 2, 0, 2), BucketShape(16, 1, 2, 2)):
        arrays, slots = runner.cost_seed_inputs(shape)
        batch = ForwardBatch(**arrays, mode=ForwardMode.MIXED,
                             num_extend_tokens=shape.num_extend_tokens,
                             num_extend_seqs=shape.num_extend_seqs)
        assert np.asarray(real_token_mask(batch)).all()
        assert (arrays["out_cache_loc"] < PAGE).all()
        assert (slots == runner.max_running).all()


def test_a_splits_layer_work_counts_the_tokens_its_matmuls_run(runner):
    """The packed CPU matmul skips the bucket's padding, so a split there is charged its
    real tokens; on XLA's dot every padded token is computed and charged."""
    rows = _rows([17, 30, 5], 0, 1, seed=4)
    path = runner.paths["split_prefill"]
    split = path.start_split(ScheduleBatch(ForwardMode.SPLIT_PREFILL, rows, []))
    tokens = 52 if runner.cfg.cpu_matmul == "packed" else split.shape.num_extend_tokens
    assert split.shape.num_extend_tokens == 64
    assert path.layer_work(split) == layer_work(CFG, tokens, rows)


def test_no_executable_copies_the_kv_pool():
    """The pool is donated and written in place (cpu_kernels.write_kv), so no executable may
    copy it. One-layer split intervals are the case that did: XLA unrolls their one-trip
    layer scan, and it then copied the whole pool before the attention's reads and again
    before the write, until the write took an operand computed from those reads."""
    rcfg = RunnerConfig(decode_buckets=(2,), extend_token_buckets=(64,), extend_seq_buckets=(1,),
                        kv_len_buckets=(64,), cpu_matmul="packed", attention_backend="cpu",
                        enable_split_prefill=True, split_prefill_layers=1, strict_compile=True)
    r = ModelRunner(CFG, llama.init_params(CFG, jax.random.key(3)),
                    CacheConfig(page_size=PAGE, num_pages=80), rcfg, max_running_requests=4)
    r.warmup(progress=False)
    assert any(name.endswith("_k1") for name in r.compiled)
    pool = f"f32[{','.join(map(str, r.kv.k.shape))}]"
    for name, exe in r.compiled.items():
        copies = [line for line in exe.as_text().splitlines() if pool in line and " copy(" in line]
        assert not copies, (name, copies[:2])
