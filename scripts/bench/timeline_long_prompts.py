"""The long-prompts-during-decode scenario, traced: a PNG timeline and the trace JSON.

    .venv/bin/python scripts/bench/timeline_long_prompts.py --out_dir=docs/timeline
    .venv/bin/python scripts/bench/timeline_long_prompts.py --set=enable_mixed_chunk=true \
        --label=mixed
    .venv/bin/python scripts/bench/timeline_long_prompts.py --smoke --out_dir=/tmp/tl   # tiny model

--num_streams requests decode; once they have run --long_after_steps decode steps,
--long_prompts prompts of --long_len tokens arrive. The timeline shows what the decode
streams do while those prefill (plain path: they stall behind each prefill chunk).
`--set` overrides any ServerArgs field (key=value; tuples as 8:16), so the same scenario
runs on another execution path once ServerArgs has its switch. Writes <label>.json (Chrome trace),
<label>.png and <label>_summary.json (decode-stream stall, bubbles) to --out_dir.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any

import bench_common as bc
import plot_timeline
from absl import app, flags

from runtime.config import ServerArgs
from runtime.engine import Engine
from runtime.perfetto import write_chrome_trace
from runtime.request import SamplingParams

FLAGS = flags.FLAGS
bc.define_run_flags("timeline_out", "tiny random model, tiny scenario (checks the script)",
                    out_help="where the files go", compilation_cache=False)
flags.DEFINE_string("label", "plain", "file name stem")
flags.DEFINE_integer("num_streams", 8, "requests decoding when the long prompts arrive")
flags.DEFINE_integer("decode_tokens", 96, "new tokens per decode stream")
flags.DEFINE_integer("long_prompts", 2, "long prompts that arrive mid-decode")
flags.DEFINE_integer("long_len", 1536, "tokens per long prompt")
flags.DEFINE_integer("long_after_steps", 16, "decode steps before the long prompts arrive")
flags.DEFINE_list("set", [], "ServerArgs overrides, key=value")


def server_args() -> ServerArgs:
    base = ServerArgs()
    if FLAGS.smoke:
        base = dataclasses.replace(bc.smoke_args(base, kv_len=128), compilation_cache_dir=None)
    types = {f.name: str(f.type) for f in dataclasses.fields(ServerArgs)}
    overrides: dict[str, Any] = {}
    for item in FLAGS.set:
        key, _, value = item.partition("=")
        if key not in types:
            raise app.UsageError(f"--set {key}: not a ServerArgs field")
        overrides[key] = _parse(types[key], value)
    return dataclasses.replace(base, **overrides)


def _parse(annotation: str, value: str) -> Any:
    """A --set value by its field's annotation; tuples are ':'-separated ("8:16")."""
    kind = annotation.split("[")[0].split(" |")[0]
    if kind == "tuple":
        return tuple(int(v) for v in value.split(":"))
    if kind == "bool":
        return value.lower() in ("1", "true", "yes")
    return {"int": int, "float": float}.get(kind, str)(value)


def run(engine: Engine, streams: int, long_prompts: int, long_len: int,
        decode_tokens: int, after: int) -> None:
    sp = SamplingParams(temperature=0, max_new_tokens=decode_tokens, ignore_eos=True)
    vocab = engine.model_cfg.vocab_size
    for i in range(streams):
        engine.add_request([3 + (i * 7 + j) % (vocab - 3) for j in range(16)], sp)
    while engine.trace.step_counts().get("decode", 0) < after:
        engine.step()
    long_sp = dataclasses.replace(sp, max_new_tokens=8)
    for i in range(long_prompts):
        engine.add_request([3 + (i * 11 + j) % (vocab - 3) for j in range(long_len)], long_sp)
    engine.run_until_idle()


def summary(engine: Engine) -> dict[str, Any]:
    """The longest gap between two consecutive decode steps (what a stream's inter-token
    latency sees) against the median one, and the device bubbles."""
    ready = [s.ready for s in engine.trace.steps() if s.mode in ("decode", "mixed")]
    gaps = sorted(b - a for a, b in zip(ready, ready[1:], strict=False))
    return {"decode_steps": len(ready), "max_decode_gap_s": gaps[-1] if gaps else None,
            "median_decode_gap_s": gaps[len(gaps) // 2] if gaps else None,
            "bubbles": engine.trace.bubbles(), "step_counts": engine.trace.step_counts()}


def main(argv: list[str]) -> None:
    del argv
    args = server_args()
    t0 = time.perf_counter()
    engine = Engine(args, model=bc.tiny_model()) if FLAGS.smoke else Engine(args)
    bc.log(f"engine ready in {time.perf_counter() - t0:.1f} s")
    if FLAGS.smoke:  # fits the tiny buckets: 3 streams, one 100-token prompt
        run(engine, 3, 1, 100, 12, 4)
    else:
        run(engine, FLAGS.num_streams, FLAGS.long_prompts, FLAGS.long_len,
            FLAGS.decode_tokens, FLAGS.long_after_steps)
    os.makedirs(FLAGS.out_dir, exist_ok=True)
    stem = os.path.join(FLAGS.out_dir, FLAGS.label)
    write_chrome_trace(engine.trace, stem + ".json")
    with open(stem + ".json") as f:
        lanes = plot_timeline.load_lanes(json.load(f), None, None, 12)
    plot_timeline.plot(lanes, stem + ".png", f"{FLAGS.label}: {FLAGS.long_prompts} x "
                       f"{FLAGS.long_len}-token prompts during {FLAGS.num_streams}-stream decode")
    result = {"label": FLAGS.label, "server_args": {k: str(v) for k, v in
                                                    dataclasses.asdict(args).items()},
              **summary(engine)}
    with open(stem + "_summary.json", "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps({k: result[k] for k in ("max_decode_gap_s", "median_decode_gap_s")}))


if __name__ == "__main__":
    app.run(main)
