"""Smoke tests of the benchmark scripts: each runs end to end on a tiny random model in a
subprocess (as a user would run it) and writes the JSON fields the docs and the lead read.
The numbers themselves mean nothing at these sizes."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from tests.cpu_isa import X12_MISSING

REPO = Path(__file__).resolve().parents[1]
HAVE_REFERENCE = all(importlib.util.find_spec(m) for m in ("torch", "transformers"))
HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def _run(script: str, out_dir: Path, *extra: str, png: bool = True,
         stem: str | None = None) -> dict:
    cmd = [sys.executable, str(REPO / "scripts" / "bench" / script), "--smoke",
           f"--out_dir={out_dir}", "--compilation_cache_dir=", *extra]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    name = (stem or script.removesuffix(".py")) + ".json"
    result = json.loads((out_dir / name).read_text())
    if HAVE_MATPLOTLIB and png:
        assert (out_dir / name.replace(".json", ".png")).stat().st_size > 0
    return result


# What the report says of 12-bit bf16, run or skipped.
X12_REPORT = ("### Offline throughput, bf16x12: skipped on this machine" if X12_MISSING else
              "### Offline throughput (tiny-random, bfloat16 weights in 12 bits (lossless), "
              "4 decode steps per program")


def _cpu_kernels_available() -> bool:
    import cpu_kernels
    return cpu_kernels.unavailable_reason() is None


def _positive(d: dict, *keys: str) -> None:
    for k in keys:
        assert d[k] > 0, (k, d[k])


def test_bench_one_batch_smoke(tmp_path: Path) -> None:
    r = _run("bench_one_batch.py", tmp_path, "--decode_buckets=4")
    assert r["script"] == "bench_one_batch" and "--smoke" in r["command"]
    # --decode_buckets: the one-row points run padded in the 4-row bucket
    assert {p["bucket"]["num_decode_seqs"] for p in r["points"] if p["decode_rows"]} == {4}
    _positive(r["roofline"], "matmul_gflops", "mem_read_gbps")
    # The compute ceiling is the faster of XLA's dot and the packed CPU kernel, both kept.
    for probe in r["roofline_probes"]:
        gemms = probe["matmul_probes"]
        assert set(gemms) == ({"xla_dot", "packed"} if _cpu_kernels_available() else {"xla_dot"})
        assert probe["matmul_gflops"] == max(gemms.values()) > 0
    assert len(r["machine"]["load_average"]) == 3
    assert r["model"]["params"] > r["model"]["matmul_params"] > 0
    modes = {p["mode"] for p in r["points"]}
    assert modes == {"decode", "extend", "mixed"}
    for p in r["points"]:
        _positive(p, "median_s", "p90_s", "tokens_per_s", "gflop", "gbyte", "frac_compute",
                  "frac_memory", "frac_roofline")
        assert p["p90_s"] >= p["median_s"]
        assert p["bucket"]["num_decode_seqs"] >= p["decode_rows"]


def test_bench_moe_ops_smoke(tmp_path: Path) -> None:
    r = _run("bench_moe_ops.py", tmp_path)
    assert [(p["tokens"], p["ep"]) for p in r["points"]] == [(8, 1), (8, 4)]
    for p in r["points"]:
        for stage in ("dispatch", "exchange", "experts", "combine", "layer"):
            _positive(p["stages"][stage], "median_s")
        # no dropping: each rank can receive every pair its peers' tokens could send
        assert p["stages"]["buffer_pairs_per_rank"] == 8 // p["ep"] * min(2, 8 // p["ep"]) * p["ep"]


def test_bench_offline_smoke(tmp_path: Path) -> None:
    """f32, and bf16 in the same rounds as `make bench` runs it: each dtype gets its own
    file, with transformers in that dtype and a single-stream bound of its weight bytes."""
    bf16 = _run("bench_offline.py", tmp_path, "--dtype=float32", "--also_dtypes=bfloat16",
                "--single_repeats=2", stem="bench_offline_bf16")
    r = json.loads((tmp_path / "bench_offline.json").read_text())
    assert r["script"] == "bench_offline" and r["tag"] == "" and bf16["tag"] == "bf16"
    assert (r["model"]["dtype"], bf16["model"]["dtype"]) == ("float32", "bfloat16")
    assert 2 * bf16["model"]["weight_bytes"] == r["model"]["weight_bytes"]
    assert bf16["rounds"][0]["roofline"] == r["rounds"][0]["roofline"]  # one run
    if HAVE_REFERENCE:
        assert (r["transformers_dtype"], bf16["transformers_dtype"]) == ("float32",
                                                                         "bfloat16")
        assert bf16["summary"]["ratios"]["single_stream_vs_hf"] > 0
    s = r["summary"]
    _positive(s, "xlaserve_output_tok_s", "xlaserve_total_tok_s",
              "xlaserve_single_decode_tok_s", "throughput_frac_compute", "matmul_gflops")
    x = r["rounds"][0]["xlaserve"]
    w = r["workload"]
    assert x["throughput"]["output_tokens"] == w["num_prompts"] * w["output_len"]
    assert x["single"]["new_tokens"] == w["single_new_tokens"]
    # The smoke run has no 32- or 64-way point, so of the f32 bound goals only the
    # single stream's share of its bandwidth bound applies; it runs transformers at batch
    # 2 and 4, which have no target (8 and 32 do).
    assert set(s["targets"]) == {"single_stream_vs_hf", "throughput_frac_compute",
                                 "single_frac_bandwidth"}
    # --single_repeats=2: f32, bf16, then bf16, f32, a read probe between neighbours.
    single, single_bf16 = x["single"], bf16["rounds"][0]["xlaserve"]["single"]
    a, b = single["runs"], single_bf16["runs"]
    assert len(a) == len(b) == 2
    probes = [a[0]["read_gbps_around"], b[0]["read_gbps_around"],
              b[1]["read_gbps_around"], a[1]["read_gbps_around"]]
    assert all(len(p) == 2 and min(p) > 0 for p in probes)
    assert all(p[1] == q[0] for p, q in zip(probes, probes[1:], strict=False))  # shared
    assert single["decode_tok_s"] == pytest.approx(
        (a[0]["decode_tok_s"] + a[1]["decode_tok_s"]) / 2)
    fracs = [run["decode_tok_s"] * r["model"]["weight_bytes"]
             / (max(run["read_gbps_around"]) * 1e9) for run in a]
    assert s["targets"]["single_frac_bandwidth"]["value"] == pytest.approx(sum(fracs) / 2)
    assert s["targets"]["single_frac_bandwidth"]["value_best"] == pytest.approx(max(fracs))
    assert s["single_frac_best_probe"] == pytest.approx(
        single["decode_tok_s"] * r["model"]["weight_bytes"] / (s["mem_read_gbps"] * 1e9))
    for v in r["rounds"][0].get("llama_server", {}).values():
        assert len(v["single"]["runs"]) == 2
    if HAVE_REFERENCE:
        hf = r["rounds"][0]["transformers"]
        for b in w["hf_batch_sizes"]:
            assert hf[f"batch_{b}"]["output_tokens"] == w["num_prompts"] * w["output_len"]
        assert hf["single"]["new_tokens"] == w["single_new_tokens"]
        assert s["ratios"]["single_stream_vs_hf"] > 0


def test_bf16_runs_carry_issue_17s_targets() -> None:
    """A bf16 run with both llama-server files is held to bf16's goals: its single
    stream against Q4_1's (1x) and 32-way against F32 at 2.5x instead of f32's 2x;
    an f32 run of the same numbers keeps f32's."""
    sys.path.insert(0, str(REPO / "scripts" / "bench"))
    import offline_summary

    def point(tok_s: float) -> dict:
        return {"output_tok_s": tok_s, "total_tok_s": 2 * tok_s, "frac_compute": 0.5}

    def peer(single: float, c32: float) -> dict:
        return {"c1": point(single), "c32": point(c32), "single": {"decode_tok_s": single},
                "prefill": {"prefill_tok_s": 100.0}}

    rnd = {"roofline": {"matmul_gflops": 100.0, "mem_read_gbps": 20.0},
           "xlaserve": {"throughput": {**point(400.0), "gflops": 50.0},
                        "single": {"decode_tok_s": 50.0, "ttft_s": 0.1,
                                   "read_gbps_around": [20.0, 20.0]},
                        "prefill": {"prefill_tok_s": 900.0}, "c1": point(50.0),
                        "c32": point(400.0)},
           "llama_server": {"f32": peer(25.0, 100.0), "q4_1": peer(60.0, 70.0)}}
    w = types.SimpleNamespace(concurrency=(1, 32), hf_batch_sizes=())
    bf16 = offline_summary.summarize([rnd], w, False, 10**8, "bfloat16")["targets"]
    assert bf16["c32_vs_llama_f32"] == {"target": 2.5, "value": 4.0, "value_best": 4.0,
                                        "met": True}
    q4 = bf16["single_stream_vs_llama_q4_1"]
    assert q4["target"] == 1.0 and q4["value"] == pytest.approx(50 / 60) and not q4["met"]
    f32 = offline_summary.summarize([rnd], w, False, 10**8, "float32")["targets"]
    assert f32["c32_vs_llama_f32"]["target"] == 2.0
    assert "single_stream_vs_llama_q4_1" not in f32


