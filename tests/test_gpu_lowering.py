"""The GPU suite's Llama-3-8B engine programs lower for CUDA from this CPU (abstract
shapes only: no 16 GB of weights here; the shape: scripts/bench/gpu_shapes.py). What
scripts/bench/bench_engine.py compiles on the GPU:
the forward of its DECODE and EXTEND buckets, a split-prefill layer interval and a fused
decode + interval program, all with the compiled Pallas kernels (Mosaic GPU in bf16).
Lowering is where Mosaic GPU and Triton reject what they cannot express, so a kernel or
shape the GPU would refuse fails here first. (The kernels alone at many shapes:
tests/test_pallas_attention.py.)"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from models import layers, llama
from models.forward_batch import ForwardBatch
from models.forward_mode import ForwardMode
from models.kv_pool import init_kv_pool
from pallas_kernels.ragged_paged_attention import paged_attention
from runtime.batch_builder import BucketShape
from runtime.config import CacheConfig
from runtime.fused_step import FusedExecutables
from runtime.split_prefill import SplitExecutables

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "bench"))
import gpu_shapes  # noqa: E402

CFG = gpu_shapes.LLAMA3_8B
PAGE = 16
NP = gpu_shapes.KV_LEN // PAGE  # the one page-table width of the suite's runners
sds = jax.ShapeDtypeStruct


@pytest.fixture(autouse=True)
def compiled_kernels(monkeypatch):
    """get_paged_attention_fn as on a GPU: "pallas" gives the compiled (not interpreted)
    kernels."""
    def pallas(backend: str):
        assert backend == "pallas"
        return functools.partial(paged_attention, interpret=False)

    monkeypatch.setattr(layers, "get_paged_attention_fn", pallas)


def _params() -> dict:
    return jax.tree.map(lambda s: sds(s, jnp.bfloat16), llama.param_shapes(CFG),
                        is_leaf=lambda x: isinstance(x, tuple))


def _kv():
    return jax.eval_shape(lambda: init_kv_pool(CFG, CacheConfig(page_size=PAGE,
                                                                 num_pages=8193),
                                               jnp.bfloat16))


def _arrays(s: BucketShape) -> dict:
    t, b = s.num_extend_tokens + s.num_decode_seqs, s.num_extend_seqs + s.num_decode_seqs
    shapes = dict(input_ids=(t,), positions=(t,), out_cache_loc=(t,),
                  page_table=(b, s.num_pages_per_seq), seq_lens=(b,), query_start=(b + 1,),
                  logits_indices=(b,))
    return {k: sds(v, jnp.int32) for k, v in shapes.items()}


def _cuda_text(lower: functools.partial) -> str:
    """A runner-style lowering (partial(jitted.lower, *args)) lowered for CUDA instead."""
    jitted = lower.func.__self__
    return jitted.trace(*lower.args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("mode,shape", [
    (ForwardMode.DECODE, BucketShape(0, 0, 128, NP)),
    (ForwardMode.EXTEND, BucketShape(2048, 16, 0, NP)),
])
def test_llama8b_forward_lowers_for_cuda(mode, shape):
    batch = ForwardBatch(**_arrays(shape), mode=mode, num_extend_tokens=shape.num_extend_tokens,
                         num_extend_seqs=shape.num_extend_seqs)
    fwd = functools.partial(llama.forward, cfg=CFG, attention_backend="pallas")
    text = jax.jit(fwd).trace(_params(), _kv(), batch).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


def test_llama8b_per_layer_weights_decode_lowers_for_cuda():
    """The GPU suite's per-layer throughput runner: the layers' own buffers behind a
    lax.switch (layers.unstack_layers) instead of slices of the stack."""
    shape = BucketShape(0, 0, 32, NP)
    batch = ForwardBatch(**_arrays(shape), mode=ForwardMode.DECODE, num_extend_tokens=0,
                         num_extend_seqs=0)
    params = jax.eval_shape(layers.unstack_layers, _params())
    assert len(params["layer_list"]) == CFG.num_layers
    fwd = functools.partial(llama.forward, cfg=CFG, attention_backend="pallas")
    text = jax.jit(fwd).trace(params, _kv(), batch).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text and "stablehlo.case" in text


def test_llama8b_split_interval_and_fused_step_lower_for_cuda():
    """The multiplexing programs of the ITL runner: a 4-layer interval of a 2048-token
    prefill, and the same interval fused with a 32-row decode step."""
    params, kv = _params(), _kv()
    split = SplitExecutables(CFG, "pallas", [BucketShape(2048, 1, 0, NP)], None)
    (interval,) = [lw for name, lw in split.lowerings(params, kv, _arrays, jnp.bfloat16)
                   if name.endswith("_k4")]
    assert "mosaic_gpu" in _cuda_text(interval)
    fused = FusedExecutables(CFG, "pallas", [BucketShape(2048, 1, 32, NP)], [4])
    (step,) = fused.lowerings(params, kv, sds((33,), jnp.int32), _arrays, jnp.bfloat16)
    assert "mosaic_gpu" in _cuda_text(step[1])


def test_llama8b_multi_step_decode_lowers_for_cuda():
    """A 4-step decode program of 32 rows (runtime/multi_step.py, --num_scheduler_steps):
    the forward with the Pallas kernels and the runner's sampler in one device loop."""
    import math
    from types import SimpleNamespace

    from runtime import sampling
    from runtime.batch_builder import input_layout
    from runtime.bucket_plan import StepKey
    from runtime.grammar import mask_width
    from runtime.multi_step import multi_step_fn
    from runtime.request import MAX_LOGIT_BIAS
    from runtime.runner_sampling import SamplingLaunch
    from runtime.slot_state import SlotState

    b, v = 32, CFG.vocab_size
    runner = SimpleNamespace(cfg=SimpleNamespace(max_top_logprobs=5), max_running=b,
                             model_cfg=CFG)
    key = StepKey(ForwardMode.DECODE, BucketShape(0, 0, b, NP))
    words = sampling.word_layout(b, mask_width(v), MAX_LOGIT_BIAS)
    program = multi_step_fn(
        key, 4, PAGE, functools.partial(llama.forward, cfg=CFG, attention_backend="pallas"),
        SamplingLaunch.sample_body(runner), 2 * b + words["step"][0])
    state = SlotState(last_tokens=sds((b + 1,), jnp.int32),
                      token_counts=sds((b + 1, v), jnp.int32),
                      prompt_mask=sds((b + 1, v), jnp.bool_))
    n = sum(math.prod(s) for _, s in input_layout(key.shape)) + b
    n_words = 2 * b + sampling.word_count(b, mask_width(v), MAX_LOGIT_BIAS)
    text = jax.jit(program).trace(_params(), _kv(), state, sds((n,), jnp.int32),
                                  sds((n_words,), jnp.int32)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text and "stablehlo.while" in text
