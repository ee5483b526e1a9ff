"""MXFP4 expert weights as gpt-oss checkpoints ship them, dequantized on load.

A quantized tensor `X` is stored as `X_blocks` [..., rows, G, 16] uint8 (two FP4 e2m1
codes a byte, the low nibble first) and `X_scales` [..., rows, G] uint8 (a power-of-two
exponent biased by 127 for each block of 32 values along the input), rows being the
output features: [E, out, in] where the bf16 form of the same tensor is [E, in, out].
`dequantizing` presents such pairs as the bf16 tensor they stand for, so the importer's
names and shapes stay those of a bf16 checkpoint. NumPy only (host code).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

__all__ = ["FP4_E2M1", "dequantize", "dequantizing"]

# The 16 FP4 e2m1 code points, by code (bit 3 the sign).
FP4_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                     -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
BLOCKS, SCALES = "_blocks", "_scales"


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """blocks [..., R, G, 16] uint8, scales [..., R, G] uint8 -> f32 [..., G*32, R] (the
    input axis first, as the bf16 checkpoint holds it)."""
    blocks, scales = np.asarray(blocks, np.uint8), np.asarray(scales, np.uint8)
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"blocks {blocks.shape} and scales {scales.shape} do not pair up "
                         f"as [..., rows, G, 16] and [..., rows, G]")
    vals = np.empty((*blocks.shape[:-1], 32), np.float32)  # [..., R, G, 32]
    vals[..., 0::2] = FP4_E2M1[blocks & 0x0F]
    vals[..., 1::2] = FP4_E2M1[blocks >> 4]
    vals = np.ldexp(vals, scales.astype(np.int32)[..., None] - 127)
    out = vals.reshape(*blocks.shape[:-2], -1)  # [..., R, G*32]
    return np.swapaxes(out, -1, -2)  # [..., G*32, R]


def dequantizing(shapes: dict[str, tuple[int, ...]], read: Callable[[str], np.ndarray],
                 where: Callable[[str], str]) -> tuple[dict[str, tuple[int, ...]],
                                                      Callable[[str], np.ndarray]]:
    """(shapes, read) of a checkpoint with every `X_blocks` / `X_scales` pair replaced by
    the f32 tensor `X` it encodes; `where(name)` names a tensor's file for errors."""
    pairs = {n[:-len(BLOCKS)] for n in shapes if n.endswith(BLOCKS)}
    if not pairs:
        return shapes, read
    out = {n: s for n, s in shapes.items()
           if not (n.endswith((BLOCKS, SCALES)) and n[:-len(BLOCKS)] in pairs)}
    for x in sorted(pairs):
        b, s = shapes[x + BLOCKS], shapes.get(x + SCALES)
        if s is None or b[:-1] != s or b[-1] != 16:
            raise ValueError(f"{where(x + BLOCKS)}: MXFP4 tensor {x + BLOCKS!r} {b} has no "
                             f"matching {x + SCALES!r} (found {s}); expected [..., rows, G, "
                             f"16] and [..., rows, G]")
        out[x] = (*b[:-3], b[-2] * 32, b[-3])

    def read_any(name: str) -> np.ndarray:
        if name in pairs:
            return dequantize(read(name + BLOCKS), read(name + SCALES))
        return read(name)

    return out, read_any
