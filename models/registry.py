"""Architecture name -> model module, and the named presets.

The runner, the checkpoint code and the shardings ask this module for a config's model
module (param_shapes, init_params, forward, run_layers, unstack_layers, fuse_projections,
pack_for_cpu), so none of them names a model family.
"""

from __future__ import annotations

from types import ModuleType

import jax
import jax.numpy as jnp

from models import deepseek, gemma3, llama, moe
from models.config import ModelConfig

_FAMILIES: dict[str, ModuleType] = {
    "llama": llama, "qwen2": llama, "qwen3": llama, "qwen2_moe": moe, "qwen3_moe": moe,
    "mixtral": moe, "gemma3": gemma3, "gpt_oss": moe, "deepseek_v2": deepseek,
    "deepseek_v3": deepseek,
}

# Random-weight models for tests and demos: the SmolLM2 tokenizer's vocabulary, weights
# from a fixed seed (the PRNG, not a file), so every process builds the same model.
PRESETS: dict[str, ModelConfig] = {
    "tiny-moe": ModelConfig(
        vocab_size=49152, hidden_size=128, intermediate_size=256, num_layers=4, num_heads=4,
        num_kv_heads=2, head_dim=32, rope_theta=10000.0, max_position_embeddings=2048,
        tie_word_embeddings=True, attention_bias=True, architecture="qwen2_moe",
        bos_token_id=1, eos_token_ids=(2,), num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=64, shared_expert_intermediate_size=128),
    # A bigger MoE for CPU benchmarks (two-batch overlap, expert parallelism): ~90M
    # parameters, 16 experts top-4 in 8 layers.
    "small-moe": ModelConfig(
        vocab_size=49152, hidden_size=512, intermediate_size=1024, num_layers=8,
        num_heads=8, num_kv_heads=4, head_dim=64, rope_theta=10000.0,
        max_position_embeddings=2048, tie_word_embeddings=True, attention_bias=True,
        architecture="qwen2_moe", bos_token_id=1, eos_token_ids=(2,), num_experts=16,
        num_experts_per_tok=4, moe_intermediate_size=256, shared_expert_intermediate_size=512),
}
PRESET_SEED = 0


def model_module(cfg: ModelConfig) -> ModuleType:
    """The module implementing cfg's architecture."""
    try:
        return _FAMILIES[cfg.architecture]
    except KeyError:
        raise ValueError(f"no model implements architecture {cfg.architecture!r}; known: "
                         f"{sorted(_FAMILIES)}") from None


def has_packed_matmul(cfg: ModelConfig) -> bool:
    """Whether the CPU packed-matmul path (cpu_kernels) covers this family's weights."""
    return model_module(cfg) in (llama, gemma3)


def load_preset(name: str, dtype: str = "float32") -> tuple[ModelConfig, dict]:
    """(config, params) of a preset (see PRESETS)."""
    cfg = PRESETS[name]
    return cfg, model_module(cfg).init_params(cfg, jax.random.key(PRESET_SEED),
                                              jnp.dtype(dtype))