def test_c64_goal_is_against_the_runs_best_probe() -> None:
    """A round whose probe ran in a slow spell (100 GFLOP/s against the run's 200) must not
    flatter its 64-way fraction: each round's GFLOP/s go against the best probe."""
    sys.path.insert(0, str(REPO / "scripts" / "bench"))
    import offline_summary

    rounds = [{"roofline": {"matmul_gflops": g}, "xlaserve": {"c64": {"frac_compute": f}}}
              for g, f in ((200.0, 0.5), (100.0, 1.2))]
    values, best = offline_summary._bound_goals(
        rounds, {"matmul_gflops": 200.0, "mem_read_gbps": 24.0}, weight_bytes=1)
    assert values["c64_frac_compute"] == pytest.approx(0.55)
    assert best["c64_frac_compute"] == pytest.approx(0.6)


def test_bench_dtypes_smoke(tmp_path: Path) -> None:
    """f32, bf16 and int8 side by side on the tiny model (the llama-server peers need `make
    peers`; the smoke run leaves them out): every contender's single stream, bracketed by
    read probes, and its throughput; int8 reads about a quarter of f32's weight bytes."""
    r = _run("bench_dtypes.py", tmp_path, png=False)
    assert r["workload"]["repeats"] == 1 and r["llama_server"] == {}
    names = ["xlaserve float32:float32", "xlaserve bfloat16:bfloat16",
             "xlaserve float32:float32:int8"]
    assert list(r["summary"]["contenders"]) == names
    nbytes = [r["summary"]["contenders"][n]["bytes_per_token"] for n in names]
    assert nbytes[0] / 2.2 < nbytes[1] < nbytes[0] / 1.8 and nbytes[2] < nbytes[0] / 3
    # two passes of single streams, interleaved: f32, bf16, int8, then int8, bf16, f32
    a, b, c = (r["rounds"][0][n]["single"]["runs"] for n in names)
    probes = [a[0]["read_gbps_around"], b[0]["read_gbps_around"], c[0]["read_gbps_around"],
              c[1]["read_gbps_around"], b[1]["read_gbps_around"], a[1]["read_gbps_around"]]
    assert all(len(p) == 2 and min(p) > 0 for p in probes)
    assert all(p[1] == q[0] for p, q in zip(probes, probes[1:], strict=False))
    for name in names:
        run = r["rounds"][0][name]
        assert run["single"]["new_tokens"] == r["workload"]["single_new_tokens"]
        assert run["throughput"]["output_tokens"] == 4 * r["workload"]["output_len"]
        c = r["summary"]["contenders"][name]
        _positive(c, "single_decode_tok_s", "share_of_bandwidth_bound",
                  "share_of_bound_probed_around")


