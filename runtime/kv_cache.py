"""Host page allocator of the paged KV pool and page-table helpers (no jax).

The device pool itself lives in models/kv_pool.py; this module only decides which page ids
are free. Token position p of a request lives in cache slot
`pages[p // page_size] * page_size + p % page_size`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

PAD_PAGE = 0


class PageAllocator:
    """Free list and reference counts over page ids [1, num_pages).

    Page 0 (PAD_PAGE) is reserved: it is never handed out, and padding tokens write there.
    Every owner of a page (a running request, a prefix-cache node) holds one reference; a page
    is on the free list exactly when its count is zero. Freeing on the host is safe while
    the device still runs earlier batches: the device executes batches in launch order, so a
    page reused by a later batch is written there only after the earlier readers are done.
    """

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"num_pages={num_pages}: page 0 is reserved, need >= 2")
        self.num_pages = num_pages
        self._refs = [0] * num_pages
        # A stack, so recently freed pages are reused first (stale-data bugs surface fast).
        self._free = list(range(num_pages - 1, PAD_PAGE, -1))

    @property
    def capacity(self) -> int:
        """Pages that can ever be handed out (all but the reserved page)."""
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.capacity - len(self._free)

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take n free pages, each with one reference owned by the caller."""
        if n > len(self._free):
            raise RuntimeError(f"cannot allocate {n} pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def incref(self, pages: Sequence[int]) -> None:
        for p in pages:
            if self._refs[p] <= 0:
                raise RuntimeError(f"incref of free page {p}")
            self._refs[p] += 1

    def decref(self, pages: Sequence[int]) -> int:
        """Drop one reference per page; pages reaching zero go back to the free list.

        Returns how many pages became free.
        """
        freed = 0
        for p in pages:
            if self._refs[p] <= 0:
                raise RuntimeError(f"decref of free page {p}")
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)
                freed += 1
        return freed

    def free(self, pages: Sequence[int]) -> None:
        """Release pages the caller owns alone (refcount exactly 1); anything else is a bug."""
        shared = [p for p in pages if self._refs[p] != 1]
        if shared:
            raise RuntimeError(f"free of pages not exclusively owned: {shared[:8]}")
        self.decref(pages)

    def check(self) -> None:
        """Assert the invariants (tests call this after every step)."""
        free = set(self._free)
        assert len(free) == len(self._free), "a page is on the free list twice"
        assert PAD_PAGE not in free and self._refs[PAD_PAGE] == 0, "reserved page 0 handed out"
        for p in range(1, self.num_pages):
            assert (self._refs[p] == 0) == (p in free), f"page {p}: refcount vs free list"
            assert self._refs[p] >= 0, f"page {p}: negative refcount"


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages needed to hold num_tokens positions."""
    return -(-num_tokens // page_size)


def page_table(rows: Sequence[Sequence[int]], width: int) -> np.ndarray:
    """[len(rows), width] int32 page table, padded with PAD_PAGE."""
    table = np.full((len(rows), width), PAD_PAGE, np.int32)
    for i, pages in enumerate(rows):
        if len(pages) > width:
            raise ValueError(f"row {i} has {len(pages)} pages, table width is {width}")
        table[i, : len(pages)] = pages
    return table
