"""PageAllocator invariants and the page-table helpers; host modules never import jax."""

from __future__ import annotations

import random
import subprocess
import sys

import numpy as np
import pytest

from runtime.kv_cache import PAD_PAGE, PageAllocator, page_table, pages_for
from tests.fake_runner import cache_slots

HOST_MODULES = (
    "runtime.request",
    "runtime.kv_cache",
    "runtime.prefix_cache",
    "runtime.schedule_batch",
    "runtime.prefill_policy",
    "runtime.scheduler",
    "tests.fake_runner",
)


def test_host_modules_do_not_import_jax():
    code = f"import sys\nimport {', '.join(HOST_MODULES)}\nprint('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_page_zero_is_never_handed_out():
    alloc = PageAllocator(8)
    pages = alloc.allocate(7)
    assert sorted(pages) == list(range(1, 8)) and PAD_PAGE not in pages
    assert not alloc.can_allocate(1)
    with pytest.raises(RuntimeError, match="cannot allocate"):
        alloc.allocate(1)
    alloc.check()


def test_refcounts_free_and_decref():
    alloc = PageAllocator(6)
    a, b = alloc.allocate(2)
    alloc.incref([a])
    with pytest.raises(RuntimeError, match="not exclusively owned"):
        alloc.free([a])
    assert alloc.decref([a]) == 0 and alloc.refcount(a) == 1
    alloc.free([a, b])
    assert alloc.num_free == alloc.capacity == 5
    with pytest.raises(RuntimeError, match="decref of free page"):
        alloc.decref([a])
    with pytest.raises(RuntimeError, match="incref of free page"):
        alloc.incref([b])
    alloc.check()


def test_random_ops_keep_invariants():
    rng = random.Random(0)
    alloc = PageAllocator(33)
    owned: list[int] = []  # one entry per reference we hold
    for _ in range(2000):
        op = rng.random()
        if op < 0.4 and alloc.can_allocate(n := rng.randint(1, 4)):
            owned += alloc.allocate(n)
        elif op < 0.55 and owned:
            page = rng.choice(owned)
            alloc.incref([page])
            owned.append(page)
        elif owned:
            page = owned.pop(rng.randrange(len(owned)))
            alloc.decref([page])
        alloc.check()
        assert alloc.num_free + alloc.num_used == alloc.capacity
        assert all(alloc.refcount(p) == owned.count(p) for p in set(owned))
        assert alloc.num_used == len(set(owned))
    alloc.decref(owned)
    assert alloc.num_free == alloc.capacity


def test_page_helpers():
    assert [pages_for(n, 4) for n in (0, 1, 4, 5, 8)] == [0, 1, 1, 2, 2]
    pages = [7, 3, 9]
    assert cache_slots(pages, 0, 10, 4).tolist() == [28, 29, 30, 31, 12, 13, 14, 15, 36, 37]
    assert cache_slots(pages, 5, 6, 4).tolist() == [13]
    table = page_table([[1, 2], [5]], 3)
    np.testing.assert_array_equal(table, [[1, 2, PAD_PAGE], [5, PAD_PAGE, PAD_PAGE]])
    with pytest.raises(ValueError, match="table width"):
        page_table([[1, 2, 3, 4]], 3)
