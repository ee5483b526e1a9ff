"""scripts/bench/bench_serving.py and its helpers: the load generator runs end to end (as a user
runs it, in a subprocess) against tests/fake_openai_server.py, which stands in for both
xlaserve and llama-server with a known timing (a prefill freezes decoding for
prefill_us_per_token per token), so what the scenarios report can be checked; the
statistics, workloads and the GGUF row permutation are checked directly."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts" / "bench"))

import serving_metrics as sm  # noqa: E402
import serving_workloads as wl  # noqa: E402
from bench_servers import parse_config  # noqa: E402
from serving_client import RequestResult, check_loopback  # noqa: E402

FAKE = "{python} tests/fake_openai_server.py"
ALL = "concurrent,poisson,shared_prefix,long_during_decode"


def _bench(out_dir: Path, *flags: str, ok: bool = True) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(REPO / "scripts" / "bench" / "bench_serving.py"), "--smoke",
           f"--out_dir={out_dir}", "--health_timeout_s=60", "--request_timeout_s=60", *flags]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240)
    if ok:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _scenarios(t: dict) -> dict:
    return t["scenarios"]


def test_frontier_and_peer_side_by_side(tmp_path: Path) -> None:
    """Two launched 'xlaserve' configs (a slow and a fast prefill) and a launched
    'llama-server': every scenario's JSON, the freeze seen during the long prefill, the
    slow config's longer TTFT, the plots and the server logs."""
    # 10 ms steps: the running streams' 200 tokens outlast the long prompts.
    _bench(tmp_path, f"--xlaserve_cmd={FAKE} --itl_ms=10",
           "--config=slow=--prefill_us_per_token=3000",
           "--config=fast=--prefill_us_per_token=100", "--peers=q4_1",
           f"--llama_server_cmd={FAKE} --itl_ms=10", f"--scenarios={ALL}")
    r = json.loads((tmp_path / "bench_serving.json").read_text())
    assert r["script"] == "bench_serving" and "--smoke" in r["command"]
    assert len(r["git_revision"]) >= 40 and r["machine"]["cpu_count"] > 0
    names = [t["name"] for t in r["targets"]]
    assert names == ["slow", "fast", "llama-server Q4_1"]
    llama = r["targets"][2]
    assert "--parallel" in llama["argv"] and llama["kind"] == "llama-server"
    for t in r["targets"]:
        assert (tmp_path / t["log"]).exists() and t["startup_s"] > 0
        sc = _scenarios(t)
        for point in sc["concurrent"] + sc["poisson"] + [sc["shared_prefix"]]:
            assert point["completed"] == point["requests"] > 0, point["errors"]
            assert point["ttft_ms"]["p50"] <= point["ttft_ms"]["p99"] <= point["ttft_ms"]["max"]
            assert point["itl_ms"]["n"] > 0 and point["output_tok_s"] > 0
        assert [p["concurrency"] for p in sc["concurrent"]] == [1, 4]
        assert sc["concurrent"][1]["output_tokens"] == 4 * r["load"]["output_len"]
        assert sc["poisson"][-1]["request_rate"] == "inf"
        ldd = sc["long_during_decode"]
        assert ldd["long_completed"] == ldd["long"] == 2 and ldd["running_failed"] == 0
        assert ldd["running_decoding_through_window"] == ldd["running"]
        running = [q for q in ldd["requests"] if q["tag"] == "running"]
        assert all(q["cancelled"] for q in running)  # stopped once the long ones finished
    slow, fast = (_scenarios(t)["long_during_decode"] for t in r["targets"][:2])
    # 2 x 96 tokens at 3 ms each freeze the streams for ~0.58 s; at 0.1 ms for ~19 ms.
    assert slow["during_prefill_itl_ms"]["max"] > 250 > slow["steady_itl_ms"]["p50"]
    assert slow["long_ttft_ms"]["max"] > fast["long_ttft_ms"]["max"] + 200
    for png in ("frontier", "timeline", "poisson", "concurrent"):
        assert (tmp_path / f"bench_serving_{png}.png").stat().st_size > 0


@pytest.fixture
def fake_server(tmp_path: Path):
    from bench_servers import Target, running
    argv = (sys.executable, "tests/fake_openai_server.py", "--port={port}")
    with running(Target("fake", "fake", argv), tmp_path, 60) as srv:
        yield srv.base_url


def test_generate_backend_against_running_server(tmp_path: Path, fake_server: str) -> None:
    _bench(tmp_path, f"--base_url={fake_server}", "--backend=generate",
           "--scenarios=concurrent,poisson", "--tag=gen")
    r = json.loads((tmp_path / "bench_serving_gen.json").read_text())
    (t,) = r["targets"]
    assert t["kind"] == "url" and r["backend"] == "generate"
    for p in _scenarios(t)["concurrent"]:
        assert p["output_tokens"] == p["concurrency"] * r["load"]["output_len"]
        assert p["itl_ms"]["n"] == p["concurrency"] * (r["load"]["output_len"] - 1)


