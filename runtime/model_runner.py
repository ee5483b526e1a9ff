"""ModelRunner: owns weights, the KV pool and per-request device state, the shared
sampler, and the compile plan; the execution paths (runtime/paths) own their executables
and launches. Steps launch asynchronously.

A step is two launches: the forward (tokens -> logits [B, V], KV written) and the
sampler (logits -> tokens, slot state updated). They are separate executables because
the sampler is most of a step's compiled kernels (~255 of ~350 memory mappings on XLA
CPU) and depends only on B: shared by every mode and bucket with the same row count, it
is compiled a handful of times instead of once per bucket (runtime/executable_budget.py).

Every executable is compiled in `warmup()`, after the plan is checked against the
process's mapping and memory budget; `launch()` only ever calls those, so a batch that
fits no bucket is an error, never a silent recompile. The runner plans, lowers, installs
and launches by looping over its enabled paths (runtime/paths/base.py is the protocol),
so it names none of them. The sampling launches and PendingStep live in
runtime/runner_sampling.py, a mixin of ModelRunner over the state it owns here.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

import cpu_kernels
from models.config import ModelConfig
from models.forward_mode import ForwardMode
from models.fp8 import Fp8Weight
from models.kv_pool import KVPool, init_kv_pool, kv_pool_shape
from models.registry import model_module
from runtime import sharding
from runtime.batch_builder import BucketShape, SeedRow, input_layout, pack_rows
from runtime.bucket_plan import BucketPlan, StepKey, cost_key
from runtime.compile_counter import CompileAfterWarmupError, compile_counter
from runtime.config import CacheConfig, RunnerConfig
from runtime.executable_budget import (
    SAMPLER_COST,
    ExecutableStat,
    PlanPart,
    check_budget,
    compile_all,
    footprint,
)
from runtime.paths import ExecPath, LaunchedForward, check_paths, enabled_paths, ring_pages
from runtime.runner_sampling import PendingStep, SamplingLaunch
from runtime.schedule_batch import ScheduleBatch
from runtime.sharding import MeshPlacement
from runtime.slot_state import SlotState, init_slot
from runtime.step_costs import DeviceCosts

logger = logging.getLogger(__name__)


class ModelRunner(SamplingLaunch):
    def __init__(self, model_cfg: ModelConfig, params: dict, cache_cfg: CacheConfig,
                 runner_cfg: RunnerConfig, max_running_requests: int,
                 mesh: Mesh | None = None,
                 draft: tuple[ModelConfig, dict] | None = None) -> None:
        """`mesh` (runtime/sharding.serving_mesh): params, KV pool and sampler state are
        placed on it (tensor-parallel weights, KV pool split over KV heads, experts over
        `ep`, the rest replicated); XLA partitions each step from those shardings.
        `draft`: a draft model's (config, weights) for speculative decoding; its path
        (runtime/paths/draft.py) keeps its own pool and programs."""
        self.model_cfg, self.cache_cfg, self.cfg = model_cfg, cache_cfg, runner_cfg
        _check_mesh(runner_cfg, mesh)
        check_paths(model_cfg, runner_cfg, cache_cfg, mesh)
        self.mesh = mesh
        self.draft_model = draft
        # Data-parallel attention ranks (--dp): every bucket is one rank's, every
        # executable's arrays dp of them.
        self.dp = 1 if mesh is None else mesh.shape.get("dp", 1)
        compile_counter()  # listen from here on, so warm-up compilations are counted too
        self.max_running = max_running_requests
        self.dtype = jnp.dtype(runner_cfg.dtype)
        self.model = model_module(model_cfg)
        if mesh is not None and jax.process_count() > 1:
            # Weights a process loaded onto its own device would be a cross-host transfer
            # to the global mesh; from host memory each process places its own shards.
            params = jax.device_get(params)
        # FP8 weights (models/fp8.py, loaded for the GPU path) stay FP8.
        self.params = jax.tree.map(
            lambda w: w if isinstance(w, Fp8Weight) else jnp.asarray(w, self.dtype), params,
            is_leaf=lambda w: isinstance(w, Fp8Weight))
        if mesh is not None:
            self.params = jax.device_put(self.params, sharding.fp8_shardings(
                self.params, sharding.param_shardings(model_cfg, mesh), mesh))
        if runner_cfg.per_layer_weights:
            self.params = self.model.unstack_layers(self.params)
        if runner_cfg.fuse_projections and runner_cfg.cpu_matmul != "packed":  # packing fuses
            self.params = self.model.fuse_projections(self.params)
        if runner_cfg.cpu_matmul == "packed":
            self.params = self.model.pack_for_cpu(self.params, runner_cfg.quantization,
                                                  compress=runner_cfg.compress_weights)
            huge = cpu_kernels.back_with_huge_pages(self.params)
            logger.info("weights in 2 MiB pages: %d MiB", huge >> 20)
        kv_sh = None if mesh is None else sharding.kv_sharding(
            model_cfg, kv_pool_shape(model_cfg, cache_cfg), mesh)
        if draft is not None and runner_cfg.sliding_window_rings:
            raise ValueError("sliding_window_rings: not with a draft model yet")
        # Sliding-window rings: one per request slot and one for the padding rows' slot.
        self.ring_pages = ring_pages(model_cfg, runner_cfg, cache_cfg.page_size)
        self.kv: KVPool = init_kv_pool(model_cfg, cache_cfg, jnp.dtype(runner_cfg.kv_dtype),
                                       kv_sh, self.ring_pages, max_running_requests + 1)
        if self.ring_pages:
            logger.info("KV pools: main %d pages x %d global layers, sliding rings %d pages "
                        "x %d layers (%d slots x %d pages)", self.kv.num_pages,
                        self.kv.k.shape[0], self.kv.sk.shape[2], self.kv.sk.shape[0],
                        max_running_requests + 1, self.ring_pages)
        if runner_cfg.attention_backend == "cpu":
            # The CPU attention kernels read each row's pages scattered over the pool: in 2
            # MiB pages, decode steps take 0.92-0.96x the time at 32 rows x 1,024 cached
            # tokens and 8 x 4,096, the same at 192 tokens or one row (f32, AMD EPYC Zen 4;
            # docs/benchmarks.md, CPU kernels). Every executable donates the pool, so it stays
            # in the memory marked here (tests/test_engine.py checks).
            huge = cpu_kernels.zeros_in_huge_pages(self.kv)
            logger.info("KV pool in 2 MiB pages as it is first touched: %d MiB", huge >> 20)
        s, v = max_running_requests + 1, model_cfg.vocab_size
        self.state = SlotState(last_tokens=jnp.zeros(s, jnp.int32),
                               token_counts=jnp.zeros((s, v), jnp.int32),
                               prompt_mask=jnp.zeros((s, v), bool))
        # On a mesh, outputs keep the inputs' placement, so a donated pool stays where it
        # was and every call of an executable sees the shardings it was compiled for.
        # The ring pool splits its KV heads over tp as the main pool does.
        ring_sh = kv_sh if self.ring_pages else None
        self.placement = MeshPlacement(mesh, None if mesh is None else KVPool(
            k=kv_sh, v=kv_sh, sk=ring_sh, sv=ring_sh, ring_pages=self.ring_pages))
        if mesh is not None:
            self.state = jax.device_put(self.state, self.placement.replicated)
        self.buckets = BucketPlan(runner_cfg, cache_cfg.page_size)
        if self.ring_pages * cache_cfg.page_size >= self.max_seq_len:
            logger.warning("sliding-window rings of %d tokens hold the longest context (%d): "
                           "they save nothing; a smaller --chunked_prefill_size shrinks them",
                           self.ring_pages * cache_cfg.page_size, self.max_seq_len)
        self.compiled: dict[str, Any] = {}  # every executable by name, set by warmup()
        self._samplers: dict[int, Callable] = {}
        # The last sampled rows and their sampler input (runner_sampling.sample_words).
        self._words_cache: tuple[list, np.ndarray] | None = None
        self.exec_stats: list[ExecutableStat] = []
        self._warm_compiles: int | None = None
        self._init_slot_exec: dict[int, Callable] = {}
        self.step_counts: dict[ForwardMode, int] = {m: 0 for m in ForwardMode}
        self.costs = DeviceCosts()
        # The execution paths (runtime/paths): each owns its executables and launches.
        self.paths: dict[str, ExecPath] = enabled_paths(self)

    # ---- buckets (runtime/bucket_plan.py) -----------------------------------------------

    def step_keys(self) -> list[StepKey]:
        """Every plain forward executable, fixed at start-up."""
        return self.buckets.step_keys()

    def sampler_sizes(self) -> list[int]:
        """Row counts B of every path's logits: one sampler executable each."""
        return sorted(set().union(*(p.sampler_rows() for p in self.paths.values())))

    def plan(self) -> list[PlanPart]:
        """The executables warm-up compiles, grouped with the flags that multiply them."""
        parts = [part for p in self.paths.values() for part in p.plan_parts()]
        return parts + [PlanPart("sampler", len(self.sampler_sizes()), SAMPLER_COST,
                                 "one per distinct batch-row count of the buckets above")]

    def bucket_for(self, batch: ScheduleBatch) -> BucketShape:
        """The bucket a batch runs in (per rank, under data-parallel attention)."""
        for path in self.paths.values():
            if (shape := path.bucket_for(batch)) is not None:
                return shape
        raise ValueError(f"no execution path has a bucket for a {batch.mode.value} batch")

    @property
    def max_seq_len(self) -> int:
        return self.buckets.max_seq_len

    # ---- compilation ---------------------------------------------------------------------

    def abstract_inputs(self, shape: BucketShape) -> tuple[dict, jax.ShapeDtypeStruct]:
        """The ForwardBatch arrays of `shape` and the row slots, as the split, fused and
        two-batch-overlap programs take them (a plain step takes them flat: flat_input)."""
        arrays = {name: self.placement.i32(*s) for name, s in input_layout(shape, self.dp)}
        return arrays, arrays.pop("row_slots")

    def flat_input(self, shape: BucketShape) -> jax.ShapeDtypeStruct:
        return self.placement.i32(sum(math.prod(s) for _, s in input_layout(shape, self.dp)))

    def _lowerings(self) -> Iterator[tuple[str, Callable[[], Any]]]:
        """(name, lower) for every executable of the plan, in compile order."""
        abstract = functools.partial(jax.tree.map, lambda a: jax.ShapeDtypeStruct(
            a.shape, a.dtype, sharding=getattr(a, "sharding", None)))
        params, kv, state = abstract(self.params), abstract(self.kv), abstract(self.state)
        for path in self.paths.values():
            yield from path.lowerings(params, kv, state)
        sample = self._sample_fn()
        for b in self.sampler_sizes():
            yield f"sample/B{b}", functools.partial(sample.lower, state,
                                                    *self.abstract_sample_inputs(b))
        place = self.placement
        init = jax.jit(init_slot, donate_argnums=(0,), **place.out(place.replicated))
        for n in self.cfg.kv_len_buckets:
            yield f"init_slot/N{n}", functools.partial(init.lower, state, place.i32(),
                                                       place.i32(n), place.i32(n))

    def warmup(self, progress: bool = True) -> float:
        """Check the plan against the budget, then compile every executable (persistent
        cache makes repeats fast); returns seconds.

        Lowering and compiling overlap (executable_budget.compile_all).
        """
        t0 = time.perf_counter()
        plan = self.plan()
        est = check_budget(plan, footprint())
        total = sum(p.count for p in plan) + len(self.cfg.kv_len_buckets)
        logger.info("executable plan: %s, %d init_slot; estimated %d mappings, %.0f MB",
                    ", ".join(f"{p.count} {p.name}" for p in plan),
                    len(self.cfg.kv_len_buckets), est.maps, est.resident_mb)
        self.compiled = compile_all(self._lowerings(), total, self.exec_stats, progress)
        self.install_executables()
        self._warm_compiles = compile_counter().count
        for path in self.paths.values():
            path.after_warmup()
        secs = time.perf_counter() - t0
        fp = footprint()
        logger.info("compiled %d executables in %.1f s; process: %d memory mappings "
                    "(%.0f%% of vm.max_map_count=%d), %.0f MB resident", total, secs, fp.maps,
                    100 * fp.maps / fp.max_maps, fp.max_maps, fp.resident_mb)
        return secs

    def install_executables(self, wrap: Callable[[str, Callable], Callable] | None = None
                            ) -> None:
        """Install the compiled executables (`self.compiled`, by name) where the launches
        find them; `wrap(name, exe)`, if given, stands in for each (runtime/multihost.py
        mirrors every call to the other processes of a multi-process mesh this way)."""
        exes = {n: wrap(n, e) if wrap else e for n, e in self.compiled.items()}
        for path in self.paths.values():
            path.install(exes)
        self._samplers = {b: exes[f"sample/B{b}"] for b in self.sampler_sizes()}
        self._init_slot_exec = {n: exes[f"init_slot/N{n}"] for n in self.cfg.kv_len_buckets}

    def device_state(self) -> tuple[Any, Any, Any]:
        """The runner's long-lived device arrays: weights, KV pool, sampler slot state."""
        return self.params, self.kv, self.state

    def cost_seed_inputs(self, shape: BucketShape) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """Inputs that fill `shape` with real tokens (the CPU fast path skips padding, so
        a padded step would time as nearly free): one extend row over every extend token
        and decode rows at their first position, all writing to the padding page (page
        0, never handed out), with the padding sampler slot."""
        page = self.cache_cfg.page_size
        te = shape.num_extend_tokens

        def row(n: int) -> SeedRow:
            return SeedRow(input_ids=[0] * n, start_pos=0, pages=[0] * -(-n // page))

        arrays = pack_rows([row(te)] if te else [],
                           [row(1) for _ in range(shape.num_decode_seqs)], shape, page)
        b = shape.num_extend_seqs + shape.num_decode_seqs
        return arrays, np.full(b, self.max_running, np.int32)

    @property
    def num_executables(self) -> int:
        if not self._samplers:  # not installed yet
            return 0
        return (sum(len(p.names) for p in self.paths.values()) + len(self._samplers)
                + len(self._init_slot_exec))

    @property
    def compiles_after_warmup(self) -> int:
        """Compilations in this process since warm-up (0 before it)."""
        if self._warm_compiles is None:
            return 0
        return compile_counter().count - self._warm_compiles

    def check_no_compiles(self) -> None:
        """In strict mode, fail if anything compiled since warm-up."""
        if self.cfg.strict_compile and self.compiles_after_warmup:
            raise CompileAfterWarmupError(
                f"{self.compiles_after_warmup} compilation(s) after warm-up")

    # ---- execution -----------------------------------------------------------------------

    def launch(self, batch: ScheduleBatch) -> PendingStep:
        """Dispatch one step asynchronously; the returned PendingStep reads it back. The
        first path that claims the batch whole runs it, else the first that claims its
        forward, followed by the shared sampler."""
        for path in self.paths.values():
            if (pending := path.launch(batch)) is not None:
                return pending
        return self.launch_sample(self.launch_forward(batch))

    def launch_forward(self, batch: ScheduleBatch) -> LaunchedForward:
        """The forward half of `launch`. The sampling half (launch_sample) may follow once
        the host knows the rows' grammar masks, i.e. after the previous step's tokens are
        consumed: the device runs this forward meanwhile."""
        for path in self.paths.values():
            if (fwd := path.forward(batch)) is not None:
                return fwd
        raise ValueError(f"no execution path runs a {batch.mode.value} batch")

    def launch_sample(self, fwd: LaunchedForward) -> PendingStep:
        """Sample a launched forward's logits with the shared sampler of its row count."""
        pending = self._sample_rows(fwd.batch, fwd.padded, fwd.logits, fwd.order)
        pending.shape, pending.detail = fwd.shape, fwd.detail
        if fwd.cost is not None:
            self.costs.watch(fwd.cost, pending.out.next_tokens)
        return pending

    def step_cost(self, batch: ScheduleBatch) -> float | None:
        """Measured device seconds of a step like `batch` (None until one has run)."""
        return self.costs.get(cost_key(batch.mode, self.bucket_for(batch)))


def _check_mesh(cfg: RunnerConfig, mesh: Mesh | None) -> None:
    """What does not run on a mesh yet, as a start-up error."""
    if mesh is None:
        return
    if "cpu" in (cfg.attention_backend, cfg.cpu_matmul.replace("packed", "cpu")):
        raise ValueError(f"the CPU kernels are single-device (attention_backend="
                         f"{cfg.attention_backend!r}, cpu_matmul={cfg.cpu_matmul!r}): on a "
                         "mesh use attention_backend='xla' and cpu_matmul='xla'")
    if cfg.fuse_projections and mesh.shape.get("tp", 1) > 1:
        raise ValueError("fuse_projections under tensor parallelism: a column shard of the "
                         "fused wq|wk|wv would not be one device's heads (fuse_projections="
                         "False)")
