"""Skip marks for tests of CPU-kernel formats this machine (or $XLASERVE_CPU_ISA) cannot
run, each naming the missing feature, so a suite on an AVX2-only CPU skips exactly those
cases and says why."""

from __future__ import annotations

import pytest

import cpu_kernels

# Why bf16 weights in 12 bits (--compress_weights) cannot run here (AVX-512BW); None: they can.
X12_MISSING = cpu_kernels.x12_unavailable_reason()

needs_x12 = pytest.mark.skipif(X12_MISSING is not None,
                               reason=f"--compress_weights: {X12_MISSING}")
