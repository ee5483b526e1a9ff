"""ModelRunner: owns weights, the KV pool and per-request device state; one AOT-compiled
forward executable per (mode, bucket) and one sampler executable per batch-row count;
launches steps asynchronously.

A step is two launches: the forward (tokens -> logits [B, V], KV written) and the
sampler (logits -> tokens, slot state updated). They are separate executables because
the sampler is most of a step's compiled kernels (~255 of ~350 memory mappings on XLA
CPU) and depends only on B: shared by every mode and bucket with the same row count, it
is compiled a handful of times instead of once per bucket (runtime/executable_budget.py).

Every executable is compiled in `warmup()`, after the plan is checked against the
process's mapping and memory budget; `launch()` only ever calls those, so a batch that
fits no bucket is an error, never a silent recompile.

The split-prefill and fused launches live in runtime/runner_split.py, the sampling
launches and PendingStep in runtime/runner_sampling.py: mixins of ModelRunner over the
state it owns here.
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
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import cpu_kernels
from models.config import ModelConfig
from models.forward_batch import ForwardBatch, ForwardMode
from models.kv_pool import KVPool, init_kv_pool, kv_pool_shape
from models.registry import model_module
from runtime import sampling, sharding, two_batch_overlap
from runtime.batch_builder import (
    BucketShape,
    SeedRow,
    flatten_inputs,
    input_layout,
    pack_flat,
    pack_rows,
    unflatten_inputs,
)
from runtime.bucket_plan import BucketPlan, StepKey, cost_key, key_name
from runtime.compile_counter import CompileAfterWarmupError, compile_counter
from runtime.config import CacheConfig, RunnerConfig
from runtime.dp_attention import (
    DPBatch,
    dp_pack,
    dp_shape,
)
from runtime.exec_trace import TboSplit
from runtime.executable_budget import (
    ExecutableStat,
    PlanPart,
    check_budget,
    compile_all,
    footprint,
)
from runtime.grammar import mask_width
from runtime.multi_step import MultiStepExecutables, multi_step_fn, pack_steps
from runtime.request import MAX_LOGIT_BIAS
from runtime.runner_sampling import PendingStep, SamplingLaunch
from runtime.runner_split import SplitLaunch
from runtime.schedule_batch import ScheduleBatch
from runtime.slot_state import SlotState, init_slot
from runtime.split_prefill import (
    MeshPlacement,
    SplitExecutables,
)
from runtime.step_costs import DeviceCosts
from runtime.tbo_step import TboExecutables, compiler_options

logger = logging.getLogger(__name__)


class LaunchedForward:
    """A launched forward whose sampling is not launched yet (logits stay on device)."""

    def __init__(self, batch: ScheduleBatch, shape: BucketShape, logits: jax.Array) -> None:
        self.batch, self.shape, self.logits = batch, shape, logits


class ModelRunner(SplitLaunch, SamplingLaunch):
    def __init__(self, model_cfg: ModelConfig, params: dict, cache_cfg: CacheConfig,
                 runner_cfg: RunnerConfig, max_running_requests: int,
                 mesh: Mesh | None = None) -> None:
        """`mesh` (runtime/sharding.serving_mesh): params, KV pool and sampler state are
        placed on it (tensor-parallel weights, KV pool split over KV heads, experts over
        `ep`, the rest replicated); XLA partitions each step from those shardings."""
        self.model_cfg, self.cache_cfg, self.cfg = model_cfg, cache_cfg, runner_cfg
        _check_mesh(runner_cfg, mesh, cache_cfg)
        self.mesh = mesh
        # Data-parallel attention ranks (runtime/dp_attention.py): every bucket is one
        # rank's, every executable's arrays dp of them.
        self.dp = 1 if mesh is None else mesh.shape.get("dp", 1)
        compile_counter()  # listen from here on, so warm-up compilations are counted too
        self.max_running = max_running_requests
        self.dtype = jnp.dtype(runner_cfg.dtype)
        self.model = model_module(model_cfg)
        if mesh is not None and jax.process_count() > 1:
            # Weights a process loaded onto its own device would be a cross-host transfer
            # to the global mesh; from host memory each process places its own shards.
            params = jax.device_get(params)
        self.params = jax.tree.map(lambda w: jnp.asarray(w, self.dtype), params)
        if mesh is not None:
            self.params = jax.device_put(self.params, sharding.param_shardings(model_cfg, mesh))
        if runner_cfg.per_layer_weights:
            self.params = self.model.unstack_layers(self.params)
        if runner_cfg.cpu_matmul == "packed":
            self.params = self.model.pack_for_cpu(self.params, runner_cfg.quantization,
                                                  compress=runner_cfg.compress_weights)
            huge = cpu_kernels.back_with_huge_pages(self.params)
            logger.info("weights in 2 MiB pages: %d MiB", huge >> 20)
        kv_sh = None if mesh is None else sharding.kv_sharding(
            model_cfg, kv_pool_shape(model_cfg, cache_cfg), mesh)
        self.kv: KVPool = init_kv_pool(model_cfg, cache_cfg, jnp.dtype(runner_cfg.kv_dtype),
                                       kv_sh)
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
        self._replicated = None if mesh is None else NamedSharding(mesh, PartitionSpec())
        self._out = (lambda *sh: {}) if mesh is None else (
            lambda *sh: {"out_shardings": sh if len(sh) > 1 else sh[0]})
        self._kv_sh = None if mesh is None else KVPool(k=kv_sh, v=kv_sh)
        if mesh is not None:
            self.state = jax.device_put(self.state, self._replicated)
        self.buckets = BucketPlan(runner_cfg, cache_cfg.page_size)
        self._executables: dict[StepKey, Callable] = {}
        self.compiled: dict[str, Any] = {}  # every executable by name, set by warmup()
        self._place = MeshPlacement(mesh, self._kv_sh)
        self.split = (SplitExecutables(model_cfg, runner_cfg.attention_backend, [
            k.shape for k in self.step_keys() if k.mode is ForwardMode.EXTEND
            and k.shape.num_extend_tokens >= runner_cfg.split_min_tokens],
            runner_cfg.split_prefill_layers, self._place)
            if runner_cfg.enable_split_prefill else None)
        self.fused = self._fused_executables() if runner_cfg.multiplex_fused else None
        self.tbo = self._tbo_executables() if runner_cfg.enable_two_batch_overlap else None
        self.multi = (MultiStepExecutables(runner_cfg.num_scheduler_steps, self.step_keys(),
                                           cache_cfg.page_size)
                      if runner_cfg.num_scheduler_steps > 1 else None)
        self._samplers: dict[int, Callable] = {}
        # The last sampled rows and their sampler input (runner_sampling._sample_words).
        self._words_cache: tuple[list, np.ndarray] | None = None
        self.exec_stats: list[ExecutableStat] = []
        self._warm_compiles: int | None = None
        self._init_slot_exec: dict[int, Callable] = {}
        self.step_counts: dict[ForwardMode, int] = {m: 0 for m in ForwardMode}
        self.costs = DeviceCosts()

    # ---- buckets (runtime/bucket_plan.py) -----------------------------------------------

    def step_keys(self) -> list[StepKey]:
        """Every forward executable the runner may call, fixed at start-up."""
        return self.buckets.step_keys()

    def sampler_sizes(self) -> list[int]:
        """Row counts B of the step keys (and of the TBO steps' merged rows): one sampler
        executable each."""
        tbo = {self.tbo.rows(k) for k in self.tbo.keys} if self.tbo else set()
        return sorted({self.dp * (k.shape.num_extend_seqs + k.shape.num_decode_seqs)
                       for k in self.step_keys()} | tbo)

    def plan(self) -> list[PlanPart]:
        """The executables warm-up compiles, grouped with the flags that multiply them."""
        keys = self.step_keys()
        n = {m: sum(k.mode is m for k in keys) for m in ForwardMode}
        return self.buckets.plan_parts(n, len(self.split.names) if self.split else 0,
                                       len(self.fused.names) if self.fused else 0,
                                       len(self.sampler_sizes()),
                                       len(self.tbo.names) if self.tbo else 0,
                                       len(self.multi.names) if self.multi else 0)

    def _tbo_executables(self) -> TboExecutables:
        """TBO programs for the buckets a split child can need: the children of a batch of
        at least tbo_min_tokens tokens hold at least half of them each (the larger one)."""
        _check_tbo(self.model_cfg, self.cfg, self.mesh)
        modes = (ForwardMode.DECODE, ForwardMode.EXTEND, ForwardMode.MIXED)
        keys = [k for k in self.step_keys() if k.mode in modes and 2 * (
            k.shape.num_extend_tokens + k.shape.num_decode_seqs) >= self.cfg.tbo_min_tokens]
        options = compiler_options(jax.default_backend())
        if options:
            logger.info("two-batch overlap: %d executables compiled with %s", len(keys),
                        options)
        return TboExecutables(self.model_cfg, self.cfg.attention_backend, self.mesh, keys,
                              self.max_running, self._out(self._replicated, self._kv_sh),
                              options)

    def bucket_for(self, batch: ScheduleBatch) -> BucketShape:
        """The (per-rank, under dp) bucket a batch runs in."""
        if isinstance(batch, DPBatch):
            return dp_shape(batch, self.buckets.bucket_for, self.buckets.decode_widths()[-1])
        return self.buckets.bucket_for(batch)

    @property
    def max_seq_len(self) -> int:
        return self.buckets.max_seq_len

    # ---- compilation ---------------------------------------------------------------------

    def _forward_fn(self, key: StepKey) -> Callable:
        shape = key.shape
        te, be = shape.num_extend_tokens, shape.num_extend_seqs
        cfg, backend, dummy = self.model_cfg, self.cfg.attention_backend, self.max_running
        model, mesh = self.model, self.mesh

        dp = self.dp

        layout = input_layout(shape, dp)

        def forward(params, kv, last_tokens, flat):
            arrays = unflatten_inputs(flat, layout)  # flat: [sum of the layout's sizes]
            row_slots = arrays.pop("row_slots")  # [B]
            # Decode inputs of -1 are the tokens this slot sampled in the previous step,
            # which the host has not read back yet (overlap scheduling).
            if dp == 1:
                tok_slot = jnp.concatenate([jnp.full(te, dummy, jnp.int32), row_slots[be:]])
            else:  # rank after rank: [extend tokens | decode rows] of each   # [T]
                per_rank = row_slots.reshape(dp, -1)[:, be:]
                tok_slot = jnp.concatenate([jnp.full((dp, te), dummy, jnp.int32), per_rank],
                                           axis=1).reshape(-1)
            ids = jnp.where(arrays["input_ids"] < 0, last_tokens[tok_slot],
                            arrays["input_ids"])
            batch = ForwardBatch(**{**arrays, "input_ids": ids}, mode=key.mode,
                                 num_extend_tokens=te, num_extend_seqs=be)
            return model.forward(params, kv, batch, cfg, backend, mesh=mesh)  # [B, V], pool

        return jax.jit(forward, donate_argnums=(1,), **self._out(self._replicated, self._kv_sh))

    def _abstract_inputs(self, shape: BucketShape) -> tuple[dict, jax.ShapeDtypeStruct]:
        """The ForwardBatch arrays of `shape` and the row slots, as the split, fused and
        two-batch-overlap programs take them (a plain step takes them flat: _flat_input)."""
        arrays = {name: jax.ShapeDtypeStruct(s, jnp.int32, sharding=self._replicated)
                  for name, s in input_layout(shape, self.dp)}
        return arrays, arrays.pop("row_slots")

    def _flat_input(self, shape: BucketShape) -> jax.ShapeDtypeStruct:
        n = sum(math.prod(s) for _, s in input_layout(shape, self.dp))
        return jax.ShapeDtypeStruct((n,), jnp.int32, sharding=self._replicated)

    def _lowerings(self) -> Iterator[tuple[str, Callable[[], Any]]]:
        """(name, lower) for every executable of the plan, in compile order."""
        abstract = functools.partial(jax.tree.map, lambda a: jax.ShapeDtypeStruct(
            a.shape, a.dtype, sharding=getattr(a, "sharding", None)))
        params, kv, state = abstract(self.params), abstract(self.kv), abstract(self.state)
        for key in self.step_keys():
            yield key_name(key), functools.partial(
                self._forward_fn(key).lower, params, kv, state.last_tokens,
                self._flat_input(key.shape))
        if self.split is not None:
            yield from self.split.lowerings(params, kv, lambda s: self._abstract_inputs(s)[0],
                                            jnp.dtype(self.cfg.activation_dtype))
        if self.fused is not None:
            yield from self.fused.lowerings(params, kv, state.last_tokens,
                                            lambda s: self._abstract_inputs(s)[0],
                                            jnp.dtype(self.cfg.activation_dtype))
        if self.tbo is not None:
            yield from self.tbo.lowerings(params, kv, state.last_tokens, self._abstract_inputs,
                                          lambda n: jax.ShapeDtypeStruct(
                                              (n,), jnp.int32, sharding=self._replicated))
        if self.multi is not None:
            yield from self.multi.lowerings(
                self._multi_step_fn, params, kv, state,
                lambda n: jax.ShapeDtypeStruct((n,), jnp.int32, sharding=self._replicated),
                lambda b: self._abstract_sample_inputs(b)[1])
        sample = self._sample_fn()
        for b in self.sampler_sizes():
            yield f"sample/B{b}", functools.partial(sample.lower, state,
                                                    *self._abstract_sample_inputs(b))
        init = jax.jit(init_slot, donate_argnums=(0,), **self._out(self._replicated))
        for n in self.cfg.kv_len_buckets:
            i32 = jax.ShapeDtypeStruct((n,), jnp.int32, sharding=self._replicated)
            yield f"init_slot/N{n}", functools.partial(
                init.lower, state, jax.ShapeDtypeStruct((), jnp.int32,
                                                        sharding=self._replicated), i32, i32)

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
        if self.split is not None:
            self._seed_costs()
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
        self._executables = {k: exes[key_name(k)] for k in self.step_keys()}
        self._samplers = {b: exes[f"sample/B{b}"] for b in self.sampler_sizes()}
        for group in (self.split, self.fused, self.tbo, self.multi):
            if group is not None:
                group.install(exes)
        self._init_slot_exec = {n: exes[f"init_slot/N{n}"] for n in self.cfg.kv_len_buckets}

    def device_state(self) -> tuple[Any, Any, Any]:
        """The runner's long-lived device arrays: weights, KV pool, sampler slot state."""
        return self.params, self.kv, self.state

    def _cost_seed_inputs(self, shape: BucketShape) -> tuple[dict[str, np.ndarray], np.ndarray]:
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
        extra = sum(len(g.names) for g in (self.split, self.fused, self.tbo, self.multi)
                    if g and self._executables)
        return len(self._executables) + len(self._samplers) + len(self._init_slot_exec) + extra

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
        """Dispatch one step asynchronously; the returned PendingStep reads it back. A
        SPLIT_PREFILL batch too small to split (can_split) runs whole as an EXTEND step.
        With two-batch overlap, a batch it splits runs as two micro-batches (launch_tbo)."""
        if batch.steps > 1:
            return self.launch_multi_step(batch)
        if self.tbo is not None and (pending := self.launch_tbo(batch)) is not None:
            return pending
        return self.launch_sample(self.launch_forward(batch))

    def launch_forward(self, batch: ScheduleBatch) -> LaunchedForward:
        """The forward half of `launch`. The sampling half (launch_sample) may follow once
        the host knows the rows' grammar masks, i.e. after the previous step's tokens are
        consumed: the device runs this forward meanwhile."""
        shape = self.bucket_for(batch)
        mode = ForwardMode.EXTEND if batch.mode is ForwardMode.SPLIT_PREFILL else batch.mode
        self.init_slots(batch.extend_rows)
        row_slots = self._row_slots(batch, shape)[0]
        key = StepKey(mode, shape)
        if isinstance(batch, DPBatch):
            logits = self.run_forward(key, dp_pack(batch, shape, self.cache_cfg.page_size),
                                      row_slots)
            self.step_counts[ForwardMode.IDLE] += batch.num_idle
        else:
            logits = self._run_flat(key, pack_flat(batch.extend_rows, batch.decode_rows,
                                                   shape, self.cache_cfg.page_size, row_slots))
        self.step_counts[mode] += 1
        return LaunchedForward(batch, shape, logits)

    def run_forward(self, key: StepKey, arrays: dict[str, np.ndarray],
                    row_slots: np.ndarray) -> jax.Array:
        """Run the plain step program `key` on packed arrays (pack_rows; dp_pack under dp)
        and the rows' slots: its logits [B, V]; the pool is updated in place."""
        return self._run_flat(key, flatten_inputs(arrays, row_slots,
                                                  input_layout(key.shape, self.dp)))

    def _run_flat(self, key: StepKey, flat: np.ndarray) -> jax.Array:
        logits, self.kv = self._executables[key](self.params, self.kv,
                                                 self.state.last_tokens, flat)
        return logits

    def launch_sample(self, fwd: LaunchedForward) -> PendingStep:
        pending = self._sample(fwd.batch, fwd.shape, fwd.logits)
        mode = (ForwardMode.EXTEND if fwd.batch.mode is ForwardMode.SPLIT_PREFILL
                else fwd.batch.mode)
        self.costs.watch(cost_key(mode, fwd.shape), pending.out.next_tokens)
        return pending

    def _multi_step_fn(self, key: StepKey) -> Callable:
        model, cfg, mesh = self.model, self.model_cfg, self.mesh
        backend = self.cfg.attention_backend
        b = key.shape.num_decode_seqs
        layout = sampling.word_layout(b, mask_width(cfg.vocab_size), MAX_LOGIT_BIAS)
        program = multi_step_fn(
            key, self.cfg.num_scheduler_steps, self.cache_cfg.page_size,
            lambda params, kv, batch: model.forward(params, kv, batch, cfg, backend, mesh=mesh),
            self._sample_body(), 2 * b + layout["step"][0])
        return jax.jit(program, donate_argnums=(1, 2),
                       **self._out(self._replicated, self._kv_sh, self._replicated))

    def launch_multi_step(self, batch: ScheduleBatch) -> PendingStep:
        """Run a DECODE batch's `steps` decode steps in one program (runtime/multi_step.py);
        its results carry a step axis."""
        shape = self.bucket_for(batch)
        key = StepKey(ForwardMode.DECODE, shape)
        rows = batch.decode_rows
        row_slots, _, padded = self._row_slots(batch, shape)
        page = self.cache_cfg.page_size
        flat = pack_steps(pack_flat([], rows, shape, page, row_slots), rows, shape, page)
        out, self.kv, self.state = self.multi(key, self.params, self.kv, self.state, flat,
                                              self._sample_words(padded))
        self.check_no_compiles()
        self.step_counts[ForwardMode.DECODE] += batch.steps
        return PendingStep(batch, out, np.arange(len(rows)), self.cfg.max_top_logprobs,
                           steps=batch.steps)

    def launch_tbo(self, batch: ScheduleBatch) -> PendingStep | None:
        """Run `batch` as two overlapped micro-batches (runtime/two_batch_overlap.py); None
        when it is not split (too few tokens, or no TBO program for its children's
        bucket), for the plain path to run."""
        split = two_batch_overlap.split_batch(batch, self.cfg.tbo_token_distribution_threshold,
                                              self.cfg.tbo_min_tokens)
        if split is None:
            return None
        shape = two_batch_overlap.common_shape(split, self.bucket_for)
        key = StepKey(batch.mode, shape)
        if not self.tbo.has(key):
            return None
        self.init_slots(batch.extend_rows)
        children = (split.a, split.b)
        arrays = [pack_rows(c.extend_rows, c.decode_rows, shape, self.cache_cfg.page_size)
                  for c in children]
        slots = [self._row_slots(c, shape)[0] for c in children]
        order = np.asarray(split.merge_order(shape), np.int32)
        logits, self.kv = self.tbo(key, self.params, self.kv, self.state.last_tokens, *arrays,
                                   *slots, order)
        self.step_counts[batch.mode] += 1
        padded = [*batch.rows, *[None] * (self.tbo.rows(key) - len(batch.rows))]
        pending = self._sample_rows(batch, padded, logits, np.arange(len(batch.rows)))
        pending.tbo = TboSplit(split.tokens(), split.rows(), split.point.seq_index,
                               split.point.two_chunk)
        pending.padded_shape = BucketShape(*(2 * getattr(shape, f) for f in (
            "num_extend_tokens", "num_extend_seqs", "num_decode_seqs")),
            shape.num_pages_per_seq)
        self.costs.watch(self.tbo.names[self.tbo.keys.index(key)], pending.out.next_tokens)
        return pending

    def step_cost(self, batch: ScheduleBatch) -> float | None:
        """Measured device seconds of a step like `batch` (None until one has run)."""
        return self.costs.get(cost_key(batch.mode, self.bucket_for(batch)))



def _check_tbo(model_cfg: ModelConfig, cfg: RunnerConfig, mesh: Mesh | None) -> None:
    """What two-batch overlap needs, as a start-up error."""
    if not model_cfg.is_moe:
        raise ValueError("two-batch overlap is for MoE models (it overlaps the expert-"
                         f"parallel all_to_all); {model_cfg.architecture} is dense")
    if cfg.per_layer_weights:
        raise ValueError("two-batch overlap runs the stacked layer weights: "
                         "per_layer_weights=False")
    if mesh is not None and mesh.shape.get("tp", 1) > 1:
        raise ValueError("two-batch overlap runs on an ep mesh without tp")


def _check_mesh(cfg: RunnerConfig, mesh: Mesh | None, cache: CacheConfig) -> None:
    """What does not run on a mesh yet, as a start-up error."""
    if mesh is None:
        return
    if "cpu" in (cfg.attention_backend, cfg.cpu_matmul.replace("packed", "cpu")):
        raise ValueError(f"the CPU kernels are single-device (attention_backend="
                         f"{cfg.attention_backend!r}, cpu_matmul={cfg.cpu_matmul!r}): on a "
                         "mesh use attention_backend='xla' and cpu_matmul='xla'")
    dp = mesh.shape.get("dp", 1)
    if dp > 1:
        if cache.num_pages % dp:
            raise ValueError(f"dp={dp}: the KV pool's {cache.num_pages} pages must split "
                             "evenly over the data-parallel ranks")
        off = [flag for flag, on in (("enable_split_prefill / multiplexing",
                                      cfg.enable_split_prefill),
                                     ("multiplex_fused", cfg.multiplex_fused),
                                     ("enable_two_batch_overlap",
                                      cfg.enable_two_batch_overlap),
                                     ("num_scheduler_steps > 1",
                                      cfg.num_scheduler_steps > 1)) if on]
        if off:
            raise ValueError(f"dp={dp} (data-parallel attention) does not run with "
                             f"{', '.join(off)} yet")
        if not cfg.enable_mixed:
            raise ValueError(f"dp={dp}: a step may hold one rank's prefill and another's "
                             "decode rows, so the runner needs the MIXED buckets "
                             "(enable_mixed)")
