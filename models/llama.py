"""Llama family decoder (Llama 2/3, SmolLM2, Qwen2 dense) over a paged KV pool.

Parameter layout: models/params_layout.md.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from runtime.config import ModelConfig


def param_shapes(cfg: ModelConfig) -> dict:
    """The parameter tree as {key: shape tuple} (see params_layout.md)."""
    L, D, F = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
    layers = {
        "attn_norm": (L, D),
        "wq": (L, D, cfg.q_size),
        "wk": (L, D, cfg.kv_size),
        "wv": (L, D, cfg.kv_size),
        "wo": (L, cfg.q_size, D),
        "mlp_norm": (L, D),
        "w_gate": (L, D, F),
        "w_up": (L, D, F),
        "w_down": (L, F, D),
    }
    if cfg.attention_bias:
        layers.update(bq=(L, cfg.q_size), bk=(L, cfg.kv_size), bv=(L, cfg.kv_size))
    tree = {"embed": (cfg.vocab_size, D), "final_norm": (D,), "layers": layers}
    if not cfg.tie_word_embeddings:
        tree["lm_head"] = (D, cfg.vocab_size)
    return tree


def init_params(cfg: ModelConfig, key: jax.Array, dtype: jnp.dtype = jnp.float32) -> dict:
    """Random weights with the real layout (norms near 1, matrices ~ N(0, 1/fan_in))."""
    shapes = param_shapes(cfg)
    leaves, treedef = jax.tree.flatten(shapes, is_leaf=lambda x: isinstance(x, tuple))
    keys = jax.random.split(key, len(leaves))
    out = []
    for (path, shape), k in zip(
        jax.tree_util.tree_flatten_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple))[0],
        keys,
    ):
        name = jax.tree_util.keystr(path)
        if "norm" in name:
            w = 1.0 + 0.1 * jax.random.normal(k, shape)
        elif name.endswith("['bq']") or name.endswith("['bk']") or name.endswith("['bv']"):
            w = 0.1 * jax.random.normal(k, shape)
        else:
            fan_in = shape[-2] if len(shape) >= 2 and "embed" not in name else 1.0
            w = jax.random.normal(k, shape) * (fan_in ** -0.5 if "embed" not in name else 1.0)
        out.append(w.astype(dtype))
    return jax.tree.unflatten(treedef, out)
