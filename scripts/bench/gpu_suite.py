"""`make gpu-check`: what one NVIDIA GPU can tell about xlaserve, in one command, within
8 minutes, without network (docs/gpu_suite.md).

    python scripts/bench/gpu_suite.py --out_dir=$OUT          # on the GPU machine, from the repo
    .venv/bin/python scripts/bench/gpu_suite.py --smoke --out_dir=/tmp/gs   # tiny, on a CPU

Sections, in this order, each one subprocess of an existing script with its own time
budget:
  kernels    scripts/bench/bench_kernels.py --sections=correctness: the Pallas kernels against
             their jnp twin on the device, decode / extend / mixed, bf16 and f32, max error
  attention  scripts/bench/bench_kernels.py --sections=roofline,decode,prefill: decode attention
             HBM bandwidth at 8k and 32k context (Llama-8B heads) against 4.8 TB/s and
             jax.nn.dot_product_attention, prefill attention TFLOP/s
  layers     scripts/bench/bench_layer_weights.py: the layer loop's weight reads at 8B shapes,
             stacked weights dynamically sliced (the GPU default) against one buffer per
             layer behind a lax.switch and an unrolled loop
  tbo        scripts/bench/tbo_schedule.py: the TBO program's compiled schedule (async all-to-all
             pairs with the other micro-batch's compute between them; 2+ GPUs)
  engine     scripts/bench/bench_engine.py: the engine on random Llama-3-8B-shaped bf16 weights:
             start-up, output throughput at 1 / 32 / 128 concurrent, ITL while a long
             prompt prefills (plain, multiplexing two-call and fused), all on the GPU
             default layout (one buffer per layer, wq|wk|wv and w_gate|w_up fused); then
             throughput again on the stacked, scanned, unfused weights (its predecessor)
  fp8        scripts/bench/bench_fp8_step.py: a one-row decode step on random 8B-shaped weights
             with FP8 (e4m3, 128 x 128 block scales) layer matrices against the bf16 step
             (target <= 0.6x), both in the GPU default layout
  spec       scripts/bench/bench_verify_step.py: speculative decoding's TARGET_VERIFY step
             (1 + 4 tokens a row, random drafts) against a DECODE step of the same rows
             (1 and 8) on random 8B-shaped bf16 weights (target: one row <= 1.3x)
  sweep      scripts/bench/bench_kernels.py --sweep: Mosaic tuning knobs side by side with the
             defaults on three decode shapes (whatever time the others left)
Why subprocesses: a hung compile is killed at its budget and the suite goes on; a crash
(a kernel fault, an out-of-memory) loses that section only; every section gets the
whole device memory (JAX preallocates per process); the scripts keep their own flags.
This process never starts a JAX backend.

Writes under --out_dir (default $OUT): <section>.json (the script's results, rewritten as
it goes, so a section cut short keeps what it measured), <section>.log (its output) and
summary.json, rewritten after every section: device kind, jax version, and per section
its status (ok, failed, timeout, not_applicable, skipped), wall time, budget, and on
failure the error and the traceback from its log.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from absl import app, flags

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "scripts" / "bench"

FLAGS = flags.FLAGS
flags.DEFINE_string("out_dir", os.environ.get("OUT", "gpu_suite_out"), "where the JSON goes")
flags.DEFINE_bool("smoke", False, "tiny sizes on any machine (a CPU check of the suite)")
flags.DEFINE_list("sections", ["kernels", "attention", "layers", "tbo", "engine", "fp8",
                                "spec", "sweep"],
                  "sections to run")
flags.DEFINE_integer("total_budget_s", None, "wall-clock limit of the whole suite (default "
                     "470 s; 1800 s with --smoke, whose sections have no budgets of their "
                     "own: a shared CPU's wall time says little)")


@dataclass(frozen=True)
class Section:
    """One subprocess: a script, its arguments (full size and --smoke) and a budget."""

    name: str
    script: str
    args: tuple[str, ...]
    smoke_args: tuple[str, ...]
    budget_s: int | None  # None: whatever the sections before it left


SECTIONS = [
    Section("kernels", "bench_kernels.py", ("--sections=correctness", "--nosweep"),
            ("--sections=correctness", "--nosweep", "--smoke"), 70),
    Section("attention", "bench_kernels.py",
            # The engine's head layout only: each contender is a compile of its own.
            ("--sections=roofline,decode,prefill", "--nosweep", "--models=llama8b",
             "--decode_batches=8,64", "--decode_contexts=8192,32768", "--iters=5"),
            ("--sections=roofline,decode,prefill", "--nosweep", "--models=smollm2",
             "--smoke"), 90),
    Section("layers", "bench_layer_weights.py", (), ("--smoke",), 60),
    Section("tbo", "tbo_schedule.py", (), (), 45),
    # Compiling the 8B executables is most of it: 10 + 16 took 29 + 44 s on the H200,
    # the whole section 130 s without the per-layer runner.
    Section("engine", "bench_engine.py", ("--parts=throughput,itl,throughput_stacked",),
            ("--smoke", "--parts=throughput,itl,throughput_stacked"), 270),
    # Two per-layer decode programs (10-13 s each compiled for an H100 on a CPU) and 16 GB
    # of bf16 weights drawn and quantized on the device; its time comes out of the sweep's.
    Section("fp8", "bench_fp8_step.py", (), ("--smoke",), 75),
    # One runner of 8 programs (DECODE and TARGET_VERIFY at 1 and 8 rows, one EXTEND, 2
    # samplers, slot init), all compiled before the first step: the H200 compiled the
    # engine's stacked 8B programs in up to 4.7 s each, per-layer ones take ~1.6x that
    # (compiled for an H100 on a CPU), so 25-40 s, the weights' draw 5.5 s and the
    # process start, 40-60 s in all; its time also comes out of the sweep's.
    Section("spec", "bench_verify_step.py", (), ("--smoke",), 75),
    Section("sweep", "bench_kernels.py", ("--sections=roofline", "--sweep", "--iters=5"),
            ("--sections=roofline", "--sweep", "--smoke"), None),
]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] gpu_suite: {msg}", flush=True)


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    # Fake CPU devices for the TBO program's mesh when the backend is a CPU (no effect
    # on a GPU backend).
    flag = "--xla_force_host_platform_device_count=4"
    if flag not in env.get("XLA_FLAGS", ""):
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {flag}".strip()
    return env


def _traceback_from(log_text: str) -> str | None:
    """The last Python traceback in a log, if there is one."""
    at = log_text.rfind("Traceback (most recent call last)")
    return log_text[at:][-6000:] if at >= 0 else None


def engine_backend(kernels: dict[str, Any] | None) -> tuple[str | None, str | None]:
    """The engine and spec sections' attention backend from the kernels section's record:
    the runtime's default (Pallas on a GPU) unless a bf16 kernel check, the dtype they
    run, failed or did not run there; then XLA's attention, so their numbers still come
    back. (backend flag or None, why)."""
    if kernels is None or FLAGS.smoke:
        return None, None
    cases = [c for c in ((kernels.get("result") or {}).get("correctness") or [])
             if c.get("dtype") == "bfloat16"]
    if cases and all(c.get("ok") for c in cases):
        return None, None
    return "xla", ("the bf16 Pallas kernels failed on the device" if cases
                   else f"the kernels section did not check bf16 ({kernels.get('status')})")


def run_section(sec: Section, out_dir: Path, timeout_s: float,
                extra_args: tuple[str, ...] = ()) -> dict[str, Any]:
    """Run one section's script; its status, wall time and results (partial ones too)."""
    result_path, log_path = out_dir / f"{sec.name}.json", out_dir / f"{sec.name}.log"
    result_path.unlink(missing_ok=True)
    cmd = [sys.executable, str(SCRIPTS / sec.script), f"--out={result_path}",
           *(sec.smoke_args if FLAGS.smoke else sec.args), *extra_args]
    rec: dict[str, Any] = {"command": " ".join(cmd[1:]), "budget_s": round(timeout_s, 1)}
    t0 = time.perf_counter()
    with open(log_path, "w") as logf:
        proc = subprocess.Popen(cmd, cwd=REPO, env=_child_env(), stdout=logf,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)  # its own session: the script and anything it started
            proc.wait()
            rc = None
    rec["wall_s"] = round(time.perf_counter() - t0, 2)
    text = log_path.read_text(errors="replace")
    result = json.loads(result_path.read_text()) if result_path.exists() else None
    rec["result"] = result
    if rc is None:
        rec["status"] = "timeout"
        rec["error"] = f"killed after its budget of {timeout_s:.0f} s"
    elif rc != 0:
        rec["status"] = "failed"
        rec["error"] = f"exit status {rc}"
    elif result is None:
        rec["status"] = "failed"
        rec["error"] = f"no {result_path.name} written"
    else:
        rec["status"] = result.get("status", "ok") if isinstance(result, dict) else "ok"
        if rec["status"] == "not_applicable":
            rec["reason"] = result.get("reason")
    if rec["status"] in ("failed", "timeout"):
        rec["traceback"] = _traceback_from(text)
        rec["log_tail"] = text[-3000:]
    return rec


