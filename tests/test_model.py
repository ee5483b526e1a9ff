"""The Llama forward against a dense numpy reference, through every batch layout."""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import pytest

from models import llama
from models.forward_batch import ForwardMode
from models.kv_pool import init_kv_pool
from runtime.batch_builder import BucketShape
from runtime.config import CacheConfig
from tests.model_utils import TINY, SimpleRow, dense_llama_logits, make_batch

PAGE = 4


@functools.cache
def _params(tie: bool, bias: bool):
    cfg = dataclasses.replace(TINY, tie_word_embeddings=tie, attention_bias=bias)
    return cfg, llama.init_params(cfg, jax.random.key(0))


def _fwd(cfg):
    return jax.jit(functools.partial(llama.forward, cfg=cfg))


def _pool(cfg, num_pages: int = 32):
    return init_kv_pool(cfg, CacheConfig(page_size=PAGE, num_pages=num_pages), np.float32)


def _prompts_and_pool(seed: int, *lengths: int):
    """The untied, bias-free model, random prompts of these lengths and an empty pool."""
    cfg, params = _params(False, False)
    rng = np.random.default_rng(seed)
    return cfg, params, [list(rng.integers(0, cfg.vocab_size, n)) for n in lengths], _pool(cfg)


def _check_dense(logits_row: jax.Array, params, cfg, tokens: list[int]) -> None:
    """One row's logits [V] against the dense reference's last position over `tokens`."""
    np.testing.assert_allclose(np.asarray(logits_row),
                               dense_llama_logits(params, cfg, tokens)[-1], atol=2e-4,
                               rtol=1e-4)


@pytest.mark.parametrize("tie,bias", [(True, False), (False, True)])
def test_extend_matches_dense(tie, bias):
    cfg, params = _params(tie, bias)
    rng = np.random.default_rng(0)
    seqs = [list(rng.integers(0, cfg.vocab_size, n)) for n in (7, 1, 12)]
    kv = _pool(cfg)
    rows, next_page = [], 1
    for s in seqs:
        n_pages = -(-len(s) // PAGE)
        rows.append(SimpleRow(s, 0, list(range(next_page, next_page + n_pages))))
        next_page += n_pages
    batch = make_batch(ForwardMode.EXTEND, rows, [], BucketShape(24, 4, 0, 4), PAGE)
    logits, kv = _fwd(cfg)(params, kv, batch)
    for i, s in enumerate(seqs):
        _check_dense(logits[i], params, cfg, s)


def test_prefix_then_decode_and_mixed_match_dense():
    """Prefill a prefix, extend on top of it, then decode token by token in a MIXED batch."""
    cfg, params, (a, b), kv = _prompts_and_pool(1, 13, 6)
    fwd = _fwd(cfg)
    pages_a, pages_b = [1, 2, 3, 4], [5, 6]
    shape = BucketShape(16, 2, 0, 4)
    # a's first 9 tokens, then its remaining 3 as an extend on top of the cached prefix.
    _, kv = fwd(params, kv, make_batch(ForwardMode.EXTEND, [SimpleRow(a[:9], 0, pages_a[:3])],
                                       [], shape, PAGE))
    logits, kv = fwd(params, kv, make_batch(ForwardMode.EXTEND,
                                            [SimpleRow(a[9:12], 9, pages_a[:3])], [], shape,
                                            PAGE))
    _check_dense(logits[0], params, cfg, a[:12])
    # MIXED: b prefilled as an extend row while a decodes its 13th token.
    mixed = make_batch(ForwardMode.MIXED, [SimpleRow(b, 0, pages_b)],
                       [SimpleRow([a[12]], 12, pages_a)], BucketShape(8, 1, 2, 4), PAGE)
    logits, kv = fwd(params, kv, mixed)
    _check_dense(logits[0], params, cfg, b)
    _check_dense(logits[1], params, cfg, a)
    # Pure DECODE with a padding row.
    dec = make_batch(ForwardMode.DECODE, [], [SimpleRow([3], 6, pages_b)],
                     BucketShape(0, 0, 4, 4), PAGE)
    logits, _ = fwd(params, kv, dec)
    _check_dense(logits[0], params, cfg, b + [3])


def test_last_row_prefix_with_bucket_padding():
    """All extend rows real, the last one on a cached prefix, padding tokens after it."""
    cfg, params, (a, b), kv = _prompts_and_pool(2, 9, 11)
    fwd = _fwd(cfg)
    _, kv = fwd(params, kv, make_batch(ForwardMode.EXTEND, [SimpleRow(b[:8], 0, [5, 6])], [],
                                       BucketShape(16, 1, 0, 4), PAGE))
    rows = [SimpleRow(a, 0, [1, 2, 3]), SimpleRow(b[8:], 8, [5, 6, 7])]
    logits, _ = fwd(params, kv, make_batch(ForwardMode.EXTEND, rows, [],
                                           BucketShape(16, 2, 0, 4), PAGE))
    _check_dense(logits[0], params, cfg, a)
    _check_dense(logits[1], params, cfg, b)


def _check_same_forward(cfg, want_params, got_params, seed: int) -> None:
    """One 10-token prompt through both weight layouts: the same logits and keys."""
    rng = np.random.default_rng(seed)
    rows = [SimpleRow(list(rng.integers(0, cfg.vocab_size, 10)), 0, [1, 2, 3])]
    batch = make_batch(ForwardMode.EXTEND, rows, [], BucketShape(16, 1, 0, 4), PAGE)
    a, kv0 = _fwd(cfg)(want_params, _pool(cfg, 8), batch)
    b, kv1 = _fwd(cfg)(got_params, _pool(cfg, 8), batch)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
    np.testing.assert_allclose(np.asarray(kv0.k), np.asarray(kv1.k), atol=1e-5)


def test_switch_dispatch_matches_stacked():
    """Per-layer weights picked by lax.switch give the stacked-slice results."""
    cfg, params = _params(False, True)
    _check_same_forward(cfg, params, llama.unstack_layers(params), seed=3)


@pytest.mark.parametrize("per_layer", [False, True])
def test_fused_projections_match_separate(per_layer):
    """wq|wk|wv and w_gate|w_up fused into one matrix each (the GPU layout) give the
    separate matrices' results, stacked or per layer."""
    cfg, params = _params(False, True)
    tree = llama.unstack_layers(params) if per_layer else params
    fused = llama.fuse_projections(tree)
    lp = fused["layer_list"][0] if per_layer else fused["layers"]
    assert {"wqkv", "w_gate_up"} <= set(lp) and not {"wq", "wk", "wv", "w_gate"} & set(lp)
    _check_same_forward(cfg, tree, fused, seed=4)
