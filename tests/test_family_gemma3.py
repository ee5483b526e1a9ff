"""Gemma 3 text (Gemma3ForCausalLM) against transformers on tiny random models (fixtures:
scripts/make_reference.py --only=gemma3): the HF config and weight map, prefill logits on
every CPU path, and 32 greedy tokens through the Engine, plain and split prefill.

"gemma3_wide" has a window longer than any sequence here (everything but the window);
"gemma3" a 4-token window, exceeded by its sequences, and final logit soft-capping."""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from models import gemma3, registry
from models.config import ModelConfig, RopeScaling
from runtime import checkpoint
from runtime.request import SamplingParams
from tests.engine_utils import engine_args, small_runner
from tests.model_utils import all_position_logits

FIXTURES = Path(__file__).parent / "fixtures" / "tiny_models"
MODELS = ["gemma3_wide", "gemma3"]


def _load(name: str) -> tuple[ModelConfig, dict, dict]:
    cfg, params = checkpoint.load_hf_safetensors(str(FIXTURES / name))
    return cfg, params, dict(np.load(FIXTURES / name / "ref_logits.npz"))


def test_config_from_the_hf_folder():
    cfg = checkpoint.load_hf_config(str(FIXTURES / "gemma3"))
    assert registry.model_module(cfg) is gemma3 and registry.has_packed_matmul(cfg)
    assert (cfg.norm_offset, cfg.qk_norm, cfg.tie_word_embeddings) == (1.0, True, True)
    assert cfg.sm_scale == 24 ** -0.5 and cfg.final_logit_softcap == 10.0
    assert cfg.sliding_layers == (True, False, True, False)
    assert cfg.layer_windows == (4, 0, 4, 0) and cfg.attn_logit_softcapping == 0.0
    assert (cfg.rope_theta, cfg.rope_local_theta) == (1e5, 1e3)
    assert cfg.rope_scaling == RopeScaling(factor=4.0, rope_type="linear")
    assert ModelConfig.from_json(cfg.to_json()) == cfg


def test_config_of_a_hub_release():
    """A config.json as google/gemma-3-4b-it's text part has it (before transformers 5):
    flat rope fields, the window pattern instead of layer_types."""
    hub = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
           "vocab_size": 262208, "hidden_size": 2560, "intermediate_size": 10240,
           "num_hidden_layers": 34, "num_attention_heads": 8, "num_key_value_heads": 4,
           "head_dim": 256, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
           "rope_local_base_freq": 1e4, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
           "sliding_window": 1024, "sliding_window_pattern": 6, "query_pre_attn_scalar": 256,
           "final_logit_softcapping": None, "attn_logit_softcapping": None,
           "hidden_activation": "gelu_pytorch_tanh", "bos_token_id": 2, "eos_token_id": [1, 106]}
    cfg = ModelConfig.from_hf_config(hub)
    assert cfg.sliding_layers == tuple((i + 1) % 6 != 0 for i in range(34))
    assert cfg.layer_windows == tuple(1024 if s else 0 for s in cfg.sliding_layers)
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.rope_scaling.factor) == (1e6, 1e4, 8.0)
    assert cfg.tie_word_embeddings and cfg.eos_token_ids == (1, 106)
    with pytest.raises(ValueError, match="hidden_activation"):
        ModelConfig.from_hf_config({**hub, "hidden_activation": "relu"})
    with pytest.raises(ValueError, match="attn_logit_softcapping"):
        ModelConfig.from_hf_config({**hub, "attn_logit_softcapping": 50.0})


def test_weight_map_reads_the_four_norms():
    """Gemma's post_attention_layernorm follows attention; pre_feedforward_layernorm is
    the MLP's input norm (Llama's post_attention_layernorm)."""
    from safetensors.numpy import load_file

    _, params, _ = _load("gemma3")
    hf = load_file(str(FIXTURES / "gemma3" / "model.safetensors"))
    layer = params["layers"]
    for key, name in [("attn_norm", "input_layernorm"),
                      ("post_attn_norm", "post_attention_layernorm"),
                      ("mlp_norm", "pre_feedforward_layernorm"),
                      ("post_mlp_norm", "post_feedforward_layernorm")]:
        np.testing.assert_array_equal(layer[key][2], hf[f"model.layers.2.{name}.weight"])
    assert "lm_head" not in params


