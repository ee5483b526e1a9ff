"""Writing this step's K/V into the paged pool: XLA's scatter, not a Pallas kernel (yet).

The write is `runtime.kv_pool.write_kv`: the pool viewed as [L, Hkv, P * S, Dh] (a free
reshape) and one `.at[...].set(...)` each for K and V. It stays an XLA scatter because:

* It moves little data: T * Hkv * Dh elements per layer (a decode step of 64 rows with
  SmolLM2's 3 x 64 KV heads is 24 KB each of K and V per layer in bf16), against the
  attention kernel reading every cached page. A kernel launch of its own would cost
  about as much as the copy.
* XLA can fuse the scatter with the K/V projection and RoPE that produce its operands,
  and updates the pool in place when the jitted step donates it, as long as the pool is
  not also read after the write in the same loop iteration (a gather after a scatter on
  the carried pool made XLA copy the whole pool every layer; see
  pallas_kernels/attention_ref.py, which is why the write moved after the layer stack).
  A Pallas kernel would need `input_output_aliases` on the whole pool and would be an
  opaque custom call between the producers and the consumers.
* Padding tokens all write page 0 (reserved). A scatter with duplicate indices is fine
  there; a TMA kernel would have to serialize or skip them.

What would change this: if XLA on the GPU does not update the pool in place (a pool copy
per step would dominate decode), or if the scatter is slower than its bytes suggest.
`scripts/bench_kernels.py` times `write_kv` against the pool size to catch both; on the
GPU this is unmeasured until that script has run there. On the CPU it already shows one
such case: with a bf16 pool, XLA CPU converts the whole pool to f32 and back around the
scatter (its time grows with the pool); f32 pools update in place.
"""

from __future__ import annotations

from runtime.kv_pool import write_kv as kv_cache_update

__all__ = ["kv_cache_update"]
