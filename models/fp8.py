"""FP8 weights: e4m3 matrices with block scales, one weight type behind layers.linear.

An `Fp8Weight` is W [..., K, N] (our [in, out] layout) stored as float8_e4m3fn `w` and
float32 `scale` [..., ceil(K / bk), ceil(N / bn)]: W[k, n] = w[k, n] * scale[k // bk,
n // bn]. One representation covers what checkpoints ship: per-block scales (DeepSeek-V3,
Qwen3-FP8: 128 x 128), per-channel (block (K, 1)) and per-tensor (block (K, N)).

`fp8_linear` never builds a dequantized copy of W for the few-row products of a decode
step: the e4m3 weight is the dot's operand (its convert to the activation dtype sits
inside the dot's fusion on a GPU, read once from memory at one byte per element), and the
block scales are applied to the f32 partial products of each K-block. Many-row products
(prefill) are compute bound; there one dequantized copy per call costs little and keeps
the gemm a single large one. `fp8_ragged_dot` is the same product for stacked MoE
experts [E, K, N] (scales [E, Kb, Nb]), rows grouped by expert as jax.lax.ragged_dot
takes them.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

FP8 = jnp.float8_e4m3fn
# Up to this many rows a block-scaled weight takes the K-blocked product; above it the
# weight is dequantized once per call. Its f32 partials [T, K/bk, N] cost 4T/bk bytes per
# weight byte: Llama-3-8B's w_gate on an H100 (compiled HLO, scripts/bench/fp8_aot.py)
# moves 0.53x the bf16 product's bytes at 1 row, 0.73x at 8, 1.3x at 32; dequantizing
# moves 2.3x at any row count, so it only pays where the gemm is compute bound.
BLOCKED_MAX_ROWS = 64


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8Weight:
    w: jax.Array  # float8_e4m3fn [..., K, N]
    scale: jax.Array  # float32 [..., ceil(K / bk), ceil(N / bn)]
    block: tuple[int, int] = dataclasses.field(metadata=dict(static=True))  # (bk, bn)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.w.shape)

    @property
    def dtype(self) -> jnp.dtype:
        return self.w.dtype

    @property
    def ndim(self) -> int:
        return self.w.ndim

    def __rmatmul__(self, x: jax.Array) -> jax.Array:
        """`x @ w`: a family's plain product takes an FP8 weight unchanged (jax arrays
        defer the operator to an operand type they do not know)."""
        return fp8_linear(x, self)

    def __getitem__(self, index: jax.Array | int) -> Fp8Weight:
        """One layer (or expert) of a stacked weight: the leading index of both arrays."""
        return Fp8Weight(self.w[index], self.scale[index], self.block)


def _repeat_last(s: jax.Array, times: int) -> jax.Array:
    """[..., M] -> [..., M * times], each element repeated (a broadcast and a reshape:
    jnp.repeat lowers to a scatter of indices that XLA GPU runs as separate kernels)."""
    return jnp.broadcast_to(s[..., None], (*s.shape, times)).reshape(*s.shape[:-1], -1)


def expand_scale(scale: jax.Array, block: tuple[int, int], k: int, n: int) -> jax.Array:
    """scale [..., Kb, Nb] -> [..., K, N] (each block's scale over its elements)."""
    s = _repeat_last(scale, block[1])[..., :n]  # [..., Kb, N]
    s = _repeat_last(jnp.swapaxes(s, -1, -2), block[0])[..., :k]  # [..., N, K]
    return jnp.swapaxes(s, -1, -2)


def dequantize(w: Fp8Weight, dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """W [..., K, N] in `dtype` (the product computed in f32)."""
    k, n = w.shape[-2:]
    return (w.w.astype(jnp.float32) * expand_scale(w.scale, w.block, k, n)).astype(dtype)


def concat_columns(parts: list[Fp8Weight]) -> Fp8Weight | None:
    """The weights side by side along N ([..., K, sum N]), as layers.fuse_projections
    fuses wq|wk|wv; None where their scale grids do not line up (different blocks, or a
    part's N not a whole number of column blocks)."""
    block = parts[0].block
    if any(p.block != block or p.shape[-1] % block[1] for p in parts):
        return None
    return Fp8Weight(jnp.concatenate([p.w for p in parts], axis=-1),
                     jnp.concatenate([p.scale for p in parts], axis=-1), block)


def fp8_linear(x: jax.Array, w: Fp8Weight) -> jax.Array:
    """x [..., K] @ W [K, N] -> [..., N] in x's dtype, W one (unstacked) Fp8Weight."""
    k, n = w.shape
    bk, bn = w.block
    lead, t = x.shape[:-1], 1
    for d in lead:
        t *= d
    kb = w.scale.shape[0]
    if kb > 1 and t > BLOCKED_MAX_ROWS:
        return x @ dequantize(w, x.dtype)
    x2, wq = _pad_k(x.reshape(t, k), w.w, kb, bk)
    xg = x2.reshape(t, kb, bk)  # [T, Kb, bk]
    wg = wq.reshape(kb, bk, n).astype(x.dtype)  # [Kb, bk, N]: converted inside the dot
    part = jnp.einsum("tgk,gkn->tgn", xg, wg, preferred_element_type=jnp.float32)  # [T, Kb, N]
    s = _repeat_last(w.scale, bn)[:, :n]  # [Kb, N]
    y = jnp.einsum("tgn,gn->tn", part, s)  # [T, N] f32
    return y.astype(x.dtype).reshape(*lead, n)


def _pad_k(x2: jax.Array, wq: jax.Array, kb: int, bk: int) -> tuple[jax.Array, jax.Array]:
    """x2 [T, K], wq [..., K, N] padded to K = kb * bk: a ragged last K-block's zero rows
    add nothing to the product."""
    k = x2.shape[-1]
    if kb * bk == k:
        return x2, wq
    pad_w = [(0, 0)] * (wq.ndim - 2) + [(0, kb * bk - k), (0, 0)]
    return jnp.pad(x2, ((0, 0), (0, kb * bk - k))), jnp.pad(wq, pad_w)


def _ragged_by_pairs(x2: jax.Array, wq: jax.Array, sizes: jax.Array, own: jax.Array,
                     kb: int) -> jax.Array:
    """K-block partials [M, Kb, N] f32 from one plain ragged_dot whose groups are the
    (expert, K-block) pairs: the weight [E, K, N] viewed as [E * Kb, bk, N] (a reshape),
    row r of expert e (the j-th of its n_e) sending K-block g to slot kb * start_e +
    g * n_e + j; the rows past sum(sizes) take the slots after the groups' (zeros)."""
    (m, k), (e, _, n) = x2.shape, wq.shape
    bk = k // kb
    total = sizes.sum()
    starts = jnp.cumsum(sizes) - sizes  # [E]
    r = jnp.arange(m)
    g = jnp.arange(kb)
    real = kb * starts[own][:, None] + g * sizes[own][:, None] + (r - starts[own])[:, None]
    past = kb * r[:, None] + g  # kb * total + kb * (r - total) + g
    slot = jnp.where((r < total)[:, None], real, past)  # [M, Kb], a permutation
    xg = jnp.zeros((m * kb, bk), x2.dtype).at[slot.reshape(-1)].set(
        x2.reshape(m * kb, bk), unique_indices=True)  # [M * Kb, bk] by group
    group_sizes = jnp.broadcast_to(sizes[:, None], (e, kb)).reshape(e * kb)
    part = jax.lax.ragged_dot(xg, wq.reshape(e * kb, bk, n).astype(x2.dtype), group_sizes,
                              preferred_element_type=jnp.float32)  # [M * Kb, N]
    return part[slot]


def _ragged_by_blocks(x2: jax.Array, wq: jax.Array, sizes: jax.Array, kb: int) -> jax.Array:
    """K-block partials [M, Kb, N] f32 from one ragged_dot_general with the K-block as a
    batch dimension (groups: the experts)."""
    (m, k), (e, _, n) = x2.shape, wq.shape
    bk = k // kb
    xg = jnp.swapaxes(x2.reshape(m, kb, bk), 0, 1)  # [Kb, M, bk]
    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([2], [2]), ([0], [1])),
        lhs_ragged_dimensions=[1], rhs_group_dimensions=[0])
    part = jax.lax.ragged_dot_general(  # [Kb, M, N]
        xg, wq.reshape(e, kb, bk, n).astype(x2.dtype), jnp.broadcast_to(sizes, (kb, e)),
        dims, preferred_element_type=jnp.float32)
    return jnp.swapaxes(part, 0, 1)


