"""Attention kernels. `get_attention_fn(backend)` picks the implementation a model calls.

Two call forms: `get_attention_fn` gives (q, k_pool, v_pool, layer, ...) functions, every
key already in the pool (ragged_paged_attention.py); `get_paged_attention_fn` gives
(q, k_new, v_new, k_pool, v_pool, layer, ...) functions, the pool holding earlier context
only (attention_ref.py), which is the form models/llama.py calls.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax

from pallas_kernels.attention_ref import paged_attention_ref
from pallas_kernels.ragged_paged_attention import (
    paged_attention,
    ragged_paged_attention,
    ragged_paged_attention_ref,
)


def _interpret() -> bool:
    return jax.default_backend() == "cpu"  # Pallas compiles for GPUs; a CPU interprets


def get_attention_fn(backend: str) -> Callable:
    """"xla": the jnp reference (the fast path on CPU). "pallas": the Pallas kernels,
    compiled on a GPU and in interpret mode on a CPU backend (where Pallas cannot compile)."""
    if backend == "xla":
        return ragged_paged_attention_ref
    if backend == "pallas":
        return functools.partial(ragged_paged_attention, interpret=_interpret())
    raise ValueError(f"unknown attention backend {backend!r}; expected 'xla' or 'pallas'")


def get_paged_attention_fn(backend: str) -> Callable:
    """As get_attention_fn, for the call form with this step's K/V passed densely."""
    if backend == "xla":
        return paged_attention_ref
    if backend == "pallas":
        return functools.partial(paged_attention, interpret=_interpret())
    raise ValueError(f"unknown attention backend {backend!r}; expected 'xla' or 'pallas'")
