"""The start-up matrix's mesh rows (tests/startup_matrix.py: tp, dp, ep, two-batch overlap)
compiled for eight compile-only H100s (a 1x1x8 topology; each mesh takes its first
dp x tp x ep of them): every program each row's runner warms up compiles with XLA's GPU
compiler, so a shard_map or sharding error on the GPU path shows on a CPU-only machine.

The runner is the one the row's Engine builds (RunnerSetup.from_args), its weights, KV pool
and slot state abstract and placed by runtime/sharding.py's rules (scripts/bench/
gpu_programs.py), in bf16 as a GPU serves. Needs jax's CUDA plugin (`make gpu-aot`'s venv);
without it every row skips and says so. Rows the CPU matrix refuses are start-up errors
there, before any program exists, so they are not repeated here.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "bench"))
import gpu_programs  # noqa: E402

from tests.startup_matrix import BASE, DENSE, MOE, ROWS, Row  # noqa: E402

_MISSING = gpu_programs.gpu_plugin_missing()
MESH_ROWS = [r for r in ROWS if r.refused is None and any(
    r.overrides.get(axis, 1) > 1 for axis in ("dp", "tp", "ep"))]


def _runner(row: Row, tgt: gpu_programs.Target):
    from runtime.config import ServerArgs
    from runtime.engine_setup import RunnerSetup

    cfg = {"dense": DENSE, "moe": MOE}[row.model]
    args = ServerArgs(**{**BASE, **row.overrides})
    if args.attention_backend == "pallas":
        # The Mosaic GPU kernels take head_dim in multiples of 32 bytes (the toy model's 8
        # is refused at trace time); 64 keeps its head layout (9 / 3 heads under tp=3).
        cfg = dataclasses.replace(cfg, head_dim=64)
    setup = RunnerSetup.from_args(args, cfg)
    # The dtype a GPU defaults to (this process's backend is the CPU's float32).
    rcfg = dataclasses.replace(setup.runner_cfg, dtype=args.dtype or "bfloat16")
    mesh = gpu_programs.runner_mesh(tgt, dp=setup.dp, tp=setup.tp, ep=setup.ep)
    return gpu_programs.abstract_runner(cfg, setup.cache, rcfg, setup.max_running_requests,
                                        mesh)


def test_mesh_rows_cover_every_mesh_kind():
    kinds = {k for r in MESH_ROWS for k in ("dp", "tp", "ep", "enable_two_batch_overlap")
             if r.overrides.get(k) is True or r.overrides.get(k, 1) is not True
             and r.overrides.get(k, 1) > 1}
    assert kinds == {"dp", "tp", "ep", "enable_two_batch_overlap"}, kinds


@pytest.mark.skipif(_MISSING is not None, reason=str(_MISSING))
@pytest.mark.parametrize("row", MESH_ROWS, ids=lambda r: r.name)
def test_mesh_row_compiles_for_eight_h100s(row: Row):
    from runtime.tbo_step import compiler_options

    tgt = gpu_programs.target("h100")
    runner = _runner(row, tgt)
    names, t0 = [], time.perf_counter()
    tbo = set(runner.paths["tbo"].names) if "tbo" in runner.paths else set()
    with gpu_programs.compiled_pallas():
        for name, lower in runner._lowerings():
            compiled = gpu_programs.compile_placed(
                lower, compiler_options("gpu") if name in tbo else None)
            assert compiled.as_text(), name
            names.append(name)
    assert not tbo or tbo <= set(names), (tbo, names)
    assert any(n.startswith("decode/") for n in names), names
    print(f"{row.name}: {len(names)} programs in {time.perf_counter() - t0:.1f} s")
