"""The engine end to end on random weights at a real model's shape: start-up, output
throughput at several concurrencies, and inter-token latency while a long prompt
prefills (plain path, multiplexing with two calls, multiplexing fused). The GPU suite's
engine section (scripts/bench/gpu_suite.py); no checkpoint, tokenizer or network needed.

    python scripts/bench/bench_engine.py --out=bench_engine.json           # Llama-3-8B, bf16
    .venv/bin/python scripts/bench/bench_engine.py --smoke --out=/tmp/be.json   # tiny, CPU

Weights are drawn by one jitted program on the device (16 GB for Llama-3-8B bf16 never
touch the host). Prompts are token ids. Two runners share those weights, each with the
few buckets its part needs, since every bucket is an executable and compile time counts:
  throughput  DECODE at each --concurrency, EXTEND of --chunk tokens x {1, --extend_seqs}
              rows; every concurrency runs --input_len in / --output_len out, greedy.
  itl         DECODE at --itl_streams + 1, EXTEND of --chunk tokens x 1 row, and the split
              prefill (embed, head, layer intervals) and fused decode + interval
              programs; three engines on this one runner run the same scenario:
              --itl_streams streams decode, then one --long_len prompt arrives (the
              decode bucket is --itl_streams + 1, so it starts at once).
ITL here is the gap between consecutive decode steps' readbacks (every stream gets one
token per step), over the window from the long prompt's arrival to its first token.
The JSON is rewritten after every part, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import bench_common as bc
import jax
import numpy as np
from absl import app, flags
from gpu_shapes import KV_LEN, LLAMA3_8B

from models.config import ModelConfig
from runtime.config import ServerArgs
from runtime.engine import Engine

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "bench_engine.json", "JSON results path")
flags.DEFINE_bool("smoke", False, "a tiny random model and tiny workloads (CPU check)")
flags.DEFINE_list("parts", ["throughput", "itl"], "which parts to run: throughput, itl, "
                  "throughput_stacked (throughput again on the stacked [L, ...] weights "
                  "dynamically sliced in a lax.scan, wq|wk|wv and w_gate|w_up separate: "
                  "the layout the runtime's GPU default, one fused buffer per layer behind a "
                  "lax.switch, replaced; see bench_layer_weights.py, docs/gpu.md)")
flags.DEFINE_list("concurrency", ["1", "32", "128"], "concurrent requests per throughput run")
bc.define_length_flags("throughput request")
flags.DEFINE_integer("chunk", 2048, "chunked-prefill size = the one extend-token bucket")
flags.DEFINE_integer("extend_seqs", 16, "most prompts in one extend batch (throughput)")
flags.DEFINE_integer("itl_streams", 31, "streams decoding when the long prompt arrives "
                     "(+1 for it: the decode bucket)")
flags.DEFINE_integer("long_len", 7680, "tokens of the long prompt")
flags.DEFINE_integer("itl_decode_tokens", 256, "new tokens per decoding stream")
flags.DEFINE_integer("itl_after_steps", 8, "decode steps before the long prompt arrives")
flags.DEFINE_float("peak_hbm_tbps", 4.8, "nominal HBM bandwidth, TB/s (H200: 4.8)")
flags.DEFINE_enum("attention_backend", None, ["pallas", "xla"], "attention kernels "
                  "(default: the runtime's, pallas on a GPU; the GPU suite passes xla when "
                  "the Pallas kernels failed their check on the device)")
flags.DEFINE_string("compilation_cache_dir", "", "JAX persistent cache ('' off: a cold "
                    "start-up is what is measured)")



STREAM_PROMPT_LEN = 16  # tokens of each decoding stream's prompt in the ITL part


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The workload and bucket sizes of one run (full or --smoke)."""

    cfg: ModelConfig
    dtype: str
    kv_len: int
    chunk: int
    extend_seqs: int
    concurrency: tuple[int, ...]
    input_len: int
    output_len: int
    itl_streams: int
    long_len: int
    itl_decode_tokens: int
    itl_after_steps: int