@pytest.mark.parametrize("path", ["xla", "cpu_kernels", "pallas"])
@pytest.mark.parametrize("name", MODELS)
def test_prefill_logits_match_transformers(name, path):
    """XLA's dot with jnp attention; the packed CPU matmuls with the CPU attention
    kernels; the Pallas kernels (interpreted on a CPU)."""
    cfg, params, ref = _load(name)
    if path == "cpu_kernels":
        params = gemma3.pack_for_cpu(params)
    logits = all_position_logits(params, cfg, ref["tokens"].tolist(), page_size=4,
                                 attention_backend="cpu" if path == "cpu_kernels" else path)
    np.testing.assert_allclose(logits, ref["logits"], atol=1e-4, rtol=1e-4)


# The wide-window model's engine runs are slow-marked: "gemma3" runs the same paths with its
# window inside the sequence.
@pytest.fixture(scope="module", params=[
    pytest.param((n, m, a), marks=[pytest.mark.slow] if n == "gemma3_wide" else [])
    for n in MODELS for m, a in [("packed", "cpu"), ("xla", "xla")]],
    ids=lambda p: f"{p[0]}-{'cpu_kernels' if p[1] == 'packed' else 'xla'}")
def model_runner(request):
    """(fixture arrays, runner) per model and CPU path; the xla runner holds per-layer,
    fused wq|wk|wv and w_gate|w_up weights, as on a GPU."""
    name, matmul, attention = request.param
    cfg, params, ref = _load(name)
    return ref, small_runner(cfg, params, cpu_matmul=matmul, attention_backend=attention,
                             per_layer_weights=matmul == "xla",
                             fuse_projections=matmul == "xla", enable_split_prefill=True)


@pytest.mark.parametrize("split", [False, True], ids=["plain", "split_prefill"])
def test_engine_greedy_matches_transformers(model_runner, split):
    """3 concurrent requests of the fixture's 8-token prompt: 32 greedy tokens equal
    transformers' (its top-2 margins all clear 0.05), nothing compiled after warm-up."""
    from runtime.engine import Engine

    ref, runner = model_runner
    assert ref["greedy_margins"].min() > 0.05
    eng = Engine(engine_args(enable_split_prefill=split, split_prefill_layers=1,
                             split_prefill_min_tokens=0), runner=runner)
    prompt = ref["prompt_ids"].tolist()
    outs = eng.generate([prompt] * 3, SamplingParams(temperature=0, max_new_tokens=32,
                                                     ignore_eos=True))
    for out in outs:
        assert out.output_ids == ref["greedy_ids"].tolist()
    modes = {s.mode for s in eng.trace.steps()}
    assert ("split_prefill" in modes) == split, modes
    runner.check_no_compiles()


def test_init_params_centres_the_norms():
    cfg = checkpoint.load_hf_config(str(FIXTURES / "gemma3"))
    import jax

    params = gemma3.init_params(cfg, jax.random.key(0), jnp.bfloat16)
    assert params["layers"]["post_mlp_norm"].dtype == jnp.bfloat16
    assert abs(float(params["final_norm"].astype(jnp.float32).mean())) < 0.1
    assert json.loads(cfg.to_json())["layer_types"][1] == "full_attention"


def test_bf16_embedding_scale_is_rounded_as_hf_rounds_it():
    """bf16 weights: sqrt(D) is rounded to bf16 and the product too (HF multiplies in the
    table's dtype); the packed path's pre-scaled f32 table holds the same values."""
    import jax

    cfg, params, _ = _load("gemma3_wide")
    params = jax.tree.map(lambda w: jnp.asarray(w, jnp.bfloat16), params)
    ids = jnp.arange(0, 200, 7, dtype=jnp.int32)
    plain = gemma3.embed(params, ids)  # [T, D] bf16
    packed = gemma3.embed(gemma3.pack_for_cpu(params), ids)  # [T, D] f32
    assert plain.dtype == jnp.bfloat16 and packed.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(plain, np.float32), np.asarray(packed))
    want = (params["embed"][ids] * jnp.bfloat16(8.0)).astype(jnp.float32)  # sqrt(64) = 8
    np.testing.assert_array_equal(np.asarray(packed), np.asarray(want))


def test_tensor_parallel_greedy_matches_transformers():
    """tp=2 (4 fake devices; each holds 2 query heads, 1 KV head): the fixture's 32 greedy
    tokens, nothing compiled after warm-up."""
    from runtime.engine import Engine
    from runtime.sharding import serving_mesh

    cfg, params, ref = _load("gemma3_wide")
    runner = small_runner(cfg, params, serving_mesh(cfg, tp=2))
    assert runner.params["layer_list"][0]["wq"].sharding.spec[-1] == "tp"
    out = Engine(engine_args(), runner=runner).generate(
        [ref["prompt_ids"].tolist()], SamplingParams(temperature=0, max_new_tokens=32,
                                                     ignore_eos=True))[0]
    assert out.output_ids == ref["greedy_ids"].tolist()
    runner.check_no_compiles()
