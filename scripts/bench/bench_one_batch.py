"""Latency of one forward per mode and bucket: ModelRunner.launch(batch).result().

    .venv/bin/python scripts/bench/bench_one_batch.py --out_dir=bench_out
    .venv/bin/python scripts/bench/bench_one_batch.py --tiny --out_dir=/tmp/b1   # seconds
    .venv/bin/python scripts/bench/bench_one_batch.py --variants=packed+cpu,xla+xla  # side by side
    XLA_FLAGS=--xla_force_host_platform_device_count=4 \
      .venv/bin/python scripts/bench/bench_one_batch.py --model=tiny-moe --ep=4  # on a mesh

Each point is a synthetic batch (fake requests with their own pages; the KV pool holds
zeros, which costs the same as real K/V) timed over --iters calls after --warmup calls:
  DECODE  B rows of one token each, every row with --decode_contexts tokens cached;
  EXTEND  one prompt of N tokens from position 0 (a prefill);
  MIXED   (--mixed) a prefill of N tokens plus B decode rows in one forward.
The buckets are the server's (runtime.engine_setup.runner_config), so each point runs
the executable a server would run for that batch; --decode_buckets / --extend_buckets
pad the points into given buckets instead (what padding costs:
    .venv/bin/python scripts/bench/bench_one_batch.py --decode_batches=16,17,32 \
      --decode_buckets=16,32 --extend_tokens=300,512 --extend_buckets=512).
The machine's roofline is measured in the same run, and every point reports the
fraction of the compute bound (useful FLOPs / f32 matmul peak) and of the memory bound
(weights + cached K/V read / read bandwidth) it reaches. --variants (MATMUL+ATTENTION
pairs: cpu_matmul packed / xla, attention backend cpu / xla / pallas) builds one runner
per pair and times each point on them back to back; the table gives each one's speed-up
over the last pair.
--model takes anything ServerArgs.model does (a preset such as tiny-moe too); --tp / --ep
put the runner on a mesh (on a CPU host the devices are XLA_FLAGS' fakes). The MoE layer's
per-op split (dispatch, exchange, experts, combine) is scripts/bench/bench_moe_ops.py.
A variant may end in `+tbo`: two-batch overlap on, at every point (tbo_min_tokens 1, so
the crossover shows), e.g. on the 4 fake devices of one CPU:
    XLA_FLAGS=--xla_force_host_platform_device_count=4 .venv/bin/python \
      scripts/bench/bench_one_batch.py --model=tiny-moe --ep=4 --variants=xla+xla+tbo,xla+xla
With any +tbo variant every variant scans the stacked weights (per_layer_weights off),
so the ratio is TBO's alone. `+switch` / `+stacked` pick the layer loop's weights: per-
layer buffers behind a lax.switch, or the stacked tree (packed matrices read in place at
the traced layer), e.g. --variants=packed+cpu+switch,packed+cpu+stacked. `+x12` holds
bf16 weights in 12 bits (--compress_weights; with --dtype=bfloat16), e.g.
--dtype=bfloat16 --variants=packed+cpu+x12,packed+cpu. --rounds interleaves the
variants' calls (A B A B) on a shared machine.
Writes bench_one_batch.json and bench_one_batch.png to --out_dir.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import bench_common as bc
import numpy as np
from absl import app, flags

from models.config import ModelConfig
from models.forward_mode import ForwardMode
from runtime import two_batch_overlap
from runtime.batch_builder import BucketShape
from runtime.bucket_plan import BucketPlan
from runtime.config import CacheConfig, RunnerConfig, ServerArgs
from runtime.engine_setup import load_model, runner_config, serving_mesh, size_kv_pool
from runtime.model_runner import ModelRunner, StepKey
from runtime.request import Req, SamplingParams
from runtime.schedule_batch import BatchRow, ScheduleBatch

FLAGS = flags.FLAGS
bc.define_run_flags("bench_out", "alias of --tiny with few iterations and a small probe",
                    checkpoint_cache=True)
flags.DEFINE_string("model", "default", "see ServerArgs.model (a preset, e.g. tiny-moe, too)")
flags.DEFINE_integer("tp", 1, "tensor-parallel devices (see ServerArgs)")
flags.DEFINE_integer("ep", 1, "expert-parallel devices (see ServerArgs)")
flags.DEFINE_bool("tiny", False, "a tiny random model instead of SmolLM2 (seconds; CI)")
flags.DEFINE_list("decode_batches", ["1", "2", "4", "8", "16", "32"], "decode rows per step")
flags.DEFINE_list("decode_contexts", ["128"], "tokens already cached per decode row")
flags.DEFINE_list("extend_tokens", ["64", "256", "512"], "prefill lengths (one row each)")
flags.DEFINE_list("decode_buckets", [], "decode buckets to pad the batches into (default: "
                  "each batch's own size); e.g. 16,32 with --decode_batches=16,17,32 times "
                  "17 rows in the 32-row bucket")
flags.DEFINE_list("extend_buckets", [], "extend token buckets likewise (default: each "
                  "prompt's own length)")
flags.DEFINE_bool("mixed", False, "also time MIXED: each prefill length with each decode "
                  "batch (compiles one executable per pair)")
flags.DEFINE_integer("iters", 10, "timed calls per point")
flags.DEFINE_integer("warmup", 2, "untimed calls per point first")
flags.DEFINE_integer("rounds", 1, "with --variants: split each point's --iters calls into "
                     "this many rounds, each visiting every variant in turn (A B A B)",
                     lower_bound=1)
flags.DEFINE_string("dtype", None, "float32 / bfloat16 (default: the server's)")
flags.DEFINE_enum("quantization", None, ["int8"], "weight-only int8 (see serve.py)")
flags.DEFINE_list("variants", [], "MATMUL+ATTENTION pairs to time side by side, e.g. "
                  "packed+cpu,xla+xla, each optionally +tbo (two-batch overlap on), "
                  "+switch or +stacked (the layer weights; see above) "
                  "(default: the server's choice alone)")


@dataclasses.dataclass(frozen=True)
class Point:
    """One timed batch: extend rows of `extend` tokens each, `decode` rows at `context`."""

    mode: ForwardMode
    extend: tuple[int, ...]
    decode: int
    context: int

    def rows(self) -> list[bc.RowWork]:
        return ([bc.RowWork(0, n) for n in self.extend]
                + [bc.RowWork(self.context, 1)] * self.decode)

    @property
    def new_tokens(self) -> int:
        return sum(self.extend) + self.decode

    def label(self, variant: str | None = None) -> str:
        parts = [f"extend {'+'.join(map(str, self.extend))}"] if self.extend else []
        if self.decode:
            parts.append(f"decode {self.decode}x@{self.context}")
        return f"{self.mode.value}: {', '.join(parts)}" + (f" [{variant}]" if variant else "")


class _BenchRunner(ModelRunner):
    """A ModelRunner that compiles only the executables this benchmark calls: warming up
    every bucket would take longer than the benchmark on a small CPU."""

    wanted: set[tuple[ForwardMode, BucketShape]] = set()

    def step_keys(self) -> list[StepKey]:
        return [k for k in super().step_keys() if (k.mode, k.shape) in self.wanted]


def _ints(values: list[str]) -> list[int]:
    return [int(v) for v in values]


def _points(decode_batches: list[int], contexts: list[int], extend: list[int],
            mixed: bool) -> list[Point]:
    pts = [Point(ForwardMode.DECODE, (), b, c) for c in contexts for b in decode_batches]
    pts += [Point(ForwardMode.EXTEND, (n,), 0, 0) for n in extend]
    if mixed:
        pts += [Point(ForwardMode.MIXED, (n,), b, contexts[0])
                for n in extend for b in decode_batches]
    return pts


def _server_args(points: list[Point], cfg: ModelConfig) -> ServerArgs:
    """The server's bucket rules, narrowed to the buckets these points use: kv-length
    buckets are the server's defaults (powers of 4 from 256) that some point needs."""
    base = _base_args()
    need = {max([*p.extend, p.context + 1]) for p in points}
    defaults = runner_config(base, cfg).kv_len_buckets
    kv = sorted({next((b for b in defaults if b >= n), defaults[-1]) for n in need})
    dec = _buckets(FLAGS.decode_buckets, {p.decode for p in points if p.decode}, "decode")
    ext = _buckets(FLAGS.extend_buckets, {sum(p.extend) for p in points if p.extend}, "extend")
    return dataclasses.replace(
        base, max_running_requests=max(dec, default=1) + 1, max_extend_seqs=1,
        decode_buckets=tuple(dec) or (1,), extend_token_buckets=tuple(ext) or (64,),
        kv_len_buckets=tuple(kv), max_top_logprobs=0,
        enable_mixed_chunk=any(p.mode is ForwardMode.MIXED for p in points))


