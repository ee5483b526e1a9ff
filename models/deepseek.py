"""DeepSeek-V2 / V3: multi-head latent attention (models/mla.py, selected by cfg.mla in
the shared skeleton) and DeepSeek-MoE (models/moe.py's routed experts with its routing
options and an ungated shared expert).

The first `first_k_dense_replace` layers run a dense SwiGLU MLP instead of the MoE. The
layer stack stays one scan: the dense MLP's weights are stacked over those layers and the
MoE's over the rest (layers.DENSE_MLP_KEYS, layers.layer_spans), so layer ranges (split
prefill, the fused multiplexed step) cross the boundary freely; a traced layer picks its
MLP with a `lax.cond` on layers.layer_weights' `dense_layer`, a per-layer weight dict
(unstack_layers) by which weights it holds.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from models import layers, llama, moe
from models.config import ModelConfig
from models.layers import compute_logits, embed, fuse_projections, unstack_layers

__all__ = ["DeepseekMlp", "compute_logits", "embed", "forward", "fuse_projections",
           "init_params", "pack_for_cpu", "param_shapes", "run_layer_range", "run_layers",
           "unstack_layers"]


def param_shapes(cfg: ModelConfig) -> dict:
    """MLA weights and norms over all layers, the dense MLP over the first
    first_k_dense_replace layers, the MoE over the rest (see params_layout.md)."""
    k, D, F = cfg.first_k_dense_replace, cfg.hidden_size, cfg.intermediate_size
    if not 0 <= k < cfg.num_layers:
        raise ValueError(f"first_k_dense_replace={k} must leave a MoE layer of "
                         f"{cfg.num_layers}")
    tree = {**layers.attention_shapes(cfg), **moe.mlp_shapes(cfg, cfg.num_layers - k)}
    if k:
        tree.update(w_gate=(k, D, F), w_up=(k, D, F), w_down=(k, F, D))
    return layers.model_shapes(cfg, tree)


def init_params(cfg: ModelConfig, key: jax.Array, dtype: jnp.dtype = jnp.float32) -> dict:
    """Random weights with the real layout (see layers.init_from_shapes)."""
    return layers.init_from_shapes(param_shapes(cfg), key, dtype)


def pack_for_cpu(params: dict, quantization: str | None = None) -> dict:
    raise ValueError("cpu_matmul='packed' is the dense Llama path; DeepSeek runs XLA's dot "
                     "(cpu_matmul='xla')")


@dataclasses.dataclass(frozen=True)
class DeepseekMlp:
    """layers.Mlp of a DeepSeek layer: the dense MLP or the MoE (see the module docstring)."""

    cfg: ModelConfig
    mesh: Mesh | None = None

    def __call__(self, lp: dict, x: jax.Array) -> jax.Array:
        routed = moe.MoeMlp(self.cfg, self.mesh)
        if "dense_layer" in lp:  # stacked weights, the layer traced
            return jax.lax.cond(lp["dense_layer"], llama.mlp, routed, lp, x)
        return routed(lp, x) if "router" in lp else llama.mlp(lp, x)


# The decoder skeleton of models/layers.py with DeepSeek's MLP (MLA comes with cfg.mla).
_DECODER = layers.Decoder(DeepseekMlp)
run_layers, run_layer_range, forward = (_DECODER.run_layers, _DECODER.run_layer_range,
                                        _DECODER.forward)
