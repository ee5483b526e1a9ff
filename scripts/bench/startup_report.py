"""Start-up cost of the executable plan, per flag combination: how many executables each
mode compiles, what each one cost (compile seconds, memory mappings, resident MB), the
warm-up time, and the process's mappings and resident memory once warm.

    .venv/bin/python scripts/bench/startup_report.py --out=/tmp/startup.json
    .venv/bin/python scripts/bench/startup_report.py --combos=default,mixed --generate=8

Every combination starts in a fresh subprocess (a process's mappings are what the limit
counts, so combinations must not share one). --generate runs greedy prompts through each
engine and the report says whether every combination produced the same tokens as the first.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

from absl import app, flags

# The documented flag combinations (README "Flags that matter"), as ServerArgs overrides.
COMBOS: dict[str, dict[str, Any]] = {
    "default": {},
    "prefill_first": {"itl_target_ms": 0},
    "mixed": {"enable_mixed_chunk": True},
    "xla": {"attention_backend": "xla", "cpu_matmul": "xla"},
    "unchunked": {"chunked_prefill_size": None, "max_prefill_tokens": 4096},
    "split_prefill": {"enable_split_prefill": True},
    "multiplexing": {"enable_multiplexing": True},
    "multi_step": {"num_scheduler_steps": 4},
}

FLAGS = flags.FLAGS
flags.DEFINE_list("combos", list(COMBOS), f"which of {list(COMBOS)}")
flags.DEFINE_string("out", "startup_report.json", "JSON output")
flags.DEFINE_string("model", "default", "see ServerArgs.model")
flags.DEFINE_integer("generate", 4, "greedy prompts to run through each engine (0: none)")
flags.DEFINE_string("compilation_cache_dir", "", "persistent cache ('' off: cold compiles)")
flags.DEFINE_string("_child", None, "internal: run one combination and print its JSON")


def _child(name: str) -> dict[str, Any]:
    from runtime.config import ServerArgs
    from runtime.engine import Engine
    from runtime.executable_budget import footprint
    from runtime.request import SamplingParams

    before = footprint()
    t0 = time.perf_counter()
    args = ServerArgs(model=FLAGS.model, compilation_cache_dir=FLAGS.compilation_cache_dir or None,
                      **COMBOS[name])
    engine = Engine(args)
    ready_s = time.perf_counter() - t0
    warm = footprint()
    runner = engine.runner
    stats = runner.exec_stats
    by_kind: dict[str, list] = {}
    for s in stats:
        by_kind.setdefault(s.name.split("/")[0], []).append(s)
    prompts = [f"Question {i}: what is {i} plus {i + 1}? Answer briefly." for i in
               range(FLAGS.generate)]
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=16)) \
        if prompts else []
    return dict(
        combo=name, overrides={k: v for k, v in COMBOS[name].items()},
        executables=runner.num_executables, engine_ready_s=round(ready_s, 1),
        before=before.to_json(), after_warmup=warm.to_json(),
        maps_share_of_limit=round(warm.maps / warm.max_maps, 4),
        per_kind={k: dict(count=len(v), compile_s_median=round(statistics.median(
            x.compile_s for x in v), 3), maps_median=statistics.median(x.maps for x in v),
            resident_mb_median=round(statistics.median(x.resident_mb for x in v), 1))
            for k, v in sorted(by_kind.items())},
        executables_detail=[dict(name=s.name, compile_s=round(s.compile_s, 3), maps=s.maps,
                                 resident_mb=round(s.resident_mb, 1)) for s in stats],
        output_ids=[o.output_ids for o in outs], prefill_policy=engine.trace.policy,
        compiles_after_warmup=runner.compiles_after_warmup)


def main(argv: list[str]) -> None:
    del argv
    if FLAGS._child:
        print("STARTUP_JSON " + json.dumps(_child(FLAGS._child)))
        return
    results = []
    for name in FLAGS.combos:
        if name not in COMBOS:
            raise app.UsageError(f"unknown combo {name!r}; known: {list(COMBOS)}")
        cmd = [sys.executable, os.path.abspath(__file__), f"--_child={name}",
               f"--model={FLAGS.model}", f"--generate={FLAGS.generate}",
               f"--compilation_cache_dir={FLAGS.compilation_cache_dir}"]
        print(f"[startup] {name}: starting", flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("STARTUP_JSON ")), None)
        if proc.returncode or line is None:
            results.append(dict(combo=name, error=proc.stderr[-2000:]))
            print(f"[startup] {name}: FAILED\n{proc.stderr[-2000:]}", flush=True)
            continue
        r = json.loads(line.removeprefix("STARTUP_JSON "))
        results.append(r)
        a, share = r["after_warmup"], 100 * r["maps_share_of_limit"]
        print(f"[startup] {name}: {r['executables']} executables, ready in "
              f"{r['engine_ready_s']} s, {a['maps']} mappings ({share:.1f}% of the limit), "
              f"{a['resident_mb']:.0f} MB resident", flush=True)
    ok = [r for r in results if "error" not in r]
    same = all(r["output_ids"] == ok[0]["output_ids"] for r in ok) if ok else None
    report = dict(argv=sys.argv, combos=results, same_tokens_as_first=same)
    with open(FLAGS.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"[startup] same greedy tokens across combinations: {same}; wrote {FLAGS.out}")
    if len(ok) < len(results):
        sys.exit(1)


if __name__ == "__main__":
    app.run(main)
