"""cpu_kernels (packed matmul in float32, bfloat16 and weight-only int8; paged attention
in float32 and bfloat16) against numpy and the jnp path, their batch invariance, and where
they are used."""

from __future__ import annotations

import dataclasses
import functools
import json
import platform

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import cpu_kernels
from cpu_kernels import isa
from models import llama
from models.forward_batch import ForwardMode, real_token_mask
from runtime.config import RunnerConfig, ServerArgs
from runtime.engine_setup import default_attention_backend, default_cpu_matmul
from tests.model_utils import TINY


def test_kernels_build_here():
    """CI machines are x86-64 with AVX-512 or AVX2 + FMA (both seen) and g++: the default
    CPU path must be ours (elsewhere the engine falls back to XLA's dot, see
    default_cpu_matmul)."""
    assert cpu_kernels.unavailable_reason() is None
    cpu_kernels.load()


def test_kernels_offered_follow_the_instruction_set():
    """Each kernel exists exactly where the build's level (the CPU's, capped by
    $XLASERVE_CPU_ISA) has its instructions: vdpbf16ps at avx512_bf16, 12-bit decoding at
    avx512 (AMX also needs the kernel's leave: test_amx_is_offered_only_...)."""
    bf16 = cpu_kernels.bf16_targets()
    assert "widen" in bf16 and ("dot" in bf16) == isa.has("avx512_bf16")
    assert (not cpu_kernels.x12_targets()) == (not isa.has("avx512"))
    assert "amx" not in bf16 or isa.has("amx")


# M covers empty, one row, every tile tail (1..5 rows past a 6-row tile), more than one
# 96-row work unit; K odd and tiny; N below, at and across 64-column panels.
@pytest.mark.parametrize("m,k,n", [(0, 8, 64), (1, 576, 576), (7, 100, 130), (5, 3, 17),
                                   (97, 33, 65), (200, 1536, 576), (13, 64, 1), (32, 17, 192)])
def test_matches_numpy(m, k, n):
    rng = np.random.default_rng(m * 1000 + k + n)
    x = rng.standard_normal((m, k), np.float32)
    w = rng.standard_normal((k, n), np.float32)
    y = jax.jit(cpu_kernels.packed_matmul)(jnp.asarray(x), cpu_kernels.pack(jnp.asarray(w)))
    assert y.shape == (m, n) and y.dtype == jnp.float32
    want = x.astype(np.float64) @ w.astype(np.float64)
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5 * np.sqrt(k))


def _pack(w: np.ndarray, dtype: str) -> cpu_kernels.PackedWeight:
    """W packed as float32 / bfloat16 panels, or quantized to int8 (pack_int8)."""
    return cpu_kernels.pack_int8(w) if dtype == "int8" else cpu_kernels.pack(jnp.asarray(w, dtype))


def _int8_weights(pw: cpu_kernels.PackedWeight) -> tuple[np.ndarray, np.ndarray]:
    """(q [..., K, N] int8, scale [..., N]) back out of int8 panels [..., P, Kp, 64]."""
    panels, lead = np.asarray(pw.panels), pw.panels.shape[:-3]
    q = np.swapaxes(panels, -3, -2).reshape(*lead, panels.shape[-2], -1)[..., :pw.k, :pw.n]
    return q, np.asarray(pw.scales).reshape(*lead, -1)[..., :pw.n]


# The f32 test's shapes; K not a multiple of 4 pads the last step with zero rows (and x
# with zero columns), N across and inside panels pads the scales with zeros.
@pytest.mark.parametrize("m,k,n", [(0, 8, 64), (1, 576, 576), (7, 100, 130), (5, 3, 17),
                                   (97, 33, 65), (200, 1536, 576), (13, 64, 1), (32, 17, 192)])
def test_int8_matches_numpy(m, k, n):
    """Per column: q = round(W / s) in [-127, 127], s = max |W| / 127, so |q s - W| <= s / 2;
    the kernel gives x @ (q s) to the f32 test's tolerance (its products x q are exact)."""
    rng = np.random.default_rng(m * 1000 + k + n)
    x = rng.standard_normal((m, k), np.float32)
    w = rng.standard_normal((k, n), np.float32)
    w[:, 0] = 0  # an all-zero column: scale 1, q 0
    pw = cpu_kernels.pack_int8(w)
    assert pw.dtype == jnp.int8 and pw.shape == (k, n) and pw.panels.shape[-2] % 4 == 0
    q, scale = _int8_weights(pw)
    amax = np.abs(w).max(0)
    np.testing.assert_array_equal(scale, np.where(amax > 0, amax / np.float32(127), 1))
    assert np.abs(q).max() <= 127 and (np.abs(q).max(0)[amax > 0] == 127).all()
    # Off by at most half a step (plus the f32 division's rounding of W / s).
    assert (np.abs(q * scale.astype(np.float64) - w) <= scale * (0.5 + 1e-5)).all()
    y = jax.jit(cpu_kernels.packed_matmul)(jnp.asarray(x), pw)
    assert y.shape == (m, n) and y.dtype == jnp.float32
    want = x.astype(np.float64) @ (q.astype(np.float64) * scale)
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5 * np.sqrt(k))


def _bf16(a: np.ndarray) -> np.ndarray:
    """a rounded to bfloat16 (nearest even), back in float64 for the reference."""
    return a.astype(ml_dtypes.bfloat16).astype(np.float64)