def _buckets(flag: list[str], sizes: set[int], name: str) -> list[int]:
    """The bucket list: --<name>_buckets, which must hold every size, or the sizes."""
    if not flag:
        return sorted(sizes)
    buckets = sorted(_ints(flag))
    if sizes and max(sizes) > buckets[-1]:
        raise app.UsageError(f"--{name}_buckets {buckets} cannot hold {max(sizes)}")
    return buckets


def _base_args() -> ServerArgs:
    return ServerArgs(model=FLAGS.model, dtype=FLAGS.dtype, quantization=FLAGS.quantization,
                      tp=FLAGS.tp, ep=FLAGS.ep,
                      checkpoint_cache_dir=FLAGS.checkpoint_cache_dir,
                      compilation_cache_dir=FLAGS.compilation_cache_dir or None)


_OPTIONS = ("tbo", "switch", "stacked", "x12")


def _variants() -> list[str | None]:
    for v in FLAGS.variants:
        matmul, attention, *options = v.split("+")
        if (matmul not in ("packed", "xla") or attention not in ("cpu", "xla", "pallas")
                or any(o not in _OPTIONS for o in options) or len(set(options)) < len(options)
                or {"switch", "stacked"} <= set(options)):
            raise app.UsageError(f"--variants: {v!r} is not MATMUL+ATTENTION[+OPTION...] with "
                                 "MATMUL packed / xla, ATTENTION cpu / xla / pallas and "
                                 "OPTION tbo, switch or stacked (not both), x12 (bf16 weights "
                                 "in 12 bits, --compress_weights)")
    return list(FLAGS.variants) or [None]


