"""Two-batch overlap on NVIDIA GPUs (`make test-gpu`; needs 2+ GPUs): with the latency-
hiding scheduler the TBO runner turns on, the compiled layer loop runs each micro-batch's
expert-parallel all-to-all asynchronously (start/done pairs) with the other micro-batch's
compute scheduled between start and done. That is the overlap, shown in the program; no
timing on one CPU can show it (runtime/tbo_step.py, models/moe_overlap.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from models import moe_overlap, registry
from runtime.batch_builder import BucketShape
from runtime.config import CacheConfig
from runtime.forward_batch import ForwardMode
from runtime.kv_pool import init_kv_pool
from runtime.sharding import make_mesh
from runtime.tbo_step import compiler_options
from tests import hlo_graph
from tests.model_utils import SimpleRow, make_batch

pytestmark = pytest.mark.gpu

CFG, PARAMS = registry.load_preset("tiny-moe")
# Ops that only rename or move a buffer's view: not compute that could hide a transfer.
_NOT_COMPUTE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "copy",
                "all-to-all-start", "all-to-all-done"}


def _compiled_tbo_text(ep: int) -> str:
    mesh = make_mesh(ep=ep)
    rows = [SimpleRow([3 + i], 20, list(range(1 + 6 * i, 7 + 6 * i))) for i in range(32)]
    batch = make_batch(ForwardMode.DECODE, [], rows, BucketShape(0, 0, 32, 8), 4)
    kv = init_kv_pool(CFG, CacheConfig(page_size=4, num_pages=256), jnp.bfloat16)
    params = jax.tree.map(lambda w: w.astype(jnp.bfloat16), PARAMS)

    def fwd(p, kv, a, b):
        return moe_overlap.forward(p, kv, (a, b), CFG, "xla", mesh)

    lowered = jax.jit(fwd).lower(params, kv, batch, batch)
    return lowered.compile(compiler_options=compiler_options("gpu")).as_text()


def test_all_to_all_pairs_have_the_other_micro_batch_compute_between():
    n = len(jax.devices())
    assert jax.default_backend() == "gpu" and n >= 2, f"needs 2+ GPUs, have {jax.devices()}"
    text = _compiled_tbo_text(ep=4 if n >= 4 else 2)
    comps = hlo_graph.parse(text)
    (body,) = [c for c, ins in comps.items()
               if any(i.opcode == "all-to-all-start" for i in ins.values())]
    order = list(comps[body])  # a scheduled module lists instructions in execution order

    def micro_batch(name: str) -> str | None:
        found = {mb for s in hlo_graph.scopes(comps, body, name)
                 for mb in moe_overlap.MICRO_BATCHES if f"{mb}/" in s}
        return found.pop() if len(found) == 1 else None

    overlapped = {mb: 0 for mb in moe_overlap.MICRO_BATCHES}
    pairs = 0
    for i, name in enumerate(order):
        ins = comps[body][name]
        if ins.opcode != "all-to-all-done":
            continue
        (start,) = ins.operands
        mb = micro_batch(start)
        between = order[order.index(start) + 1:i]
        other = [x for x in between if comps[body][x].opcode not in _NOT_COMPUTE
                 and micro_batch(x) not in (mb, None)]
        pairs += 1
        overlapped[mb] += bool(other)
    assert pairs >= 6, f"{pairs} async all-to-all pairs (want 3 per micro-batch)"
    assert all(overlapped.values()), (
        f"all-to-all pairs with the other micro-batch's compute inside: {overlapped}")
