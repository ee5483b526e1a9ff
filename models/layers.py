"""Pure building blocks shared by the model families."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from cpu_kernels import PackedWeight, packed_matmul
from runtime.config import RopeScaling


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """x [..., D], w [D]; the mean of squares in f32 as in the HF reference."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * w.astype(jnp.float32)).astype(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
    """[Dh/2] inverse frequencies, with Llama-3 frequency-dependent scaling."""
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if scaling is None:
        return inv.astype(np.float32)
    lo_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    hi_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    scaled = np.where(wavelen > lo_wavelen, inv / scaling.factor, inv)
    mid = (wavelen <= lo_wavelen) & (wavelen >= hi_wavelen)
    scaled = np.where(mid, (1 - smooth) * inv / scaling.factor + smooth * inv, scaled)
    return scaled.astype(np.float32)


def rope_cos_sin(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """positions [T] -> cos, sin [T, Dh/2] in f32, computed once per forward."""
    ang = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]
    return jnp.cos(ang), jnp.sin(ang)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE (HF layout). x [T, H, Dh], cos/sin [T, Dh/2]."""
    half = x.shape[-1] // 2
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


def linear(x: jax.Array, w: jax.Array | PackedWeight) -> jax.Array:
    """x [..., K] @ w [K, N]; a PackedWeight runs the CPU kernel (cpu_kernels)."""
    return packed_matmul(x, w) if isinstance(w, PackedWeight) else x @ w


def gated_mlp(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """SwiGLU: x [T, D] -> [T, D]."""
    return (jax.nn.silu(x @ w_gate) * (x @ w_up)) @ w_down


def fused_gated_mlp(x: jax.Array, w_gate_up: jax.Array | PackedWeight,
                    w_down: jax.Array | PackedWeight) -> jax.Array:
    """SwiGLU with gate and up in one matrix [D, 2F] (gate columns first): x [T, D] -> [T, D]."""
    gate, up = jnp.split(linear(x, w_gate_up), 2, axis=-1)  # [T, F] each
    return linear(jax.nn.silu(gate) * up, w_down)
