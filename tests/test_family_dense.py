"""Mistral (sliding window) and Qwen3 dense (q/k norm) against transformers: tiny random
models written by scripts/make_reference.py --only=tiny_dense. Prefill logits of a 12-token
input (past Mistral's 5-token window) and transformers' 32 greedy tokens from a 5-token
prompt (its decode slides the window over the generated tokens), through the Engine on the
plain path and on split prefill, on the xla and cpu attention backends, nothing compiled
after warm-up."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from models.config import ModelConfig, attention_variant_fields
from runtime.checkpoint import load_hf_safetensors
from runtime.engine import Engine
from runtime.request import SamplingParams
from tests.engine_utils import check_same, each_alone, engine_args, prompts, small_runner
from tests.model_utils import all_position_logits

TINY = Path(__file__).parent / "fixtures" / "tiny_models"
FAMILIES = ["mistral", "qwen3"]
BACKENDS = ["xla", "cpu"]


@pytest.fixture(scope="module", params=FAMILIES)
def model(request) -> tuple[str, ModelConfig, dict]:
    cfg, params = load_hf_safetensors(str(TINY / request.param))
    return request.param, cfg, params


def test_configs():
    mistral, _ = load_hf_safetensors(str(TINY / "mistral"))
    assert (mistral.architecture, mistral.sliding_window, mistral.layer_windows,
            mistral.uniform_window, mistral.qk_norm) == ("llama", 5, (5, 5, 5), 5, False)
    qwen3, params = load_hf_safetensors(str(TINY / "qwen3"))
    assert (qwen3.architecture, qwen3.qk_norm, qwen3.attention_bias, qwen3.has_window) == (
        "qwen3", True, False, False)
    assert params["layers"]["q_norm"].shape == (3, 16)


@pytest.mark.parametrize("hf,want", [
    (dict(sliding_window=4096), (4096, ())),  # Mistral: every layer
    (dict(sliding_window=None), (0, ())),
    (dict(sliding_window=4096, use_sliding_window=False, max_window_layers=2), (0, ())),
    (dict(sliding_window=8, use_sliding_window=True, max_window_layers=2, num_hidden_layers=3),
     (8, ("full_attention", "full_attention", "sliding_attention"))),
    (dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
     (8, ("sliding_attention", "full_attention"))),
    (dict(sliding_window=8, layer_types=["full_attention"] * 2), (0, ())),
])
def test_hf_window_fields(hf, want):
    got = attention_variant_fields(hf)
    assert (got["sliding_window"], got["layer_types"]) == want
    assert got["attn_logit_softcapping"] == 0.0


def test_layer_windows_follow_layer_types():
    cfg = ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=3,
                      num_heads=2, num_kv_heads=1, head_dim=4, sliding_window=4,
                      layer_types=("sliding_attention", "full_attention", "sliding_attention"))
    assert (cfg.layer_windows, cfg.has_window, cfg.uniform_window) == ((4, 0, 4), True, 0)
    assert ModelConfig.from_json(cfg.to_json()) == cfg
    with pytest.raises(ValueError, match="layer_types"):
        dataclasses.replace(cfg, layer_types=("sliding_attention",))


@pytest.mark.parametrize("backend", [*BACKENDS, "pallas"])
def test_prefill_logits_match_transformers(model, backend):
    name, cfg, params = model
    ref = np.load(TINY / name / "ref_logits.npz")
    ids = ref["tokens"].tolist()
    # Pages of 4 tokens: the 5-token window spans a page boundary at every position.
    logits = all_position_logits(params, cfg, ids, page_size=4, attention_backend=backend)
    np.testing.assert_allclose(logits, ref["logits"], atol=1e-4, rtol=1e-4)
    if cfg.has_window:  # the window is what makes them match past position 4
        full = all_position_logits(params, dataclasses.replace(cfg, sliding_window=0), ids,
                                   page_size=4, attention_backend=backend)
        np.testing.assert_allclose(full[:5], ref["logits"][:5], atol=1e-4, rtol=1e-4)
        assert np.abs(full[5:] - ref["logits"][5:]).max() > 1e-2


GREEDY = SamplingParams(temperature=0, max_new_tokens=32, ignore_eos=True, top_logprobs=2)


# The packed CPU runner's engine runs are slow-marked: the CPU kernels' window and q/k norm
# are checked by the prefill logits here and by test_attention_variants.
@pytest.fixture(scope="module",
                params=["xla", pytest.param("cpu", marks=pytest.mark.slow)])
def runner(model, request):
    """A runner with split prefill compiled in (one layer per call), on XLA's dot over
    per-layer weights (xla), or the packed CPU matmul over the stacked ones (cpu)."""
    _, cfg, params = model
    cpu = request.param == "cpu"
    return small_runner(cfg, params, attention_backend=request.param,
                        cpu_matmul="packed" if cpu else "xla", per_layer_weights=not cpu,
                        enable_split_prefill=True, split_prefill_layers=1)


@pytest.mark.parametrize("split", [False, True])
def test_greedy_matches_transformers(model, runner, split):
    name, _, _ = model
    ref = np.load(TINY / name / "greedy.npz")
    assert ref["greedy_margins"].min() > 1e-2  # no near-tie: every token is comparable
    eng = Engine(engine_args(enable_split_prefill=split, split_prefill_layers=1), runner=runner)
    # Mistral's pages wholly before the window are freed as it decodes (those the prefix
    # cache does not hold), so its tokens also check that nothing reads them.
    assert eng.scheduler.config.sliding_window == (5 if name == "mistral" else 0)
    out = eng.generate([ref["prompt_ids"].tolist()], GREEDY)[0]
    assert out.output_ids == ref["greedy_ids"].tolist()
    runner.check_no_compiles()
    assert runner.compiles_after_warmup == 0


def test_chunks_prefix_cache_and_split_match_alone(model, runner):
    """Prompts of 3..60 tokens (windows end mid-page, prefixes come from the cache) in
    16-token chunks, and again on split prefill: each prompt's tokens as when run alone."""
    _, cfg, _ = model
    sampling = dataclasses.replace(GREEDY, max_new_tokens=12)
    want = each_alone(runner, prompts(cfg.vocab_size), sampling, max_prefill_tokens=64)
    for split in (False, True):
        eng = Engine(engine_args(chunked_prefill_size=16, max_prefill_tokens=16,
                                 enable_split_prefill=split, split_prefill_layers=1),
                     runner=runner)
        check_same(eng.generate(prompts(cfg.vocab_size), sampling), want)
        again = eng.generate(prompts(cfg.vocab_size), sampling)
        assert sum(o.meta_info["cached_tokens"] for o in again) > 0
        check_same(again, want)
    runner.check_no_compiles()
