"""Llama family decoder (Llama 2/3, SmolLM2, Qwen2 dense) over a paged KV pool.

Attention, the layer scan and the logits are the shared skeleton of models/layers.py;
this module adds the dense SwiGLU MLP and the CPU weight packing. Parameter layout:
models/params_layout.md.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

import cpu_kernels
from models import layers
from models.config import ModelConfig
from models.forward_batch import ForwardBatch, real_row_mask
from models.kv_pool import KVPool
from models.layers import compute_logits, embed, fused_gated_mlp, gated_mlp, unstack_layers

__all__ = ["compute_logits", "embed", "forward", "init_params", "pack_for_cpu",
           "param_shapes", "run_layer_range", "run_layers", "unstack_layers"]


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
    if "w_gate_up" in lp:  # packed (pack_for_cpu)
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


def run_layers(params: dict, kv: KVPool, h: jax.Array, batch: ForwardBatch, cfg: ModelConfig,
               *, start: jax.Array | int = 0, num_layers: int | None = None,
               attention_backend: str = "xla",
               mesh: Mesh | None = None) -> tuple[jax.Array, KVPool]:
    """Decoder layers [start, start + num_layers) (see layers.run_decoder_layers)."""
    return layers.run_decoder_layers(params, kv, h, batch, cfg, mlp, start=start,
                                     num_layers=num_layers,
                                     attention_backend=attention_backend, mesh=mesh)


def run_layer_range(params: dict, kv: KVPool, h: jax.Array, batch: ForwardBatch,
                    cfg: ModelConfig, start: jax.Array, stop: jax.Array,
                    new_kv: tuple[jax.Array, jax.Array], attention_backend: str = "xla",
                    mesh: Mesh | None = None) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """Layers [start, stop), both traced; K/V into new_kv (see layers.run_decoder_layer_range)."""
    return layers.run_decoder_layer_range(params, kv, h, batch, cfg, mlp, start, stop,
                                          new_kv, attention_backend, mesh)


def forward(params: dict, kv: KVPool, batch: ForwardBatch, cfg: ModelConfig,
            attention_backend: str = "xla",
            mesh: Mesh | None = None) -> tuple[jax.Array, KVPool]:
    """One full forward: logits [B, V] for each row's sampled token, and the updated pool.

    On a `mesh` the matmuls follow the parameters' shardings (GSPMD) and attention runs
    per device on its heads (layers.attend)."""
    h = embed(params, batch.input_ids)
    h, kv = run_layers(params, kv, h, batch, cfg, attention_backend=attention_backend,
                       mesh=mesh)
    return compute_logits(params, h, batch.logits_indices, cfg, real_row_mask(batch.seq_lens)), kv