def _sizes() -> Sizes:
    if FLAGS.smoke:
        # 4 layers: interval sizes 2 and 4, so a fused program (k < depth) exists.
        return Sizes(dataclasses.replace(bc.TINY_CONFIG, num_layers=4), "float32",
                     kv_len=256, chunk=64, extend_seqs=1, concurrency=(1, 4), input_len=16,
                     output_len=8, itl_streams=3, long_len=150, itl_decode_tokens=24,
                     itl_after_steps=3)
    return Sizes(LLAMA3_8B, "bfloat16", KV_LEN, FLAGS.chunk, FLAGS.extend_seqs,
                 tuple(int(c) for c in FLAGS.concurrency), FLAGS.input_len,
                 FLAGS.output_len, FLAGS.itl_streams, FLAGS.long_len,
                 FLAGS.itl_decode_tokens, FLAGS.itl_after_steps)


def _base_args(s: Sizes, max_running: int, decode_buckets: tuple[int, ...], extend_seqs: int,
               max_total_tokens: int, stacked: bool = False) -> ServerArgs:
    """Few buckets: one extend-token bucket (the chunk), one page-table width. --smoke
    takes XLA's dot and the jnp attention (interpreted Pallas would compile for minutes;
    the kernels section checks the kernels). `stacked`: the scanned stacked weights,
    unfused (else the runtime's default layout)."""
    layout = dict(per_layer_weights=False, fuse_projections=False) if stacked else {}
    cpu = (dict(attention_backend="xla", cpu_matmul="xla", per_layer_weights=not stacked)
           if FLAGS.smoke else dict(attention_backend=FLAGS.attention_backend))
    cpu = {**cpu, **layout}
    return ServerArgs(dtype=s.dtype, max_total_tokens=max_total_tokens,
                      max_running_requests=max_running, decode_buckets=decode_buckets,
                      extend_token_buckets=(s.chunk,), kv_len_buckets=(s.kv_len,),
                      max_prefill_tokens=s.chunk, chunked_prefill_size=s.chunk,
                      max_extend_seqs=extend_seqs, max_top_logprobs=0,
                      split_prefill_min_tokens=s.chunk,
                      compilation_cache_dir=FLAGS.compilation_cache_dir or None, **cpu)


def start_engine(args: ServerArgs, model: tuple[ModelConfig, dict]) -> tuple[Engine, dict]:
    """An Engine whose runner compiles its whole plan now; (engine, start-up record)."""
    t0 = time.perf_counter()
    engine = Engine(args, model=model)
    secs = time.perf_counter() - t0
    stats = engine.runner.exec_stats
    rec = {"startup_s": secs, "executables": engine.runner.num_executables,
           "compile_s_sum": sum(s.compile_s for s in stats),
           "compile_s_max": max((s.compile_s for s in stats), default=0.0),
           "plan": {p.name: p.count for p in engine.runner.plan()},
           "kv_pages": engine.runner.cache_cfg.num_pages}
    bc.log(f"engine up in {secs:.1f} s: {rec['executables']} executables, compile "
           f"{rec['compile_s_sum']:.1f} s")
    return engine, rec


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(3, vocab, (n, length)).tolist()


def _decode_steps(engine: Engine, since: float, rids: set[str] | None = None) -> list[float]:
    """Readback times of the decode steps since `since` (of those with one of `rids`)."""
    return [s.ready for s in engine.trace.steps(since=since)
            if s.mode in ("decode", "mixed") and s.ready is not None
            and (rids is None or rids.intersection(s.rids))]


