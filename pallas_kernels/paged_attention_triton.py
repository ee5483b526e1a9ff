"""The Triton body of paged attention: the f32 fallback (see
paged_attention_mosaic.mosaic_unsupported for why f32 cannot take the Mosaic GPU body).

Pallas' Triton backend is deprecated (since jax 0.11 it may be gone, and then f32 attention
needs attention_backend="xla"). One program per (tile, KV head), one page per step, loaded
straight from GMEM; Triton pipelines the loads.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.kv_schedule import MASKED, META, KernelConfig, KVSchedule, finish, softmax_step
from pallas_kernels.mesh_types import out_struct

try:  # deprecated since jax 0.11
    from jax.experimental.pallas import triton as pltriton
except ImportError:
    pltriton = None


def paged_attention_kernel(meta_ref, pt_ref, q_ref, k_ref, v_ref, kn_ref, vn_ref, *refs,
                           cfg: KernelConfig):
    """Triton body for one (tile, KV head) program. meta [NT, 8], page table [B, Np], K / V
    pools [L, Hkv, P, S, Dh] and new K / V [T + pad, Hkv, Dh] are whole arrays in GMEM;
    refs: (sinks, o) or (o,), sinks this KV head's [M] sink logits per tile row, o this
    program's [M, Dh] tile, as q_ref is."""
    sink_ref, o_ref = refs if len(refs) == 2 else (None, refs[0])
    t, h = pl.program_id(0), pl.program_id(1)
    row, kv_len, prefix_len, pos0, nrows, new_start, layer, window = (
        meta_ref[t, i] for i in range(len(META)))
    sched = KVSchedule(kv_len, prefix_len, pos0, nrows, window, cfg)
    q = q_ref[...]  # [M, Dh]
    m_rows, bk = q.shape[0], cfg.block_kv
    hp = lax.Precision.HIGHEST  # f32 in, no tf32

    def load(pool_ref, new_ref, is_new, blk):  # -> [S, Dh]
        # Both sources are read and one is kept (f32 is not the fast path); the unused
        # source's index is clamped so the read stays in bounds.
        page = pt_ref[row, jnp.minimum(jnp.where(is_new, 0, blk), cfg.pages_per_seq - 1)]
        tok = new_start + jnp.where(is_new, blk, 0) * bk
        return jnp.where(is_new, new_ref[pl.ds(tok, bk), h, :], pool_ref[layer, h, page])

    def step(i, carry):
        acc, m, l = carry
        is_new, blk, base, bound = sched.block(i)
        k = load(k_ref, kn_ref, is_new, blk)
        v = load(v_ref, vn_ref, is_new, blk)
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=hp,
                            preferred_element_type=jnp.float32)  # [M, S]
        rows = lax.broadcasted_iota(jnp.int32, (m_rows, bk), 0)
        kv_pos = base + lax.broadcasted_iota(jnp.int32, (m_rows, bk), 1)
        p, alpha, m, l = softmax_step(s, rows, kv_pos, m, l, bound, pos0, nrows, window, cfg)
        acc = acc * alpha[:, None] + jnp.dot(p.astype(v.dtype), v, precision=hp,
                                             preferred_element_type=jnp.float32)
        return acc, m, l

    init = (jnp.zeros(q.shape, jnp.float32), jnp.full((m_rows,), MASKED, jnp.float32),
            jnp.zeros((m_rows,), jnp.float32))
    acc, m, l = lax.fori_loop(0, sched.num_steps, step, init)
    sink = None if sink_ref is None else sink_ref[...]
    o_ref[...] = finish(acc, l, m, sink).astype(o_ref.dtype)


def launch(meta, page_table, q_tiles, k_pool, v_pool, k_new, v_new, cfg: KernelConfig,
           interpret: bool, sinks=None):
    """q_tiles [NT, Hkv, M, Dh] -> output tiles [NT, Hkv, M, Dh]; sinks [Hkv, M] f32
    (kv_schedule.sink_rows) or None."""
    if pltriton is None:
        raise NotImplementedError("f32 attention needs Pallas' Triton backend, which this "
                                  "jax no longer has; use bf16 or attention_backend='xla'")
    _, _, m_rows, dh = q_tiles.shape
    anywhere = pl.BlockSpec(memory_space=pl.ANY)  # whole array, indexed inside the kernel
    tile = pl.BlockSpec((None, None, m_rows, dh), lambda t, h: (t, h, 0, 0))
    operands = (meta, page_table, q_tiles, k_pool, v_pool, k_new, v_new)
    in_specs = [anywhere, anywhere, tile] + [anywhere] * 4
    if sinks is not None:
        operands += (sinks,)
        in_specs.append(pl.BlockSpec((None, m_rows), lambda t, h: (h, 0)))
    return pl.pallas_call(
        functools.partial(paged_attention_kernel, cfg=cfg),
        grid=q_tiles.shape[:2],
        in_specs=in_specs,
        out_specs=tile,
        out_shape=out_struct(q_tiles.shape, q_tiles.dtype, *operands),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
    )(*operands)
