"""Weights packed once at load into the panels the matmul kernels read (packed_matmul.cc):
f32 and bf16 panels (`pack`), weight-only int8 with a scale per column (`pack_int8`), and
bf16 in 12 bits, losslessly (`pack_x12`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

PANEL = 64  # panel width, kNR in packed_matmul.cc
X12_STEP = 192  # bytes of a compressed k pair of a panel, kX12StepBytes in packed_matmul.cc


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedWeight:
    """W [..., K, N] as panels, P = ceil(N / 64), zero-padded (packed_matmul.cc):
    float32 [..., P, K, 64]; bfloat16 [..., P, K2, 64, 2] with K2 = ceil(K / 2), rows
    k and k + 1 interleaved per column (vdpbf16ps's operand layout); int8 (pack_int8)
    [..., P, K4 * 4, 64] with K4 = ceil(K / 4) and `scales` f32 [..., P, 64], W's
    column n being q[:, n] * scales[n]; compressed bfloat16 (pack_x12) uint8
    [..., P, K2, 192] with `table` uint8 [..., 16], `exc_start` int32 [..., P + 1] and
    `exc` int32 [..., E, 2] (packed_matmul.cc, X12Decode).

    `layer`: None for one matrix; for a stack of them ([L, ...] panels), the traced index
    of the one a call multiplies by (at_layer), which the kernel reads in place.
    `rows`: None, or int32 [M]: the rows of x [M, K] a call computes (nonzero); the
    others, a bucket's padding, come out zero at no cost (only_rows)."""

    panels: jax.Array
    n: int = dataclasses.field(metadata=dict(static=True))
    k: int = dataclasses.field(metadata=dict(static=True))
    layer: jax.Array | None = None
    rows: jax.Array | None = None
    scales: jax.Array | None = None
    table: jax.Array | None = None
    exc_start: jax.Array | None = None
    exc: jax.Array | None = None

    @property
    def matrix_ndim(self) -> int:
        """Dims of one matrix's panels."""
        return 4 if self.dtype == jnp.bfloat16 else 3

    @property
    def shape(self) -> tuple[int, ...]:
        """The unpacked shape [..., K, N] (of the picked matrix when `layer` is set)."""
        lead = self.panels.shape[:self.panels.ndim - self.matrix_ndim]
        return (*(lead[1:] if self.layer is not None else lead), self.k, self.n)

    @property
    def dtype(self) -> jnp.dtype:
        return self.panels.dtype


def at_layer(w: PackedWeight, layer: jax.Array) -> PackedWeight:
    """Matrix `layer` (traced int32 []) of a stack of them [L, K, N], without a copy."""
    if w.panels.ndim != w.matrix_ndim + 1:
        raise ValueError(f"at_layer takes a stack of matrices, got panels {w.panels.shape}")
    return dataclasses.replace(w, layer=layer)


def only_rows(tree: Any, rows: jax.Array) -> Any:
    """Every PackedWeight of `tree` computing only the x rows where rows [M] is nonzero
    (the real tokens of a padded batch: models/forward_batch.real_token_mask)."""
    return jax.tree.map(
        lambda w: dataclasses.replace(w, rows=rows) if isinstance(w, PackedWeight) else w,
        tree, is_leaf=lambda w: isinstance(w, PackedWeight))


def pack(w: jax.Array) -> PackedWeight:
    """W [..., K, N] (float32 or bfloat16) -> PackedWeight of the same dtype."""
    *lead, k, n = w.shape
    p = -(-n // PANEL)
    if w.dtype == jnp.float32:
        w = jnp.pad(w, [(0, 0)] * (len(lead) + 1) + [(0, p * PANEL - n)])
        panels = jnp.swapaxes(w.reshape(*lead, k, p, PANEL), -3, -2)  # [..., P, K, 64]
        return PackedWeight(panels=panels, n=n, k=k)
    if w.dtype != jnp.bfloat16:
        raise ValueError(f"pack takes float32 or bfloat16 weights, not {w.dtype}")
    k2 = -(-k // 2)
    w = jnp.pad(w, [(0, 0)] * len(lead) + [(0, 2 * k2 - k), (0, p * PANEL - n)])
    w = w.reshape(*lead, k2, 2, p, PANEL)  # [..., K2, 2, P, 64]
    nd = len(lead)
    panels = w.transpose(*range(nd), nd + 2, nd, nd + 3, nd + 1)  # [..., P, K2, 64, 2]
    return PackedWeight(panels=panels, n=n, k=k)


def pack_int8(w: jax.Array | np.ndarray) -> PackedWeight:
    """W [..., K, N] -> weight-only int8 panels: each column n symmetric over its K values,
    q = round(W[:, n] / s_n) in [-127, 127] with s_n = max |W[:, n]| / 127 (the scheme of
    SGLang's torchao `int8wo` and of llama.cpp's Q8_0, there per block of 32). Per column
    the scale factors out of the sum: y = (x @ q) * s, one multiply an output.

    Quantized on the host in numpy, each step one IEEE f32 operation, so q and s are
    exactly what a reference computing the same formula gets (make_reference.py's
    torch): under XLA a scale came out 1 ulp off and moved a q by one."""
    w = np.asarray(w, np.float32)
    *lead, k, n = w.shape
    amax = np.abs(w).max(axis=-2)  # [..., N]
    scale = np.where(amax > 0, amax / np.float32(127), np.float32(1)).astype(np.float32)
    q = np.clip(np.rint(w / scale[..., None, :]), -127, 127).astype(np.int8)
    p, kp = -(-n // PANEL), -(-k // 4) * 4
    q = np.pad(q, [(0, 0)] * len(lead) + [(0, kp - k), (0, p * PANEL - n)])
    panels = np.swapaxes(q.reshape(*lead, kp, p, PANEL), -3, -2)  # [..., P, Kp, 64]
    scales = np.pad(scale, [(0, 0)] * len(lead) + [(0, p * PANEL - n)])
    return PackedWeight(panels=jnp.asarray(np.ascontiguousarray(panels)), n=n, k=k,
                        scales=jnp.asarray(scales.reshape(*lead, p, PANEL)))


def pack_x12(w: jax.Array | np.ndarray) -> PackedWeight:
    """W [..., K, N] bfloat16 -> the same weights in 12 bits each, losslessly.

    Each bf16's high byte (sign and 7 exponent bits) becomes a 4-bit code into a table of
    its matrix's 15 most frequent high bytes and 0x00; its low byte is kept. A weight
    whose high byte has no code (SmolLM2: ~0.02%) is stored as +0 and listed as an
    exception, which the kernel adds after the product. The panel layout is the bf16
    panels' (pack), each k pair's 128 values in packed_matmul.cc's byte order
    (X12Decode). Done on the host in numpy, once at load."""
    plain = pack(jnp.asarray(w, jnp.bfloat16))
    rows = np.asarray(plain.panels).view(np.uint16)  # [..., P, K2, 64, 2]
    *lead, p, k2 = rows.shape[:-2]
    mats = rows.reshape(-1, p, k2, 2 * PANEL)  # [B, P, K2, 128]: word t = 2 column + k parity
    t = np.arange(2 * PANEL)
    j, wi = t // 32, t % 32  # zmm j of the row, word wi in it
    byte = 16 * (wi // 8) + 8 * (j % 2) + wi % 8
    steps = np.zeros((*mats.shape[:3], X12_STEP), np.uint8)
    tables = np.zeros((len(mats), 16), np.uint8)
    starts = np.zeros((len(mats), p + 1), np.int32)
    excs = []
    for b, mat in enumerate(mats):
        hi = (mat >> 8).astype(np.uint8)
        counts = np.bincount(hi.ravel(), minlength=256)
        counts[0] = -1  # 0x00 is entry 0 whatever its count: exceptions decode to +0
        top = np.argsort(-counts, kind="stable")[:15]
        table = np.concatenate([[0], np.sort(top)]).astype(np.uint8)
        lut = np.full(256, -1, np.int16)
        lut[table] = np.arange(16)
        code = lut[hi]
        miss = code < 0
        lo = (mat & 0xFF).astype(np.uint8)
        code[miss], lo[miss] = 0, 0
        step = steps[b]  # [P, K2, 192], a view
        step[..., 64 * (j // 2) + byte] = lo
        for half in (0, 1):
            sel = j // 2 == half
            step[..., 128 + byte[sel]] |= (code[..., sel] << (4 * half)).astype(np.uint8)
        pp, ss, tt = np.nonzero(miss)
        pos = (2 * ss + tt % 2) * PANEL + tt // 2  # k * 64 + column
        order = np.lexsort((pos, pp))
        excs.append(np.stack([pos[order], mat[pp, ss, tt][order].astype(np.int32)], -1))
        starts[b, 1:] = np.cumsum(np.bincount(pp, minlength=p))
        tables[b] = table
    e_max = max(len(e) for e in excs)
    exc = np.zeros((len(mats), e_max, 2), np.int32)
    for b, e in enumerate(excs):
        exc[b, :len(e)] = e
    return PackedWeight(panels=jnp.asarray(steps.reshape(*lead, p, k2, X12_STEP)),
                        n=plain.n, k=plain.k,
                        table=jnp.asarray(tables.reshape(*lead, 16)),
                        exc_start=jnp.asarray(starts.reshape(*lead, p + 1)),
                        exc=jnp.asarray(exc.reshape(*lead, e_max, 2)))