def test_single_stream_goal_is_against_the_probes_around_it() -> None:
    """The single stream's share of its bandwidth bound uses the higher of the read probes
    taken just before and after it in its round, not a probe from another minute."""
    sys.path.insert(0, str(REPO / "scripts" / "bench"))
    import offline_summary

    # weight_bytes 1e9: tok/s x 1 GB = GB/s read
    rounds = [{"roofline": {"matmul_gflops": 200.0, "mem_read_gbps": g},
               "xlaserve": {"single": {"decode_tok_s": tok_s, "read_gbps_around": around}}}
              for g, tok_s, around in ((45.0, 27.0, [30.0, 28.0]), (29.0, 40.0, [44.0, 42.0]),
                                       (30.0, 20.0, [31.0, 32.0]))]
    summary = {"matmul_gflops": 200.0, "mem_read_gbps": 45.0}
    values, best = offline_summary._bound_goals(rounds, summary, weight_bytes=10**9)
    # rounds: 27 / 30, 40 / 44, 20 / 32
    assert values["single_frac_bandwidth"] == pytest.approx(0.9)
    assert best["single_frac_bandwidth"] == pytest.approx(40.0 / 44.0)
    assert summary["single_frac_best_probe"] == pytest.approx(27.0 / 45.0)  # median stream
    # bench_offline's records: the runs of a round, each against its own probes.
    runs = [{"decode_tok_s": 27.0, "read_gbps_around": [30.0, 28.0]},
            {"decode_tok_s": 40.0, "read_gbps_around": [44.0, 42.0]},
            {"decode_tok_s": 20.0, "read_gbps_around": [31.0, 32.0]}]
    rounds = [{"roofline": {"matmul_gflops": 200.0, "mem_read_gbps": 45.0},
               "xlaserve": {"single": {"decode_tok_s": 27.0, "runs": runs}}}]
    values, best = offline_summary._bound_goals(rounds, dict(summary), weight_bytes=10**9)
    assert values["single_frac_bandwidth"] == pytest.approx(0.9)
    assert best["single_frac_bandwidth"] == pytest.approx(40.0 / 44.0)