def _bf16_targets() -> list[str | None]:
    """The bf16 matmul that serves and each kernel by name: weights widened to f32,
    vdpbf16ps where the CPU has avx512_bf16, AMX tiles where it has AMX-BF16."""
    return [None, *cpu_kernels.bf16_targets().values()]


# The f32 test's shapes; K odd pads the last k pair with a zero row.
@pytest.mark.parametrize("m,k,n", [(0, 8, 64), (1, 576, 576), (7, 100, 130), (5, 3, 17),
                                   (97, 33, 65), (200, 1536, 576), (13, 64, 1), (32, 17, 192)])
def test_bf16_matches_numpy(m, k, n):
    """bf16(x) @ bf16(W) with f32 accumulation: the products are exact in f32, so the error
    is f32 summation over K of terms of size |x||w|, the f32 test's tolerance."""
    rng = np.random.default_rng(m * 1000 + k + n)
    x = rng.standard_normal((m, k), np.float32)
    w = rng.standard_normal((k, n), np.float32).astype(ml_dtypes.bfloat16)
    pw = cpu_kernels.pack(jnp.asarray(w))
    assert pw.dtype == jnp.bfloat16 and pw.shape == (k, n)
    want = _bf16(x) @ _bf16(w)
    for target in _bf16_targets():
        f = jax.jit(functools.partial(cpu_kernels.packed_matmul, target=target))
        y = f(jnp.asarray(x), pw)
        assert y.shape == (m, n) and y.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5 * np.sqrt(k))


@pytest.mark.parametrize("k", [1, 16, 37, 576])
def test_bf16_kernel_rounds_x_as_xla_converts(k):
    """The bf16 kernels round f32 x to bf16 themselves: bitwise what x rounded by XLA's
    convert gives, with exact ties (both directions) and values that carry into the
    exponent among the inputs, odd K's zero pad included."""
    rng = np.random.default_rng(k)
    x = rng.standard_normal((9, k), np.float32)
    bits = x.view(np.uint32)
    bits[0] = (bits[0] & 0xFFFF0000) | 0x8000  # ties: even stays, odd rounds up
    bits[1] = (bits[1] & 0xFFFF0000) | 0x7FFF  # just below a tie: down
    bits[2] = 0x3F7FFFFF  # 0.99999994 rounds up into the next binade (1.0)
    w = cpu_kernels.pack(jnp.asarray(rng.standard_normal((k, 70)), jnp.bfloat16))
    xj = jnp.asarray(x)
    for target in _bf16_targets():
        f = jax.jit(functools.partial(cpu_kernels.packed_matmul, target=target))
        np.testing.assert_array_equal(
            np.asarray(f(xj, w)), np.asarray(f(xj.astype(jnp.bfloat16).astype(jnp.float32), w)))


def test_bf16_rows_do_not_depend_on_the_batch():
    """As for f32: bitwise equal alone, in a tile, in a tail tile and a second work unit,
    on every bf16 kernel (AMX: in a 16-row tile, alone with 15 rows of whatever x holds
    there, and past a k tail of 7 pairs)."""
    rng = np.random.default_rng(2)
    w = cpu_kernels.pack(jnp.asarray(rng.standard_normal((301, 200)), jnp.bfloat16))
    x = jnp.asarray(rng.standard_normal((150, 301), np.float32))
    for target in _bf16_targets():
        f = jax.jit(functools.partial(cpu_kernels.packed_matmul, target=target))
        full = np.asarray(f(x, w))
        for i in (0, 5, 6, 95, 96, 149):
            np.testing.assert_array_equal(np.asarray(f(x[i:i + 1], w))[0], full[i])
        np.testing.assert_array_equal(np.asarray(f(x[3:10], w)), full[3:10])


def test_the_faster_bf16_kernel_serves_and_is_recorded(monkeypatch, tmp_path):
    """The choice: each kernel's time relative to the best at each row count, summed;
    recorded beside the library, so a later process reads it instead of measuring;
    $XLASERVE_CPU_BF16_KERNEL overrides, naming a kernel this CPU has."""
    monkeypatch.setattr(cpu_kernels.build, "_bf16_choice", cpu_kernels.bf16_kernel())
    monkeypatch.delenv("XLASERVE_CPU_BF16_KERNEL", raising=False)
    record = tmp_path / "bf16_kernel.json"
    # widen: 1.0 + 2.0 = 3.0; dot: 1.2 + 1.0 = 2.2 (slower alone, much faster at 32 rows)
    monkeypatch.setattr(cpu_kernels.build, "_time_bf16", lambda kernels: {
        "widen": {1: 1e-3, 32: 2e-3}, "dot": {1: 1.2e-3, 32: 1e-3}})
    assert cpu_kernels.build._choose_bf16(record, ["widen", "dot"]) == "dot"
    assert cpu_kernels.bf16_kernel() == "dot"
    assert json.loads(record.read_text())["kernel"] == "dot"

    def measured_again(kernels):
        raise AssertionError("measured again with a record")
    monkeypatch.setattr(cpu_kernels.build, "_time_bf16", measured_again)
    assert cpu_kernels.build._choose_bf16(record, ["widen", "dot"]) == "dot"
    assert cpu_kernels.build._choose_bf16(tmp_path / "other.json", ["widen"]) == "widen"
    monkeypatch.setenv("XLASERVE_CPU_BF16_KERNEL", "widen")
    assert cpu_kernels.build._choose_bf16(record, ["widen", "dot"]) == "widen"
    monkeypatch.setenv("XLASERVE_CPU_BF16_KERNEL", "dot")
    with pytest.raises(ValueError, match=r"the kernels here: \['widen'\]"):
        cpu_kernels.build._choose_bf16(record, ["widen"])