def test_only_loopback_targets(tmp_path: Path) -> None:
    proc = _bench(tmp_path, "--base_url=http://192.0.2.1:30000", ok=False)
    assert proc.returncode != 0 and "only loopback hosts" in proc.stderr
    assert check_loopback("http://127.0.0.1:1/") == "http://127.0.0.1:1"


def test_against_xlaserve(tmp_path: Path) -> None:
    """The real server (tiny random model, the SmolLM2 tokenizer) over both protocols: the
    load generator parses what xlaserve streams and every request makes its tokens."""
    from tests.test_server import LiveServer, tiny_engine
    with LiveServer(tiny_engine, api_key=None) as srv:
        srv.wait_ready()
        for backend in ("openai", "generate"):
            _bench(tmp_path, f"--base_url={srv.url}", f"--backend={backend}",
                   "--scenarios=concurrent,long_during_decode", f"--tag={backend}")
            r = json.loads((tmp_path / f"bench_serving_{backend}.json").read_text())
            sc = _scenarios(r["targets"][0])
            for p in sc["concurrent"]:
                assert p["completed"] == p["requests"] == p["concurrency"], p["errors"]
                assert p["output_tokens"] == p["concurrency"] * r["load"]["output_len"]
            ldd = sc["long_during_decode"]
            assert ldd["long_completed"] == 2 and ldd["running_failed"] == 0
            assert ldd["steady_itl_ms"]["n"] > 0 and ldd["long_ttft_ms"]["n"] == 2


def _result(send: float, chunks: list[float], tag: str = "running") -> RequestResult:
    return RequestResult(tag, 8, len(chunks), send, chunks, len(chunks), ok=True)


def test_long_during_decode_windows() -> None:
    """Steady gaps are those inside [steady_from, window_start]; a gap overlapping the
    prefill window (the freeze) counts as during it."""
    run = _result(0.0, [1.0, 1.1, 1.2, 1.3, 2.3, 2.4])
    longs = [_result(1.25, [2.2], "long"), _result(1.25, [2.25], "long")]
    a = sm.long_during_decode([run], longs, steady_from=1.0, window_start=1.25)
    assert a["steady_itl_ms"]["n"] == 2 and a["steady_itl_ms"]["p50"] == pytest.approx(100)
    assert a["window_s"] == pytest.approx(1.0)
    assert a["during_prefill_itl_ms"]["max"] == pytest.approx(1000)
    assert a["long_ttft_ms"]["max"] == pytest.approx(1000)
    assert a["running_decoding_through_window"] == 1


def test_summary_and_goodput() -> None:
    fast = _result(0.0, [0.1, 0.2, 0.3])  # TTFT 100 ms, TPOT 100 ms
    slow = _result(0.0, [3.0, 3.1])  # TTFT 3 s: misses a 2 s SLO
    failed = RequestResult("x", 8, 4, 0.0, error="HTTP 500: boom")
    s = sm.summarize([fast, slow, failed], sm.duration([fast, slow]), sm.SLO(2000, 200))
    assert (s["completed"], s["failed"]) == (2, 1) and s["errors"] == ["HTTP 500: boom"]
    assert s["goodput_req_s"] == pytest.approx(1 / 3.1)
    assert s["output_tok_s"] == pytest.approx(5 / 3.1)
    assert s["ttft_ms"]["max"] == pytest.approx(3000) and s["itl_ms"]["n"] == 3


def test_workload_lengths_and_arrivals() -> None:
    rng = np.random.default_rng(0)
    r = wl.LengthSpec(100, 50, "random", range_ratio=0.5).sample(rng, 500)
    assert all(50 <= i <= 100 and 25 <= o <= 50 for i, o in r)
    g = wl.LengthSpec(200, 100, "sharegpt").sample(rng, 4000)
    ins = np.array([i for i, _ in g])
    assert 170 < ins.mean() < 230 and np.median(ins) < ins.mean()  # right-skewed
    offs = wl.poisson_offsets(rng, 2000, 10.0)
    assert np.all(np.diff(offs) >= 0) and 180 < offs[-1] < 220
    assert wl.poisson_offsets(rng, 3, float("inf")) == [0.0, 0.0, 0.0]
    sp = wl.shared_prefix_requests(rng, 3, 4, 16, 4, 8, 1000)
    by_group: dict[str, set] = {}
    for s in sp:
        by_group.setdefault(s.tag, set()).add(tuple(s.prompt[:16]))
    assert len(sp) == 12 and all(len(v) == 1 for v in by_group.values())
    assert isinstance(wl.make_prompt(rng, 5, "words", 1000), str)