def test_bench_offline_reference_off(tmp_path: Path) -> None:
    """--reference=off runs xlaserve alone, whether or not torch is installed."""
    r = _run("bench_offline.py", tmp_path, "--reference=off")
    assert "transformers" not in r["rounds"][0]
    assert r["summary"]["ratios"] == {}
    assert r["summary"]["targets"]["single_stream_vs_hf"]["met"] is False


def test_bench_kernels_kv_write_smoke(tmp_path: Path) -> None:
    """The GPU kernel benchmark's kv_write section at tiny sizes in interpret mode. Its
    correctness, decode and prefill sections run in test_gpu_suite.py, at the same smoke
    size, as the GPU suite's kernels and attention sections."""
    out = tmp_path / "bench_kernels.json"
    cmd = [sys.executable, str(REPO / "scripts" / "bench" / "bench_kernels.py"), "--smoke",
           "--nosweep", "--models=smollm2", "--sections=kv_write", f"--out={out}"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["errors"] == [] and r["env"]["smoke"] and r["env"]["interpret"]
    assert r["kv_write"] and r["decode"] == r["prefill"] == r["correctness"] == []
    for w in r["kv_write"]:
        _positive(w, "pool_bytes", "tokens", "layers", "seconds")


FAKE = "{python} tests/fake_openai_server.py"
HAND_WRITTEN = "# Benchmarks\n\nHand-written analysis that must survive.\n"


def _script(name: str, *flags: str) -> None:
    cmd = [sys.executable, str(REPO / "scripts" / "bench" / name), *flags]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_make_bench_pipeline(tmp_path: Path) -> None:
    """`make bench` at a tiny size, llama-server and xlaserve's server played by the fake
    (no build needed): bench_offline's llama-server sweep, the serving sweep and frontier,
    the greedy check, then the page regenerated from their JSON between its markers."""
    r = _run("bench_offline.py", tmp_path, "--reference=off", "--llama_server=on",
             f"--llama_server_cmd={FAKE}", "--llama_variants=q4_1,f32",
             "--also_dtypes=bfloat16,int8,bf16x12", "--llama_concurrency=f32=4",
             "--xla_concurrency=int8=1", "--xla_concurrency=bf16x12=1",
             "--xla_steps=bf16x12=4", "--hf_dtypes=float32")
    w, rnd = r["workload"], r["rounds"][0]
    assert w["concurrency"] == [1, 4] and "--parallel" in r["llama_server"]["q4_1"]["argv"]
    for c in w["concurrency"]:
        for point in (rnd["xlaserve"][f"c{c}"], rnd["llama_server"]["q4_1"][f"c{c}"]):
            assert point["output_tokens"] == c * w["output_len"]
            _positive(point, "output_tok_s", "frac_compute")
        assert r["summary"]["ratios"][f"c{c}_vs_llama_q4_1"] > 0
    # The point at --num_prompts concurrent is xlaserve's throughput run, not a rerun.
    assert w["num_prompts"] == 4 and rnd["xlaserve"]["c4"]["wall_s"] == \
        rnd["xlaserve"]["throughput"]["wall_s"]
    # --llama_concurrency cut F32 to the 4-way point: no 1-way run, ratio or target.
    assert set(rnd["llama_server"]["f32"]) == {"c4", "single", "prefill"}
    assert "c1_vs_llama_f32" not in r["summary"]["ratios"]
    assert r["summary"]["ratios"]["c4_vs_llama_f32"] > 0
    assert rnd["llama_server"]["q4_1"]["single"]["new_tokens"] == w["single_new_tokens"]
    # --single_repeats' default: three runs each of the four single streams, interleaved
    for single in (rnd["xlaserve"]["single"], rnd["llama_server"]["q4_1"]["single"]):
        assert len(single["runs"]) == 3
    # make bench's bf16 engine, in the same rounds against the same llama-server runs
    bf16 = json.loads((tmp_path / "bench_offline_bf16.json").read_text())
    assert bf16["rounds"][0]["llama_server"] == rnd["llama_server"]
    assert "single_stream_vs_llama_q4_1" in bf16["summary"]["targets"]
    assert "single_stream_vs_llama_q4_1" not in r["summary"]["targets"]
    # --hf_dtypes=float32: transformers' targets stand for f32 (asked for; with
    # --reference=off, missed) and are no target of bf16's
    assert r["summary"]["targets"]["single_stream_vs_hf"]["met"] is False
    assert not [k for k in bf16["summary"]["targets"] if "hf" in k]
    # ... and the weight-only int8 one: its own bytes (a quarter of f32's, plus a scale a
    # column), held to the same single-stream bar; no transformers targets (none runs int8)
    int8 = json.loads((tmp_path / "bench_offline_int8.json").read_text())
    assert int8["tag"] == "int8" and int8["rounds"][0]["llama_server"] == rnd["llama_server"]
    assert (int8["model"]["dtype"], int8["model"]["weights"]) == ("float32", "int8")
    assert r["model"]["weight_bytes"] / 4 < int8["model"]["weight_bytes"] < \
        r["model"]["weight_bytes"] / 3
    assert "single_stream_vs_llama_q4_1" in int8["summary"]["targets"]
    assert not [k for k in int8["summary"]["targets"] if "hf" in k]
    assert int8["transformers_dtype"] is None
    # --xla_concurrency cut int8's sweep to the 1-way point; its 4-request throughput run
    # (the 4-way point of the others) still ran, and no ratio stands on a point not run
    x8 = int8["rounds"][0]["xlaserve"]
    assert "c1" in x8 and "c4" not in x8 and x8["throughput"]["output_tok_s"] > 0
    assert "c1_vs_llama_q4_1" in int8["summary"]["ratios"]
    assert not [k for k in int8["summary"]["ratios"] if k.startswith("c4_")]
    # ... and bf16 in 12 bits (--compress_weights): the bf16 model in about 3/4 of its
    # bytes (tables, exception lists), held to bf16's targets, no transformers of its own;
    # where the CPU lacks AVX-512BW, skipped with the reason, and the report says so
    x12 = json.loads((tmp_path / "bench_offline_bf16x12.json").read_text())
    assert x12["tag"] == "bf16x12"
    if X12_MISSING:
        assert x12["skipped"] == X12_MISSING and "rounds" not in x12
        assert r["skipped_formats"] == bf16["skipped_formats"] == {"bf16x12": X12_MISSING}
    else:
        assert x12["engine_args"]["compress_weights"] and r["skipped_formats"] == {}
        assert (x12["model"]["dtype"], x12["model"]["weights"]) == ("bfloat16", "bf16x12")
        assert 0.7 < x12["model"]["weight_bytes"] / bf16["model"]["weight_bytes"] < 0.85
        assert {"single_stream_vs_llama_q4_1", "c32_vs_llama_f32"} & \
            set(x12["summary"]["targets"])
        assert x12["transformers_dtype"] is None and "c4" not in x12["rounds"][0]["xlaserve"]
        # --xla_steps: 12-bit bf16 decodes 4 steps a program (--num_scheduler_steps)
        assert x12["engine_args"]["num_scheduler_steps"] == 4
    # ... the rest one step a program
    assert bf16["engine_args"]["num_scheduler_steps"] == 1
    assert r["engine_args"]["num_scheduler_steps"] == 1
    serving = ["--smoke", f"--out_dir={tmp_path}", f"--xlaserve_cmd={FAKE}",
               f"--llama_server_cmd={FAKE}"]
    _script("bench_serving.py", *serving, "--tag=sweep", "--config=default=",
            "--peers=q4_1", "--scenarios=concurrent,poisson")
    _script("bench_serving.py", *serving, "--tag=frontier", "--config=a=", "--config=b=")
    _script("check_llama_peer.py", f"--out_dir={tmp_path}", f"--xlaserve_cmd={FAKE}",
            f"--llama_server_cmd={FAKE}", "--variants=q4_1,bf16", "--max_tokens=5")
    check = json.loads((tmp_path / "check_llama_peer.json").read_text())
    for v, dtype in (("q4_1", "float32"), ("bf16", "bfloat16")):
        rows = check["variants"][v]["prompts"]
        assert len(rows) == 4 and all(x["agree_tokens"] == x["tokens"] == 5 for x in rows)
        # each variant against xlaserve in its own dtype
        assert check["variants"][v]["xlaserve_dtype"] == dtype
        assert f"--dtype={dtype}" in check["xlaserve"][dtype]["argv"]
    assert check["variants"]["bf16"]["argv"][check["variants"]["bf16"]["argv"].index(
        "--model") + 1].endswith("-bf16.gguf")

    doc = tmp_path / "docs" / "benchmarks.md"
    doc.parent.mkdir()
    doc.write_text(HAND_WRITTEN)
    report = ["bench_report.py", f"--results_dir={tmp_path}", f"--doc={doc}"]
    _script(*report)
    first = doc.read_text()
    assert first.startswith(HAND_WRITTEN) and "<!-- END GENERATED -->" in first
    for needle in ("### Offline throughput (tiny-random, float32", "llama-server Q4_1 tok/s",
                   "### Offline throughput (tiny-random, bfloat16", "of the f32 matmul probe",
                   "### Offline throughput (tiny-random, int8 weights, float32 activations",
                   X12_REPORT,
                   "single_stream_vs_llama_q4_1", "### Serving",
                   "Poisson arrivals", "### Long prompts during decode", "| a |",
                   "### llama-server serves the same model", "| bf16 | bfloat16 |", "5/5",
                   "llama-server F32 ran at 4 concurrent only", "the median of 3 run(s)",
                   "xlaserve ran at 1 concurrent only (`--xla_concurrency`)"):
        assert needle in first, needle
    assert "not in" not in first  # every JSON was found
    if HAVE_MATPLOTLIB:
        assert "](../bench_serving_frontier_frontier.png)" in first
        assert "](../bench_offline_bf16.png)" in first
        assert "](../bench_offline_int8.png)" in first
    _script(*report)  # idempotent: the section is replaced, not appended
    assert doc.read_text() == first


def test_llama_concurrency_specs() -> None:
    """--llama_concurrency: a point outside --concurrency, an unknown variant or a bad
    list is an error that names the flag; a good spec keeps --concurrency's order."""
    sys.path.insert(0, str(REPO / "scripts" / "bench"))
    import offline_peers

    variants, conc = ["q4_1", "f32"], (1, 8, 32)
    assert offline_peers.sweep_points(variants, conc, ["q4_1=32,1"]) == {
        "q4_1": (1, 32), "f32": (1, 8, 32)}
    for spec in ("q4_1=3", "q8_0=1", "q4_1=", "q4_1=x"):
        with pytest.raises(ValueError, match="--llama_concurrency"):
            offline_peers.sweep_points(variants, conc, [spec])
    # the same parsing names --xla_concurrency and xlaserve's weight formats for those
    formats = ["float32", "bfloat16", "int8"]
    assert offline_peers.sweep_points(formats, conc, ["int8=1,8"], "--xla_concurrency",
                                      "the weight formats")["int8"] == (1, 8)
    with pytest.raises(ValueError, match="--xla_concurrency=int4=1: .*the weight formats"):
        offline_peers.sweep_points(formats, conc, ["int4=1"], "--xla_concurrency",
                                   "the weight formats")


@pytest.mark.parametrize("flag", ["--llama_concurrency=q4_1=3", "--xla_concurrency=int8=3",
                                  "--hf_dtypes=int8", "--also_dtypes=int4",
                                  "--xla_steps=int4=2"])
def test_bench_offline_rejects_bad_flags(tmp_path: Path, flag: str) -> None:
    """A bad sweep spec, a transformers format it has not, or an unknown weight format is a
    usage error naming the flag at once, before anything is written."""
    cmd = [sys.executable, str(REPO / "scripts" / "bench" / "bench_offline.py"), "--smoke",
           f"--out_dir={tmp_path}", "--reference=off", flag]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and flag.split("=")[0] in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "bench_offline.json").exists()


