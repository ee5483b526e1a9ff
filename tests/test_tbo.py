"""Two-batch overlap on the 4 fake CPU devices (tiny-moe, EP=4, f32): TBO on equals TBO
off (greedy tokens, logits) for decode, extend, mixed, the two-chunk cut, single-sequence
batches and an IDLE micro-batch; the compiled program keeps the two micro-batches'
collectives and compute in independent dataflow chains; the execution trace shows both
micro-batches of a TBO step; nothing compiles after warm-up (strict)."""

from __future__ import annotations

import json
import math
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import moe_overlap, registry
from runtime import two_batch_overlap
from runtime.batch_builder import BucketShape
from runtime.bucket_plan import StepKey
from runtime.config import CacheConfig, RunnerConfig
from runtime.exec_trace import ExecutionTrace
from runtime.forward_mode import ForwardMode
from runtime.kv_pool import init_kv_pool
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


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    rcfg = RunnerConfig(decode_buckets=(2, 4), extend_token_buckets=(16,),
                        extend_seq_buckets=(2,), kv_len_buckets=(64,), enable_mixed=True,
                        max_top_logprobs=2, strict_compile=True, attention_backend="xla",
                        enable_two_batch_overlap=True, tbo_min_tokens=1)
    r = _Runner(CFG, PARAMS, CacheConfig(page_size=PAGE, num_pages=64), rcfg,
                max_running_requests=8, mesh=make_mesh(ep=4))
    r.warmup(progress=False)
    return r


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
        if not tbo:
            m.setattr(runner, "tbo", None)
        pending = runner.launch(batch)
        tokens = pending.result().next_token_ids
    assert (pending.tbo is not None) == tbo
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


def test_micro_batches_are_independent_chains_in_the_compiled_program(runner):
    """In the compiled layer loop, none of A's ops (attention, MoE compute, all-to-alls)
    reads anything of B's; B's MoE ops read nothing of A's MoE, only A's attention (B's
    attention reads A's K/V of the layer: the two-chunk continuation)."""
    text = runner.tbo._exe["tbo/mixed/te16_be2_bd4_np16"].as_text()
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


def test_no_tbo_program_writes_or_copies_the_pool_in_its_layer_loop(runner):
    """The layer loops only read the pool (a pool written inside the loop is copied by XLA
    CPU on every trip: TBO ran 8-50x slower than plain): in every TBO program, decode,
    extend, mixed, nothing but passing the loop's parameter on makes a pool-sized buffer
    inside the loop, and nothing anywhere copies one."""
    pool = f"{runner.kv.k.dtype}[{math.prod(runner.kv.k.shape)}]"

    def size(ins: hlo_graph.Instr) -> str:
        """dtype[elements] of an array result (f32[2,3]{1,0} -> f32[6]), '' for a tuple."""
        m = re.match(r"(\w+)\[([\d,]*)\]", ins.type)
        return f"{m[1]}[{math.prod(int(d) for d in m[2].split(',') if d)}]" if m else ""

    for name in runner.tbo.names:
        comps = hlo_graph.parse(runner.tbo._exe[name].as_text())
        loops = {c for ins in comps.values() for i in ins.values() if i.opcode == "while"
                 for c in i.calls}  # each loop's body and condition
        assert loops, name
        for comp, instrs in comps.items():
            made = {i.opcode for i in instrs.values() if size(i) == pool}
            assert "copy" not in made, (name, comp)
            if comp in loops:
                assert made <= {"parameter", "get-tuple-element", "bitcast"}, (name, comp, made)


def test_trace_shows_both_micro_batches(runner, decoding):
    trace = ExecutionTrace()
    batch = ScheduleBatch(D, [], [s.decode() for s in decoding])
    step = launch_traced(trace, runner, batch, time.perf_counter())
    read_back(trace, step)
    rec = trace.steps()[-1]
    assert rec.tbo is not None and rec.tbo.rows == (2, 2) and rec.tbo.tokens == (2, 2)
    assert (rec.padded_rows, rec.padded_tokens) == (4, 4)  # two children of 2 rows
    doc = json.loads(json.dumps(chrome_trace(trace.steps(), trace.requests(), trace.t0)))
    names = lanes(doc)
    got = {names[e["pid"], e["tid"]] for e in check_chrome_trace(doc)}
    assert {"micro-batches (TBO)/micro-batch A", "micro-batches (TBO)/micro-batch B"} <= got


def test_plan_counts_tbo_executables_and_gpu_options(runner):
    (part,) = [p for p in runner.plan() if p.name == "TBO"]
    assert part.count == len(KEYS) == len(runner.tbo.names)
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


def test_tbo_forward_lowers_for_cuda():
    """The GPU program (checked for overlap by tests/test_tbo_gpu.py) lowers from here:
    three all_to_all per micro-batch and layer, no CPU-only op."""
    shape = BucketShape(0, 0, 2, W)
    batch = make_batch(D, [], [SimpleRow([3], 5, [1, 2])], shape, PAGE)
    kv = init_kv_pool(CFG, CacheConfig(page_size=PAGE, num_pages=8), jnp.float32)

    def fwd(p, kv, a, b):
        return moe_overlap.forward(p, kv, (a, b), CFG, "xla", make_mesh(ep=4))

    text = jax.jit(fwd).trace(PARAMS, kv, batch, batch).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count("stablehlo.all_to_all") == 6