def throughput(engine: Engine, s: Sizes, weight_bytes: int) -> dict[str, Any]:
    """Output tok/s at each concurrency (all requests submitted at once) and the median
    decode step against the weights-read bound."""
    vocab = engine.model_cfg.vocab_size
    engine.generate(_prompts(1, s.input_len, vocab, 99), bc.greedy(4))  # first-call costs
    out: dict[str, Any] = {}
    for c in s.concurrency:
        t0 = time.perf_counter()
        rec = bc.xla_throughput(engine, _prompts(c, s.input_len, vocab, c), s.output_len)
        ready = _decode_steps(engine, t0)
        step = float(np.median(np.diff(ready))) if len(ready) > 2 else None
        rec["decode_step_median_s"] = step
        if step:
            # At batch c a step reads the weights once: its floor at the nominal bandwidth.
            rec["decode_frac_of_weight_read_bound"] = (
                weight_bytes / (FLAGS.peak_hbm_tbps * 1e12) / step)
        out[str(c)] = rec
        bc.log(f"throughput {c} concurrent: {rec['output_tok_s']:.1f} output tok/s, decode "
               f"step {step * 1e3 if step else float('nan'):.2f} ms")
    return out


def long_prompt_during_decode(engine: Engine, s: Sizes) -> dict[str, Any]:
    """s.itl_streams streams decode; once every one of them has its first token and
    s.itl_after_steps more decode steps have run, one prompt of s.long_len tokens arrives.
    Decode-step gaps before it and while it prefills (the gap the first token falls in
    counts: with prefill first it is the whole freeze)."""
    vocab = engine.model_cfg.vocab_size
    t_start = time.perf_counter()
    streams = {engine.add_request(ids, bc.greedy(s.itl_decode_tokens))
               for ids in _prompts(s.itl_streams, STREAM_PROMPT_LEN, vocab, 7)}
    started: set[str] = set()
    intervals: dict[str, int] = {}  # split-prefill intervals of each request's prefill

    def step() -> list:
        outs = engine.step()
        intervals.update((o.rid, o.meta_info.get("prefill_intervals", 0)) for o in outs)
        return outs

    while started != streams and engine.has_work():
        started.update(o.rid for o in step() if o.output_ids)
    t_all = time.perf_counter()
    while len(_decode_steps(engine, t_all)) < s.itl_after_steps and engine.has_work():
        step()
    t_arrive = time.perf_counter()
    rid = engine.add_request(_prompts(1, s.long_len, vocab, 8)[0], bc.greedy(4))
    t_first = None
    while engine.has_work():
        for o in step():
            if o.rid == rid and o.output_ids and t_first is None:
                t_first = time.perf_counter()
    ready = _decode_steps(engine, t_start, streams)  # the streams' tokens, not the prompt's
    gaps = np.diff(ready)
    starts, ends = np.asarray(ready[:-1]), np.asarray(ready[1:])
    before = gaps[(ends < t_arrive) & (starts >= t_all)]
    during = gaps[(ends > t_arrive) & (starts < (t_first or ends[-1]))]
    # The window is only a measurement if the streams were still decoding at its end.
    return {"long_ttft_s": None if t_first is None else t_first - t_arrive,
            "itl_before": bc.summarize(before) if len(before) else None,
            "itl_during_prefill": bc.summarize(during) if len(during) else None,
            "streams_outlived_prefill": bool(t_first and ends[-1] > t_first),
            "long_prefill_intervals": intervals.get(rid, 0),
            "stream_prefill_intervals": sum(intervals.get(r, 0) for r in streams),
            "step_counts": engine.trace.step_counts()}


