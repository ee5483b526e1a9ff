"""Hugging Face tensor names of DeepSeek-V2/V3 (MLA + DeepSeek-MoE) for runtime/checkpoint.py.

kv_b_proj [H*(Dn+Dv), C] holds each head's key rows then its value rows; the absorbed
form (models/mla.py) keeps them apart: w_uk [H, Dn, C] and w_uv [H, C, Dv].
"""

from __future__ import annotations

import numpy as np

from models.config import ModelConfig

_ATTN = "model.layers.{i}.self_attn."
_MLP = "model.layers.{i}.mlp."
HF_NAMES: dict[str, str] = {
    "wq": _ATTN + "q_proj.weight",
    "wq_a": _ATTN + "q_a_proj.weight",
    "q_a_norm": _ATTN + "q_a_layernorm.weight",
    "wq_b": _ATTN + "q_b_proj.weight",
    "w_kv_a": _ATTN + "kv_a_proj_with_mqa.weight",
    "kv_a_norm": _ATTN + "kv_a_layernorm.weight",
    "w_uk": _ATTN + "kv_b_proj.weight",
    "w_uv": _ATTN + "kv_b_proj.weight",
    "router": _MLP + "gate.weight",
    "router_bias": _MLP + "gate.e_score_correction_bias",
    "we_gate": _MLP + "experts.{j}.gate_proj.weight",
    "we_up": _MLP + "experts.{j}.up_proj.weight",
    "we_down": _MLP + "experts.{j}.down_proj.weight",
    "ws_gate": _MLP + "shared_experts.gate_proj.weight",
    "ws_up": _MLP + "shared_experts.up_proj.weight",
    "ws_down": _MLP + "shared_experts.down_proj.weight",
}
# Stored [out, in], used [in, out].
TRANSPOSED = frozenset({"wq_a", "wq_b", "w_kv_a"})
KV_B_KEYS = ("w_uk", "w_uv")


def kv_b_shape(cfg: ModelConfig) -> tuple[int, int]:
    m = cfg.mla
    return cfg.num_heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank


def split_kv_b(cfg: ModelConfig, key: str, w: np.ndarray) -> np.ndarray:
    """kv_b_proj [H*(Dn+Dv), C] -> w_uk [H, Dn, C] or w_uv [H, C, Dv]."""
    m = cfg.mla
    per_head = w.reshape(cfg.num_heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
    if key == "w_uk":
        return per_head[:, :m.qk_nope_head_dim]
    return per_head[:, m.qk_nope_head_dim:].transpose(0, 2, 1)


def beyond_layers(cfg: ModelConfig, names: set[str]) -> set[str]:
    """DeepSeek-V3's multi-token-prediction layers (model.layers.{L}.*, past the decoder),
    which serving does not run."""
    prefixes = tuple(f"model.layers.{i}." for i in range(cfg.num_layers, cfg.num_layers + 4))
    return {n for n in names if n.startswith(prefixes)}
