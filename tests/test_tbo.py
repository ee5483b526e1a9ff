"""Two-batch overlap on the 4 fake CPU devices (tiny-moe, f32): TBO on equals TBO off
(greedy tokens, logits) for decode, extend, mixed, the two-chunk cut, single-sequence
batches and an IDLE micro-batch, on each attention backend: `xla` (the jnp reference) at
EP=4, `cpu` (cpu_kernels through the FFI; single-device, so EP=1) and `pallas` (interpret
mode, EP=4; slow). The compiled program keeps the two micro-batches' collectives and
compute in independent dataflow chains; no TBO program writes or copies the pool inside
its layer loop; the execution trace shows both micro-batches of a TBO step; nothing
compiles after warm-up (strict)."""

from __future__ import annotations

import functools
import json
import math
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import layers, moe_overlap, registry
from models.forward_mode import ForwardMode
from models.kv_pool import init_kv_pool
from pallas_kernels.ragged_paged_attention import paged_attention
from runtime import two_batch_overlap
from runtime.batch_builder import BucketShape
from runtime.bucket_plan import StepKey
from runtime.config import CacheConfig, RunnerConfig
from runtime.exec_trace import ExecutionTrace
from runtime.model_runner import ModelRunner
from runtime.perfetto import chrome_trace
from runtime.request import Req, SamplingParams
from runtime.schedule_batch import BatchRow, ScheduleBatch
from runtime.sharding import make_mesh
from runtime.tbo_step import compiler_options
from runtime.traced_launch import launch_traced, read_back
from tests import hlo_graph
from tests.model_utils import SimpleRow, make_batch
from tests.trace_utils import check_chrome_trace, lanes

CFG, PARAMS = registry.load_preset("tiny-moe")
PAGE, W = 4, 16  # page size; page-table width of the one kv bucket (64 tokens)
E, D, M = ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.MIXED
# The plain buckets the cases below run (parent batches and their children); TBO gets a
# program for each.
KEYS = {(E, BucketShape(16, 2, 0, 0)), (E, BucketShape(16, 2, 0, W)),
        (D, BucketShape(0, 0, 4, W)), (D, BucketShape(0, 0, 2, W)),
        (M, BucketShape(16, 2, 4, W))}


class _Runner(ModelRunner):
    """Compiles only KEYS: every bucket of even a tiny plan would double the test time."""

    def step_keys(self) -> list[StepKey]:
        return [k for k in super().step_keys() if (k.mode, k.shape) in KEYS]


# (attention backend, ep). The CPU kernels are single-device (on a mesh: a start-up
# error, test_cpu_kernels_on_a_mesh_are_a_startup_error); Pallas' interpret-mode programs
# took 66 s to 8 minutes to compile here (the box's load), beyond the suite's budget.
XLA_EP4 = ("xla", 4)
BACKENDS = [pytest.param(XLA_EP4, id="xla-ep4"), pytest.param(("cpu", 1), id="cpu-ep1"),
            pytest.param(("pallas", 4), id="pallas-ep4", marks=pytest.mark.slow)]


def _runner_config(backend: str) -> RunnerConfig:
    return RunnerConfig(decode_buckets=(2, 4), extend_token_buckets=(16,),
                        extend_seq_buckets=(2,), kv_len_buckets=(64,), enable_mixed=True,
                        max_top_logprobs=2, strict_compile=True, attention_backend=backend,
                        enable_two_batch_overlap=True, tbo_min_tokens=1)


@pytest.fixture(scope="module")
def runners() -> dict[tuple[str, int], ModelRunner]:
    """Warmed-up runners by (backend, ep), each built once for the module."""
    made: dict[tuple[str, int], ModelRunner] = {}
    yield made
    made.clear()


def _warm(runners: dict, backend: str, ep: int) -> ModelRunner:
    if (backend, ep) not in runners:
        r = _Runner(CFG, PARAMS, CacheConfig(page_size=PAGE, num_pages=64),
                    _runner_config(backend), max_running_requests=8,
                    mesh=make_mesh(ep=ep) if ep > 1 else None)
        r.warmup(progress=False)
        runners[backend, ep] = r
    return runners[backend, ep]


@pytest.fixture(scope="module", params=BACKENDS)
def runner(request, runners) -> ModelRunner:
    return _warm(runners, *request.param)


@pytest.fixture(scope="module")
def ep4_runner(runners) -> ModelRunner:
    """The xla runner on the EP=4 mesh: the one whose programs hold the MoE all-to-alls."""
    return _warm(runners, *XLA_EP4)


_rng = np.random.default_rng(0)


