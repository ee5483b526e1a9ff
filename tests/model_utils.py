"""Test helpers: tiny configs, a dense numpy Llama, and single-call batches."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig, RopeScaling
from models.forward_batch import ForwardBatch, ForwardMode
from models.layers import rope_inv_freq
from runtime.batch_builder import BucketShape, pack_rows

TINY = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=3,
                   num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0,
                   rope_scaling=RopeScaling(factor=8.0, original_max_position_embeddings=64))


@dataclasses.dataclass
class SimpleRow:
    input_ids: list[int]
    start_pos: int
    pages: list[int]


def make_batch(mode: ForwardMode, extend: list[SimpleRow], decode: list[SimpleRow],
               shape: BucketShape, page_size: int) -> ForwardBatch:
    arrays = pack_rows(extend, decode, shape, page_size)
    return ForwardBatch(**{k: jnp.asarray(v) for k, v in arrays.items()}, mode=mode,
                        num_extend_tokens=shape.num_extend_tokens,
                        num_extend_seqs=shape.num_extend_seqs)


def numpy_norm_rope(cfg: ModelConfig, t: int) -> tuple[Callable, Callable]:
    """f64 numpy RMSNorm(x, w) and rotate-half rope(x [T, H, Dh]) over positions 0..t-1,
    for the reference decoders below and in the tests."""
    inv = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).astype(np.float64)
    ang = np.arange(t)[:, None] * inv[None]
    cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]

    def norm(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + cfg.rms_norm_eps) * w

    def rope(x):
        h = x.shape[-1] // 2
        return np.concatenate([x[..., :h] * cos - x[..., h:] * sin,
                               x[..., h:] * cos + x[..., :h] * sin], -1)

    return norm, rope


def dense_llama_logits(params: dict, cfg: ModelConfig, ids: list[int]) -> np.ndarray:
    """Straightforward numpy f64 Llama over one sequence -> logits [T, V]."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    t = len(ids)
    norm, rope = numpy_norm_rope(cfg, t)

    x = p["embed"][ids]
    g = cfg.num_heads // cfg.num_kv_heads
    for i in range(cfg.num_layers):
        lp = {k: v[i] for k, v in p["layers"].items()}
        a = norm(x, lp["attn_norm"])
        q, k, v = a @ lp["wq"], a @ lp["wk"], a @ lp["wv"]
        if cfg.attention_bias:
            q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
        q = rope(q.reshape(t, cfg.num_heads, cfg.head_dim))
        k = np.repeat(rope(k.reshape(t, cfg.num_kv_heads, cfg.head_dim)), g, axis=1)
        v = np.repeat(v.reshape(t, cfg.num_kv_heads, cfg.head_dim), g, axis=1)
        s = np.einsum("thd,shd->hts", q, k) / np.sqrt(cfg.head_dim)
        s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
        pr = np.exp(s - s.max(-1, keepdims=True))
        pr /= pr.sum(-1, keepdims=True)
        o = np.einsum("hts,shd->thd", pr, v).reshape(t, -1)
        x = x + o @ lp["wo"]
        m = norm(x, lp["mlp_norm"])
        silu = (m @ lp["w_gate"]) / (1 + np.exp(-(m @ lp["w_gate"])))
        x = x + (silu * (m @ lp["w_up"])) @ lp["w_down"]
    x = norm(x, p["final_norm"])
    head = p["embed"].T if cfg.tie_word_embeddings else p["lm_head"]
    return x @ head


def all_position_logits(params: dict, cfg: ModelConfig, ids: list[int], page_size: int = 16,
                        attention_backend: str = "xla", kv_dtype: Any = np.float32,
                        mesh: Any = None) -> np.ndarray:
    """Our forward over one sequence in a single EXTEND call -> logits [T, V] (f32);
    `kv_dtype`: the pool's (its dtype rounds this step's K/V, see layers.attend); `mesh`:
    the pool split over KV heads (runtime/sharding.kv_sharding), the batch replicated."""
    from models.kv_pool import init_kv_pool
    from models.registry import model_module
    from runtime.config import CacheConfig

    t = len(ids)
    n_pages = -(-t // page_size)
    cache = CacheConfig(page_size=page_size, num_pages=n_pages + 1)
    kv_sh = None
    if mesh is not None:
        from models.kv_pool import kv_pool_shape
        from runtime import sharding

        kv_sh = sharding.kv_sharding(cfg, kv_pool_shape(cfg, cache), mesh)
    kv = init_kv_pool(cfg, cache, kv_dtype, kv_sh)
    batch = make_batch(ForwardMode.EXTEND, [SimpleRow(list(ids), 0, list(range(1, n_pages + 1)))],
                       [], BucketShape(t, 1, 0, n_pages), page_size)
    if mesh is not None:
        from jax.sharding import NamedSharding, PartitionSpec

        batch = jax.device_put(batch, NamedSharding(mesh, PartitionSpec()))

    model = model_module(cfg)

    @jax.jit
    def run(params, kv, batch):
        h, _ = model.run_layers(params, kv, model.embed(params, batch.input_ids), batch, cfg,
                                attention_backend=attention_backend, mesh=mesh)
        return model.compute_logits(params, h, jnp.arange(t), cfg)

    return np.asarray(run(params, kv, batch))
