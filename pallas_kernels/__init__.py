"""Attention kernels. `get_paged_attention_fn(backend)` picks the implementation a model
calls; both take (q, k_new, v_new, k_pool, v_pool, layer, page_table, seq_lens,
query_start, positions, *, num_extend_tokens, num_extend_seqs, sm_scale, ...), the pool
holding each row's earlier context and this step's K/V passed densely.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax

from pallas_kernels.attention_ref import paged_attention_ref
from pallas_kernels.ragged_paged_attention import paged_attention


def _interpret() -> bool:
    return jax.default_backend() == "cpu"  # Pallas compiles for GPUs; a CPU interprets


def get_paged_attention_fn(backend: str) -> Callable:
    """"xla": the jnp reference `paged_attention_ref`. "cpu": the same split into extend
    tokens and decode rows, each through cpu_kernels (the CPU fast path; float32). "pallas": the
    Pallas kernels `paged_attention`, compiled on a GPU and in interpret mode on a CPU
    backend (where Pallas cannot compile)."""
    if backend == "xla":
        return paged_attention_ref
    if backend == "cpu":
        import cpu_kernels

        return functools.partial(paged_attention_ref, decode_fn=cpu_kernels.decode_attention,
                                 extend_fn=cpu_kernels.extend_attention)
    if backend == "pallas":
        return functools.partial(paged_attention, interpret=_interpret())
    raise ValueError(f"unknown attention backend {backend!r}; expected 'xla', 'cpu' or "
                     "'pallas'")
