"""Attention kernels. `get_attention_fn(backend)` picks the implementation a model calls."""

from __future__ import annotations

from collections.abc import Callable

from pallas_kernels.ragged_paged_attention import ragged_paged_attention_ref


def get_attention_fn(backend: str) -> Callable:
    if backend == "xla":
        return ragged_paged_attention_ref
    raise ValueError(f"unknown attention backend {backend!r}; expected 'xla' or 'pallas'")