class _Seq:
    """A request with its own pages (slot i owns pages 1 + 4i .. 4 + 4i: 16 tokens)."""

    def __init__(self, slot: int, n: int) -> None:
        self.ids = [int(t) for t in _rng.integers(0, CFG.vocab_size, n)]
        self.req = Req(f"r{slot}", self.ids, SamplingParams(temperature=0))
        self.req.req_slot = slot
        self.pages = list(range(1 + 4 * slot, 5 + 4 * slot))

    def extend(self, start: int = 0, stop: int | None = None) -> BatchRow:
        return BatchRow(self.req, self.ids[start:stop], start, self.pages, sample=True)

    def decode(self) -> BatchRow:
        return BatchRow(self.req, [7], len(self.ids), self.pages, sample=True)


def _run(runner: ModelRunner, batch: ScheduleBatch, tbo: bool,
         monkeypatch: pytest.MonkeyPatch) -> tuple[np.ndarray, np.ndarray]:
    """Greedy tokens [rows] and the logits [rows, V] of each row, TBO on or off."""
    seen: list[jax.Array] = []
    with monkeypatch.context() as m:
        for n, sample in runner._samplers.items():
            m.setitem(runner._samplers, n, lambda st, lg, *a, f=sample: (
                seen.append(lg), f(st, lg, *a))[1])
        if not tbo:  # the TBO path claims no batch: the plain path runs it
            m.setattr(runner.paths["tbo"], "forward", lambda batch: None)
        pending = runner.launch(batch)
        tokens = pending.result().next_token_ids
    assert (pending.detail is not None) == tbo
    logits = np.asarray(seen[0])[pending._order]
    return tokens, logits


def _check_same(runner: ModelRunner, batch: ScheduleBatch,
                monkeypatch: pytest.MonkeyPatch) -> None:
    want_tokens, want = _run(runner, batch, False, monkeypatch)
    got_tokens, got = _run(runner, batch, True, monkeypatch)
    np.testing.assert_array_equal(got_tokens, want_tokens)
    # Logits reach |20|: the micro-batches' different row counts round the f32 matmuls
    # differently (~1e-6 relative), as EP=4 against EP=1 does (tests/test_moe_ep.py).
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    runner.check_no_compiles()


def test_extend_balanced_boundary(runner, monkeypatch):
    a, b = _Seq(0, 8), _Seq(1, 8)
    batch = ScheduleBatch(E, [a.extend(), b.extend()], [])
    assert not two_batch_overlap.split_batch(batch).point.two_chunk
    _check_same(runner, batch, monkeypatch)


def test_two_chunk_single_sequence(runner, monkeypatch):
    s = _Seq(2, 14)
    batch = ScheduleBatch(E, [s.extend()], [])
    assert two_batch_overlap.split_batch(batch).point == two_batch_overlap.SplitPoint(
        0, 7, two_chunk=True)
    _check_same(runner, batch, monkeypatch)


def test_two_chunk_two_sequences(runner, monkeypatch):
    a, b = _Seq(3, 3), _Seq(4, 12)  # 3 | 12 leaves 0.2 on the left: cut at token 7 (4 of b in A)
    batch = ScheduleBatch(E, [a.extend(), b.extend()], [])
    assert two_batch_overlap.split_batch(batch).point.two_chunk
    _check_same(runner, batch, monkeypatch)


@pytest.fixture(scope="module")
def decoding(runner) -> list[_Seq]:
    """Four requests with 5..8 prompt tokens in the pool (prefilled on the plain path)."""
    seqs = [_Seq(4 + i, 5 + i) for i in range(4)]
    for pair in (seqs[:2], seqs[2:]):
        runner.launch(ScheduleBatch(E, [s.extend() for s in pair], [])).result()
    return seqs


def test_decode_splits_at_half(runner, decoding, monkeypatch):
    _check_same(runner, ScheduleBatch(D, [], [s.decode() for s in decoding]), monkeypatch)


def test_single_sequence_decode_has_an_idle_micro_batch(runner, decoding, monkeypatch):
    batch = ScheduleBatch(D, [], [decoding[0].decode()])
    assert two_batch_overlap.split_batch(batch).a.mode is ForwardMode.IDLE
    _check_same(runner, batch, monkeypatch)


def test_mixed_two_chunk(runner, decoding, monkeypatch):
    p = _Seq(0, 10)
    batch = ScheduleBatch(M, [p.extend()], [s.decode() for s in decoding[:3]])
    split = two_batch_overlap.split_batch(batch)
    assert split.point.two_chunk and split.tokens() == (6, 7)
    _check_same(runner, batch, monkeypatch)