def fp8_ragged_dot(x: jax.Array, w: Fp8Weight, sizes: jax.Array, own: jax.Array) -> jax.Array:
    """jax.lax.ragged_dot(x, W, sizes) for stacked expert weights: x [M, K] with expert
    e's rows contiguous and in expert order (sizes [E] of them; rows past sum(sizes) come
    back as zeros), W [E, K, N] -> [M, N] in x's dtype. own [M]: each row's expert (any
    valid id for the rows past sum(sizes)), which picks its block scales.

    As fp8_linear: the e4m3 experts are the product's operand (converted to x's dtype
    inside it) and each K-block's f32 partial products are weighed by their block's
    scales. XLA GPU runs a ragged dot as a dense product over every group with the rows
    masked per group, so the two ways to get the partials cost (compiled for an H100,
    scripts/bench/fp8_aot.py, per weight byte): groups of (expert, K-block) pairs read
    the weights once but expand the rows Kb-fold, ~1 + 4 * M * Kb / N; the K-block as a
    batch dimension copies the weights transposed every call, ~3. The pairs are taken
    while M * Kb <= N / 2 (DeepSeek-V3's down projection up to ~28 decode rows of 8
    pairs, its gate only at 1-2; bf16 is ~2). Many rows (past BLOCKED_MAX_ROWS per
    expert on average) take one dequantized copy of the experts instead (~5, but the
    product is then compute bound)."""
    e, _, n = w.shape
    bk, bn = w.block
    m = x.shape[0]
    kb = w.scale.shape[-2]
    if kb > 1 and m > BLOCKED_MAX_ROWS * e:
        return jax.lax.ragged_dot(x, dequantize(w, x.dtype), sizes)
    x2, wq = _pad_k(x, w.w, kb, bk)
    s = _repeat_last(w.scale[own], bn)[..., :n]  # [M, Kb, N]: each row's expert's scales
    if kb == 1:  # per channel / per tensor: one product, its columns scaled after
        part = jax.lax.ragged_dot(x2, wq.astype(x.dtype), sizes,
                                  preferred_element_type=jnp.float32)  # [M, N]
        return (part * s[:, 0]).astype(x.dtype)
    if 2 * m * kb <= n:
        part = _ragged_by_pairs(x2, wq, sizes, own, kb)
    else:
        part = _ragged_by_blocks(x2, wq, sizes, kb)
    return jnp.einsum("mgn,mgn->mn", part, s).astype(x.dtype)  # [M, N]
