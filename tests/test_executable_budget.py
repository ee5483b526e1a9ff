"""The executable plan: its count per mode, its budget check before any compilation, and
what warm-up measures of each executable it compiles."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import jax
import pytest

from models import llama
from models.forward_mode import ForwardMode
from runtime import executable_budget as eb
from runtime import model_runner
from runtime.compile_counter import compile_counter
from runtime.config import CacheConfig, RunnerConfig, ServerArgs
from runtime.model_runner import ModelRunner
from tests.model_utils import TINY

CFG = dataclasses.replace(TINY, max_position_embeddings=1024)
BASE = dict(decode_buckets=(1, 4, 16), extend_token_buckets=(64, 256), extend_seq_buckets=(1, 4),
            kv_len_buckets=(256, 1024), per_layer_weights=True)


def _runner(**kw) -> ModelRunner:
    rcfg = RunnerConfig(**{**BASE, **kw})
    return ModelRunner(CFG, llama.init_params(CFG, jax.random.key(0)),
                       CacheConfig(page_size=16, num_pages=64), rcfg, max_running_requests=16)


def _counts(r: ModelRunner) -> dict[str, int]:
    return {p.name: p.count for p in r.plan() if p.count or p.name == "MIXED"}


def test_plan_counts_follow_the_attention_backend():
    # (te, be) pairs: 64 x {1, 4}, 256 x {1, 4} = 4.
    cpu = _counts(_runner(attention_backend="cpu", cpu_matmul="packed"))
    # Decode walks the real context on every backend: one page-table width.
    assert cpu == {"DECODE": 3, "EXTEND": 4 * 2, "MIXED": 0, "sampler": 3}  # B 1, 4, 16
    xla = _counts(_runner(attention_backend="xla"))
    # The jnp extend's cost follows the table's width: fresh + one per kv_len bucket.
    assert xla == {"DECODE": 3, "EXTEND": 4 * 3, "MIXED": 0, "sampler": 3}
    mixed = _counts(_runner(attention_backend="cpu", cpu_matmul="packed", enable_mixed=True))
    # MIXED rows: be + bd in {1, 4} x {1, 4, 16} -> 2, 5, 17, 5, 8, 20; with 1, 4, 16: 8 sizes.
    assert mixed == {"DECODE": 3, "EXTEND": 8, "MIXED": 4 * 3, "sampler": 8}


def test_bucket_widths_match_the_plan():
    r = _runner(attention_backend="xla")
    keys = set(r.step_keys())
    for key in keys:
        assert key.shape.num_pages_per_seq in (0, 16, 64)
    decode = {k.shape.num_pages_per_seq for k in keys if k.mode is ForwardMode.DECODE}
    assert decode == {64}


def _tight(maps_left: int) -> eb.Footprint:
    return eb.Footprint(maps=1000, resident_mb=100.0, max_maps=1000 + 4096 + maps_left,
                        available_mb=1e6)


def test_check_budget_passes_a_plan_that_fits_and_names_the_multipliers_otherwise():
    parts = [eb.PlanPart("DECODE", 10, eb.ExecutableCost(100, 1.0), "10 decode_buckets"),
             eb.PlanPart("MIXED", 30, eb.ExecutableCost(100, 1.0), "--enable_mixed_chunk: 30")]
    assert eb.check_budget(parts, _tight(4000)).maps == 4000
    with pytest.raises(eb.ExecutableBudgetError) as e:
        eb.check_budget(parts, _tight(3999))
    msg = str(e.value)
    assert "40 executables" in msg and "4000 memory mappings" in msg
    assert "MIXED: 30 = --enable_mixed_chunk" in msg and "vm.max_map_count" in msg
    mem = eb.Footprint(maps=0, resident_mb=0.0, max_maps=1 << 30, available_mb=10.0)
    with pytest.raises(eb.ExecutableBudgetError, match="MB of memory"):
        eb.check_budget(parts, mem)


def test_warmup_refuses_an_over_budget_plan_before_compiling(monkeypatch):
    r = _runner(attention_backend="xla", enable_mixed=True)
    monkeypatch.setattr(model_runner, "footprint", lambda: _tight(500))
    before = compile_counter().count
    with pytest.raises(eb.ExecutableBudgetError, match="--enable_mixed_chunk"):
        r.warmup(progress=False)
    assert compile_counter().count == before
    assert r.exec_stats == [] and r.num_executables == 0


def test_warmup_measures_every_executable():
    r = _runner(attention_backend="xla", decode_buckets=(2,), extend_token_buckets=(64,),
                extend_seq_buckets=(1,), kv_len_buckets=(256,))
    r.warmup(progress=False)
    names = [s.name for s in r.exec_stats]
    # DECODE, EXTEND fresh + prefix, samplers for B = 1 and 2, one init_slot.
    assert len(names) == r.num_executables == 6
    assert sorted(n.split("/")[0] for n in names) == [
        "decode", "extend", "extend", "init_slot", "sample", "sample"]
    assert all(s.compile_s > 0 for s in r.exec_stats)
    fp = eb.footprint()
    assert fp.maps > 0 and fp.resident_mb > 0 and fp.max_maps > fp.maps


@pytest.mark.slow
def test_documented_flag_combinations_start_and_agree(tmp_path):
    """SmolLM2 at full size: every documented combination starts within the budget, the
    default leaves 75% of the mapping limit free, and all give the same greedy tokens.
    Through the user's persistent compilation cache: cold compiles of all three took over
    50 minutes on a shared 2-core box (cold figures: scripts/bench/startup_report.py, cache off)."""
    out = tmp_path / "startup.json"
    proc = subprocess.run([sys.executable, "scripts/bench/startup_report.py", f"--out={out}",
                           "--combos=default,mixed,multiplexing", "--generate=4",
                           f"--compilation_cache_dir={ServerArgs().compilation_cache_dir}"],
                          capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    combos = {c["combo"]: c for c in report["combos"]}
    assert report["same_tokens_as_first"] is True
    assert combos["default"]["maps_share_of_limit"] < 0.25
    assert all(c["compiles_after_warmup"] == 0 for c in combos.values())
    assert combos["mixed"]["per_kind"]["mixed"]["count"] > 0


def test_split_and_fused_programs_are_counted():
    r = _runner(attention_backend="cpu", cpu_matmul="packed", enable_split_prefill=True,
                multiplex_fused=True, split_min_tokens=256)
    counts = _counts(r)
    # Only the 256-token buckets split: 2 rows x 2 widths x sizes {1, 2, 3} of 3 layers,
    # + embed 256 + heads (256, 1), (256, 4); fused: 2 x 3 decode buckets x {1, 2}.
    assert counts["SPLIT_PREFILL"] == 2 * 2 * 3 + 1 + 2
    assert counts["FUSED"] == 2 * 3 * 2


def test_warmup_seeds_split_costs_at_an_even_depth():
    """Even depth: no one-layer interval is compiled, so the seeding must use the
    smallest compiled one (SmolLM2's 30 layers)."""
    cfg = dataclasses.replace(CFG, num_layers=4)
    rcfg = RunnerConfig(decode_buckets=(2,), extend_token_buckets=(64,), extend_seq_buckets=(1,),
                        kv_len_buckets=(256,), per_layer_weights=True, attention_backend="xla",
                        enable_split_prefill=True)
    r = ModelRunner(cfg, llama.init_params(cfg, jax.random.key(0)),
                    CacheConfig(page_size=16, num_pages=64), rcfg, max_running_requests=4)
    assert r.paths["split_prefill"].interval_sizes == [2, 4]
    r.warmup(progress=False)
    r.costs.close()  # drains the watcher: every seeded cost is in
    keys = r.costs.snapshot()
    assert any(k.startswith("decode/") for k in keys)
    shapes = r.paths["split_prefill"].programs.shapes
    assert sum(k.startswith("split_prefill/") for k in keys) == len(shapes)