def test_micro_batches_are_independent_chains_in_the_compiled_program(ep4_runner):
    """In the compiled layer loop, none of A's ops (attention, MoE compute, all-to-alls)
    reads anything of B's; B's MoE ops read nothing of A's MoE, only A's attention (B's
    attention reads A's K/V of the layer: the two-chunk continuation)."""
    text = ep4_runner.paths["tbo"].programs._exe["tbo/mixed/te16_be2_bd4_np16"].as_text()
    comps = hlo_graph.parse(text)
    body = [c for c, ins in comps.items() if any(i.opcode == "all-to-all" for i in ins.values())]
    assert len(body) == 1, body
    instrs = comps[body[0]]
    data = hlo_graph.data_dependent(instrs)
    stages = ("prepare", "dispatch_shared", "run_experts", "combine_send", "output")

    def tags(name: str) -> set[str]:
        """mb/stage of the instruction, e.g. {'mb_a/run_experts'}."""
        out = set()
        for s in hlo_graph.scopes(comps, body[0], name):
            for mb in ("mb_a/", "mb_b/"):
                if mb in s:
                    out.add("/".join(s[s.index(mb):].split("/")[:2]))
        return out

    a2a = {"mb_a": [], "mb_b": []}  # the MoE exchanges (GSPMD adds some in attention)
    for n, ins in instrs.items():
        if ins.opcode == "all-to-all" and any(t.split("/")[1] in stages for t in tags(n)):
            (mb,) = {t.split("/")[0] for t in tags(n)}
            a2a[mb].append(n)
    assert len(a2a["mb_a"]) == len(a2a["mb_b"]) == 3  # dispatch x, dispatch ids, combine
    # (micro-batch, its ops checked, the other's ops they may read)
    checks = (("mb_a", stages + ("attention",), ()), ("mb_b", stages, ("mb_a/attention",)))
    for mb, checked, allowed in checks:
        other = "mb_b" if mb == "mb_a" else "mb_a"
        mine = [n for n in data if any(t.startswith(mb) and t.split("/")[1] in checked
                                       for t in tags(n))]
        assert set(a2a[mb]) <= set(mine)
        for n in mine:
            deps = set().union(*(tags(x) for x in hlo_graph.ancestors(instrs, n) & data))
            bad = {t for t in deps if t.startswith(other) and t not in allowed}
            assert not bad, (mb, n, bad)
    # each chain has compute on both sides of its all-to-alls: there is something to overlap
    assert any(t == "mb_b/run_experts" for n in data for t in tags(n))


def _pool_sized(ins: hlo_graph.Instr, pool: str) -> bool:
    """Whether the result, or an array of a tuple result, is pool-sized: dtype[elements]
    (f32[2,3]{1,0} -> f32[6]) equal to `pool`."""
    return any(f"{t}[{math.prod(int(d) for d in dims.split(',') if d)}]" == pool
               for t, dims in re.findall(r"(\w+)\[([\d,]*)\]", ins.type))


def _loops(comps: dict) -> set[str]:
    """Every while loop's body and condition."""
    return {c for ins in comps.values() for i in ins.values() if i.opcode == "while"
            for c in i.calls}


def test_no_tbo_program_writes_or_copies_the_pool_in_its_layer_loop(runner):
    """The layer loops only read the pool (a pool written inside the loop is copied by XLA
    CPU on every trip: TBO ran 8-50x slower than plain): in every TBO program, decode,
    extend, mixed, on every backend, nothing but passing loop state on (parameters,
    tuples, a nested loop of Pallas' interpret mode) makes a pool-sized buffer inside a
    loop, and nothing anywhere copies one."""
    pool = f"{runner.kv.k.dtype}[{math.prod(runner.kv.k.shape)}]"
    passing = {"parameter", "get-tuple-element", "bitcast", "tuple", "while"}
    for name in runner.paths["tbo"].names:
        comps = hlo_graph.parse(runner.paths["tbo"].programs._exe[name].as_text())
        loops = _loops(comps)
        assert loops, name
        for comp, instrs in comps.items():
            made = {i.opcode for i in instrs.values() if _pool_sized(i, pool)}
            assert "copy" not in made, (name, comp)
            if comp in loops:
                assert made <= passing, (name, comp, made)


def test_cpu_kernels_attend_in_the_loop_and_write_the_pool_in_place(runners):
    """With attention_backend="cpu" every TBO program attends through the C++ kernels
    inside its layer loop and writes the pool with their in-place FFI call, once per
    micro-batch after the loop, the pool aliased to the call's result (no copy: above)."""
    runner = _warm(runners, "cpu", 1)
    aliased = "output_to_operand_aliasing={{0}: (0, {}), {1}: (1, {})}"

    def calls(comps: dict, target: str, inside: bool) -> list[hlo_graph.Instr]:
        """The custom calls of `target` inside (or outside) the program's loops."""
        loops = _loops(comps)
        return [i for c, ins in comps.items() if (c in loops) == inside
                for i in ins.values() if f'custom_call_target="{target}"' in i.text]

    for name in runner.paths["tbo"].names:
        comps = hlo_graph.parse(runner.paths["tbo"].programs._exe[name].as_text())
        kernels = {"decode": ("decode",), "extend": ("extend",),
                   "mixed": ("extend", "decode")}[name.split("/")[1]]
        for k in kernels:  # one call of A's attention and one of B's
            assert len(calls(comps, f"xlaserve_{k}_attention", True)) == 2, (name, k)
        assert not calls(comps, "xlaserve_write_kv", True), name
        writes = calls(comps, "xlaserve_write_kv", False)
        assert len(writes) == 2 and all(aliased in w.text for w in writes), name


