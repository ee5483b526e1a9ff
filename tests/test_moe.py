"""MoE models (models/moe.py) against Hugging Face transformers on committed tiny random
Qwen2-MoE / Qwen3-MoE / Mixtral checkpoints (scripts/make_reference.py --only=tiny_moe),
and the MoE config / matmul-path plumbing."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest

from models import moe, registry
from models.config import ModelConfig
from runtime import checkpoint
from runtime.config import ServerArgs
from runtime.engine_setup import default_cpu_matmul
from tests.model_utils import all_position_logits

TINY = Path(__file__).parent / "fixtures" / "tiny_models"
MOE_MODELS = pytest.mark.parametrize("name", ["qwen2_moe", "qwen3_moe", "mixtral"])


@MOE_MODELS
def test_config_parsed_from_hf(name):
    cfg = checkpoint.load_hf_config(str(TINY / name))
    assert (cfg.architecture, cfg.num_experts, cfg.num_experts_per_tok) == (name, 8, 2)
    assert cfg.moe_intermediate_size == 32
    assert cfg.shared_expert_intermediate_size == (48 if name == "qwen2_moe" else 0)
    assert cfg.norm_topk_prob == (name != "qwen2_moe")
    assert cfg.qk_norm == (name == "qwen3_moe")
    assert cfg.attention_bias == (name == "qwen2_moe")
    assert ModelConfig.from_json(cfg.to_json()) == cfg


def test_dense_layers_inside_moe_are_rejected():
    hf = json.loads((TINY / "qwen2_moe" / "config.json").read_text())
    with pytest.raises(ValueError, match="mlp_only_layers"):
        ModelConfig.from_hf_config({**hf, "mlp_only_layers": [1]})


@MOE_MODELS
def test_moe_block_matches_transformers(name):
    """Layer 0's MoE MLP alone (routing, experts, shared expert) on 16 random tokens."""
    cfg, params = checkpoint.load_hf_safetensors(str(TINY / name))
    ref = np.load(TINY / name / "ref_logits.npz")
    lp = jax.tree.map(lambda w: w[0], params["layers"])
    out = jax.jit(moe.MoeMlp(cfg))(lp, ref["moe_in"])
    np.testing.assert_allclose(np.asarray(out), ref["moe_out"], atol=1e-5, rtol=1e-5)


@MOE_MODELS
@pytest.mark.parametrize("attention", ["xla", "cpu"])
def test_moe_model_logits_match_transformers(name, attention):
    cfg, params = checkpoint.load_hf_safetensors(str(TINY / name))
    ref = np.load(TINY / name / "ref_logits.npz")
    logits = all_position_logits(params, cfg, ref["tokens"].tolist(), page_size=4,
                                 attention_backend=attention)
    np.testing.assert_allclose(logits, ref["logits"], atol=1e-4, rtol=1e-4)


def test_moe_uses_xla_matmul_by_default():
    cfg = registry.PRESETS["tiny-moe"]
    assert default_cpu_matmul(ServerArgs(), cfg) == "xla"
    with pytest.raises(ValueError, match="packed"):
        moe.pack_for_cpu({})


def test_preset_is_deterministic():
    a = registry.load_preset("tiny-moe")[1]
    b = registry.load_preset("tiny-moe")[1]
    assert a["layers"]["we_gate"].shape == (4, 8, 128, 64)
    np.testing.assert_array_equal(np.asarray(a["layers"]["router"]),
                                  np.asarray(b["layers"]["router"]))


def test_orbax_roundtrip_of_stacked_experts(tmp_path):
    cfg, params = checkpoint.load_hf_safetensors(str(TINY / "qwen2_moe"))
    checkpoint.save_checkpoint(str(tmp_path / "ckpt"), cfg, params)
    cfg2, restored = checkpoint.restore_checkpoint(str(tmp_path / "ckpt"))
    assert cfg2 == cfg
    for key in ("we_down", "ws_router", "router"):
        np.testing.assert_array_equal(np.asarray(restored["layers"][key]),
                                      params["layers"][key])