def test_bench_offline_missing_llama_server_says_make_peers(tmp_path: Path) -> None:
    cmd = [sys.executable, str(REPO / "scripts" / "bench" / "bench_offline.py"), "--smoke",
           f"--out_dir={tmp_path}", "--compilation_cache_dir=", "--reference=off",
           "--llama_server=on"]
    env = {**os.environ, "HOME": str(tmp_path)}  # no ~/.cache/xlaserve/peers there
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode != 0
    assert "llama-server not found" in proc.stderr and "make peers" in proc.stderr


def test_bench_cpu_matmul_smoke(tmp_path: Path) -> None:
    r = _run("bench_cpu_matmul.py", tmp_path)
    assert r["shapes"]["qkv"] == [64, 128] and r["shapes"]["lm_head"] == [64, 256]
    got = {(x["op"], x["rows"], x["contender"]) for x in r["records"]}
    # By default: f32, int8, every bf16 kernel this CPU runs (widening is plain "bf16") and
    # every 12-bit one (widening is plain "x12").
    import cpu_kernels
    contenders = {"f32", "int8", "bf16", *(f"bf16_{n}" for n in cpu_kernels.bf16_targets()
                                           if n != "widen"),
                  *("x12" if n == "widen" else f"x12_{n}" for n in cpu_kernels.x12_targets())}
    assert got == {(op, m, c) for op in ("qkv", "wo", "gate_up", "down", "lm_head")
                   for m in (1, 32) for c in contenders}
    for x in r["records"]:
        _positive(x, "median_us", "weight_gb_s", "gflop_s")
        # GB/s is the weights' bytes (1, 1.5, 2 or 4 a weight) over the time
        itemsize = {"f32": 4, "int8": 1}.get(x["contender"],
                                             1.5 if x["contender"].startswith("x12") else 2)
        assert x["weight_gb_s"] == pytest.approx(
            int(x["k"] * x["n"] * itemsize) / x["median_us"] / 1e3)