def test_the_bf16_kernels_are_measured_from_inside_a_trace(monkeypatch, tmp_path):
    """A process's first load() may come from a jit trace (its first packed_matmul): the
    measurement then still runs real arrays, and the choice is recorded."""
    monkeypatch.setattr(cpu_kernels.build, "_bf16_choice", cpu_kernels.bf16_kernel())
    monkeypatch.delenv("XLASERVE_CPU_BF16_KERNEL", raising=False)
    record = tmp_path / "bf16_kernel.json"
    kernels = list(cpu_kernels.bf16_targets())
    if len(kernels) == 1:  # nothing to measure: widening alone
        kernels = kernels * 2

    @jax.jit
    def traced(x):
        cpu_kernels.build._choose_bf16(record, kernels)
        return x + 1

    assert int(traced(jnp.int32(1))) == 2
    assert json.loads(record.read_text())["kernel"] in kernels


def test_amx_is_offered_only_where_the_process_may_use_it():
    """The AMX kernel needs Linux's leave to use the tile registers (XlaserveAmxReady);
    refused, the kernel is not offered, so the per-machine choice cannot pick it."""
    class Lib:
        XlaservePackedMatmulBf16Widen = XlaservePackedMatmulBf16Amx = object()

        def __init__(self, ready: int) -> None:
            self.XlaserveAmxReady = lambda: ready

    assert cpu_kernels.build._bf16_kernels(Lib(1)) == ["widen", "amx"]
    assert cpu_kernels.build._bf16_kernels(Lib(0)) == ["widen"]
    if isa.has("amx"):  # built with AMX here: it must be offered
        assert "amx" in cpu_kernels.bf16_targets()


def test_bf16_kernels_agree():
    """Same panels, same bf16 products, summed in another order: the kernels differ only
    by f32 rounding; the serving target is one of them, bitwise."""
    rng = np.random.default_rng(3)
    w = cpu_kernels.pack(jnp.asarray(rng.standard_normal((576, 960)) * 0.05, jnp.bfloat16))
    x = jnp.asarray(rng.standard_normal((9, 576), np.float32))
    ys = {name: np.asarray(jax.jit(functools.partial(cpu_kernels.packed_matmul,
                                                     target=target))(x, w))
          for name, target in cpu_kernels.bf16_targets().items()}
    serving = np.asarray(jax.jit(cpu_kernels.packed_matmul)(x, w))
    np.testing.assert_array_equal(serving, ys[cpu_kernels.bf16_kernel()])
    for y in ys.values():
        np.testing.assert_allclose(y, ys["widen"], rtol=1e-5, atol=1e-4)


def test_leading_dims_and_stacked_weights():
    """x [A, B, K] flattens to rows; a stacked [L, K, N] weight packs per layer."""
    rng = np.random.default_rng(1)
    w = jnp.asarray(rng.standard_normal((3, 40, 70), np.float32))
    pw = cpu_kernels.pack(w)
    assert pw.panels.shape == (3, 2, 40, 64) and pw.shape == (3, 40, 70)
    x = jnp.asarray(rng.standard_normal((2, 5, 40), np.float32))
    layer1 = jax.tree.map(lambda a: a[1], pw)  # what run_layers' stacked path does
    y = cpu_kernels.packed_matmul(x, layer1)
    np.testing.assert_allclose(np.asarray(y), np.asarray(x) @ np.asarray(w[1]), rtol=1e-5,
                               atol=1e-5)
    with pytest.raises(ValueError, match="one matrix"):
        cpu_kernels.packed_matmul(x, pw)
    pb = cpu_kernels.pack(w.astype(jnp.bfloat16))
    assert pb.panels.shape == (3, 2, 20, 64, 2) and pb.shape == (3, 40, 70)
    y = cpu_kernels.packed_matmul(x, jax.tree.map(lambda a: a[1], pb))
    np.testing.assert_allclose(np.asarray(y), _bf16(np.asarray(x)) @ _bf16(np.asarray(w[1])),
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="one matrix"):
        cpu_kernels.packed_matmul(x, pb)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_a_stacked_weight_is_read_in_place_at_a_traced_layer(dtype):
    """at_layer (the layer loop's path): the kernel reads matrix `layer` of the stack
    itself, bitwise what the sliced matrix gives, for every layer under one trace; a
    layer outside the stack is an error, not a read past the weights."""
    rng = np.random.default_rng(3)
    w = _pack(rng.standard_normal((3, 70, 130)), dtype)
    x = jnp.asarray(rng.standard_normal((7, 70), np.float32))
    f = jax.jit(lambda x, w, layer: cpu_kernels.packed_matmul(x, cpu_kernels.at_layer(w, layer)))
    for layer in range(3):
        sliced = jax.tree.map(lambda a, layer=layer: a[layer], w)
        np.testing.assert_array_equal(np.asarray(f(x, w, jnp.int32(layer))),
                                      np.asarray(cpu_kernels.packed_matmul(x, sliced)))
    assert f._cache_size() == 1
    assert cpu_kernels.at_layer(w, jnp.int32(0)).shape == (70, 130)
    for layer in (-1, 3):
        with pytest.raises(Exception, match="packed_matmul: layer out of range"):
            jax.block_until_ready(f(x, w, jnp.int32(layer)))
    with pytest.raises(ValueError, match="a stack of matrices"):
        cpu_kernels.at_layer(jax.tree.map(lambda a: a[0], w), jnp.int32(0))


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_row_results_do_not_depend_on_the_batch(dtype):
    """Every row runs the same FMA sequence wherever it sits: bitwise equal alone, in a
    6-row tile, in a tail tile and in a second 96-row work unit."""
    rng = np.random.default_rng(2)
    w = _pack(rng.standard_normal((300, 200)), dtype)
    x = jnp.asarray(rng.standard_normal((150, 300), np.float32))
    f = jax.jit(cpu_kernels.packed_matmul)
    full = np.asarray(f(x, w))
    for i in (0, 5, 6, 95, 96, 149):
        np.testing.assert_array_equal(np.asarray(f(x[i:i + 1], w))[0], full[i])
    np.testing.assert_array_equal(np.asarray(f(x[3:10], w)), full[3:10])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_masked_rows_come_out_zero_and_the_others_unchanged(dtype):
    """only_rows: the masked rows of y are zero, every other row bitwise what the
    unmasked call gives, for runs of every kind (one row, a tile tail, a run across the
    96-row work unit, the last row) and for an all-zero mask."""
    rng = np.random.default_rng(4)
    w = _pack(rng.standard_normal((300, 200)), dtype)
    x = jnp.asarray(rng.standard_normal((150, 300), np.float32))
    f = jax.jit(cpu_kernels.packed_matmul)
    full = np.asarray(f(x, w))
    mask = np.zeros(150, np.int32)
    for begin, end in ((0, 1), (3, 10), (40, 47), (90, 130), (149, 150)):
        mask[begin:end] = 1
    got = np.asarray(f(x, cpu_kernels.only_rows(w, jnp.asarray(mask))))
    np.testing.assert_array_equal(got[mask == 1], full[mask == 1])
    assert not got[mask == 0].any()
    none = np.asarray(f(x, cpu_kernels.only_rows(w, jnp.zeros(150, jnp.int32))))
    assert not none.any()
    with pytest.raises(ValueError, match="row mask"):
        f(x, cpu_kernels.only_rows(w, jnp.ones(149, jnp.int32)))


