"""Compressed bf16 weights (cpu_kernels.pack_x12, `--compress_weights`): the format holds
every bf16 bit pattern exactly, the kernels give bf16's products (bitwise where no weight
is an exception), a row's result does not depend on its batch, and the runtime refuses
what it cannot serve."""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import cpu_kernels
from runtime.config import RunnerConfig
from tests.cpu_isa import needs_x12

pytestmark = needs_x12
PANEL = cpu_kernels.PANEL


def _bf16(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


def _targets() -> dict[str, str]:
    targets = cpu_kernels.x12_targets()
    assert targets, cpu_kernels.x12_unavailable_reason()
    return targets


def _weights(rng: np.random.Generator, shape: tuple[int, ...], exceptions: bool = True
             ) -> np.ndarray:
    """bf16 weights like a layer's (normal, std 0.05); with `exceptions`, some far below
    the rest (their high bytes miss the 16-entry table), a few large ones, exact zeros and
    negative zeros; without, none below 2^-10 in magnitude (the normal tail near zero
    holds ~0.03% exceptions: 15 high bytes cover 15 binades a sign)."""
    w = rng.standard_normal(shape).astype(np.float32) * 0.05
    if not exceptions:
        w = np.where(np.abs(w) < 2**-10, np.copysign(np.float32(2**-10), w), w)
    else:
        pick = rng.random(shape)
        w[pick < 0.02] *= 1e-7
        w[pick > 0.999] *= 300.0
        w[(pick > 0.5) & (pick < 0.51)] = 0.0
        w[(pick > 0.6) & (pick < 0.605)] = -0.0
    return w.astype(ml_dtypes.bfloat16)


def _unpack(pw: cpu_kernels.PackedWeight) -> np.ndarray:
    """The bf16 bits [..., K, N] back out of a compressed PackedWeight, by the layout
    packed_matmul.cc documents (X12Decode), written independently of pack_x12."""
    steps = np.asarray(pw.panels)  # [..., P, K2, 192]
    lead, (p, k2) = steps.shape[:-3], steps.shape[-3:-1]
    steps = steps.reshape(-1, p, k2, 192)
    tables = np.asarray(pw.table).reshape(-1, 16)
    starts = np.asarray(pw.exc_start).reshape(-1, p + 1)
    excs = np.asarray(pw.exc).reshape(len(steps), -1, 2)
    out = np.zeros((len(steps), 2 * k2, p * PANEL), np.uint16)
    for b in range(len(steps)):
        words = np.zeros((p, k2, 128), np.uint16)
        for t in range(128):
            j, wi = divmod(t, 32)
            byte = 16 * (wi // 8) + 8 * (j % 2) + wi % 8
            lo = steps[b, :, :, 64 * (j // 2) + byte]
            code = (steps[b, :, :, 128 + byte] >> (4 * (j // 2))) & 0xF
            words[:, :, t] = (tables[b][code].astype(np.uint16) << 8) | lo
        # word t of step s of panel q: column 64 q + t // 2, row 2 s + t % 2
        mat = words.reshape(p, k2, PANEL, 2).transpose(1, 3, 0, 2).reshape(2 * k2, p * PANEL)
        for q in range(p):
            for pos, bits in excs[b, starts[b, q]:starts[b, q + 1]]:
                k, col = divmod(int(pos), PANEL)
                assert mat[k, q * PANEL + col] == 0  # an exception's slot decodes to +0
                mat[k, q * PANEL + col] = bits
        out[b] = mat
    return out.reshape(*lead, 2 * k2, p * PANEL)[..., :pw.k, :pw.n]


@pytest.mark.parametrize("shape", [(576, 192), (7, 130), (1, 1), (3, 65, 64)])
def test_the_format_holds_every_weight_exactly(shape):
    """Every bit pattern comes back, zeros of both signs and the exceptions included; a
    stack of matrices with different exception counts pads its lists."""
    w = _weights(np.random.default_rng(sum(shape)), shape)
    pw = cpu_kernels.pack_x12(jnp.asarray(w))
    assert pw.dtype == jnp.uint8 and pw.shape == shape
    np.testing.assert_array_equal(_unpack(pw), w.view(np.uint16))
    if len(shape) == 3:
        counts = np.asarray(pw.exc_start)[:, -1]
        assert len(set(counts)) > 1 and pw.exc.shape[1] == counts.max()


def test_it_is_three_quarters_of_bf16():
    """12 bits a weight plus the exceptions (~2% of them here, on purpose many more than
    SmolLM2's ~0.02%) and the tables."""
    w = _weights(np.random.default_rng(0), (576, 1536))
    pw = cpu_kernels.pack_x12(jnp.asarray(w))
    nbytes = sum(a.nbytes for a in (pw.panels, pw.table, pw.exc_start, pw.exc))
    assert nbytes < 0.8 * cpu_kernels.pack(jnp.asarray(w)).panels.nbytes
    plain = cpu_kernels.pack_x12(jnp.asarray(_weights(np.random.default_rng(0), (576, 1536),
                                                      exceptions=False)))
    assert plain.panels.nbytes == 576 * 1536 * 3 // 2 and plain.exc.shape[0] == 0


# The bf16 test's shapes (test_cpu_kernels): every tile tail, two 96-row work units, K odd
# and tiny, N below, at and across panels.
@pytest.mark.parametrize("m,k,n", [(0, 8, 64), (1, 576, 576), (7, 100, 130), (5, 3, 17),
                                   (97, 33, 65), (200, 1536, 576), (13, 64, 1), (32, 17, 192)])
def test_matches_numpy(m, k, n):
    """bf16(x) @ W with f32 accumulation, W's exceptions included: the bf16 test's
    tolerance."""
    rng = np.random.default_rng(m * 1000 + k + n)
    x = rng.standard_normal((m, k), np.float32)
    w = _weights(rng, (k, n))
    pw = cpu_kernels.pack_x12(jnp.asarray(w))
    want = _bf16(x) @ w.astype(np.float64)
    scale = np.abs(_bf16(x)) @ np.abs(w.astype(np.float64))
    for target in _targets().values():
        y = jax.jit(functools.partial(cpu_kernels.packed_matmul, target=target))(
            jnp.asarray(x), pw)
        assert y.shape == (m, n) and y.dtype == jnp.float32
        np.testing.assert_array_less(np.abs(np.asarray(y) - want), 1e-6 * scale + 1e-30)


@pytest.mark.parametrize("m", [1, 4, 6, 7, 32, 150])
def test_without_exceptions_it_is_the_bf16_kernel_bitwise(m):
    """Where no weight is an exception the decoded panels are bf16's and the products run
    in bf16's order: the same bits as the bf16 kernel it decodes into, whether a unit
    decodes as it goes (up to 6 rows) or its first tile decodes for the others."""
    rng = np.random.default_rng(m)
    w = jnp.asarray(_weights(rng, (577, 200), exceptions=False))
    pw = cpu_kernels.pack_x12(w)
    assert pw.exc.shape[0] == 0
    x = jnp.asarray(rng.standard_normal((m, 577), np.float32))
    bf16 = cpu_kernels.bf16_targets()
    for name, target in _targets().items():
        y = jax.jit(functools.partial(cpu_kernels.packed_matmul, target=target))(x, pw)
        want = jax.jit(functools.partial(cpu_kernels.packed_matmul, target=bf16[name]))(
            x, cpu_kernels.pack(w))
        np.testing.assert_array_equal(np.asarray(y), np.asarray(want))


def test_rows_do_not_depend_on_the_batch():
    """Bitwise equal alone (a decoding tile), in a 6-row tile, in the tiles that read the
    first tile's decoded panel, in a tail tile and in a second work unit, exceptions
    included."""
    rng = np.random.default_rng(5)
    pw = cpu_kernels.pack_x12(jnp.asarray(_weights(rng, (301, 200))))
    assert pw.exc.shape[0] > 0
    x = jnp.asarray(rng.standard_normal((150, 301), np.float32))
    for target in _targets().values():
        f = jax.jit(functools.partial(cpu_kernels.packed_matmul, target=target))
        full = np.asarray(f(x, pw))
        for i in (0, 5, 6, 11, 95, 96, 149):
            np.testing.assert_array_equal(np.asarray(f(x[i:i + 1], pw))[0], full[i])
        np.testing.assert_array_equal(np.asarray(f(x[3:10], pw)), full[3:10])
        np.testing.assert_array_equal(np.asarray(f(x[:6], pw)), full[:6])


def test_a_stack_is_read_at_the_traced_layer():
    """A stack [L, K, N] (the layer loop's weights) at a traced layer index: each layer's
    own table and exceptions, the same bits as that matrix packed alone; the row mask
    zeroes the padding rows."""
    rng = np.random.default_rng(9)
    w = _weights(rng, (3, 96, 130))
    stack = cpu_kernels.pack_x12(jnp.asarray(w))
    x = jnp.asarray(rng.standard_normal((9, 96), np.float32))
    rows = jnp.asarray([1] * 7 + [0] * 2, jnp.int32)

    @jax.jit
    def at(x, stack, layer):
        w = cpu_kernels.only_rows(cpu_kernels.at_layer(stack, layer), rows)
        return cpu_kernels.packed_matmul(x, w)

    for layer in range(3):
        alone = cpu_kernels.packed_matmul(x, cpu_kernels.pack_x12(jnp.asarray(w[layer])))
        y = np.asarray(at(x, stack, jnp.int32(layer)))
        np.testing.assert_array_equal(y[:7], np.asarray(alone)[:7])
        np.testing.assert_array_equal(y[7:], 0.0)


def test_the_serving_kernel_follows_the_bf16_one():
    """packed_matmul on compressed weights runs the decoding kernel of the products the
    bf16 kernel that serves here computes (vdpbf16ps where "dot" serves, else widening)."""
    rng = np.random.default_rng(4)
    pw = cpu_kernels.pack_x12(jnp.asarray(_weights(rng, (64, 64))))
    x = jnp.asarray(rng.standard_normal((3, 64), np.float32))
    name = "dot" if cpu_kernels.bf16_kernel() == "dot" else "widen"
    want = cpu_kernels.packed_matmul(x, pw, target=_targets()[name])
    np.testing.assert_array_equal(np.asarray(cpu_kernels.packed_matmul(x, pw)),
                                  np.asarray(want))


@pytest.mark.parametrize("kw", [dict(dtype="float32", cpu_matmul="packed"),
                                dict(dtype="bfloat16", cpu_matmul="xla"),
                                dict(dtype="bfloat16", cpu_matmul="packed", quantization="int8")])
def test_the_runner_refuses_what_it_cannot_compress(kw):
    with pytest.raises(ValueError, match="compress_weights stores bfloat16 weights"):
        RunnerConfig(compress_weights=True, **kw)


def test_serve_refuses_compress_weights_without_bf16():
    """A usage error before anything loads, naming the flag to add."""
    serve = Path(__file__).resolve().parent.parent / "scripts" / "serve.py"
    proc = subprocess.run([sys.executable, str(serve), "--compress_weights"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "pass --dtype=bfloat16" in proc.stderr
