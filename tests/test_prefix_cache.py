"""Prefix cache: match / insert / lock / evict / LRU, and the disabled variant."""

from __future__ import annotations

import pytest

from runtime.kv_cache import PageAllocator
from runtime.prefix_cache import DisabledPrefixCache, PrefixCache

PS = 4


def _cache(num_pages: int = 64) -> tuple[PrefixCache, PageAllocator]:
    alloc = PageAllocator(num_pages)
    return PrefixCache(alloc, PS), alloc


def _store(cache: PrefixCache, alloc: PageAllocator, ids: list[int]) -> list[int]:
    """What a finishing request does: its pages go into the cache, then it drops them."""
    pages = alloc.allocate(len(ids) // PS)
    cache.insert(ids[: len(pages) * PS], pages)
    alloc.decref(pages)
    return pages


def test_match_is_page_aligned_and_leaves_a_token():
    cache, alloc = _cache()
    ids = list(range(100, 112))
    pages = _store(cache, alloc, ids)
    m = cache.match_prefix(ids)
    assert (m.pages, m.num_tokens) == (pages, 12)
    # Matching ids[:-1] (what the scheduler does) always leaves the last token to prefill.
    assert cache.match_prefix(ids[:-1]).num_tokens == 8
    assert cache.match_prefix(ids[:6] + [0, 0]).num_tokens == 4
    assert cache.match_prefix([1, 2, 3, 4]).num_tokens == 0
    assert cache.match_prefix(ids[:3]).pages == []
    cache.check()


def test_insert_keeps_existing_pages_and_counts_refs():
    cache, alloc = _cache()
    ids = list(range(8))
    first = _store(cache, alloc, ids)
    assert [alloc.refcount(p) for p in first] == [1, 1]
    dup = alloc.allocate(3)
    assert cache.insert(ids + [9, 9, 9, 9], dup).num_cached == 8
    # Only the new page is referenced by the tree; the duplicates stay the caller's alone.
    assert [alloc.refcount(p) for p in dup] == [1, 1, 2]
    alloc.decref(dup)
    assert cache.num_pages == 3 and alloc.num_used == 3
    assert cache.match_prefix(ids + [9] * 4).pages == first + [dup[2]]
    with pytest.raises(ValueError, match="fill"):
        cache.insert([1, 2, 3], [5])
    cache.check()


def test_branches_share_their_prefix():
    cache, alloc = _cache()
    _store(cache, alloc, [1] * 8 + [2] * 4)
    _store(cache, alloc, [1] * 8 + [3] * 4)
    assert cache.num_pages == 4
    assert cache.match_prefix([1] * 8 + [3] * 4).num_tokens == 12
    cache.check()


def test_lock_protects_from_eviction():
    cache, alloc = _cache()
    ids = list(range(12))
    _store(cache, alloc, ids)
    m = cache.match_prefix(ids[:8])
    cache.lock(m.node)
    assert (cache.protected_pages, cache.evictable_pages) == (2, 1)
    assert cache.evict(10) == 1  # only the unlocked leaf
    assert cache.match_prefix(ids).num_tokens == 8
    cache.check()
    cache.unlock(m.node)
    assert cache.evictable_pages == 2 and cache.evict(10) == 2
    assert alloc.num_free == alloc.capacity and cache.num_pages == 0
    with pytest.raises(RuntimeError, match="not locked"):
        cache.unlock(m.node)


def test_evict_is_lru_over_leaves():
    cache, alloc = _cache()
    a, b, c = [1] * 8, [2] * 8, [3] * 8
    for ids in (a, b, c):
        _store(cache, alloc, ids)
    cache.match_prefix(a)  # a is now the most recently used
    # b's leaf goes first, then b's first page (now a leaf, older than c), then c's leaf.
    assert cache.evict(3) == 3
    assert cache.match_prefix(b).num_tokens == 0
    assert cache.match_prefix(c).num_tokens == 4
    assert cache.match_prefix(a).num_tokens == 8
    assert alloc.num_used == 3
    cache.check()


def test_evicting_everything_frees_every_page():
    cache, alloc = _cache(32)
    for i in range(6):
        _store(cache, alloc, [7] * 4 + [i] * 8)
    assert cache.num_pages == 13 and alloc.num_used == 13
    assert cache.evict(1000) == 13
    assert alloc.num_free == alloc.capacity
    cache.check()


def test_disabled_cache_has_the_same_interface():
    alloc = PageAllocator(8)
    cache = DisabledPrefixCache(alloc, PS)
    pages = alloc.allocate(2)
    assert cache.insert(list(range(8)), pages) == (0, None)
    m = cache.match_prefix(list(range(8)))
    assert (m.pages, m.num_tokens, m.node) == ([], 0, None)
    cache.lock(m.node)
    cache.unlock(m.node)
    assert cache.evict(5) == 0 and cache.num_pages == cache.evictable_pages == 0
    assert [alloc.refcount(p) for p in pages] == [1, 1]
