"""Llama family decoder (Llama 2/3, SmolLM2, Qwen2 dense) over a paged KV pool.

Attention, the layer scan and the logits are the shared skeleton of models/layers.py;
this module adds the dense SwiGLU MLP and the CPU weight packing. Parameter layout:
models/params_layout.md.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import cpu_kernels
from models import layers
from models.config import ModelConfig
from models.layers import (
    compute_logits,
    embed,
    fuse_projections,
    fused_gated_mlp,
    gated_mlp,
    unstack_layers,
)

__all__ = ["compute_logits", "embed", "forward", "fuse_projections", "init_params",
           "pack_for_cpu", "param_shapes", "run_layer_range", "run_layers", "unstack_layers"]


def param_shapes(cfg: ModelConfig) -> dict:
    """The parameter tree as {key: shape tuple} (see params_layout.md)."""
    L, D, F = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
    mlp = {"w_gate": (L, D, F), "w_up": (L, D, F), "w_down": (L, F, D)}
    return layers.model_shapes(cfg, {**layers.attention_shapes(cfg), **mlp})


def init_params(cfg: ModelConfig, key: jax.Array, dtype: jnp.dtype = jnp.float32) -> dict:
    """Random weights with the real layout (see layers.init_from_shapes)."""
    return layers.init_from_shapes(param_shapes(cfg), key, dtype)


def mlp(lp: dict, x: jax.Array) -> jax.Array:
    """The dense SwiGLU MLP: x [T, D] -> [T, D]."""
    if "w_gate_up" in lp:  # fused (fuse_projections, pack_for_cpu)
        return fused_gated_mlp(x, lp["w_gate_up"], lp["w_down"])
    return gated_mlp(x, lp["w_gate"], lp["w_up"], lp["w_down"])


def pack_for_cpu(params: dict, quantization: str | None = None, compress: bool = False) -> dict:
    """Weights for cpu_kernels.packed_matmul: per layer wq|wk|wv as `wqkv` and
    w_gate|w_up as `w_gate_up` (fewer, wider calls), wo and w_down packed, and the output
    head as a packed `lm_head` (for tied embeddings a transposed copy beside `embed`,
    which the token lookup keeps using, in f32). Weights keep their dtype (float32 or
    bfloat16), or with quantization="int8" these matrices become weight-only int8 with a
    scale per output column (cpu_kernels.pack_int8; the fused matrices are quantized
    after fusing, which is the same per column), or with `compress` bfloat16 matrices are
    stored in 12 bits each, losslessly (cpu_kernels.pack_x12). Norms and the lookup table
    stay as they are. Stacked or per-layer (unstack_layers) trees."""
    if quantization not in (None, "int8"):
        raise ValueError(f"quantization={quantization!r}: expected None or 'int8'")
    pack = (cpu_kernels.pack_int8 if quantization == "int8" else
            cpu_kernels.pack_x12 if compress else cpu_kernels.pack)
    fused = {"wqkv": ("wq", "wk", "wv"), "wo": ("wo",), "w_gate_up": ("w_gate", "w_up"),
             "w_down": ("w_down",)}
    dropped = {name for parts in fused.values() for name in parts}

    def pack_layer(lp: dict) -> dict:
        out = {k: v for k, v in lp.items() if k not in dropped}
        for name, parts in fused.items():
            out[name] = pack(jnp.concatenate([lp[p] for p in parts], axis=-1))
        return out

    out = dict(params)
    if "layer_list" in params:
        out["layer_list"] = [pack_layer(lp) for lp in params["layer_list"]]
    else:
        out["layers"] = pack_layer(params["layers"])
    head = params["lm_head"] if "lm_head" in params else params["embed"].T  # [D, V]
    out["lm_head"] = pack(head)
    # The lookup gathers a few rows, but XLA CPU gathers from a bf16 table by converting
    # all of it to f32 first (49152 x 576: tens of ms a step); an f32 table holds the same
    # values and is gathered in place.
    out["embed"] = params["embed"].astype(jnp.float32)
    return out


# The decoder skeleton of models/layers.py with the dense MLP.
_DECODER = layers.Decoder(lambda cfg, mesh: mlp)
run_layers, run_layer_range, forward = (_DECODER.run_layers, _DECODER.run_layer_range,
                                        _DECODER.forward)