def test_parse_config() -> None:
    assert parse_config("chunk=--chunked_prefill_size=128 --enable_mixed_chunk") == (
        "chunk", "--chunked_prefill_size=128 --enable_mixed_chunk")
    assert parse_config("--chunked_prefill_size=-1") == ("--chunked_prefill_size=-1",) * 2
    assert parse_config("default=") == ("default", "")


def test_permute_rows_is_llama_cpp_order() -> None:
    """llama_peer.permute_rows inverts the importer's unpermutation, and within a head it
    interleaves the two rope halves: HF rows [a0 a1 .. b0 b1 ..] -> [a0 b0 a1 b1 ..]."""
    from llama_peer import permute_rows

    from runtime.checkpoint import _unpermute_rows
    w = np.random.default_rng(0).normal(size=(3 * 8, 5)).astype(np.float32)
    np.testing.assert_array_equal(_unpermute_rows(permute_rows(w, 3), 3), w)
    rows = np.arange(8, dtype=np.float32)[:, None]  # one head, head_dim 8
    assert permute_rows(rows, 1)[:, 0].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]


def test_llama_server_skips_its_amx_repacking_on_amx_cpus(monkeypatch) -> None:
    """On an AMX CPU llama-server starts with --no-repack (its AMX buffers crashed at
    warm-up on one), recorded in the target's flags; elsewhere it runs as built."""
    import llama_peer

    for amx in (True, False):
        monkeypatch.setattr(llama_peer, "_has_amx", lambda amx=amx: amx)
        t = llama_peer.llama_target("q4_1", 4, 256, 2, "{python} fake.py", "/unused")
        assert ("--no-repack" in t.argv) == amx
        assert ("--no-repack" in t.flags) == amx
    t = llama_peer.llama_target("q4_1", 4, 256, 2, "{python} fake.py", "/unused",
                                extra="--no-repack")
    assert t.argv.count("--no-repack") == 1


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["f32", "bf16"])
def test_written_gguf_round_trip(tmp_path: Path, variant: str) -> None:
    """The F32 / BF16 GGUF written for llama-server, read back by xlaserve's GGUF importer,
    gives exactly the weights xlaserve serves in that dtype (every tensor rounded to bf16,
    nearest even, as restore_checkpoint's cast does; so only llama.cpp's reading of it can
    differ; check_llama_peer.py checks that), with the source's metadata."""
    import gguf
    import jax.numpy as jnp
    from llama_peer import write_gguf

    from runtime import checkpoint
    src = checkpoint.default_gguf_path()
    cfg, params = checkpoint.load_gguf(src)
    dst = write_gguf(src, params, cfg, tmp_path / f"{variant}.gguf", variant)
    cfg2, params2 = checkpoint.load_gguf(str(dst))
    assert cfg2 == cfg

    def served(arr: np.ndarray) -> np.ndarray:
        arr = jnp.asarray(arr, jnp.float32)
        return np.asarray(arr if variant == "f32" else arr.astype(jnp.bfloat16), np.float32)

    for key in ("embed", "final_norm"):
        np.testing.assert_array_equal(params2[key], served(params[key]), err_msg=key)
    for key, arr in params["layers"].items():
        np.testing.assert_array_equal(params2["layers"][key], served(arr), err_msg=key)
    reader = gguf.GGUFReader(str(dst))
    types = {gguf.GGMLQuantizationType.F32}
    if variant == "bf16":
        types.add(gguf.GGMLQuantizationType.BF16)
        vectors = {t.tensor_type for t in reader.tensors if len(t.shape) == 1}
        assert vectors == {gguf.GGMLQuantizationType.F32}
    assert {t.tensor_type for t in reader.tensors} == types
    assert "tokenizer.chat_template" in reader.fields


def test_llama_slots_follow_the_scenarios() -> None:
    """llama-server's slots and per-slot context are sized by the scenarios that run (a
    concurrent-only run must not reserve KV for the long prompts of another scenario)."""
    from bench_serving import Load
    load = Load(128, 128, 24, (8, 32), (2.0,), (16, 64, 2048, 4, 2048, 8, 4.0),
                (4, 8, 512, 32, 4.0))
    assert load.needs(["concurrent"], "random") == (32, 256)
    assert load.needs(["concurrent", "long_during_decode"], "random") == (32, 2112)
    assert load.needs(["poisson"], "sharegpt") == (24, 1024)
    assert load.needs(["shared_prefix"], "fixed") == (32, 672)
