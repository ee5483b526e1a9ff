"""CPU kernels of our own, called from jit through the XLA FFI.

`packed_matmul`: x [M, K] @ W [K, N] with W packed once at load (`pack`) into 64-column
panels; see packed_matmul.cc for why XLA CPU's own GEMM is slow on decode-sized M. Up to
three bf16 kernels (widening, vdpbf16ps, AMX tiles); the fastest on this CPU serves
(bf16_kernel, measured once per machine). `pack_int8`: weight-only int8 panels with a
scale per output column (`--quantization=int8`), a quarter of f32's bytes. `pack_x12`:
bf16 weights in 12 bits each, losslessly (`--compress_weights`): 3/4 of bf16's bytes for
a memory-bound decode step, the same products.
`decode_attention`, `extend_attention`: paged attention of decode rows / of prefill
(extend) tokens, reading the pool (float32 or bfloat16) in place; see attention.cc.
`write_kv`: this step's K/V into the pool in place (write_kv.cc: XLA CPU's scatter
converts a whole bf16 pool every step).

One module a job: isa.py (which instruction sets the build targets), build.py (compiling,
loading, the bf16 kernel choice), packing.py, matmul.py, attention.py, huge_pages.py. This
package re-exports what the models, the runtime and the tests use.
"""

from cpu_kernels import isa
from cpu_kernels.attention import decode_attention, extend_attention, write_kv
from cpu_kernels.build import (
    bf16_kernel,
    bf16_targets,
    load,
    unavailable_reason,
    x12_targets,
    x12_unavailable_reason,
)
from cpu_kernels.huge_pages import back_with_huge_pages, zeros_in_huge_pages
from cpu_kernels.matmul import packed_matmul
from cpu_kernels.packing import (
    PANEL,
    X12_STEP,
    PackedWeight,
    at_layer,
    only_rows,
    pack,
    pack_int8,
    pack_x12,
)

__all__ = ["PANEL", "X12_STEP", "PackedWeight", "at_layer", "back_with_huge_pages",
           "bf16_kernel", "bf16_targets", "decode_attention", "extend_attention", "isa", "load",
           "only_rows", "pack", "pack_int8", "pack_x12", "packed_matmul", "unavailable_reason",
           "write_kv", "x12_targets", "x12_unavailable_reason", "zeros_in_huge_pages"]
