"""Prefix cache: a radix tree over page-aligned token runs, sharing KV pages between requests.

Host only (no jax). Each tree edge is one full page: its key is the tuple of the page_size
token ids stored in that page, its value the page id.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from typing import NamedTuple

from runtime.kv_cache import PageAllocator


class Node:
    """One cached page. lock_ref counts the locks held on this node or any descendant."""

    __slots__ = ("key", "page", "parent", "children", "lock_ref", "last_access")

    def __init__(self, key: tuple[int, ...], page: int, parent: Node | None):
        self.key = key
        self.page = page
        self.parent = parent
        self.children: dict[tuple[int, ...], Node] = {}
        self.lock_ref = 0
        self.last_access = 0

    def __lt__(self, other: Node) -> bool:
        return self.last_access < other.last_access


class PrefixMatch(NamedTuple):
    pages: list[int]  # one page per matched page_size tokens
    num_tokens: int  # len(pages) * page_size
    node: Node | None  # deepest matched node; pass it to lock() / unlock()


class InsertResult(NamedTuple):
    num_cached: int  # leading tokens that were cached already
    node: Node | None  # the node of the last inserted page; pass it to lock() / unlock()


class PrefixCache:
    """Radix tree of cached KV pages with LRU eviction.

    Contract:
    - Ownership: the tree holds one allocator reference per page it stores. `insert` increfs
      only the pages it adds; where a key is already cached the tree keeps its own page and
      the caller's page is left alone (the caller drops its reference as usual). A page may
      be inserted while its KV is still being written by a launched batch: the device runs
      batches in order, so any later reader sees it written.
    - `match_prefix` changes no ownership. Its pages are safe to use only after `lock(node)`:
      an unlocked node may be evicted, and its page reused, by the next `evict`. A request
      that uses matched pages also increfs them, like every page in its page list.
    - `lock(node)` pins the node and all its ancestors; each lock is undone by exactly one
      `unlock(node)`. Locked nodes are never evicted. A running request keeps its matched
      and its inserted pages locked, so every unlocked page is held by the tree alone and
      evicting it really frees it (`evictable_pages` is exact).
    - `evict(n)` drops least-recently-used unlocked leaves (a parent becomes a candidate once
      its last child goes) until n pages are freed or nothing evictable is left.
    - Callers match on ids[:-1] when they need the logits of the last token: the match is
      page aligned, so at least one token is always left to prefill.
    """

    def __init__(self, allocator: PageAllocator, page_size: int):
        self.allocator = allocator
        self.page_size = page_size
        self.root = Node((), -1, None)
        self.num_pages = 0
        self._num_locked = 0
        self._leaves: set[Node] = set()  # unlocked leaves: the eviction candidates
        self._clock = itertools.count(1)

    @property
    def evictable_pages(self) -> int:
        return self.num_pages - self._num_locked

    @property
    def protected_pages(self) -> int:
        return self._num_locked

    def _keys(self, ids: Sequence[int]):
        ps = self.page_size
        for i in range(len(ids) // ps):
            yield tuple(ids[i * ps : (i + 1) * ps])

    def match_prefix(self, ids: Sequence[int]) -> PrefixMatch:
        """Longest cached run of whole pages that prefixes ids; refreshes its LRU stamps."""
        node, pages, now = self.root, [], next(self._clock)
        for key in self._keys(ids):
            child = node.children.get(key)
            if child is None:
                break
            node = child
            node.last_access = now
            pages.append(node.page)
        return PrefixMatch(pages, len(pages) * self.page_size, node)

    def insert(self, ids: Sequence[int], pages: Sequence[int]) -> InsertResult:
        """Cache whole pages: pages[i] holds ids[i*page_size:(i+1)*page_size]."""
        if len(ids) != len(pages) * self.page_size:
            raise ValueError(f"{len(ids)} ids do not fill {len(pages)} pages exactly")
        node, now, known = self.root, next(self._clock), 0
        for key, page in zip(self._keys(ids), pages, strict=True):
            child = node.children.get(key)
            if child is None:
                child = self._add_child(node, key, page)
            else:
                known += self.page_size
            node = child
            node.last_access = now
        return InsertResult(known, node)

    def _add_child(self, parent: Node, key: tuple[int, ...], page: int) -> Node:
        self.allocator.incref([page])
        child = Node(key, page, parent)
        parent.children[key] = child
        self._leaves.discard(parent)
        self._leaves.add(child)
        self.num_pages += 1
        return child

    def lock(self, node: Node | None) -> None:
        while node is not None and node is not self.root:
            if node.lock_ref == 0:
                self._num_locked += 1
                self._leaves.discard(node)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: Node | None) -> None:
        while node is not None and node is not self.root:
            if node.lock_ref <= 0:
                raise RuntimeError("unlock of a node that is not locked")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._num_locked -= 1
                if not node.children:
                    self._leaves.add(node)
            node = node.parent

    def evict(self, num_pages: int) -> int:
        """Free at least num_pages pages if that many are evictable; returns pages freed."""
        heap = list(self._leaves)
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            node = heapq.heappop(heap)
            parent = node.parent
            del parent.children[node.key]
            self._leaves.discard(node)
            self.num_pages -= 1
            freed += self.allocator.decref([node.page])
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                self._leaves.add(parent)
                heapq.heappush(heap, parent)
        return freed

    def check(self) -> None:
        """Assert size accounting and lock counts against a full walk (tests only)."""
        nodes, locked, stack = 0, 0, list(self.root.children.values())
        while stack:
            node = stack.pop()
            nodes += 1
            locked += node.lock_ref > 0
            child_locks = sum(c.lock_ref for c in node.children.values())
            assert node.lock_ref >= child_locks, "a locked node has an unlocked ancestor"
            assert self.allocator.refcount(node.page) >= 1, "cached page is free"
            is_leaf = not node.children and node.lock_ref == 0
            assert is_leaf == (node in self._leaves), "leaf set out of date"
            stack.extend(node.children.values())
        assert (nodes, locked) == (self.num_pages, self._num_locked), "size accounting"


class DisabledPrefixCache:
    """The --disable_prefix_cache variant: same interface, caches nothing."""

    num_pages = 0
    evictable_pages = 0
    protected_pages = 0

    def __init__(self, allocator: PageAllocator, page_size: int):
        self.allocator = allocator
        self.page_size = page_size

    def match_prefix(self, ids: Sequence[int]) -> PrefixMatch:
        return PrefixMatch([], 0, None)

    def insert(self, ids: Sequence[int], pages: Sequence[int]) -> InsertResult:
        return InsertResult(0, None)

    def lock(self, node: Node | None) -> None:
        pass

    def unlock(self, node: Node | None) -> None:
        pass

    def evict(self, num_pages: int) -> int:
        return 0

    def check(self) -> None:
        pass


def make_prefix_cache(
    allocator: PageAllocator, page_size: int, enabled: bool
) -> PrefixCache | DisabledPrefixCache:
    return (PrefixCache if enabled else DisabledPrefixCache)(allocator, page_size)
