"""The Pallas paged attention kernels against their jnp twin paged_attention_ref, on the
CPU (interpret mode).

f32 inputs take the Triton body (generic Pallas interpreter), 16-bit inputs the Mosaic GPU
body (Mosaic GPU's interpreter, which also simulates the TMA copies and barriers), exactly
as they would on a GPU; `impl="mosaic"` in f32 checks the Mosaic body's logic at f32
tolerance. GPU lowering is checked from the CPU for the shapes the runtime serves.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import layers, llama
from models.config import ModelConfig
from models.forward_batch import ForwardBatch
from models.forward_mode import ForwardMode
from models.kv_pool import init_kv_pool
from pallas_kernels import get_paged_attention_fn
from pallas_kernels import ragged_paged_attention as rpa
from pallas_kernels.kv_schedule import NEW_START
from pallas_kernels.ragged_paged_attention import paged_attention, paged_attention_ref
from runtime.batch_builder import BucketShape
from runtime.config import CacheConfig
from tests.model_utils import TINY, SimpleRow, make_batch

HKV, DH, LAYERS, LAYER = 2, 64, 2, 1
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def _batch(extend: list[tuple[int, int]], decode: list[int], page_size: int,
           pad_tokens: int = 3, spare_row: bool = True):
    """extend: (new tokens, cached prefix) per row; decode: seq_len per row. Adds padding
    tokens, a padding decode row (seq_len 0) and, with spare_row, a padding extend row
    (without it the padding tokens fall in the last real row's query range). Pages are
    handed out from 1 up (page 0 is reserved). The page table lists only the pages of a
    row's earlier context, whatever pack_rows puts there, so a kernel that read pages
    past a row's prefix would read page 0."""
    next_page = 1

    def row(n_new: int, prefix: int) -> SimpleRow:
        nonlocal next_page
        n_pages = -(-(prefix + n_new) // page_size)
        pages = list(range(next_page, next_page + n_pages))
        next_page += n_pages
        return SimpleRow(list(range(n_new)), prefix, pages)

    ext = [row(n, p) for n, p in extend]
    dec = [row(1, n - 1) for n in decode]
    te = sum(n for n, _ in extend) + pad_tokens if extend else 0
    be = len(extend) + spare_row if extend else 0
    bd = len(dec) + 1 if decode else 0
    npg = max(len(r.pages) for r in ext + dec)
    mode = ForwardMode.MIXED if ext and dec else ForwardMode.EXTEND if ext else ForwardMode.DECODE
    batch = make_batch(mode, ext, dec, BucketShape(te, be, bd, npg), page_size)
    table = np.zeros((be + bd, npg), np.int32)
    for i, r in zip([*range(len(ext)), *range(be, be + len(dec))], ext + dec, strict=True):
        n = -(-r.start_pos // page_size)
        table[i, :n] = r.pages[:n]
    return batch.replace(page_table=jnp.asarray(table)), next_page


def _inputs(batch, n_pages: int, page_size: int, group: int, dtype, seed: int) -> tuple:
    """Random q, k_new, v_new and pools for `batch`, as the attention functions take them."""
    rng = np.random.default_rng(seed)
    pool_shape = (LAYERS, HKV, n_pages + 2, page_size, DH)
    k_pool, v_pool = (jnp.asarray(rng.standard_normal(pool_shape), dtype) for _ in "kv")
    t = batch.num_tokens
    # Scores of a few units, so the soft cap and the softmax are both far from trivial.
    q = jnp.asarray(2 * rng.standard_normal((t, HKV * group, DH)), dtype)
    k_new, v_new = (jnp.asarray(rng.standard_normal((t, HKV, DH)), dtype) for _ in "kv")
    return (q, k_new, v_new, k_pool, v_pool, jnp.int32(LAYER), batch.page_table,
            batch.seq_lens, batch.query_start, batch.positions)


def _sinks(group: int, seed: int) -> jax.Array:
    """[Hq] sink logits around the scores' scale, one well above them (its rows' outputs
    shrink towards 0) and one well below (no effect)."""
    s = 2 * np.random.default_rng(seed + 100).standard_normal(HKV * group)
    s[0], s[-1] = 8.0, -30.0
    return jnp.asarray(s, jnp.float32)


def _traced_variants(fn, window, sinks):
    """fn with the window and the sinks as traced arguments after the 10 attention
    operands (as a model's layer scan passes them), or left out where None."""
    names = [n for n, x in (("window", window), ("sinks", sinks)) if x is not None]
    extra = tuple(jnp.int32(window) if n == "window" else sinks for n in names)

    def call(*args):
        return fn(*args[:10], **dict(zip(names, args[10:], strict=True)))
    return jax.jit(call), extra


def _check(extend, decode, *, page_size, group, dtype, impl=None, window=None,
           logit_softcap=0.0, sinks=False, num_splits=None, spare_row=True, seed=0):
    batch, n_pages = _batch(extend, decode, page_size, spare_row=spare_row)
    args = _inputs(batch, n_pages, page_size, group, dtype, seed)
    kw = dict(num_extend_tokens=batch.num_extend_tokens, num_extend_seqs=batch.num_extend_seqs,
              sm_scale=DH ** -0.5, logit_softcap=logit_softcap)
    sink_arr = _sinks(group, seed) if sinks else None
    ref_fn, extra = _traced_variants(functools.partial(paged_attention_ref, **kw), window,
                                     sink_arr)
    ref = ref_fn(*args, *extra)
    out_fn, _ = _traced_variants(functools.partial(paged_attention, impl=impl, interpret=True,
                                                   num_splits=num_splits, **kw), window, sink_arr)
    out = out_fn(*args, *extra)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    # Padding tokens and the seq_len-0 decode row give exact zeros from the kernels; the
    # reference lets some of them attend to padding K/V (don't-care outputs), so only
    # real tokens are compared.
    real = np.zeros(batch.num_tokens, bool)
    real[:sum(n for n, _ in extend)] = True
    real[batch.num_extend_tokens:batch.num_extend_tokens + len(decode)] = True
    assert not np.asarray(out[~real], np.float32).any()
    err = np.abs(np.asarray(out, np.float32) - np.asarray(ref, np.float32))[real]
    assert err.max() < TOL[dtype], f"max abs error {err.max()} at token {err.max((1, 2)).argmax()}"


def _ragged_lens(s: int) -> list[int]:
    return [1, s, s + 1, 2 * s + 5, 9 * s + 7]  # 0 is the padding row _batch adds


@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("group", [1, 3, 8])
def test_decode_ragged_lengths(group, page_size):
    _check([], _ragged_lens(page_size), page_size=page_size, group=group, dtype=jnp.float32)


@pytest.mark.parametrize("page_size", [16, 64])
def test_extend_on_cached_prefix(page_size):
    s = page_size
    rows = [(1, 0), (s, 0), (s + 1, 3), (5, s), (2, 2 * s - 1), (70, 2 * s + 1)]
    _check(rows, [], page_size=page_size, group=3, dtype=jnp.float32)


@pytest.mark.parametrize("group", [1, 8])
def test_mixed_batch(group):
    _check([(17, 0), (3, 16), (40, 100)], _ragged_lens(16), page_size=16, group=group,
           dtype=jnp.float32)


@pytest.mark.parametrize("window,cap,sinks", [(20, 0.0, False), (None, 5.0, False),
                                              (37, 5.0, False), (None, 0.0, True),
                                              (0, 0.0, True), (5, 5.0, True)])
def test_window_soft_cap_and_sinks(window, cap, sinks):
    """The window is traced (0: none at run time); 5 tokens leaves most of a 16-token page
    outside it, so decode rows skip whole pages and extend rows start mid-page."""
    _check([(40, 0), (9, 30)], [1, 19, 21, 150], page_size=16, group=3, dtype=jnp.float32,
           window=window, logit_softcap=cap, sinks=sinks)


def test_window_is_one_trace_for_every_layer():
    """Layers of different windows (Gemma 3 / gpt-oss interleave them) share one trace:
    the window is an operand, and a window of 0 is the full causal attention."""
    batch, n_pages = _batch([(20, 5)], [1, 40], 16)
    args = _inputs(batch, n_pages, 16, 3, jnp.float32, 0)
    kw = dict(num_extend_tokens=batch.num_extend_tokens, num_extend_seqs=batch.num_extend_seqs,
              sm_scale=DH ** -0.5)
    traces = []

    @jax.jit
    def f(*a):
        traces.append(1)
        return paged_attention_ref(*a[:10], window=a[10], **kw)
    full = jax.jit(functools.partial(paged_attention_ref, **kw))(*args)
    np.testing.assert_allclose(np.asarray(f(*args, jnp.int32(0))), np.asarray(full), atol=1e-6)
    assert np.abs(np.asarray(f(*args, jnp.int32(4))) - np.asarray(full)).max() > 1e-3
    assert len(traces) == 1


@pytest.mark.parametrize("page_size,window,cap", [(16, None, 0.0), (16, 37, 5.0),
                                                   (64, None, 0.0), (16, 5, 0.0)])
def test_reference_decode_walks_blocks(monkeypatch, page_size, window, cap):
    """The jnp decode path walks each batch's prefix in blocks, as many as its longest row
    needs (a dynamic trip count). Force one-page blocks so the rows span 1 to 10 of them
    (and the padding row none), in a MIXED batch, and hold the result to the kernels."""
    from pallas_kernels import attention_ref
    monkeypatch.setattr(attention_ref, "_DECODE_BLOCK_TOKENS", page_size)
    _check([(9, 20)], _ragged_lens(page_size), page_size=page_size, group=3,
           dtype=jnp.float32, window=window, logit_softcap=cap, sinks=window is not None)


@pytest.mark.parametrize("window,cap", [(None, 0.0), (37, 5.0)])
def test_reference_extend_walks_blocks(monkeypatch, window, cap):
    """The jnp extend path scores new tokens in query blocks against the key blocks from
    the block's earliest row start on (a dynamic trip count). With 8-token blocks the rows
    (fresh and on cached prefixes, one 76 tokens long) start and end mid-block, span up to
    11 blocks, and the bucket ends in padding; hold the result to the kernels."""
    from pallas_kernels import attention_ref
    monkeypatch.setattr(attention_ref, "_EXTEND_BLOCK_TOKENS", 8)
    rows = [(1, 0), (16, 0), (17, 3), (5, 16), (2, 31), (76, 33)]  # 117 + 3 padding = 120
    _check(rows, [1, 40], page_size=16, group=3, dtype=jnp.float32, window=window,
           logit_softcap=cap, sinks=window is not None)


def test_reference_extend_one_row(monkeypatch):
    """One row of 77 new tokens on a cached prefix walks 10 causal 8-token blocks, with the
    bucket's padding tokens in the row's query range (no spare row)."""
    from pallas_kernels import attention_ref
    monkeypatch.setattr(attention_ref, "_EXTEND_BLOCK_TOKENS", 8)
    _check([(77, 33)], [], page_size=16, group=3, dtype=jnp.float32, spare_row=False)


@pytest.mark.parametrize("window,cap,sinks,spare_row", [(None, 0.0, False, True),
                                                          (37, 5.0, True, True),
                                                          (None, 0.0, False, False)])
def test_reference_verify_is_extend(monkeypatch, window, cap, sinks, spare_row):
    """A TARGET_VERIFY batch (rows of at most W = 5 tokens on cached prefixes, back to
    back, the bucket's padding after them) through the decode walk (verify_width) gives
    the extend path's outputs for every real token. One-page walk blocks make the rows
    span 1 to 10 of them; without a spare row the padding sits in the last row's range."""
    from pallas_kernels import attention_ref
    monkeypatch.setattr(attention_ref, "_DECODE_BLOCK_TOKENS", 16)
    width, rows = 5, [(5, 20), (1, 143), (3, 7), (5, 0), (2, 16)]
    n_rows = len(rows) + spare_row
    batch, n_pages = _batch(rows, [], 16, pad_tokens=n_rows * width - 16, spare_row=spare_row)
    assert batch.num_extend_tokens == n_rows * width
    args = _inputs(batch, n_pages, 16, 3, jnp.float32, seed=2)
    kw = dict(num_extend_tokens=batch.num_extend_tokens, num_extend_seqs=batch.num_extend_seqs,
              sm_scale=DH ** -0.5, logit_softcap=cap)
    sink_arr = _sinks(3, 2) if sinks else None
    ext_fn, extra = _traced_variants(functools.partial(paged_attention_ref, **kw), window,
                                     sink_arr)
    ver_fn, _ = _traced_variants(functools.partial(paged_attention_ref, verify_width=width,
                                                   **kw), window, sink_arr)
    ext, ver = np.asarray(ext_fn(*args, *extra)), np.asarray(ver_fn(*args, *extra))
    assert np.isfinite(ver).all()
    np.testing.assert_allclose(ver[:16], ext[:16], atol=1e-5, rtol=1e-5)


def test_reference_extend_without_page_table(monkeypatch):
    """Fresh prompts run with a page table of width 0 (the runner's prefixless EXTEND
    executables): same result as with the rows' (empty-prefix) pages listed."""
    from pallas_kernels import attention_ref
    monkeypatch.setattr(attention_ref, "_EXTEND_BLOCK_TOKENS", 8)
    batch, n_pages = _batch([(13, 0), (30, 0), (18, 0)], [], 16)  # 61 + 3 padding = 64
    ref = jax.jit(functools.partial(
        paged_attention_ref, num_extend_tokens=batch.num_extend_tokens,
        num_extend_seqs=batch.num_extend_seqs, sm_scale=DH ** -0.5))
    # The same seed gives both calls the same q, K/V and pools.
    with_pages = ref(*_inputs(batch, n_pages, 16, 3, jnp.float32, seed=1))
    without = ref(*_inputs(batch.replace(page_table=batch.page_table[:, :0]), n_pages, 16, 3,
                           jnp.float32, seed=1))
    np.testing.assert_allclose(np.asarray(without)[:61], np.asarray(with_pages)[:61],
                               atol=1e-5)


def test_padding_tokens_in_last_row():
    """No spare extend row: the bucket's padding tokens sit in the last real row's query
    range (query_start), which has a cached prefix."""
    _check([(5, 0), (9, 20)], [1, 40], page_size=16, group=3, dtype=jnp.float32,
           spare_row=False)


# The Mosaic GPU body: in bf16 as the GPU runs it, and in f32 to hold its logic to 1e-5.
# Rows of 300+ tokens span several KV blocks, so the slot ring and the online softmax
# across blocks are exercised; with 3 KV splits some splits of short rows are empty.
@pytest.mark.parametrize("dtype,page_size,group,window,cap,sinks,splits", [
    (jnp.bfloat16, 16, 3, None, 0.0, False, 1),
    (jnp.bfloat16, 64, 8, 100, 20.0, True, 3),
    (jnp.float32, 16, 3, 150, 5.0, True, 3),
    (jnp.float32, 16, 3, 5, 0.0, True, 1),
])
def test_mosaic_body(dtype, page_size, group, window, cap, sinks, splits):
    s = page_size
    _check([(s + 1, 0), (30, 300)], [1, s, s + 1, 520], page_size=page_size, group=group,
           dtype=dtype, impl="mosaic", window=window, logit_softcap=cap, sinks=sinks,
           num_splits=splits)


def test_mosaic_decode_only_sinks_and_window():
    _check([], _ragged_lens(16), page_size=16, group=3, dtype=jnp.float32, impl="mosaic",
           window=20, sinks=True, num_splits=3)


def test_mosaic_decode_only_group_1_split():
    _check([], _ragged_lens(16), page_size=16, group=1, dtype=jnp.bfloat16, num_splits=4)


@pytest.mark.parametrize("group,splits,rows", [(4, 1, 8), (12, 3, 16)])
def test_mosaic_decode_only_moves_live_rows(group, splits, rows):
    """A decode-only Mosaic launch's q and output hold each tile's G live rows rounded up to
    8, not the 64 of its shared-memory tile (the rest of which is never loaded); the results
    still match the reference, and a mixed launch keeps whole tiles."""
    _check([], _ragged_lens(6), page_size=16, group=group, dtype=jnp.float32, impl="mosaic",
           num_splits=splits)
    batch, _ = _batch([], [1, 17, 300], 16)
    q = jnp.zeros((3, 2 * group, 64), jnp.bfloat16)
    pool = jnp.zeros((1, 2, 4, 16, 64), jnp.bfloat16)
    cfg = rpa._config(q, pool, batch.page_table, te=0, be=0, sm_scale=1.0,
                      windowed=False, logit_softcap=0.0, impl="mosaic", block_kv=None,
                      num_slots=None, num_splits=splits)
    assert (cfg.tile_rows, cfg.q_rows) == (64, rows)
    mixed = rpa._config(q, pool, batch.page_table, te=2, be=1, sm_scale=1.0,
                        windowed=False, logit_softcap=0.0, impl="mosaic", block_kv=None,
                        num_slots=None, num_splits=splits)
    assert mixed.q_rows == mixed.tile_rows == 64


@pytest.mark.parametrize("decode_only", [False, True])
@pytest.mark.parametrize("page_size", [16, 64])
def test_mosaic_new_tokens_start_page_aligned(page_size, decode_only):
    """What the Mosaic body's TMA needs from the wrapper: each row's new K/V rows start at a
    multiple of the page size (SMEM tiles are 8 rows; interpret mode cannot see an unaligned
    copy, the device reads the wrong rows), hold the row's tokens in order, and meta's
    new_start points at them; the bucket's padding tokens are dropped."""
    s = page_size
    extend = [] if decode_only else [(s + 1, 0), (5, 300), (37, s)]
    batch, n_pages = _batch(extend, [1, s + 1, 40], s)
    (q, k_new, v_new, k_pool, *_), te = (_inputs(batch, n_pages, s, 3, jnp.float32, 0),
                                         batch.num_extend_tokens)
    be = batch.num_extend_seqs
    cfg = rpa._config(q, k_pool, batch.page_table, te=te, be=be, sm_scale=1.0,
                      windowed=False, logit_softcap=0.0, impl="mosaic", block_kv=None,
                      num_slots=None, num_splits=1)
    meta, _ = rpa._tile_metadata(batch.seq_lens, batch.query_start, batch.positions, 1,
                                 te=te, be=be, cfg=cfg)
    meta2, k2, v2 = rpa._page_aligned_new_kv(meta, batch.query_start, k_new, v_new, te=te,
                                             be=be, cfg=cfg)
    meta, meta2, qs = np.asarray(meta), np.asarray(meta2), np.asarray(batch.query_start)
    k_new, k2, v2 = np.asarray(k_new), np.asarray(k2), np.asarray(v2)
    starts = meta2[:, NEW_START]
    assert (starts % s == 0).all()
    assert k2.shape[0] % cfg.block_kv == 0 and k2.shape[0] >= starts.max() + cfg.block_kv
    others = np.delete(meta2, NEW_START, axis=1)
    np.testing.assert_array_equal(others, np.delete(meta, NEW_START, axis=1))
    for tile in range(meta.shape[0]):
        row = meta[tile, 0]
        n = qs[row + 1] - qs[row] if tile < cfg.num_extend_tiles else 1
        src = meta[tile, NEW_START]
        np.testing.assert_array_equal(k2[starts[tile]:starts[tile] + n], k_new[src:src + n])
        np.testing.assert_array_equal(v2[starts[tile]:starts[tile] + n],
                                      np.asarray(v_new)[src:src + n])
    # Every row's own tokens and nothing else: the padding tokens past the last row are gone.
    assert np.count_nonzero(np.abs(k2).sum((1, 2))) == qs[be] + batch.seq_lens.shape[0] - be


def test_triton_body_bf16():
    _check([(20, 5)], [1, 33], page_size=16, group=3, dtype=jnp.bfloat16, impl="triton")


# ------------------------------------------------------------------------ GPU lowering

SMOLLM2 = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                      num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0,
                      tie_word_embeddings=True)
LLAMA8B_HEADS = dict(num_heads=32, num_kv_heads=8, head_dim=128)
# (T_e, B_e, B_d, Np): decode, extend (chunked-prefill sized) and mixed buckets.
BUCKETS = {"decode": (0, 0, 64, 512), "extend": (2048, 8, 0, 512), "mixed": (512, 4, 60, 512)}


def _lower_for_cuda(fn, *args) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _attention_args(cfg: ModelConfig, bucket, page_size: int, dtype, num_pages: int = 4096):
    te, be, bd, npg = bucket
    sds = jax.ShapeDtypeStruct
    pool = sds((cfg.num_layers, cfg.num_kv_heads, num_pages, page_size, cfg.head_dim), dtype)
    new = sds((te + bd, cfg.num_kv_heads, cfg.head_dim), dtype)
    b, t = be + bd, te + bd
    return (sds((t, cfg.num_heads, cfg.head_dim), dtype), new, new, pool, pool,
            sds((), jnp.int32), sds((b, npg), jnp.int32), sds((b,), jnp.int32),
            sds((b + 1,), jnp.int32), sds((t,), jnp.int32))


def _compiled(bucket, **kw):
    return functools.partial(paged_attention, interpret=False, num_extend_tokens=bucket[0],
                             num_extend_seqs=bucket[1], **kw)


@pytest.mark.parametrize("mode", list(BUCKETS))
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_smollm2_kernels_lower_for_cuda(mode, dtype):
    bucket = BUCKETS[mode]
    text = _lower_for_cuda(_compiled(bucket, sm_scale=0.125),
                           *_attention_args(SMOLLM2, bucket, 16, dtype))
    # bf16 must be the Mosaic GPU kernel; f32 the Triton one (see mosaic_unsupported).
    assert ("mosaic_gpu" if dtype == jnp.bfloat16 else "triton") in text


@pytest.mark.parametrize("mode", ["decode", "mixed"])
def test_split_kv_lowers_for_cuda(mode):
    """On a GPU small batches run with several KV splits per tile (on the CPU the default
    is 1), so lower that configuration explicitly."""
    bucket = (0, 0, 8, 512) if mode == "decode" else BUCKETS[mode]
    fn = _compiled(bucket, sm_scale=0.125, num_splits=8)
    assert "mosaic_gpu" in _lower_for_cuda(fn, *_attention_args(SMOLLM2, bucket, 16,
                                                                 jnp.bfloat16))


@pytest.mark.parametrize("page_size,dtype", [(16, jnp.bfloat16), (64, jnp.bfloat16),
                                             (16, jnp.float32)])
def test_llama8b_heads_lower_for_cuda(page_size, dtype):
    """With every variant on: a traced window, sinks and the soft cap, in both bodies."""
    cfg = dataclasses.replace(SMOLLM2, **LLAMA8B_HEADS)
    bucket = BUCKETS["mixed"]
    fn = _compiled(bucket, sm_scale=128 ** -0.5, logit_softcap=50.0)
    args = _attention_args(cfg, bucket, page_size, dtype)
    variants = lambda *a: fn(*a[:10], window=a[10], sinks=a[11])  # noqa: E731
    sds = jax.ShapeDtypeStruct
    extra = (sds((), jnp.int32), sds((cfg.num_heads,), jnp.float32))
    text = _lower_for_cuda(variants, *args, *extra)
    assert ("mosaic_gpu" if dtype == jnp.bfloat16 else "triton") in text


@pytest.mark.parametrize("bucket,splits", [((0, 0, 8, 2048), 4), ((0, 0, 64, 2048), 1),
                                           ((4096, 2, 0, 128), None)])
def test_gpu_suite_attention_shapes_lower_for_cuda(bucket, splits):
    """The GPU suite's attention section (scripts/bench/bench_kernels.py as gpu_suite.py runs
    it): Llama-8B heads, decode at 32k context in batches of 8 (with the KV splits an
    H200's default picks: 2 x 132 SMs / 64 programs) and 64, and a 2 x 2048 prefill."""
    cfg = dataclasses.replace(SMOLLM2, **LLAMA8B_HEADS)
    fn = _compiled(bucket, sm_scale=128 ** -0.5, num_splits=splits)
    args = _attention_args(cfg, bucket, 16, jnp.bfloat16, num_pages=64 * 2048 + 1)
    assert "mosaic_gpu" in _lower_for_cuda(fn, *args)


def _compiled_kernels(backend: str):
    """get_paged_attention_fn as it behaves on a GPU: "pallas" gives compiled kernels."""
    assert backend == "pallas"
    return functools.partial(paged_attention, interpret=False)


@pytest.mark.parametrize("mode", list(BUCKETS))
def test_smollm2_forward_lowers_for_cuda(mode, monkeypatch):
    """The model's own call site (inside the layer scan) with compiled kernels, bf16."""
    monkeypatch.setattr(layers, "get_paged_attention_fn", _compiled_kernels)
    te, be, bd, npg = BUCKETS[mode]
    sds = jax.ShapeDtypeStruct
    params = jax.tree.map(lambda s: sds(s, jnp.bfloat16), llama.param_shapes(SMOLLM2),
                          is_leaf=lambda x: isinstance(x, tuple))
    kv = jax.eval_shape(lambda: init_kv_pool(SMOLLM2, CacheConfig(page_size=16,
                                                                  num_pages=4096),
                                             jnp.bfloat16))
    t, b = te + bd, be + bd
    arrays = dict(input_ids=(t,), positions=(t,), out_cache_loc=(t,), page_table=(b, npg),
                  seq_lens=(b,), query_start=(b + 1,), logits_indices=(b,))
    mode_enum = {"decode": ForwardMode.DECODE, "extend": ForwardMode.EXTEND,
                 "mixed": ForwardMode.MIXED}[mode]
    batch = ForwardBatch(**{k: sds(v, jnp.int32) for k, v in arrays.items()}, mode=mode_enum,
                         num_extend_tokens=te, num_extend_seqs=be)
    fwd = functools.partial(llama.forward, cfg=SMOLLM2, attention_backend="pallas")
    assert "mosaic_gpu" in _lower_for_cuda(fwd, params, kv, batch)


# ------------------------------------------------------------------------ end to end

def test_tiny_model_pallas_equals_xla():
    """Prefill a prompt, extend it on its cached prefix, then a MIXED step; logits and the
    written pool must agree between attention_backend="pallas" and "xla"."""
    page = 4
    params = llama.init_params(TINY, jax.random.key(0))
    rng = np.random.default_rng(0)
    a, b = list(rng.integers(0, TINY.vocab_size, 11)), list(rng.integers(0, TINY.vocab_size, 6))
    steps = [
        make_batch(ForwardMode.EXTEND, [SimpleRow(a[:7], 0, [1, 2])], [],
                   BucketShape(8, 2, 0, 3), page),
        make_batch(ForwardMode.EXTEND, [SimpleRow(a[7:10], 7, [1, 2, 3])], [],
                   BucketShape(8, 2, 0, 3), page),
        make_batch(ForwardMode.MIXED, [SimpleRow(b, 0, [4, 5])], [SimpleRow([a[10]], 10,
                                                                            [1, 2, 3])],
                   BucketShape(8, 1, 2, 3), page),
    ]
    results = {}
    for backend in ("xla", "pallas"):
        fwd = jax.jit(functools.partial(llama.forward, cfg=TINY, attention_backend=backend))
        kv = init_kv_pool(TINY, CacheConfig(page_size=page, num_pages=8), jnp.float32)
        logits = []
        for batch in steps:
            out, kv = fwd(params, kv, batch)
            logits.append(np.asarray(out))
        results[backend] = logits, np.asarray(kv.k), np.asarray(kv.v)
    for got, want in zip(results["pallas"][0], results["xla"][0], strict=True):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
    # Page 0 takes the padding tokens' K/V, which differ: the kernels give padding tokens
    # zero attention output, the reference whatever its masks let through.
    for i in (1, 2):  # K, V pools [L, Hkv, P, S, Dh]
        np.testing.assert_allclose(results["pallas"][i][:, :, 1:], results["xla"][i][:, :, 1:],
                                   atol=1e-5)


def test_get_paged_attention_fn():
    assert get_paged_attention_fn("xla") is paged_attention_ref
    fn = get_paged_attention_fn("pallas")
    assert fn.func is paged_attention
    assert fn.keywords["interpret"] == (jax.default_backend() == "cpu")
    with pytest.raises(ValueError):
        get_paged_attention_fn("cuda")