def test_padding_tokens_do_not_change_the_real_ones(monkeypatch):
    """A packed model's forward over a padded MIXED batch skips the padding tokens and
    rows in its matmuls: the real rows' logits are bitwise those of the same batch with
    the padding computed, the padding rows' logits zero."""
    from models import layers
    from models.kv_pool import init_kv_pool
    from runtime.batch_builder import BucketShape
    from runtime.config import CacheConfig
    from tests.model_utils import SimpleRow, make_batch

    params = llama.pack_for_cpu(llama.init_params(TINY, jax.random.key(5)))
    kv = init_kv_pool(TINY, CacheConfig(page_size=16, num_pages=8), np.float32)
    # One extend row of 5 tokens in a 16-token, 2-row bucket; 2 decode rows of 4.
    batch = make_batch(ForwardMode.MIXED, [SimpleRow(list(range(3, 8)), 0, [1])],
                       [SimpleRow([9], 20, [2, 3]), SimpleRow([11], 7, [4])],
                       BucketShape(16, 2, 4, 2), 16)
    real = np.array([True, False, True, True, False, False])

    def logits() -> np.ndarray:  # a fresh trace each call
        return np.asarray(jax.jit(lambda p, kv, b: llama.forward(p, kv, b, TINY, "cpu")[0])(
            params, kv, batch))

    got = logits()
    monkeypatch.setattr(layers, "real_token_mask", lambda b: jnp.ones_like(b.input_ids))
    monkeypatch.setattr(layers, "real_row_mask", jnp.ones_like)
    want = logits()
    np.testing.assert_array_equal(got[real], want[real])
    assert not got[~real].any() and want[~real].any()


def test_packed_model_matches_unpacked():
    """pack_for_cpu (fused QKV and gate/up, packed head) gives the same logits, stacked
    and per-layer, tied and untied heads."""
    from tests.model_utils import all_position_logits

    ids = list(range(3, 40))
    for tie in (True, False):
        cfg = dataclasses.replace(TINY, tie_word_embeddings=tie)
        params = llama.init_params(cfg, jax.random.key(3))
        want = all_position_logits(params, cfg, ids)
        for tree in (params, llama.unstack_layers(params)):
            packed = llama.pack_for_cpu(tree)
            assert isinstance(packed["lm_head"], cpu_kernels.PackedWeight)
            np.testing.assert_allclose(all_position_logits(packed, cfg, ids), want,
                                       rtol=2e-5, atol=2e-5)


def test_int8_model_matches_its_dequantized_weights():
    """pack_for_cpu(..., "int8"): every fused matrix and the head quantized per column;
    the logits are those of the f32 model whose matrices are q * s (the lookup table
    unquantized), stacked and per-layer."""
    from tests.model_utils import all_position_logits

    ids = list(range(3, 40))
    params = llama.init_params(TINY, jax.random.key(3))
    packed = llama.pack_for_cpu(params, "int8")
    deq = {**params, "lm_head": None, "layers": dict(params["layers"])}
    for name, parts in {"wqkv": ("wq", "wk", "wv"), "w_gate_up": ("w_gate", "w_up"),
                        "wo": ("wo",), "w_down": ("w_down",)}.items():
        q, scale = _int8_weights(packed["layers"][name])
        full = q * scale[:, None, :]  # [L, K, N]
        splits = np.cumsum([params["layers"][p].shape[-1] for p in parts])[:-1]
        for p, part in zip(parts, np.split(full, splits, axis=-1), strict=True):
            deq["layers"][p] = jnp.asarray(part, jnp.float32)
    q, scale = _int8_weights(packed["lm_head"])
    deq["lm_head"] = jnp.asarray(q * scale, jnp.float32)
    want = all_position_logits(deq, dataclasses.replace(TINY, tie_word_embeddings=False), ids)
    for tree in (params, llama.unstack_layers(params)):
        got = all_position_logits(llama.pack_for_cpu(tree, "int8"), TINY, ids)
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    with pytest.raises(ValueError, match="quantization='int4'"):
        llama.pack_for_cpu(params, "int4")