def _device_kind(sections: dict[str, Any]) -> str | None:
    """From the first section that reached the device (this process starts no backend)."""
    for rec in sections.values():
        env = (rec.get("result") or {}).get("env") or {}
        if env.get("device"):
            return env["device"]
    return None


def main(argv: list[str]) -> None:
    del argv
    import bench_common  # imports jax for its version only: that starts no backend
    import jax

    out_dir = Path(FLAGS.out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    unknown = set(FLAGS.sections) - {s.name for s in SECTIONS}
    if unknown:
        raise app.UsageError(f"--sections: unknown {sorted(unknown)}")
    total = FLAGS.total_budget_s or (1800 if FLAGS.smoke else 470)
    t_start = time.perf_counter()
    deadline = t_start + total
    summary: dict[str, Any] = {
        "suite": "gpu_suite", "command": bench_common.command_line(),
        "git_revision": bench_common.git_revision(), "smoke": FLAGS.smoke,
        "jax_version": jax.__version__,
        "python": platform.python_version(), "host": platform.node(),
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "total_budget_s": total, "device_kind": None, "sections": {}}
    for sec in [s for s in SECTIONS if s.name in FLAGS.sections]:
        left = deadline - time.perf_counter()
        if left < 5:
            rec: dict[str, Any] = {"status": "skipped", "error": "no time left in the "
                                   f"suite's {total} s", "wall_s": 0.0}
        else:
            budget = left if FLAGS.smoke or sec.budget_s is None else min(sec.budget_s, left)
            extra: tuple[str, ...] = ()
            why = None
            if sec.name in ("engine", "spec"):
                backend, why = engine_backend(summary["sections"].get("kernels"))
                extra = (f"--attention_backend={backend}",) if backend else ()
            log(f"{sec.name}: starting (budget {budget:.0f} s){' ' + extra[0] if extra else ''}")
            try:
                rec = run_section(sec, out_dir, budget, extra)
            except Exception as e:  # the suite itself must go on to the next section
                rec = {"status": "failed", "error": repr(e),
                       "traceback": traceback.format_exc(), "wall_s": 0.0}
            if why:
                rec["attention_backend_why"] = why
        summary["sections"][sec.name] = rec
        summary["device_kind"] = _device_kind(summary["sections"])
        summary["total_wall_s"] = round(time.perf_counter() - t_start, 2)
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        log(f"{sec.name}: {rec['status']} in {rec['wall_s']:.1f} s"
            + (f" ({rec['error']})" if rec.get("error") else ""))
    log(f"done in {summary['total_wall_s']:.1f} s; {out_dir / 'summary.json'}")


if __name__ == "__main__":
    app.run(main)
