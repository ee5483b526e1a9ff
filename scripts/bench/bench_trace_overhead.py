"""Offline throughput with the execution trace on and off, side by side in one process.

    .venv/bin/python scripts/bench/bench_trace_overhead.py --out_dir=bench_out
    .venv/bin/python scripts/bench/bench_trace_overhead.py --smoke --num_prompts=4 --input_len=16 \
        --output_len=40 --rounds=40 --out_dir=/tmp/bt   # tiny model: ~1 ms, host-bound steps

Two engines share one ModelRunner (same executables, same weights): one records the trace
(ServerArgs.trace_buffer_steps, the default), one has it off (0). Each round runs the same
workload (bench_offline's throughput run: --num_prompts greedy requests, --input_len
prompt tokens, --output_len new tokens, EOS ignored) on each, in alternating order (A B,
then B A), with fresh prompts per round so the prefix cache never helps. Reports the
median of the per-round ratios on / off, and the best run of each (less sensitive to a
busy neighbour). On a shared machine the run-to-run noise can exceed the effect, so the
script also measures the trace's own host cost directly: it replays the recorded steps
through a fresh ExecutionTrace (the engine's calls, same rows and requests) and divides
that time by the run's wall time per step. Writes bench_trace_overhead.json.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import bench_common as bc
import numpy as np
from absl import app, flags

from runtime.config import ServerArgs
from runtime.engine import Engine
from runtime.exec_trace import ExecutionTrace, StepRecord
from runtime.request import SamplingParams

FLAGS = flags.FLAGS
flags.DEFINE_string("out_dir", "bench_out", "where the JSON goes")
flags.DEFINE_bool("smoke", False, "tiny random model and buckets (at most 4 requests, 64 "
                  "tokens each): steps of ~1 ms, where the host's share is largest")
flags.DEFINE_integer("num_prompts", 32, "requests per run")
flags.DEFINE_integer("input_len", 64, "prompt tokens per request")
flags.DEFINE_integer("output_len", 64, "new tokens per request")
flags.DEFINE_integer("rounds", 4, "rounds; each runs both engines once")
flags.DEFINE_string("compilation_cache_dir", "~/.cache/xlaserve/jax", "see ServerArgs; '' off")


def _args() -> ServerArgs:
    base = ServerArgs(max_top_logprobs=0, kv_len_buckets=(256,),
                      compilation_cache_dir=FLAGS.compilation_cache_dir or None)
    return bc.smoke_args(base) if FLAGS.smoke else base


def _run(engine: Engine, prompts: list[list[int]], n: int) -> dict[str, Any]:
    sp = SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, sp)
    secs = time.perf_counter() - t0
    tokens = sum(len(o.output_ids) for o in outs)
    return {"seconds": secs, "output_tokens": tokens, "output_tok_s": tokens / secs}


def replay_cost_s(steps: list[StepRecord], repeats: int = 5) -> float:
    """Best seconds per step of the trace calls the engine makes for these steps: the
    record (step_record's fields and the row tuple), record, ready, processed, plus each
    request's add and finish."""
    best = float("inf")
    for _ in range(repeats):
        trace = ExecutionTrace()
        rids = {rid for s in steps for rid in s.rids}
        t0 = time.perf_counter()
        for rid in rids:
            trace.add_request(rid, 0.0)
        for s in steps:
            rec = trace.record(dataclasses.replace(s, rids=tuple(list(s.rids)), step=-1))
            trace.ready(rec, s.ready or 0.0, s.waited)
            trace.processed(rec, s.process_end or 0.0)
        for rid in rids:
            trace.finish_request(rid, 1.0)
        best = min(best, (time.perf_counter() - t0) / len(steps))
    return best


def main(argv: list[str]) -> None:
    del argv
    machine = bc.machine_info()
    args = _args()
    on = Engine(args, model=bc.tiny_model()) if FLAGS.smoke else Engine(args)
    num, inp, out = FLAGS.num_prompts, FLAGS.input_len, FLAGS.output_len
    off = Engine(dataclasses.replace(args, trace_buffer_steps=0), runner=on.runner,
                 tokenizer=on.tokenizer)
    vocab = on.model_cfg.vocab_size
    warm = np.random.default_rng(1 << 20).integers(3, vocab, (num, inp)).tolist()
    for eng in (on, off):  # first calls of each executable off the clock
        _run(eng, warm, out)
    rounds = []
    for r in range(FLAGS.rounds):
        rng = np.random.default_rng(r)
        prompts = rng.integers(3, vocab, (2, num, inp)).tolist()
        order = [("on", on), ("off", off)] if r % 2 == 0 else [("off", off), ("on", on)]
        res = {name: _run(eng, prompts[i], out) for i, (name, eng) in enumerate(order)}
        res["ratio_on_off"] = res["on"]["output_tok_s"] / res["off"]["output_tok_s"]
        bc.log(f"round {r}: on {res['on']['output_tok_s']:.1f} tok/s, off "
               f"{res['off']['output_tok_s']:.1f} tok/s, ratio {res['ratio_on_off']:.4f}")
        rounds.append(res)
    assert not off.trace.steps() and on.trace.steps(), "the trace switch did nothing"
    ratios = [r["ratio_on_off"] for r in rounds]
    on_rates = [r["on"]["output_tok_s"] for r in rounds]
    off_rates = [r["off"]["output_tok_s"] for r in rounds]
    steps = on.trace.steps()
    per_step = bc.median([r["on"]["seconds"] for r in rounds]) / (
        on.trace.num_recorded / (FLAGS.rounds + 1))  # the warm-up and every round
    cost = replay_cost_s(steps)
    summary = {"median_ratio_on_off": bc.median(ratios), "ratios": ratios,
               "best_ratio_on_off": max(on_rates) / max(off_rates),
               "median_on_tok_s": bc.median(on_rates), "median_off_tok_s": bc.median(off_rates),
               "steps_recorded": on.trace.num_recorded, "wall_s_per_step": per_step,
               "trace_cost_s_per_step": cost, "trace_cost_fraction": cost / per_step}
    machine["load_average_end"] = bc.load_average()
    bc.log(f"on/off: median ratio {summary['median_ratio_on_off']:.4f}, best-run ratio "
           f"{summary['best_ratio_on_off']:.4f}; trace cost {cost * 1e6:.1f} us per "
           f"{per_step * 1e3:.2f} ms step ({summary['trace_cost_fraction']:.3%})")
    bc.write_json(FLAGS.out_dir, "bench_trace_overhead.json",
                  {"script": "bench_trace_overhead", "command": bc.command_line(),
                   "machine": machine, "workload": {"num_prompts": num, "input_len": inp,
                                                    "output_len": out},
                   "rounds": rounds, "summary": summary})


if __name__ == "__main__":
    app.run(main)