def _variant_args(args: ServerArgs, variant: str | None) -> ServerArgs:
    if variant is None:
        return args
    matmul, attention, *options = variant.split("+")
    tbo = "tbo" in options
    per_layer = args.per_layer_weights
    if any("tbo" in v.split("+")[2:] for v in FLAGS.variants) or "stacked" in options:
        per_layer = False
    elif "switch" in options:
        per_layer = True
    args = dataclasses.replace(args, cpu_matmul=matmul, attention_backend=attention,
                               enable_two_batch_overlap=tbo, tbo_min_tokens=1,
                               per_layer_weights=per_layer, compress_weights="x12" in options)
    if not tbo:
        return args
    # Buckets for the micro-batches too (half of each point, rounded up), so a child is
    # padded to its own size, not to its parent's.
    def halves(b: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(sorted(set(b) | {-(-n // 2) for n in b}))

    return dataclasses.replace(args, decode_buckets=halves(args.decode_buckets),
                               extend_token_buckets=halves(args.extend_token_buckets))


def _wanted(rcfg: RunnerConfig, page_size: int, batches: list[ScheduleBatch]
            ) -> set[tuple[ForwardMode, BucketShape]]:
    """The buckets of `batches` and, with TBO, the common bucket of their micro-batches."""
    plan = BucketPlan(rcfg, page_size)
    wanted = {(b.mode, plan.bucket_for(b)) for b in batches}
    for b in batches if rcfg.enable_two_batch_overlap else []:
        split = two_batch_overlap.split_batch(b, rcfg.tbo_token_distribution_threshold)
        if split is not None:
            wanted.add((b.mode, two_batch_overlap.common_shape(split, plan.bucket_for)))
    return wanted


class _Pages:
    """Hands out distinct pages, so no two rows of a batch write the same KV slots."""

    def __init__(self, page_size: int) -> None:
        self.page_size, self.next = page_size, 1  # page 0 is the padding page

    def take(self, tokens: int) -> list[int]:
        n = -(-tokens // self.page_size)
        out = list(range(self.next, self.next + n))
        self.next += n
        return out


def _build_batch(p: Point, vocab: int, page_size: int,
                 rng: np.random.Generator) -> tuple[ScheduleBatch, int]:
    """(batch, pages used). Decode rows take slots 0..B-1, extend rows the slots after."""
    pages = _Pages(page_size)
    sp = SamplingParams(temperature=0, max_new_tokens=1 << 16, ignore_eos=True)

    def row(slot: int, start: int, n: int) -> BatchRow:
        req = Req(rid=f"r{slot}", prompt_ids=rng.integers(3, vocab, max(start, n)).tolist(),
                  sampling=sp, req_slot=slot)
        ids = rng.integers(3, vocab, n).tolist()
        return BatchRow(req=req, input_ids=ids, start_pos=start, pages=pages.take(start + n),
                        sample=True)

    dec = [row(i, p.context, 1) for i in range(p.decode)]
    ext = [row(p.decode + i, 0, n) for i, n in enumerate(p.extend)]
    return ScheduleBatch(mode=p.mode, extend_rows=ext, decode_rows=dec), pages.next


def _make_runner(args: ServerArgs, model: tuple[ModelConfig, dict], batches: list,
                 num_pages: int) -> _BenchRunner:
    """A runner with the server's pool size (at least `num_pages`) and the executables of
    `batches` compiled."""
    cfg, params = model
    rcfg = runner_config(args, cfg)
    pages = max(num_pages, size_kv_pool(args, cfg, rcfg.dtype))
    cache = CacheConfig(page_size=args.page_size, num_pages=pages)
    # The wanted buckets are a class attribute: the runner's constructor already asks for
    # its step keys (the TBO programs are chosen from them).
    runner_cls = type("_Runner", (_BenchRunner,), {"wanted": _wanted(rcfg, args.page_size,
                                                                       batches)})
    runner = runner_cls(cfg, params, cache, rcfg, args.max_running_requests,
                        mesh=serving_mesh(args, cfg))
    bc.log(f"compiling {len(runner.step_keys())} executables")
    secs = runner.warmup(progress=False)
    bc.log(f"compiled in {secs:.1f} s")
    return runner


def _time_point(runner: ModelRunner, batch: ScheduleBatch, iters: int,
                warmup: int) -> tuple[list[float], list[float]]:
    """(launch seconds, launch + result seconds) per call: the first is host work
    (bucketing, packing, dispatch); the difference is the device step and read-back."""
    host: list[float] = []
    ran_tbo: list[bool] = []

    def call() -> None:
        t0 = time.perf_counter()
        pending = runner.launch(batch)
        host.append(time.perf_counter() - t0)
        pending.result()
        ran_tbo.append(pending.detail is not None)

    total = bc.time_calls(call, iters, warmup)
    if runner.cfg.enable_two_batch_overlap and not all(ran_tbo):
        raise RuntimeError(f"{batch.mode.value} batch ran the plain path with TBO on")
    return host[warmup:], total


def _time_interleaved(runners: list[ModelRunner], batch: ScheduleBatch, iters: int,
                      warmup: int, rounds: int) -> list[tuple[list[float], list[float]]]:
    """_time_point of each runner at one point, its calls spread over `rounds` rounds that
    visit every runner in turn, so a neighbour's load on a shared machine falls on all of
    them alike; the warm-up calls run in the first round."""
    out: list[tuple[list[float], list[float]]] = [([], []) for _ in runners]
    for i in range(rounds):
        n = iters // rounds + (i < iters % rounds)
        for runner, (host, total) in zip(runners, out, strict=True):
            h, t = _time_point(runner, batch, n, warmup if i == 0 else 0)
            host += h
            total += t
    return out


def _record(p: Point, variant: str | None, shape: BucketShape, host: list[float],
            total: list[float], cfg: ModelConfig, itemsize: float,
            roof: bc.Roofline) -> dict[str, Any]:
    stats = bc.summarize(total)
    med = stats["median_s"]
    rows = p.rows()
    rec = {"mode": p.mode.value, "point": p.label(), "label": p.label(variant),
           "variant": variant,
           "extend_tokens": list(p.extend),
           "decode_rows": p.decode, "context": p.context, "new_tokens": p.new_tokens,
           "bucket": dataclasses.asdict(shape), **stats,
           "launch_median_s": bc.median(host), "tokens_per_s": p.new_tokens / med}
    rec.update(bc.roofline_fractions(bc.step_flops(cfg, rows),
                                     bc.step_bytes(cfg, rows, itemsize), med, roof))
    return rec


def _series(records: list[dict[str, Any]]) -> dict[tuple[int, str], list[dict[str, Any]]]:
    """Plot lines: (panel, legend) -> records. Decode lines vary the batch at one context;
    prefill lines vary the prompt length (MIXED: with a fixed number of decode rows)."""
    out: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for r in records:
        if r["mode"] == "decode":
            key = (0, f"context {r['context']}")
        elif r["mode"] == "extend":
            key = (1, "extend")
        else:
            key = (1, f"mixed, +{r['decode_rows']} decode rows")
        if r["variant"]:
            key = (key[0], f"{key[1]} [{r['variant']}]")
        out.setdefault(key, []).append(r)
    return out


def _plot(records: list[dict[str, Any]], roof: bc.Roofline, out_dir: str, title: str) -> None:
    plt = bc.pyplot()
    if plt is None:
        return
    from matplotlib.ticker import FormatStrFormatter
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for (panel, name), rs in _series(records).items():
        x = [r["decode_rows"] if panel == 0 else sum(r["extend_tokens"]) for r in rs]
        line, = axes[panel].plot(x, [r["tokens_per_s"] for r in rs], "o-", label=name)
        bound = [r["new_tokens"] / max(r["compute_bound_s"], r["memory_bound_s"]) for r in rs]
        axes[panel].plot(x, bound, "--", color=line.get_color(), alpha=0.6,
                         label=f"{name}: roofline")
    for ax, xlabel, what in ((axes[0], "decode rows", "DECODE"),
                             (axes[1], "prefill tokens", "EXTEND / MIXED")):
        ax.set(xscale="log", yscale="log", xlabel=xlabel, ylabel="new tokens / s", title=what)
        ax.xaxis.set_major_formatter(FormatStrFormatter("%g"))
        ax.xaxis.set_minor_formatter(FormatStrFormatter("%g"))
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{title}: median step latency as tokens/s; roofline from f32 matmul "
                 f"{roof.matmul_gflops:.0f} GFLOP/s, read {roof.mem_read_gbps:.1f} GB/s")
    bc.save_figure(fig, out_dir, "bench_one_batch.png")


def _probe(when: str) -> bc.Roofline:
    roof = bc.measure_roofline(small=FLAGS.smoke)
    bc.log(f"roofline {when}: {roof.matmul_gflops:.1f} GFLOP/s f32 matmul, "
           f"{roof.mem_read_gbps:.1f} GB/s read")
    return roof


def _load(tiny: bool) -> tuple[tuple[ModelConfig, dict], str]:
    if tiny:
        return bc.tiny_model(), "tiny-random"
    cfg, params, _ = load_model(_base_args())
    name = "SmolLM2-135M-Instruct" if FLAGS.model == "default" else FLAGS.model
    return (cfg, params), name + (f" tp={FLAGS.tp} ep={FLAGS.ep}" if FLAGS.tp * FLAGS.ep > 1
                                  else "")


def _print_table(records: list[dict[str, Any]], variants: list[str | None]) -> None:
    bc.log("results (fractions against the best roofline probe):")
    for r in records:
        print(f"  {r['label']:<47} median {r['median_s'] * 1e3:8.2f} ms  p90 "
              f"{r['p90_s'] * 1e3:8.2f} ms  {r['tokens_per_s']:9.1f} tok/s  "
              f"compute {r['frac_compute']:6.1%}  memory {r['frac_memory']:6.1%}")
    if len(variants) > 1:
        bc.log(f"speed-up over {variants[-1]} (its median / each median, same point):")
        n = len(variants)
        for i in range(0, len(records), n):
            group = records[i:i + n]
            base = group[-1]["median_s"]
            print(f"  {group[0]['point']:<38} " + "  ".join(
                f"{r['variant']} {base / r['median_s']:.2f}x" for r in group[:-1]))


def main(argv: list[str]) -> None:
    del argv
    t_start = time.perf_counter()
    tiny = FLAGS.tiny or FLAGS.smoke
    iters, warmup = (3, 1) if FLAGS.smoke else (FLAGS.iters, FLAGS.warmup)
    dec_b, ctxs, ext = (_ints(FLAGS.decode_batches), _ints(FLAGS.decode_contexts),
                        _ints(FLAGS.extend_tokens))
    if FLAGS.smoke:
        dec_b, ctxs, ext = [1, 4], [32], [64]
    machine = bc.machine_info()
    bc.log(f"load average {machine['load_average']} on {machine['cpu_count']} CPUs")
    probes = [_probe("before")]

    points = _points(dec_b, ctxs, ext, FLAGS.mixed or tiny)
    variants = _variants()
    bc.enable_compilation_cache(FLAGS.compilation_cache_dir)
    model, name = _load(tiny)
    cfg = model[0]
    args = _server_args(points, cfg)
    rng = np.random.default_rng(0)
    built = [_build_batch(p, cfg.vocab_size, args.page_size, rng) for p in points]
    runners = {v: _make_runner(_variant_args(args, v), model, [b for b, _ in built],
                               max(n for _, n in built))
               for v in variants}
    timed = []  # point-major, variants of one point side by side
    for p, (batch, _) in zip(points, built, strict=True):
        timed += _time_interleaved([runners[v] for v in variants], batch, iters, warmup,
                                   min(FLAGS.rounds, iters))
        for v, (_, total) in zip(variants, timed[-len(variants):], strict=True):
            shape = runners[v].bucket_for(batch)
            padded = (f" in {shape.num_extend_tokens}+{shape.num_decode_seqs}"
                      if shape.num_extend_tokens + shape.num_decode_seqs > p.new_tokens else "")
            bc.log(f"{p.label(v) + padded:<49} median {bc.median(total) * 1e3:8.2f} ms")
    probes.append(_probe("after"))
    # The best probe is the machine's capability; a probe slowed by a neighbour would
    # flatter every fraction.
    roof = bc.Roofline(max(r.matmul_gflops for r in probes),
                       max(r.mem_read_gbps for r in probes))
    jobs = [(p, batch, v) for p, (batch, _) in zip(points, built, strict=True) for v in variants]
    # Each variant's own bucket: the attention backend decides the page-table width.
    records = [_record(p, v, runners[v].bucket_for(batch), host, total, cfg,
                       1 if runners[v].cfg.quantization == "int8" else
                       1.5 if runners[v].cfg.compress_weights else runners[v].dtype.itemsize,
                       roof)
               for (p, batch, v), (host, total) in zip(jobs, timed, strict=True)]
    runner = runners[variants[0]]
    _print_table(records, variants)

    machine["load_average_end"] = bc.load_average()
    result = {"script": "bench_one_batch", "command": bc.command_line(), "machine": machine,
              "model": bc.model_summary(cfg, name, runner.cfg.dtype),
              "runner": dataclasses.asdict(runner.cfg),
              "variants": {str(v): {"cpu_matmul": runners[v].cfg.cpu_matmul,
                                    "attention_backend": runners[v].cfg.attention_backend,
                                    "two_batch_overlap":
                                        runners[v].cfg.enable_two_batch_overlap}
                           for v in variants},
              "roofline": roof.to_json(),
              "roofline_probes": [r.to_json() for r in probes],
              "iters": iters, "warmup": warmup, "rounds": min(FLAGS.rounds, iters),
              "points": records,
              "wall_s": time.perf_counter() - t_start}
    os.makedirs(FLAGS.out_dir, exist_ok=True)
    bc.write_json(FLAGS.out_dir, "bench_one_batch.json", result)
    _plot(records, roof, FLAGS.out_dir, name)


if __name__ == "__main__":
    app.run(main)
