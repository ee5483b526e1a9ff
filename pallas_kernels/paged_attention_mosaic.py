"""The Mosaic GPU body of paged attention (16-bit inputs; Pallas' default GPU backend).

One program is one warpgroup working on a (tile, KV head, KV split): TMA copies bring KV
blocks into swizzled shared memory through a ring of `num_slots` buffers, wgmma computes
QK^T and PV, and the online softmax of kv_schedule.py folds the blocks in. Splits of one
tile are merged by log-sum-exp after the launch (flash-decoding).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.kv_schedule import (
    MASKED,
    META,
    KernelConfig,
    KVSchedule,
    apply_sinks_by_lse,
    finish,
    softmax_step,
)
from pallas_kernels.mesh_types import out_struct


def mosaic_unsupported(dtype) -> str | None:
    """Why Mosaic GPU cannot run this dtype (None if it can)."""
    if jnp.dtype(dtype).itemsize == 2:
        return None
    # f32 falls back to Triton: wgmma on f32 (tf32) accepts neither a transposed B operand
    # nor an A operand in registers, and a V page is [tokens, Dh] row-major, so P @ V would
    # need every page transposed on its way through shared memory. Triton's dot does f32
    # (with precision=HIGHEST) from plain loads.
    return f"{jnp.dtype(dtype).name}: Mosaic GPU wgmma has no f32 P @ V from row-major pages"


@functools.cache
def _gpu_interpret_params():
    """Mosaic GPU interpret mode (simulates SMEM, TMA and barriers on the CPU). It is public
    as plgpu.InterpretGPUParams in newer jax; jax 0.10 only has the private class."""
    cls = getattr(plgpu, "InterpretGPUParams", None)
    if cls is None:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams as cls
    return cls()


def _qk(q_smem, k_smem, slot, compiled: bool):
    """q [M, Dh] @ k_smem[slot]^T [Dh, BK] -> scores [M, BK] f32."""
    if not compiled:
        return lax.dot_general(q_smem[...], k_smem[slot], (((1,), (1,)), ((), ())),
                               precision=lax.Precision.HIGHEST,
                               preferred_element_type=jnp.float32)

    def scope(acc_ref):
        plgpu.wgmma(acc_ref, q_smem, plgpu.transpose_ref(k_smem.at[slot], (1, 0)))
        return acc_ref[...]
    return pl.run_scoped(scope, plgpu.ACC((q_smem.shape[0], k_smem.shape[1]), jnp.float32))


def _pv(acc, p, v_smem, slot, compiled: bool):
    """acc [M, Dh] + p [M, BK] @ v_smem[slot] [BK, Dh]."""
    p = p.astype(v_smem.dtype)
    if not compiled:
        return acc + jnp.dot(p, v_smem[slot], precision=lax.Precision.HIGHEST,
                             preferred_element_type=jnp.float32)
    return pl.run_state(lambda acc_ref: plgpu.wgmma(acc_ref, p, v_smem.at[slot]))(
        plgpu.ACC.init(acc))


def paged_attention_kernel(meta_ref, pt_ref, q_ref, k_ref, v_ref, kn_ref, vn_ref, o_ref,
                           lse_ref, q_smem, k_smem, v_smem, lse_smem, q_bar, k_bar, v_bar, *,
                           cfg: KernelConfig, compiled: bool):
    """Mosaic GPU body for one (tile, KV head, KV split) program: one warpgroup.

    GMEM refs: meta [NT, 7] int32, page table [B, Np] int32, q tiles [NT, Hkv, Mq, Dh],
    K / V pools [L, Hkv, P, S, Dh], new K / V [T + pad, Hkv, Dh]; outputs o [splits, NT,
    Hkv, Mq, Dh] (normalized within the split) and lse [splits, NT, Hkv, Mq] f32 (log-sum-
    exp, to merge the splits). SMEM: q_smem [M, Dh] (then the output tile), k_smem / v_smem
    [slots, BK, Dh], lse_smem [M]. Mq = M, or in a decode-only launch the tile's live rows
    rounded up to 8 (cfg.q_rows): they land in q_smem's first Mq rows, and its other rows
    are never loaded; they are rows past nrows, so the softmax masks whatever they hold
    and they are not stored.

    A KV block of BK tokens arrives as BK / S TMA copies of [S, Dh] slices (pool pages, or
    runs of new tokens), issued `slots - 1` blocks ahead of the block being multiplied.
    Slot reuse is safe because a wgmma result is read back (which waits for it) before the
    next step issues copies. `compiled=False` is the CPU interpret mode: the same copies
    and barriers run in Mosaic GPU's interpreter, but the two wgmmas become dot_generals
    and layouts are left out, since the interpreter implements neither transposed wgmma
    operands nor layout casts.
    """
    m_rows, dh = q_smem.shape
    q_rows = q_ref.shape[2]  # Mq <= M
    q_live = q_smem if q_rows == m_rows else q_smem.at[pl.ds(0, q_rows)]
    slots, bk = k_smem.shape[0], k_smem.shape[1]
    s_page, per_block = cfg.page_size, bk // cfg.page_size
    t, h, split = lax.axis_index("tile"), lax.axis_index("kv_head"), lax.axis_index("split")
    row, kv_len, prefix_len, pos0, nrows, new_start, layer, window = (
        meta_ref[t, i] for i in range(len(META)))
    sched = KVSchedule(kv_len, prefix_len, pos0, nrows, window, cfg)
    lo, hi = sched.split(split, cfg.num_splits)
    layout = plgpu.layout_cast if compiled else (lambda x, _: x)
    wgmma_layout = plgpu.Layout.WGMMA

    def fetch_pages(blk, slot):
        for i in range(per_block):
            page = pt_ref[row, jnp.minimum(blk * per_block + i, cfg.pages_per_seq - 1)]
            dst = (slot, pl.ds(i * s_page, s_page))
            plgpu.copy_gmem_to_smem(k_ref.at[layer, h, page], k_smem.at[dst], k_bar.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[layer, h, page], v_smem.at[dst], v_bar.at[slot])

    # The wrapper starts each row's new tokens at a multiple of S; writing each copy's
    # first row as (page index) * S lets the lowering prove what TMA into 8-row SMEM tiles
    # needs (jax 0.11's layout inference checks it; 0.10 would read the wrong rows).
    new_page = lax.div(new_start, s_page)

    def fetch_new(blk, slot):  # as many copies as a page block: the barriers count arrivals
        for i in range(per_block):
            src = (pl.ds((new_page + blk * per_block + i) * s_page, s_page), h)
            dst = (slot, pl.ds(i * s_page, s_page))
            plgpu.copy_gmem_to_smem(kn_ref.at[src], k_smem.at[dst], k_bar.at[slot])
            plgpu.copy_gmem_to_smem(vn_ref.at[src], v_smem.at[dst], v_bar.at[slot])

    def fetch(step, slot):
        is_new, blk, _, _ = sched.block(step)
        pl.when(is_new)(lambda: fetch_new(blk, slot))
        pl.when(jnp.logical_not(is_new))(lambda: fetch_pages(blk, slot))

    plgpu.copy_gmem_to_smem(q_ref.at[t, h], q_live, q_bar)
    for i in range(slots - 1):
        pl.when(lo + i < hi)(functools.partial(fetch, lo + i, i))
    plgpu.barrier_wait(q_bar)

    def step(i, carry):
        acc, m, l = carry
        slot = lax.rem(i - lo, slots)
        ahead = i + slots - 1
        pl.when(ahead < hi)(lambda: fetch(ahead, lax.rem(ahead - lo, slots)))
        _, _, base, bound = sched.block(i)
        plgpu.barrier_wait(k_bar.at[slot])
        s = _qk(q_smem, k_smem, slot, compiled)  # [M, BK]
        rows = layout(lax.broadcasted_iota(jnp.int32, (m_rows, bk), 0), wgmma_layout)
        kv_pos = base + layout(lax.broadcasted_iota(jnp.int32, (m_rows, bk), 1), wgmma_layout)
        p, alpha, m, l = softmax_step(s, rows, kv_pos, m, l, bound, pos0, nrows, window, cfg)
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, (0,))
        plgpu.barrier_wait(v_bar.at[slot])
        return _pv(acc, p, v_smem, slot, compiled), m, l

    row_layout = wgmma_layout.reduce(1)
    init = (layout(jnp.full((m_rows, dh), 0.0, jnp.float32), wgmma_layout),  # acc
            layout(jnp.full((m_rows,), MASKED, jnp.float32), row_layout),  # running max
            layout(jnp.full((m_rows,), 0.0, jnp.float32), row_layout))  # running sum
    acc, m, l = lax.fori_loop(lo, hi, step, init)
    q_smem[...] = finish(acc, l).astype(q_smem.dtype)
    lse_smem[...] = m + jnp.log(jnp.maximum(l, 1e-30))
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_live, o_ref.at[split, t, h])
    plgpu.copy_smem_to_gmem(lse_smem if q_rows == m_rows else lse_smem.at[pl.ds(0, q_rows)],
                            lse_ref.at[split, t, h])
    plgpu.wait_smem_to_gmem(0)


def _swizzle_transforms(minor: int, dtype) -> tuple:
    """Tiling + swizzle for a [rows, minor] SMEM operand of wgmma (and of the TMA that fills
    it): the widest swizzle whose span divides a row, so head_dim 64 in bf16 (128 bytes)
    gets the 128-byte swizzle and needs no padding."""
    row_bytes = minor * jnp.dtype(dtype).itemsize
    for swizzle in (128, 64, 32):
        if row_bytes % swizzle == 0:
            elems = swizzle // jnp.dtype(dtype).itemsize
            return plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(swizzle)
    raise ValueError(f"head_dim {minor} of {jnp.dtype(dtype).name} is not a multiple of 32 bytes")


def _merge_splits(out, lse):
    """out [K, NT, Hkv, M, Dh] (each split normalized), lse [K, NT, Hkv, M] -> [NT, Hkv, M, Dh]
    and its log-sum-exp [NT, Hkv, M]. Empty splits have lse ~ MASKED and weigh 0; rows
    empty in every split stay 0."""
    if out.shape[0] == 1:
        return out[0], lse[0]
    top = lse.max(axis=0)
    w = jnp.exp(lse - top)  # [K, NT, Hkv, M]
    merged = jnp.einsum("ktgm,ktgmd->tgmd", w, out.astype(jnp.float32))
    total = w.sum(axis=0)
    return (merged / total[..., None]).astype(out.dtype), top + jnp.log(total)


def launch(meta, page_table, q_tiles, k_pool, v_pool, k_new, v_new, cfg: KernelConfig,
           interpret: bool, sinks=None):
    """q_tiles [NT, Hkv, Mq, Dh] -> output tiles [NT, Hkv, Mq, Dh] (decode-only batches:
    only the G live rows of each tile, [NT, Hkv, G, Dh]). Mq: cfg.q_rows. sinks [Hkv, Mq]
    f32 (kv_schedule.sink_rows) or None: applied to the merged splits by their log-sum-exp,
    outside the body."""
    nt, hkv, q_rows, dh = q_tiles.shape
    m_rows = cfg.tile_rows
    dtype, slots, bk, splits = q_tiles.dtype, cfg.num_slots, cfg.block_kv, cfg.num_splits
    tf = _swizzle_transforms(dh, dtype)
    per_block = bk // cfg.page_size
    body = functools.partial(paged_attention_kernel, cfg=cfg, compiled=not interpret)
    operands = (meta, page_table, q_tiles, k_pool, v_pool, k_new, v_new)
    out, lse = plgpu.kernel(
        body,
        out_type=(out_struct((splits, *q_tiles.shape), dtype, *operands),
                  out_struct((splits, nt, hkv, q_rows), jnp.float32, *operands)),
        grid=(nt, hkv, splits),
        grid_names=("tile", "kv_head", "split"),
        scratch_types=[
            plgpu.SMEM((m_rows, dh), dtype, transforms=tf),  # q, then the output tile
            plgpu.SMEM((slots, bk, dh), dtype, transforms=tf),  # K blocks
            plgpu.SMEM((slots, bk, dh), dtype, transforms=tf),  # V blocks
            plgpu.SMEM((m_rows,), jnp.float32),  # log-sum-exp of each tile row
            plgpu.Barrier(),
            # one arrival per page copy: a block is ready when all its pages landed
            plgpu.Barrier(num_arrivals=per_block, num_barriers=slots),
            plgpu.Barrier(num_arrivals=per_block, num_barriers=slots),
        ],
        interpret=_gpu_interpret_params() if interpret else None,
    )(*operands)
    if not cfg.num_extend_tiles:  # decode only: just the G live rows of each tile
        out, lse = out[..., :cfg.group, :], lse[..., :cfg.group]
    out, lse = _merge_splits(out, lse)
    if sinks is None:
        return out
    return apply_sinks_by_lse(out, lse, sinks[:, :out.shape[2]])