def test_config_choices():
    for dtype in ("float32", "bfloat16"):  # CPU, kernels build: ours in both dtypes
        assert default_cpu_matmul(ServerArgs(dtype=dtype)) == "packed"
        assert default_attention_backend(ServerArgs(dtype=dtype)) == "cpu"
    assert default_cpu_matmul(ServerArgs(cpu_matmul="xla")) == "xla"
    assert default_attention_backend(ServerArgs(attention_backend="pallas")) == "pallas"
    cfg = RunnerConfig(dtype="bfloat16", cpu_matmul="packed", attention_backend="cpu")
    assert (cfg.kv_dtype, cfg.activation_dtype) == ("bfloat16", "float32")
    cfg = RunnerConfig(dtype="bfloat16", kv_cache_dtype="float32")
    assert (cfg.kv_dtype, cfg.activation_dtype) == ("float32", "bfloat16")
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8_e5m2'"):
        RunnerConfig(kv_cache_dtype="fp8_e5m2")
    assert RunnerConfig(cpu_matmul="packed", quantization="int8").quantization == "int8"
    with pytest.raises(ValueError, match="runs on the packed CPU matmul"):
        RunnerConfig(cpu_matmul="xla", quantization="int8")
    with pytest.raises(ValueError, match="quantization='fp8'"):
        RunnerConfig(cpu_matmul="packed", quantization="fp8")


def test_fallback_where_the_kernels_cannot_build(monkeypatch, caplog):
    """A CPU without AVX2 (or without g++): XLA's dot and the jnp attention, said in
    the log; asking for the kernels there is an error that says why."""
    reason = "needs a CPU with AVX-512F, or AVX2 and FMA"
    monkeypatch.setattr(cpu_kernels, "unavailable_reason", lambda: reason)
    with caplog.at_level("WARNING"):
        assert default_cpu_matmul(ServerArgs()) == "xla"
        assert default_attention_backend(ServerArgs()) == "xla"
    assert "AVX2 and FMA" in caplog.text
    with pytest.raises(ValueError, match=f"needs the CPU kernels: {reason}"):
        default_cpu_matmul(ServerArgs(cpu_matmul="packed"))
    with pytest.raises(ValueError, match="needs the CPU kernels"):
        default_attention_backend(ServerArgs(attention_backend="cpu"))


