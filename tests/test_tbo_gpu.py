"""Two-batch overlap on NVIDIA GPUs (`make test-gpu`; needs 2+ GPUs): with the latency-
hiding scheduler the TBO runner turns on, the compiled layer loop runs each micro-batch's
expert-parallel all-to-all asynchronously (start/done pairs) with the other micro-batch's
compute scheduled between start and done. That is the overlap, shown in the program; no
timing on one CPU can show it (runtime/tbo_step.py, models/moe_overlap.py). The program
and its reading are scripts/bench/tbo_schedule.py's, which the GPU suite runs too."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import pytest

from runtime.sharding import make_mesh

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "bench"))
import tbo_schedule  # noqa: E402

pytestmark = pytest.mark.gpu


def test_all_to_all_pairs_have_the_other_micro_batch_compute_between():
    n = len(jax.devices())
    assert jax.default_backend() == "gpu" and n >= 2, f"needs 2+ GPUs, have {jax.devices()}"
    report = tbo_schedule.overlap_report(
        tbo_schedule.compiled_tbo_text(make_mesh(ep=4 if n >= 4 else 2)))
    assert report["async_pairs"] >= 6, f"{report} (want 3 async pairs per micro-batch)"
    assert all(report["overlapped_pairs"].values()), (
        f"all-to-all pairs with the other micro-batch's compute inside: {report}")
