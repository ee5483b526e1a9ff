"""The attention variants through the decoder skeleton: sliding and full layers interleaved
(the window looked up per layer inside the layer scan), attention sinks and logit soft
capping, against a plain numpy decoder, on every attention backend and under tensor
parallelism (the sinks split with the heads)."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from models import llama
from models.config import ModelConfig
from runtime.engine import Engine
from runtime.request import SamplingParams
from runtime.sharding import serving_mesh
from tests.engine_utils import check_same, engine_args, prompts, small_runner
from tests.model_utils import all_position_logits, numpy_norm_rope

# 8 query / 4 KV heads (tp 2 divides both); layers 0 and 2 slide over 5 tokens.
CFG = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=3,
                  num_heads=8, num_kv_heads=4, head_dim=8, max_position_embeddings=256,
                  sliding_window=5, attn_logit_softcapping=3.0, attention_sinks=True,
                  layer_types=("sliding_attention", "full_attention", "sliding_attention"))


def _numpy_logits(params: dict, cfg: ModelConfig, ids: list[int]) -> np.ndarray:
    """A plain f64 decoder over one sequence with the variants as transformers defines
    them (gpt-oss's sinks, Gemma 2's soft cap, the sliding_window_overlay mask)."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    t = len(ids)
    norm, rope = numpy_norm_rope(cfg, t)

    x, g = p["embed"][ids], cfg.num_heads // cfg.num_kv_heads
    q_pos, k_pos = np.arange(t)[:, None], np.arange(t)[None, :]
    for i in range(cfg.num_layers):
        lp = {k: v[i] for k, v in p["layers"].items()}
        a = norm(x, lp["attn_norm"])
        q = rope((a @ lp["wq"]).reshape(t, cfg.num_heads, cfg.head_dim))
        k = np.repeat(rope((a @ lp["wk"]).reshape(t, cfg.num_kv_heads, cfg.head_dim)), g, 1)
        v = np.repeat((a @ lp["wv"]).reshape(t, cfg.num_kv_heads, cfg.head_dim), g, 1)
        s = np.einsum("thd,shd->hts", q, k) / np.sqrt(cfg.head_dim)  # [H, T, T]
        if cfg.attn_logit_softcapping:
            s = cfg.attn_logit_softcapping * np.tanh(s / cfg.attn_logit_softcapping)
        mask = k_pos <= q_pos
        if cfg.layer_windows[i]:
            mask &= k_pos > q_pos - cfg.layer_windows[i]
        s = np.where(mask, s, -np.inf)
        sink = lp["sinks"][:, None, None] if cfg.attention_sinks else np.full((1, 1, 1), -np.inf)
        top = np.maximum(s.max(-1, keepdims=True), sink)
        e = np.exp(s - top)
        pr = e / (e.sum(-1, keepdims=True) + np.exp(sink - top))
        x = x + np.einsum("hts,shd->thd", pr, v).reshape(t, -1) @ lp["wo"]
        m = norm(x, lp["mlp_norm"])
        silu = (m @ lp["w_gate"]) / (1 + np.exp(-(m @ lp["w_gate"])))
        x = x + (silu * (m @ lp["w_up"])) @ lp["w_down"]
    x = norm(x, p["final_norm"])
    return x @ (p["embed"].T if cfg.tie_word_embeddings else p["lm_head"])


@pytest.fixture(scope="module")
def params() -> dict:
    p = llama.init_params(CFG, jax.random.key(5))
    assert p["layers"]["sinks"].shape == (3, 8)
    return p


@pytest.mark.parametrize("backend", ["xla", "cpu", "pallas"])
@pytest.mark.parametrize("variant", ["all", "window", "sinks", "softcap"])
def test_variants_match_numpy(params, backend, variant):
    cfg = CFG
    if variant != "all":
        cfg = dataclasses.replace(cfg, sliding_window=5 if variant == "window" else 0,
                                  layer_types=CFG.layer_types if variant == "window" else (),
                                  attention_sinks=variant == "sinks",
                                  attn_logit_softcapping=3.0 if variant == "softcap" else 0.0)
    p = params if cfg.attention_sinks else {
        **params, "layers": {k: v for k, v in params["layers"].items() if k != "sinks"}}
    ids = [int(i) for i in np.random.default_rng(0).integers(0, CFG.vocab_size, 23)]
    got = all_position_logits(p, cfg, ids, page_size=4, attention_backend=backend)
    want = _numpy_logits(p, cfg, ids)
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=2e-4)


GREEDY = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True, top_logprobs=2)


def test_tensor_parallel_matches_one_device(params):
    """tp=2: each device attends with its own heads and their sinks; the tokens equal one
    device's, with chunked prefill and the prefix cache, and nothing compiles late."""
    one = small_runner(CFG, params)
    want = Engine(engine_args(disable_prefix_cache=True, chunked_prefill_size=None),
                  runner=one).generate(prompts(CFG.vocab_size), GREEDY)
    tp = small_runner(CFG, params, serving_mesh(CFG, tp=2))
    assert tp.params["layer_list"][0]["sinks"].sharding.spec[-1] == "tp"
    got = Engine(engine_args(chunked_prefill_size=16), runner=tp).generate(
        prompts(CFG.vocab_size), GREEDY)
    check_same(got, want)
    tp.check_no_compiles()
