"""What compiled executables cost the process, and the check that a plan fits before any
compilation starts. Plain Python (no jax): the runner hands in its plan as counts.

Why it matters: XLA CPU loads every compiled kernel as its own small object (a code page,
a read-only page, a data page: three memory mappings), so one executable costs one
mapping per ~third of its kernels, and the process dies inside LLVM ("Cannot allocate
memory", then a segfault) when it reaches the kernel's `vm.max_map_count` (65,530 by
default), with plenty of RAM still free. Resident memory grows too, mostly from the
compiler's freed-but-retained heap, which `release_freed_heap` hands back.

Measured on the 2-vCPU CPU box, SmolLM2-135M f32 (docs/benchmarks.md, "Executables"):
a forward executable (model only, sampling split out) maps ~100 regions; a sampler
executable, one per batch-row bucket, ~255. These are the planning estimates below;
the runner also measures each executable as it compiles and reports the real figures.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import ctypes.util
import dataclasses
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

from tqdm import tqdm


@dataclasses.dataclass(frozen=True)
class ExecutableCost:
    """Planning estimate of what one executable adds to the process."""

    maps: int
    resident_mb: float


# Estimates for XLA CPU (see the module docstring); on a GPU the code lives on the device
# and the host side is a small fraction of this, so the CPU figures are an upper bound.
FORWARD_COST = ExecutableCost(maps=130, resident_mb=12.0)
SAMPLER_COST = ExecutableCost(maps=270, resident_mb=12.0)
# A multi-step decode program (runtime/multi_step.py): a forward and a sampler in one loop.
MULTI_STEP_COST = ExecutableCost(maps=FORWARD_COST.maps + SAMPLER_COST.maps,
                                 resident_mb=FORWARD_COST.resident_mb + SAMPLER_COST.resident_mb)
# Mappings the runtime needs beyond the executables (threads' stacks, arenas, the KV
# pool, sockets) and the share of free memory the plan may take.
_RESERVED_MAPS = 4096
_MEMORY_SHARE = 0.8


@dataclasses.dataclass(frozen=True)
class Footprint:
    """The process's memory mappings and resident memory, and the machine's limits."""

    maps: int
    resident_mb: float
    max_maps: int
    available_mb: float

    def to_json(self) -> dict[str, float]:
        return dataclasses.asdict(self)


def max_map_count() -> int:
    """The kernel's per-process mapping limit (Linux; elsewhere effectively unbounded)."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except OSError:
        return 1 << 31


def _memory_mb() -> tuple[float, float]:
    """(this process's resident MB, the machine's available MB). psutil where it is
    installed; else Linux's /proc (a bare GPU machine, scripts/bench/gpu_suite.py)."""
    try:
        import psutil
    except ImportError:
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
        with open("/proc/meminfo") as f:
            avail = next(int(ln.split()[1]) for ln in f if ln.startswith("MemAvailable:"))
        return rss, avail / 2**10
    return psutil.Process().memory_info().rss / 2**20, psutil.virtual_memory().available / 2**20


def footprint() -> Footprint:
    try:
        with open(f"/proc/{os.getpid()}/maps") as f:
            maps = sum(1 for _ in f)
    except OSError:
        maps = 0
    rss, available = _memory_mb()
    return Footprint(maps=maps, resident_mb=rss, max_maps=max_map_count(), available_mb=available)


def release_freed_heap() -> None:
    """Return the allocator's freed pages to the OS (glibc `malloc_trim`). Compiling an
    executable allocates and frees a few hundred MB of LLVM state in arenas that glibc
    keeps resident: without this a warm-up of 12 SmolLM2 executables holds +31 MB each,
    with it nothing (measured; docs/benchmarks.md)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return
    libc = ctypes.CDLL(name)
    if hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


@dataclasses.dataclass(frozen=True)
class ExecutableStat:
    """What compiling one executable cost, measured around its compilation."""

    name: str
    compile_s: float
    maps: int
    resident_mb: float


def compile_all(lowerings: Iterable[tuple[str, Callable[[], Any]]], total: int,
                stats: list[ExecutableStat], progress: bool) -> dict[str, Any]:
    """Lower and compile every (name, lower) of a plan, recording each one's cost.

    Tracing and lowering hold the GIL while XLA's compilation (or loading from the
    persistent cache) releases it, so a worker thread compiles executable i while the
    main thread lowers i + 1: start-up costs about max(lowering, compiling) instead of
    their sum (warm cache, 72 executables, 2 cores: 33 s against 47 s in series). One worker, so the
    mappings and memory measured around a compilation are its own.
    """

    def compile_one(name: str, lowered: Any) -> Any:
        before, t0 = footprint(), time.perf_counter()
        exe = lowered.compile()
        secs = time.perf_counter() - t0
        release_freed_heap()  # the compiler's freed heap would otherwise stay resident
        after = footprint()
        stats.append(ExecutableStat(name, secs, after.maps - before.maps,
                                    after.resident_mb - before.resident_mb))
        return exe

    bar = tqdm(total=total, desc="compiling buckets", disable=not progress, unit="exe")
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        futures = {}
        for name, lower in lowerings:
            futures[name] = pool.submit(compile_one, name, lower())
            futures[name].add_done_callback(lambda _: bar.update())
        compiled = {name: f.result() for name, f in futures.items()}
    bar.close()
    return compiled


class ExecutableBudgetError(RuntimeError):
    """The executable plan does not fit this process; raised before compiling anything."""


@dataclasses.dataclass(frozen=True)
class PlanPart:
    """One group of the plan: how many executables, of which cost, and why that many
    (the flags whose values multiply into the count)."""

    name: str
    count: int
    cost: ExecutableCost
    why: str


def plan_cost(parts: list[PlanPart]) -> ExecutableCost:
    return ExecutableCost(maps=sum(p.count * p.cost.maps for p in parts),
                          resident_mb=sum(p.count * p.cost.resident_mb for p in parts))


def check_budget(parts: list[PlanPart], now: Footprint) -> ExecutableCost:
    """Refuse a plan that would exceed the mapping limit or the free memory (with a
    message naming what multiplies the count); return its estimated cost otherwise."""
    cost = plan_cost(parts)
    maps_left = now.max_maps - now.maps - _RESERVED_MAPS
    mem_left = now.available_mb * _MEMORY_SHARE
    if cost.maps <= maps_left and cost.resident_mb <= mem_left:
        return cost
    total = sum(p.count for p in parts)
    lines = [f"  {p.name}: {p.count} = {p.why}" for p in parts if p.count]
    raise ExecutableBudgetError(
        f"the executable plan has {total} executables, estimated at {cost.maps} memory "
        f"mappings and {cost.resident_mb:.0f} MB, but this process has {max(maps_left, 0)} "
        f"mappings left under vm.max_map_count={now.max_maps} (it holds {now.maps}) and "
        f"{mem_left:.0f} MB of memory to spend. Where the count comes from:\n"
        + "\n".join(lines)
        + "\nCut a multiplying flag (fewer --decode_buckets / --max_running_requests, "
        "--extend_token_buckets, --kv_len_buckets, --max_extend_seqs, or drop "
        "--enable_mixed_chunk), or raise the limit (sysctl -w vm.max_map_count=262144).")