def itl(model: tuple[ModelConfig, dict], s: Sizes, results: dict[str, Any]) -> None:
    """One runner with split-prefill and fused programs; the three loops run on it. Its
    one decode bucket holds the streams and the long prompt (a slot of its own, so it
    starts at once and decodes with them). A second, small extend bucket takes the
    streams' prompts whole: in the chunk's bucket they would be split prefills too (the
    runner splits by bucket), so the streams would start one by one, over many iterations
    (the first GPU run measured that by mistake)."""
    rows = s.itl_streams + 1
    kv_tokens = (s.itl_streams * (STREAM_PROMPT_LEN + s.itl_decode_tokens) + s.long_len
                 + 4 * s.chunk)
    args = dataclasses.replace(_base_args(s, rows, (rows,), 1, kv_tokens),
                               extend_token_buckets=(2 * STREAM_PROMPT_LEN, s.chunk),
                               enable_multiplexing=True, multiplex_fused=True)
    fused, results["itl_startup"] = start_engine(args, model)
    runner = fused.runner
    loops = {"plain": dataclasses.replace(args, enable_multiplexing=False, multiplex_fused=False),
             "multiplex_two_call": dataclasses.replace(args, multiplex_fused=False),
             "multiplex_fused": args}
    results["itl"] = {}
    for name, loop_args in loops.items():
        engine = fused if name == "multiplex_fused" else Engine(loop_args, runner=runner)
        rec = long_prompt_during_decode(engine, s)
        rec["compiles_after_warmup"] = runner.compiles_after_warmup
        results["itl"][name] = rec
        during = rec["itl_during_prefill"] or {}
        bc.log(f"itl {name}: long TTFT {rec['long_ttft_s']}, ITL during prefill median "
               f"{during.get('median_s')} max {during.get('max_s')}")
        _write(results)


def _write(results: dict[str, Any]) -> None:
    out = Path(FLAGS.out)
    bc.write_json(out.parent, out.name, results)


def main(argv: list[str]) -> None:
    del argv
    s = _sizes()
    dev = jax.devices()[0]
    results: dict[str, Any] = {
        "script": "bench_engine", "command": bc.command_line(),
        "env": {"jax": jax.__version__, "backend": jax.default_backend(),
                "device": dev.device_kind, "smoke": FLAGS.smoke,
                "attention_backend": FLAGS.attention_backend or "default"},
        "model": bc.model_summary(s.cfg, "llama3-8b-shape random" if not FLAGS.smoke
                                  else "tiny random", s.dtype),
        "sizes": dataclasses.asdict(s), "errors": []}
    params, results["weights_init_s"] = bc.init_weights(s.cfg, s.dtype)
    bc.log(f"weights ({results['model']['weight_bytes'] / 2**30:.1f} GiB) in "
           f"{results['weights_init_s']:.1f} s")
    _write(results)
    model = (s.cfg, params)
    parts = {"throughput": functools.partial(_throughput_part, model, s, results),
             "itl": functools.partial(itl, model, s, results),
             "throughput_stacked": functools.partial(_throughput_part, model, s, results,
                                                     stacked=True)}
    for name in FLAGS.parts:
        try:
            parts[name]()
        except Exception as e:  # the next part may still work: record and go on
            results["errors"].append({"part": name, "error": repr(e),
                                      "traceback": traceback.format_exc()})
            bc.log(f"{name}: ERROR {e!r}")
        _write(results)
    sys.exit(1 if results["errors"] else 0)


def _throughput_part(model: tuple[ModelConfig, dict], s: Sizes, results: dict[str, Any],
                     stacked: bool = False) -> None:
    """Start-up and throughput of one runner; stacked=True: on the stacked weights (see
    _base_args), the results under keys with a _stacked suffix."""
    most = max(s.concurrency)
    kv_tokens = most * (s.input_len + s.output_len) + 2 * s.chunk
    args = _base_args(s, most, s.concurrency, s.extend_seqs, kv_tokens, stacked)
    sfx = "_stacked" if stacked else ""
    engine, results["startup" + sfx] = start_engine(args, model)
    _write(results)
    results["throughput" + sfx] = throughput(engine, s, results["model"]["weight_bytes"])
    results[f"throughput{sfx}_compiles_after_warmup"] = engine.runner.compiles_after_warmup
    # Returning drops the engine and its KV pool; the weights stay for the next runner.


if __name__ == "__main__":
    app.run(main)