def test_bench_cpu_matmul_torch_peer(tmp_path: Path) -> None:
    """PyTorch's linear (oneDNN) on the same shapes, side by side, where torch is installed
    (the `reference` extra); without it, asking for it is a usage error naming the extra."""
    flags = ["--ops=gate_up", "--rows=4", "--contenders=bf16,torch_f32,torch_bf16"]
    if importlib.util.find_spec("torch") is None:
        cmd = [sys.executable, str(REPO / "scripts" / "bench" / "bench_cpu_matmul.py"), "--smoke",
               f"--out_dir={tmp_path}", *flags]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
        assert proc.returncode != 0 and ".[reference]" in proc.stderr
        return
    r = _run("bench_cpu_matmul.py", tmp_path, *flags)
    got = {x["contender"]: x for x in r["records"]}
    assert set(got) == {"bf16", "torch_f32", "torch_bf16"}
    assert got["torch_f32"]["weight_gb_s"] > 0
    # The same shape and bytes per weight: the GB/s and GFLOP/s are comparable.
    assert got["torch_bf16"]["median_us"] * got["torch_bf16"]["weight_gb_s"] == \
        pytest.approx(got["bf16"]["median_us"] * got["bf16"]["weight_gb_s"])
    for x in r["records"]:
        _positive(x, "median_us", "weight_gb_s", "gflop_s")