def test_trace_shows_both_micro_batches(runner, decoding):
    trace = ExecutionTrace()
    batch = ScheduleBatch(D, [], [s.decode() for s in decoding])
    step = launch_traced(trace, runner, batch, time.perf_counter())
    read_back(trace, step)
    rec = trace.steps()[-1]
    assert rec.detail is not None and rec.detail.rows == (2, 2) and rec.detail.tokens == (2, 2)
    assert (rec.padded_rows, rec.padded_tokens) == (4, 4)  # two children of 2 rows
    doc = json.loads(json.dumps(chrome_trace(trace.steps(), trace.requests(), trace.t0)))
    names = lanes(doc)
    got = {names[e["pid"], e["tid"]] for e in check_chrome_trace(doc)}
    assert {"micro-batches (TBO)/micro-batch A", "micro-batches (TBO)/micro-batch B"} <= got


def test_plan_counts_tbo_executables_and_gpu_options(runner):
    (part,) = [p for p in runner.plan() if p.name == "TBO"]
    assert part.count == len(runner.paths["tbo"].names) == len(runner.step_keys())
    assert runner.num_executables == len(runner.exec_stats)
    assert compiler_options("gpu") == {"xla_gpu_enable_latency_hiding_scheduler": True}
    assert compiler_options("cpu") == {}


def test_dense_model_or_per_layer_weights_is_a_startup_error():
    from tests.model_utils import TINY
    with pytest.raises(ValueError, match="MoE models"):
        ModelRunner(TINY, registry.model_module(TINY).init_params(TINY, jax.random.key(0)),
                    CacheConfig(page_size=PAGE, num_pages=8),
                    RunnerConfig(enable_two_batch_overlap=True), max_running_requests=2)
    with pytest.raises(ValueError, match="per_layer_weights"):
        ModelRunner(CFG, PARAMS, CacheConfig(page_size=PAGE, num_pages=8),
                    RunnerConfig(enable_two_batch_overlap=True, per_layer_weights=True),
                    max_running_requests=2)


def test_cpu_kernels_on_a_mesh_are_a_startup_error():
    """TBO on the CPU kernels runs at EP=1: they are single-device, and a mesh says so."""
    with pytest.raises(ValueError, match="single-device .attention_backend='cpu'.*on a mesh "
                                         "use attention_backend='xla'"):
        ModelRunner(CFG, PARAMS, CacheConfig(page_size=PAGE, num_pages=8),
                    _runner_config("cpu"), max_running_requests=2, mesh=make_mesh(ep=4))


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_tbo_forward_lowers_for_cuda(backend, monkeypatch):
    """The GPU program (checked for overlap by tests/test_tbo_gpu.py) lowers from here:
    three all_to_all per micro-batch and layer, no CPU-only op. With "pallas": the compiled
    kernels (Mosaic GPU, bf16) in both micro-batches' attention of an extend program,
    B's reading the one-layer copy of its pages (16-token pages: Mosaic's tiles)."""
    dtype, page = (jnp.float32, PAGE) if backend == "xla" else (jnp.bfloat16, 16)
    if backend == "pallas":
        monkeypatch.setattr(layers, "get_paged_attention_fn", lambda b: functools.partial(
            paged_attention, interpret=False))
        shape, mode, rows = BucketShape(16, 2, 0, 4), E, ([SimpleRow([3, 4], 5, [1])], [])
    else:
        shape, mode, rows = BucketShape(0, 0, 2, W), D, ([], [SimpleRow([3], 5, [1, 2])])
    batch = make_batch(mode, *rows, shape, page)
    kv = init_kv_pool(CFG, CacheConfig(page_size=page, num_pages=8), dtype)

    def fwd(p, kv, a, b):
        return moe_overlap.forward(p, kv, (a, b), CFG, backend, make_mesh(ep=4))

    params = jax.tree.map(lambda w: w.astype(dtype), PARAMS)
    text = jax.jit(fwd).trace(params, kv, batch, batch).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count("stablehlo.all_to_all") == 6
    assert text.count("custom_call @mosaic_gpu") == (2 if backend == "pallas" else 0)
