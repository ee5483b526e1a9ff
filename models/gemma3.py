"""Gemma 3 text decoder (Gemma3ForCausalLM) over a paged KV pool.

The shared skeleton of models/layers.py with Gemma's choices, most of them config
fields (models/config.py `_gemma3_fields`): RMSNorm scaling by (1 + w), q/k norm, the
attention scale query_pre_attn_scalar**-0.5, sliding-window layers with their own rope
(rope_local_theta) between global ones, final logit soft-capping. This module adds what
the config does not say: the post-attention and post-MLP norms (`post_attn_norm`,
`post_mlp_norm`, which layers.out_mlp applies where a layer has them), the
gelu-tanh gated MLP, and the embedding scaled by sqrt(hidden_size).
Parameter layout: models/params_layout.md.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from cpu_kernels import PackedWeight
from models import layers, llama
from models.config import ModelConfig
from models.layers import compute_logits, fuse_projections, linear, unstack_layers

__all__ = ["compute_logits", "embed", "forward", "fuse_projections", "init_params",
           "pack_for_cpu", "param_shapes", "run_layer_range", "run_layers", "unstack_layers"]


def param_shapes(cfg: ModelConfig) -> dict:
    """Llama's tree (with q_norm / k_norm) plus the two norms of each layer's outputs."""
    shapes = llama.param_shapes(cfg)
    L, D = cfg.num_layers, cfg.hidden_size
    shapes["layers"].update(post_attn_norm=(L, D), post_mlp_norm=(L, D))
    return shapes


def init_params(cfg: ModelConfig, key: jax.Array, dtype: jnp.dtype = jnp.float32) -> dict:
    """Random weights with the real layout; norm weights near 0, as Gemma stores them."""
    params = layers.init_from_shapes(param_shapes(cfg), key, jnp.float32)

    def center(path: tuple, w: jax.Array) -> jax.Array:
        return w - cfg.norm_offset if "norm" in path[-1].key else w

    return jax.tree.map(lambda w: w.astype(dtype),
                        jax.tree_util.tree_map_with_path(center, params))


def mlp(lp: dict, x: jax.Array) -> jax.Array:
    """Gated MLP with tanh-approximated GELU (gelu_pytorch_tanh): x [T, D] -> [T, D]."""
    if "w_gate_up" in lp:  # fused (fuse_projections, pack_for_cpu)
        gate, up = jnp.split(linear(x, lp["w_gate_up"]), 2, axis=-1)  # [T, F] each
    else:
        gate, up = x @ lp["w_gate"], x @ lp["w_up"]
    return linear(jax.nn.gelu(gate, approximate=True) * up, lp["w_down"])


def embed(params: dict, input_ids: jax.Array) -> jax.Array:
    """input_ids [T] -> hidden [T, D], times sqrt(D) rounded to the table's dtype as HF
    does (bf16 Gemma multiplies by 55.5, not 55.43, at D = 3072). The packed CPU path's
    table is pre-scaled (pack_for_cpu)."""
    table = params["embed"]  # [V, D]
    h = layers.embed(params, input_ids)
    if isinstance(params.get("lm_head"), PackedWeight):
        return h
    return h * jnp.asarray(math.sqrt(table.shape[-1]), table.dtype)


def pack_for_cpu(params: dict, quantization: str | None = None, compress: bool = False) -> dict:
    """llama.pack_for_cpu (the matrices are Llama's), with the f32 lookup table scaled by
    sqrt(D) in the weights' own dtype first: that table only serves the lookup (the head
    is a packed copy), and the product is then HF's to the bit."""
    out = llama.pack_for_cpu(params, quantization, compress)
    table = params["embed"]  # [V, D]
    scaled = table * jnp.asarray(math.sqrt(table.shape[-1]), table.dtype)
    return {**out, "embed": scaled.astype(jnp.float32)}


_DECODER = layers.Decoder(lambda cfg, mesh: mlp, embed)
run_layers, run_layer_range, forward = (_DECODER.run_layers, _DECODER.run_layer_range,
                                        _DECODER.forward)