def test_bench_cpu_attention_smoke(tmp_path: Path) -> None:
    r = _run("bench_cpu_attention.py", tmp_path)
    assert r["shape"] == {"layers": 2, "heads": 4, "kv_heads": 2, "head_dim": 64,
                          "page_size": 16}
    got = {(x["mode"], x.get("rows"), x.get("context"), x.get("tokens"), x["kv_dtype"])
           for x in r["records"]}
    assert got == {(m, *p, d) for d in ("float32", "bfloat16")
                   for m, p in (("decode", (2, 40, None)), ("extend", (None, None, 70)))}
    for x in r["records"]:
        _positive(x, "median_ms", "kv_gb_s" if x["mode"] == "decode" else "gflop_s")


def test_bench_multi_step_smoke(tmp_path: Path) -> None:
    """scripts/bench/bench_multi_step.py at a tiny size: an engine per --steps value, alternating
    rounds, the same greedy tokens on each, ratios against the first."""
    r = _run("bench_multi_step.py", tmp_path, "--steps=1,4", "--rounds=2", png=False)
    assert r["steps"] == [1, 4] and len(r["rounds"]) == 2 and r["concurrency"] == 4
    s = r["summary"]
    assert s["K4_same_tokens"] and s["K1_same_tokens"] and s["K1_single_vs_K1"] == 1.0
    for k in ("K1_single_decode_tok_s", "K4_single_decode_tok_s", "K4_c4_output_tok_s",
              "K4_single_vs_K1", "K4_c4_vs_K1"):
        assert s[k] > 0, k
    assert r["rounds"][0]["4"]["single"]["new_tokens"] == r["new_tokens"] == 8


