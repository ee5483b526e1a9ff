"""Multi-head latent attention (DeepSeek-V2/V3) on the shared decoder skeleton.

The pool caches one latent row per token and layer, [c_kv | k_pe] of kv_lora_rank +
qk_rope_head_dim (KV pool with one KV head of that width and no V: models/kv_pool.py).
Every step runs the absorbed form over it, as SGLang's MLA decode does:

  q_lat = q_nope @ W_UK[h]            [T, H, C]      (W_UK: kv_b_proj's key rows, per head)
  score = (q_lat . c_kv + q_pe . k_pe) * scale       (MQA: every head reads the one row)
  o_lat = softmax(score) @ c_kv       [T, H, C]
  o     = o_lat @ W_UV[h]             [T, H, Dv]     (W_UV: kv_b_proj's value rows)

so attention is plain paged MQA with one KV head of dim C + R whose value is the key row
itself: every backend (xla, cpu, pallas) runs it unchanged, and the value's last R dims
(the rope part) are computed and dropped. Prefill uses the same form; expanding k/v per
head would cost fewer flops at long prompts, and is left to a kernel that needs it.

Parameter layout per layer (models/params_layout.md): wq [D, H*(Dn+R)] or wq_a [D, Q] +
q_a_norm [Q] + wq_b [Q, H*(Dn+R)]; w_kv_a [D, C+R], kv_a_norm [C]; w_uk [H, Dn, C],
w_uv [H, C, Dv] (both from kv_b_proj); wo [H*Dv, D].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from models import layers
from models.config import ModelConfig


def attention_shapes(cfg: ModelConfig) -> dict:
    """The per-layer MLA weights and the two norms every layer has."""
    m, L, D, H = cfg.mla, cfg.num_layers, cfg.hidden_size, cfg.num_heads
    q_out = H * m.qk_head_dim
    out = {"attn_norm": (L, D), "mlp_norm": (L, D), "w_kv_a": (L, D, m.latent_dim),
           "kv_a_norm": (L, m.kv_lora_rank), "w_uk": (L, H, m.qk_nope_head_dim, m.kv_lora_rank),
           "w_uv": (L, H, m.kv_lora_rank, m.v_head_dim), "wo": (L, H * m.v_head_dim, D)}
    if m.q_lora_rank:
        out.update(wq_a=(L, D, m.q_lora_rank), q_a_norm=(L, m.q_lora_rank),
                   wq_b=(L, m.q_lora_rank, q_out))
    else:
        out["wq"] = (L, D, q_out)
    return out


def _rope(x: jax.Array, cos: jax.Array, sin: jax.Array, interleaved: bool) -> jax.Array:
    """x [T, H, R]. Interleaved pairs (x0, x1), (x2, x3) are gathered to [evens | odds]
    first, then rotated as rotate-half; q and k get the same order, so their products
    equal transformers' (whose output keeps either order)."""
    if interleaved:
        x = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
    return layers.apply_rope(x, cos, sin)


def qkv(lp: dict, h: jax.Array, cos: jax.Array, sin: jax.Array,
        cfg: ModelConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
    """h [T, D] -> q [T, H, C+R] (absorbed), the latent row k [T, 1, C+R] and an empty
    v [T, 1, 0] (the value is the latent: see the module docstring)."""
    m, t, eps = cfg.mla, h.shape[0], cfg.rms_norm_eps
    x = layers.rms_norm(h, lp["attn_norm"], eps)  # [T, D]
    if m.q_lora_rank:
        q = layers.rms_norm(x @ lp["wq_a"], lp["q_a_norm"], eps) @ lp["wq_b"]
    else:
        q = x @ lp["wq"]  # [T, H*(Dn+R)]
    q = q.reshape(t, cfg.num_heads, m.qk_head_dim)
    q_nope, q_pe = q[..., :m.qk_nope_head_dim], q[..., m.qk_nope_head_dim:]
    q_lat = jnp.einsum("thn,hnc->thc", q_nope, lp["w_uk"])  # [T, H, C]
    kv = x @ lp["w_kv_a"]  # [T, C+R]
    c_kv = layers.rms_norm(kv[:, :m.kv_lora_rank], lp["kv_a_norm"], eps)  # [T, C]
    k_pe = _rope(kv[:, None, m.kv_lora_rank:], cos, sin, m.rope_interleave)  # [T, 1, R]
    q_pe = _rope(q_pe, cos, sin, m.rope_interleave)  # [T, H, R]
    q = jnp.concatenate([q_lat, q_pe.astype(q_lat.dtype)], axis=-1)  # [T, H, C+R]
    k = jnp.concatenate([c_kv[:, None], k_pe.astype(c_kv.dtype)], axis=-1)  # [T, 1, C+R]
    return q, k, jnp.zeros((t, 1, 0), k.dtype)


def output(lp: dict, o: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Attention over the latent o [T, H*(C+R)] -> per-head values [T, H*Dv] (before wo)."""
    m, t = cfg.mla, o.shape[0]
    o_lat = o.reshape(t, cfg.num_heads, m.latent_dim)[..., :m.kv_lora_rank]  # [T, H, C]
    return jnp.einsum("thc,hcv->thv", o_lat, lp["w_uv"]).reshape(t, -1)  # [T, H*Dv]