def test_bad_operands_are_rejected_by_the_kernels():
    """Shape mismatches reach the FFI handlers' checks and come back as errors, not
    crashes."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((3, 10), np.float32))
    bad = cpu_kernels.PackedWeight(panels=jnp.zeros((1, 12, 64), jnp.float32), n=64, k=12)
    with pytest.raises(Exception, match="packed_matmul: want x"):
        jax.block_until_ready(jax.jit(cpu_kernels.packed_matmul)(x, bad))
    q8 = cpu_kernels.pack_int8(np.ones((10, 64), np.float32))
    for bad in (dataclasses.replace(q8, scales=q8.scales[:, :32]),  # scales [P, 32]
                dataclasses.replace(q8, k=13)):  # 12 rows of panels for K = 13
        with pytest.raises(Exception, match="int8, scale \\[P, 64\\]"):
            jax.block_until_ready(jax.jit(cpu_kernels.packed_matmul)(
                jnp.ones((3, bad.k), jnp.float32), bad))
    q = jnp.zeros((2, 6, 64), jnp.float32)
    kv = jnp.zeros((2, 2, 64), jnp.float32)
    pool = jnp.zeros((1, 2, 4, 16, 64), jnp.float32)
    table, lens = jnp.ones((2, 1), jnp.int32), jnp.full((2,), 5, jnp.int32)
    f = jax.jit(functools.partial(cpu_kernels.decode_attention, sm_scale=0.125))
    with pytest.raises(Exception, match="decode_attention: layer out of range"):
        jax.block_until_ready(f(q, kv, kv, pool, pool, jnp.int32(3), table, lens))
    with pytest.raises(Exception, match="decode_attention: want page_table"):
        jax.block_until_ready(f(q, kv, kv, pool, pool, jnp.int32(0), table[:1], lens))
    with pytest.raises(ValueError, match="expected 'xla' or 'packed'"):
        RunnerConfig(cpu_matmul="mkl")


def _attention(batch, args, backend: str, **kw) -> np.ndarray:
    from pallas_kernels import get_paged_attention_fn

    traced = {k: kw.pop(k) for k in ("window", "sinks") if k in kw}  # jit operands
    fn = functools.partial(get_paged_attention_fn(backend),
                           num_extend_tokens=batch.num_extend_tokens,
                           num_extend_seqs=batch.num_extend_seqs, sm_scale=0.125, **kw)
    return np.asarray(jax.jit(lambda a, t: fn(*a, **t))(args, traced))


# Decode rows from 1 token (own key only) to 10 pages, plus the seq_len-0 padding row that
# _batch adds; extend rows fresh and on cached prefixes (mid-page starts and ends), the
# bucket's padding tokens and a padding row; MIXED batches; GQA groups 1/3/8 (8: the
# general, not register-resident path); window (traced; 5 tokens: pages wholly outside it,
# a window starting mid-page; 0: none at run time), soft cap and sinks.
@pytest.mark.parametrize("page_size,group,extend,window,cap,sinks", [
    (16, 3, [], None, 0.0, False), (64, 1, [], None, 0.0, False),
    (16, 8, [(9, 20)], None, 0.0, False), (16, 3, [(40, 0)], 37, 0.0, False),
    (16, 3, [], None, 5.0, False), (16, 3, [(9, 30)], 20, 5.0, False),
    (16, 3, [(1, 0), (16, 0), (17, 3), (5, 16), (2, 31), (76, 33)], None, 0.0, False),
    (64, 8, [(70, 0), (3, 100)], 37, 5.0, False), (16, 3, [(9, 30)], None, 0.0, True),
    (16, 3, [(40, 0), (9, 30)], 5, 0.0, True), (16, 8, [(9, 20)], 0, 5.0, True),
    (16, 1, [(17, 3)], 6, 0.0, True)])
@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16"])
def test_attention_matches_reference(page_size, group, extend, window, cap, sinks, kv_dtype):
    """bfloat16 pages: the kernel widens them to f32 and rounds this step's K/V to bf16
    (what the pool will hold); the jnp path in f32 on the same rounded values agrees to
    f32 rounding."""
    from tests.test_pallas_attention import _batch, _inputs, _ragged_lens, _sinks

    batch, n_pages = _batch(extend, _ragged_lens(page_size), page_size)
    args = _inputs(batch, n_pages, page_size, group, jnp.float32, seed=group)
    kw = dict(logit_softcap=cap)
    if window is not None:
        kw["window"] = jnp.int32(window)
    if sinks:
        kw["sinks"] = _sinks(group, seed=group)
    if kv_dtype == "bfloat16":
        kv = [jnp.asarray(a, jnp.bfloat16) for a in args[1:5]]  # k_new, v_new, pools
        args = (args[0], *kv, *args[5:])
        want = _attention(batch, (args[0], *[a.astype(jnp.float32) for a in kv], *args[5:]),
                          "xla", **kw)
        # This step's K/V come in f32; the kernel rounds them as the pool write does.
        got = _attention(batch, (args[0], *[a.astype(jnp.float32) for a in kv[:2]], *kv[2:],
                                 *args[5:]), "cpu", **kw)
    else:
        want = _attention(batch, args, "xla", **kw)
        got = _attention(batch, args, "cpu", **kw)
    # Padding tokens: what either path gives them is unused (the CPU kernel skips the
    # extend ones; the jnp path attends them as queries).
    real = np.asarray(real_token_mask(batch)) == 1
    np.testing.assert_allclose(got[real], want[real], atol=2e-5, rtol=2e-5)


def test_extend_attention_padding_in_last_row_and_no_page_table():
    """No spare row (the bucket's padding tokens sit in the last row's span) and a width-0
    page table (fresh prompts): the same as the jnp path on the real tokens, and the
    padding tokens are not attended at all (zero, not a query that sees every key)."""
    from tests.test_pallas_attention import _batch, _inputs

    batch, n_pages = _batch([(13, 0), (30, 0), (18, 0)], [], 16, spare_row=False)
    assert batch.num_extend_tokens > 61
    for table_width in (None, 0):
        b = batch if table_width is None else batch.replace(page_table=batch.page_table[:, :0])
        args = _inputs(b, n_pages, 16, 3, jnp.float32, seed=2)
        want = _attention(b, args, "xla")[:61]
        got = _attention(b, args, "cpu")
        np.testing.assert_allclose(got[:61], want, atol=2e-5, rtol=2e-5)
        assert not got[61:].any()


@pytest.mark.parametrize("kv_dtype", [jnp.float32, jnp.bfloat16])
def test_decode_attention_rows_do_not_depend_on_the_batch(kv_dtype):
    """Each row alone gives bitwise what it gives inside the batch."""
    from tests.test_pallas_attention import _batch, _inputs

    lens = [3, 17, 40, 100]
    batch, n_pages = _batch([], lens, 16)
    q, k_new, v_new, k_pool, v_pool, layer, table, seq_lens, _, _ = _inputs(
        batch, n_pages, 16, 3, jnp.float32, seed=5)
    k_pool, v_pool = k_pool.astype(kv_dtype), v_pool.astype(kv_dtype)
    f = jax.jit(functools.partial(cpu_kernels.decode_attention, sm_scale=0.125))
    full = np.asarray(f(q, k_new, v_new, k_pool, v_pool, layer, table, seq_lens))
    for i in range(len(lens)):
        one = slice(i, i + 1)
        alone = f(q[one], k_new[one], v_new[one], k_pool, v_pool, layer, table[one],
                  seq_lens[one])
        np.testing.assert_array_equal(np.asarray(alone)[0], full[i])


@pytest.mark.parametrize("kv_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("group,dh", [(2, 128), (3, 128), (4, 128), (3, 48), (6, 64)])
def test_decode_attention_head_shapes(group, dh, kv_dtype):
    """Register-resident variants (D = 64 with G <= 6, D = 128 with G <= 3) and the
    general path (D = 48, D = 128 with G = 4: masked bf16 tails) against the jnp decode
    (in f32 on the same K/V values)."""
    from pallas_kernels.attention_ref import _decode

    rng = np.random.default_rng(group * dh)
    b, hkv, s, n_pages = 5, 2, 16, 40
    lens = np.array([1, 2, 17, 64, 130], np.int32)
    table = (np.arange(b * 9).reshape(b, 9) % (n_pages - 1) + 1).astype(np.int32)
    q = jnp.asarray(2 * rng.standard_normal((b, hkv * group, dh)), jnp.float32)
    k_new, v_new = (jnp.asarray(rng.standard_normal((b, hkv, dh)), kv_dtype) for _ in "kv")
    pools = [jnp.asarray(rng.standard_normal((2, hkv, n_pages, s, dh)), kv_dtype)
             for _ in "kv"]
    rest = (jnp.int32(1), jnp.asarray(table), jnp.asarray(lens))
    kw = dict(sm_scale=dh ** -0.5)
    f32 = [a.astype(jnp.float32) for a in (k_new, v_new, *pools)]
    want = jax.jit(functools.partial(_decode, **kw))(q, *f32, *rest)
    got = jax.jit(functools.partial(cpu_kernels.decode_attention, **kw))(
        q, k_new, v_new, *pools, *rest)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)


def _extend_case(rng, group, dh, kv_dtype, page_size=16, n_pages=24):
    """Row 0: 70 new tokens after a 21-token cached prefix (mid-page); row 1: 5 fresh
    tokens; 3 padding tokens past the rows. Pages of row 0 in scrambled pool order."""
    hkv, lens, prefix = 2, [70, 5], 21
    t = sum(lens) + 3
    table = np.zeros((2, 8), np.int32)
    table[0] = rng.permutation(np.arange(1, n_pages))[:8]
    q = jnp.asarray(2 * rng.standard_normal((t, hkv * group, dh)), jnp.float32)
    k_new, v_new = (jnp.asarray(rng.standard_normal((t, hkv, dh)), kv_dtype) for _ in "kv")
    pools = [jnp.asarray(rng.standard_normal((2, hkv, n_pages, page_size, dh)), kv_dtype)
             for _ in "kv"]
    positions = np.full(t, 1 << 30, np.int32)
    positions[:70] = np.arange(prefix, prefix + 70)
    positions[70:75] = np.arange(5)
    return q, k_new, v_new, pools, table, np.array([0, 70, 75], np.int32), positions


@pytest.mark.parametrize("kv_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("group,dh,window", [(3, 64, None), (1, 64, 30), (4, 128, None),
                                             (8, 48, 40), (6, 64, None)])
def test_extend_attention_head_shapes_and_chunking(group, dh, window, kv_dtype):
    """The blocked extend kernel against the jnp extend (in f32 on the same K/V), items of
    64 / G tokens, head dims 48 / 64 / 128; chunking a prompt anywhere gives the later
    tokens bitwise what the whole prompt gives (its keys then come from the pool), and a
    row gives bitwise the same alone as in a batch."""
    from pallas_kernels.attention_ref import _extend

    rng = np.random.default_rng(group * dh)
    q, k_new, v_new, pools, table, qs, positions = _extend_case(rng, group, dh, kv_dtype)
    kw = dict(sm_scale=dh ** -0.5, window=window)
    rest = (jnp.int32(1), jnp.asarray(table), jnp.asarray(qs), jnp.asarray(positions))
    f32 = [a.astype(jnp.float32) for a in (k_new, v_new, *pools)]
    want = np.asarray(jax.jit(functools.partial(_extend, **kw))(q, *f32, *rest))
    f = jax.jit(functools.partial(cpu_kernels.extend_attention, **kw))
    got = np.asarray(f(q, k_new, v_new, *pools, *rest))
    np.testing.assert_allclose(got[:75], want[:75], atol=2e-5, rtol=2e-5)
    np.testing.assert_array_equal(got[75:], 0.0)  # padding past the rows

    # Row 0 in two chunks, split off the 16-key blocks and the items: the first 33 tokens'
    # K/V go into the pool (layer 1, row 0's pages), then the last 37 tokens run alone.
    split = 33
    k_pool, v_pool = (np.array(p) for p in pools)
    for i, pos in enumerate(positions[:split]):
        page, slot = table[0, pos // 16], pos % 16
        k_pool[1, :, page, slot], v_pool[1, :, page, slot] = k_new[i], v_new[i]
    rest2 = (jnp.int32(1), jnp.asarray(table[:1]), jnp.asarray([0, 70 - split], np.int32),
             jnp.asarray(positions[split:70]))
    later = f(q[split:70], k_new[split:70], v_new[split:70], jnp.asarray(k_pool),
              jnp.asarray(v_pool), *rest2)
    np.testing.assert_array_equal(np.asarray(later), got[split:70])
    # Row 1 alone: bitwise what it gives beside row 0.
    alone = f(q[70:75], k_new[70:75], v_new[70:75], *pools, jnp.int32(1),
              jnp.asarray(table[1:]), jnp.asarray([0, 5], np.int32),
              jnp.asarray(positions[70:75]))
    np.testing.assert_array_equal(np.asarray(alone), got[70:75])


def test_out_of_range_page_ids_stay_inside_the_pool():
    """A corrupt page-table entry must not read outside the pool (the kernels clip page
    ids into it, as the jnp gathers clip their indices): finite output, no crash."""
    rng = np.random.default_rng(4)
    q = jnp.asarray(rng.standard_normal((2, 6, 64)), jnp.float32)
    kv = jnp.asarray(rng.standard_normal((2, 2, 64)), jnp.float32)
    pool = jnp.asarray(rng.standard_normal((1, 2, 4, 16, 64)), jnp.float32)
    table = jnp.asarray([[1, 2**30], [-5, 3]], jnp.int32)
    out = jax.jit(functools.partial(cpu_kernels.decode_attention, sm_scale=0.125))(
        q, kv, kv, pool, pool, jnp.int32(0), table, jnp.full((2,), 30, jnp.int32))
    assert np.isfinite(np.asarray(out)).all()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_write_kv_matches_the_scatter(dtype):
    """The kernel-side pool write equals models.kv_pool.write_kv bitwise (values rounded
    to the pool's dtype, out-of-pool slots dropped), in place under a donating jit."""
    from models.kv_pool import KVPool, write_kv

    rng = np.random.default_rng(6)
    shape = (3, 2, 5, 4, 64)  # [L, Hkv, P, S, Dh]
    pools = [jnp.asarray(rng.standard_normal(shape), dtype) for _ in "kv"]
    layers = jnp.asarray([2, 0], jnp.int32)
    # 20 and 25: past the 20 slots (the scatter drops them; it would wrap a negative one,
    # which the engine never makes, where the kernel drops it too).
    slots = jnp.asarray([4, 19, 7, 20, 25], jnp.int32)
    k, v = (jnp.asarray(rng.standard_normal((2, 5, 2, 64)), jnp.float32) for _ in "kv")
    want = write_kv(KVPool(*pools), layers, slots, k, v)
    f = jax.jit(cpu_kernels.write_kv, donate_argnums=(0, 1))
    got = f(*[p.copy() for p in pools], layers, slots, k, v)
    for g, w in zip(got, (want.k, want.v), strict=True):
        assert g.dtype == dtype
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


def _can_collapse() -> bool:
    """Transparent huge pages not turned off, and MADV_COLLAPSE (Linux >= 6.1)."""
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return False
    major, minor = (int(v) for v in platform.release().split(".")[:2])
    return "[never]" not in text and (major, minor) >= (6, 1)


def test_weights_move_to_huge_pages_unchanged():
    """Arrays of at least min_bytes are collapsed into 2 MiB pages (where the machine
    allows transparent huge pages at all) with their values kept; smaller ones are left."""
    big = jnp.arange(6 << 20, dtype=jnp.float32)  # 24 MiB
    small = jnp.arange(1024, dtype=jnp.float32)
    want = np.asarray(big).copy()
    done = cpu_kernels.back_with_huge_pages({"w": big, "b": small})
    assert done % (2 << 20) == 0 and done <= big.nbytes
    if not _can_collapse():
        assert done == 0
    else:  # 24 MiB holds at least 11 whole aligned 2 MiB pages
        assert done >= 11 * (2 << 20)
    np.testing.assert_array_equal(np.asarray(big), want)
    assert cpu_kernels.back_with_huge_pages({"b": small}) == 0


def _huge_kb(arrays: tuple[jax.Array, ...]) -> int:
    """kB of transparent huge pages in the mappings that hold `arrays` (/proc/self/smaps)."""
    spans = [(a.unsafe_buffer_pointer(), a.unsafe_buffer_pointer() + a.nbytes) for a in arrays]
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's header: start-end perms ...
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = any(lo < b and a < hi for a, b in spans)
        elif inside and line.startswith("AnonHugePages:"):
            total += int(line.split()[1])
    return total


def test_a_zero_pool_comes_back_in_huge_pages_as_zeros():
    """A fresh (all-zero) KV pool's memory is handed back and marked for huge pages: it
    still reads as zeros, a kernel writing into it sees what it wrote, and the pages its
    first writes touch come back as 2 MiB pages (where the machine allows them)."""
    shape = (2, 3, 1024, 16, 64)  # [L, Hkv, P, S, Dh] f32: 24 MiB each
    pool = jax.jit(lambda: (jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32)))()
    done = cpu_kernels.zeros_in_huge_pages(pool)
    assert done % (2 << 20) == 0 and done <= 2 * pool[0].nbytes
    if _can_collapse():  # 2 x 24 MiB hold at least 2 x 11 whole aligned 2 MiB pages
        assert done >= 2 * 11 * (2 << 20)
    assert not np.asarray(pool[0]).any() and not np.asarray(pool[1]).any()
    # The write_kv kernel (donating the pool) fills every page of layer 1, KV head 0.
    slots = jnp.arange(1024 * 16, dtype=jnp.int32)
    k = jnp.ones((1, slots.size, 3, 64), jnp.float32)
    got = jax.jit(cpu_kernels.write_kv, donate_argnums=(0, 1))(
        *pool, jnp.ones(1, jnp.int32), slots, k, 2 * k)
    assert (np.asarray(got[0][1]) == 1).all() and (np.asarray(got[1][1]) == 2).all()
    assert not np.asarray(got[0][0]).any()
    # 2 x 12 MiB written: 12 whole 2 MiB pages in a fresh process, fewer where the
    # allocator reuses memory earlier tests left (with 4 KiB pages alone: none)
    if _can_collapse():
        assert _huge_kb(got) >= 2 * 2048
