"""The GPU suite (scripts/bench/gpu_suite.py, `make gpu-check`) at --smoke size on this CPU, so
it cannot rot before a GPU runs it. The GPU machine's Python has jax, flax, orbax, chex,
absl, numpy, pytest, transformers and torch only: a sitecustomize on PYTHONPATH makes
every other package the runtime could import fail in the suite and all its sections'
subprocesses, so an import the bare machine cannot satisfy fails here. Every section
must be in summary.json with status ok, or not_applicable for the stated reason a CPU
cannot show it. The numbers mean nothing at this size."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import pytest

from pallas_kernels import grouped_matmul

REPO = Path(__file__).resolve().parents[1]
# Packages of the project's dependencies that the GPU machine does not have.
ABSENT = ("llguidance", "fastapi", "uvicorn", "pydantic", "starlette", "prometheus_client",
          "gguf", "psutil", "tokenizers", "jinja2", "matplotlib", "httpx", "openai")
SITECUSTOMIZE = f"""
import importlib.abc, sys

class _Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in {ABSENT!r}:
            raise ModuleNotFoundError(f"{{name}} is not installed on the GPU machine",
                                      name=name)
        return None

sys.meta_path.insert(0, _Absent())
"""
SECTIONS = ["kernels", "attention", "layers", "tbo", "engine", "fp8", "spec", "sweep"]


def _bare_env(tmp: Path) -> dict[str, str]:
    """The GPU machine's Python, and an empty compilation cache (it has none: a section's
    time includes its compiles)."""
    (tmp / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return {**os.environ, "PYTHONPATH": str(tmp), "JAX_COMPILATION_CACHE_DIR": str(tmp / "jax")}


def _suite(tmp: Path, *args: str, timeout: int = 1900) -> tuple[dict[str, Any], str]:
    out = tmp / "out"
    proc = subprocess.run([sys.executable, "scripts/bench/gpu_suite.py", "--smoke",
                           f"--out_dir={out}", *args], cwd=REPO, env=_bare_env(tmp),
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "summary.json").read_text()), proc.stdout


@pytest.fixture(scope="module")
def suite(tmp_path_factory) -> tuple[dict[str, Any], str]:
    return _suite(tmp_path_factory.mktemp("gpu_suite"))


def test_the_bare_machine_lacks_the_blocked_packages(tmp_path):
    """The stand-in works: under it the packages the suite must not need do not import."""
    code = "import importlib, sys\nfor m in sys.argv[1:]:\n" \
           "    try:\n        importlib.import_module(m)\n        print('imported', m)\n" \
           "    except ModuleNotFoundError:\n        pass\n"
    proc = subprocess.run([sys.executable, "-c", code, *ABSENT], env=_bare_env(tmp_path),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "imported" not in proc.stdout, proc.stdout + proc.stderr


def test_every_section_ran_and_reports(suite):
    summary, stdout = suite
    assert summary["smoke"] and summary["jax_version"] == jax.__version__
    assert summary["device_kind"] == "cpu"
    assert list(summary["sections"]) == SECTIONS
    for name, rec in summary["sections"].items():
        want = "not_applicable" if name == "tbo" else "ok"
        assert rec["status"] == want, (name, rec.get("error"), rec.get("log_tail"))
        assert rec["wall_s"] > 0 and rec["result"], name
        assert f"gpu_suite: {name}: starting" in stdout and f"gpu_suite: {name}: {want}" in stdout
    # Every time is rounded to 10 ms, so the sections' sum may pass the rounded total by
    # up to 5 ms each and the total fall short by 5 ms (a 55.66 s total against sections
    # summing to 55.660000000000004).
    sections = summary["sections"].values()
    slack = 0.005 * (len(sections) + 1)
    assert summary["total_wall_s"] >= sum(r["wall_s"] for r in sections) - slack


def test_kernels_section_checks_every_mode_and_dtype(suite):
    checks = suite[0]["sections"]["kernels"]["result"]["correctness"]
    grouped = {"grouped_matmul"} if grouped_matmul.pltriton is not None else set()
    assert {c["mode"] for c in checks} == {"decode", "extend", "mixed"} | grouped
    assert {c["dtype"] for c in checks} == {"bfloat16", "float32"}
    assert all(c["ok"] and c["max_abs_err"] < c["tol"] for c in checks), checks


def test_attention_section_compares_with_the_roofline_and_dot_product_attention(suite):
    r = suite[0]["sections"]["attention"]["result"]
    assert r["errors"] == [] and r["roofline"]["measured_tbps"] > 0
    (d,) = r["decode"]
    assert d["pallas_tbps"] > 0 and d["dpa_tbps"] > 0 and d["speedup_vs_dpa"] > 0
    assert d["pallas_frac_of_nominal"] == pytest.approx(d["pallas_tbps"] / 4.8)
    (p,) = r["prefill"]
    assert p["pallas_tflops"] > 0 and p["dpa_tflops"] > 0


def test_layers_section_reads_the_weights_four_ways(suite):
    r = suite[0]["sections"]["layers"]["result"]
    assert r["errors"] == [] and [p["batch"] for p in r["points"]] == [1, 32, 128]
    for p in r["points"]:
        for v in ("stacked", "switch", "switch_fused", "unrolled"):
            assert p[f"{v}_gbps"] == pytest.approx(r["weight_bytes"] / p[f"{v}_s"] / 1e9)
        # The same function of x four ways (f32 at smoke size: the same sums in order).
        for v in ("switch", "switch_fused", "unrolled"):
            assert p[f"{v}_max_abs_diff"] < 1e-5, v


def test_sweep_section_times_variants_beside_the_defaults(suite):
    r = suite[0]["sections"]["sweep"]["result"]
    assert r["errors"] == [] and len(r["sweep"]) == 2
    for point in r["sweep"]:
        assert "default" in point["variants"] and not point["failed"]
        for name in point["variants"]:
            assert point[f"{name}_tbps"] > 0, name


def test_tbo_section_says_why_a_cpu_cannot_show_the_overlap(suite):
    rec = suite[0]["sections"]["tbo"]
    r = rec["result"]
    assert r["devices"] == 4 and r["ep"] == 4  # the suite's 4 fake CPU devices
    # Three exchanges per micro-batch, all synchronous on a CPU: nothing to overlap.
    assert r["sync_all_to_all"] == 6 and r["async_pairs"] == 0
    assert "synchronous all-to-alls" in rec["reason"] == r["reason"]


def test_engine_section_measures_startup_throughput_and_itl(suite):
    r = suite[0]["sections"]["engine"]["result"]
    assert r["errors"] == []
    sizes = r["sizes"]
    assert r["startup"]["executables"] > 0 and r["startup"]["startup_s"] > 0
    assert r["itl_startup"]["plan"]["FUSED"] > 0 and r["itl_startup"]["plan"]["SPLIT_PREFILL"] > 0
    for c in sizes["concurrency"]:
        t = r["throughput"][str(c)]
        assert t["output_tokens"] == c * sizes["output_len"] and t["output_tok_s"] > 0
    assert r["throughput_compiles_after_warmup"] == 0
    # Throughput again on the stacked weights: the same tokens' worth of work.
    assert r["startup_stacked"]["executables"] > 0
    for c in sizes["concurrency"]:
        t = r["throughput_stacked"][str(c)]
        assert t["output_tokens"] == c * sizes["output_len"] and t["output_tok_s"] > 0
    assert r["throughput_stacked_compiles_after_warmup"] == 0
    assert set(r["itl"]) == {"plain", "multiplex_two_call", "multiplex_fused"}
    for name, rec in r["itl"].items():
        assert rec["long_ttft_s"] > 0 and rec["streams_outlived_prefill"], name
        assert rec["itl_during_prefill"]["n"] > 0 and rec["itl_before"]["n"] > 0, name
        assert rec["compiles_after_warmup"] == 0, name
    # The multiplexing loops ran the prefill as layer intervals, the plain one did not.
    assert r["itl"]["multiplex_two_call"]["step_counts"].get("split_prefill", 0) > 0
    assert r["itl"]["plain"]["step_counts"].get("split_prefill", 0) == 0
    # Only the long prompt was split: the streams' prompts ran whole, so they all decode
    # from the start (the first GPU run split them too, and they started one by one).
    for name, rec in r["itl"].items():
        assert rec["stream_prefill_intervals"] == 0, name
        assert (rec["long_prefill_intervals"] > 0) == (name != "plain"), name


def test_fp8_section_times_the_fp8_step_beside_the_bf16_one(suite):
    r = suite[0]["sections"]["fp8"]["result"]
    assert r["errors"] == [] and r["block"] == [16, 16]
    # The FP8 copy holds each layer matrix in one byte (f32 at smoke size: a quarter).
    assert r["weight_bytes"]["fp8"] < 0.6 * r["weight_bytes"]["bf16"]
    steps = r["steps"]
    assert steps["fp8"]["n"] == steps["bf16"]["n"] > 0
    assert r["fp8_vs_bf16"] == pytest.approx(steps["fp8"]["median_s"] / steps["bf16"]["median_s"])
    assert r["meets_target"] == (r["fp8_vs_bf16"] <= r["target"] == 0.6)
    # The quantized model computes the same function, to e4m3's precision.
    assert r["logits"]["same_argmax"]
    assert r["logits"]["max_abs_diff"] < 0.05 * r["logits"]["bf16_max_abs"]


def test_spec_section_times_verify_beside_decode(suite):
    r = suite[0]["sections"]["spec"]["result"]
    assert r["errors"] == [] and r["draft_tokens"] == 4 and r["context"] == 64
    assert set(r["steps"]) == {"rows_1", "rows_8"}
    for step in r["steps"].values():
        assert step["decode_ms"] > 0 and step["verify_ms"] > 0 and step["n"] == r["rounds"]
        assert step["ratio"] == pytest.approx(step["verify_ms"] / step["decode_ms"])
    one = r["steps"]["rows_1"]["ratio"]
    assert r["verify_vs_decode_one_row"] == one
    assert r["meets_target"] == (one <= r["target"] == 1.3)
    # Only the two steps' programs at rows 1 and 8 (and what a runner always has: one
    # EXTEND bucket, two page-table widths on XLA's attention; samplers; slot init).
    assert sorted(r["runner"]["compile_s"]) == [
        "decode/te0_be0_bd1_np8", "decode/te0_be0_bd8_np8", "extend/te16_be1_bd0_np0",
        "extend/te16_be1_bd0_np8", "init_slot/N128", "sample/B1", "sample/B8",
        "target_verify/bd1_k4_np8", "target_verify/bd8_k4_np8"]
    # The GPU default layout, every step compiled at start-up.
    assert r["runner"]["per_layer_weights"] and r["runner"]["fuse_projections"]
    assert r["compiles_after_warmup"] == 0


def test_a_section_over_its_budget_is_killed_and_the_suite_goes_on(tmp_path):
    """The kernels section cannot finish in the suite's 12 s: it is killed at the limit
    and recorded as a timeout with its log; the tbo section after it gets no time and is
    recorded as skipped; the summary is written and the suite exits cleanly."""
    summary, stdout = _suite(tmp_path, "--sections=kernels,tbo", "--total_budget_s=12",
                             timeout=300)
    kernels, tbo = summary["sections"]["kernels"], summary["sections"]["tbo"]
    assert kernels["status"] == "timeout" and "budget" in kernels["error"], kernels
    assert "log_tail" in kernels and "gpu_suite: kernels: timeout" in stdout
    assert tbo["status"] == "skipped" and "no time left" in tbo["error"], tbo