def test_bare_step_batches_and_their_ratio() -> None:
    """bench_common's bare steps (bench_spec.py, bench_verify_step.py): one row per token
    list on `context` cached tokens, each its own slot and pages that cover what it writes,
    no page shared (page 0 is the pool's padding page); only one-token rows sample; the
    verify / decode ratio is of the medians."""
    sys.path.insert(0, str(REPO / "scripts" / "bench"))
    import bench_common as bc

    from models.forward_mode import ForwardMode

    batch = bc.bare_batch(ForwardMode.TARGET_VERIFY, [[7, 8, 9, 10, 11]] * 3, 30, 16)
    rows = batch.decode_rows
    assert batch.mode is ForwardMode.TARGET_VERIFY and batch.extend_rows == []
    assert [r.req.req_slot for r in rows] == [0, 1, 2]
    assert all(r.start_pos == 30 and len(r.req.prompt_ids) == 30 for r in rows)
    assert all(r.input_ids == [7, 8, 9, 10, 11] and not r.sample for r in rows)
    pages = [p for r in rows for p in r.pages]
    assert all(len(r.pages) == 3 for r in rows)  # 35 tokens in 16-token pages
    assert sorted(pages) == pages == list(range(1, 10))
    (decode,) = bc.bare_batch(ForwardMode.DECODE, [[5]], 32, 16).decode_rows
    assert decode.sample and decode.pages == [1, 2, 3] and decode.start_pos == 32
    rec = bc.verify_vs_decode([0.010, 0.030, 0.020], [0.025, 0.012, 0.100])
    assert rec == pytest.approx({"decode_ms": 20.0, "verify_ms": 25.0, "ratio": 1.25})


def test_bench_spec_smoke(tmp_path: Path) -> None:
    """scripts/bench/bench_spec.py at a tiny size: plain and prompt lookup alternately on one
    runner, both prompt sets, the same greedy tokens, acceptance reported; bare decode and
    verify steps timed at 1 and 4 rows."""
    r = _run("bench_spec.py", tmp_path, "--rounds=2", "--streams=4", "--step_rounds=2",
             png=False)
    for rows in ("rows_1", "rows_4"):
        step = r["bare_steps"][rows]
        assert step["decode_ms"] > 0 and step["verify_ms"] > 0, step
    assert set(r["results"]) == {"copy_heavy", "chat"}
    for res in r["results"].values():
        s = res["summary"]
        assert s["same_tokens_single"] and s["same_tokens_streams"]
        for k in ("single_plain_tok_s", "single_ngram_tok_s", "streams_plain_tok_s",
                  "streams_ngram_tok_s"):
            assert s[k] > 0, k
        assert len(res["rounds"]) == 2
    assert r["results"]["copy_heavy"]["summary"]["single_accept_length"] > 1
