"""Expert parallelism (models/moe.py) on the 4 fake CPU devices: EP=4 equals EP=1 (f32,
1e-5) with unbalanced routing, layer alone and whole model."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from models import moe, registry
from models.forward_batch import ForwardMode
from models.kv_pool import init_kv_pool
from runtime.batch_builder import BucketShape
from runtime.config import CacheConfig
from runtime.sharding import make_mesh
from tests.model_utils import SimpleRow, make_batch

CFG, PARAMS = registry.load_preset("tiny-moe")
PAGE = 4


def _unbalanced_layer(t: int, seed: int) -> tuple[dict, jax.Array]:
    """Layer 0 of tiny-moe with a router that sends 3/4 of the tokens to experts 0 and 1
    (both on rank 0), the rest to 0-5, none to 6 and 7 (rank 3 gets no token)."""
    rng = np.random.default_rng(seed)
    d = CFG.hidden_size
    u = rng.standard_normal(d)
    u /= np.linalg.norm(u)

    def orth(a: np.ndarray) -> np.ndarray:  # remove the u component of each row
        return a - (a @ u)[..., None] * u

    noise = orth(rng.standard_normal((t, d)))  # [T, D]
    main = np.arange(t) % 4 != 3
    x = np.where(main[:, None], u + 0.1 * noise, 0.5 * u + 2 * noise)
    router = np.zeros((d, CFG.num_experts))
    router[:, 0], router[:, 1], router[:, 6:] = 8 * u, 5 * u, -8 * u[:, None]
    router[:, 2:6] = orth(rng.standard_normal((4, d))).T / np.sqrt(d)
    lp = jax.tree.map(lambda w: w[0], PARAMS["layers"])
    return {**lp, "router": jnp.asarray(router, jnp.float32)}, jnp.asarray(x, jnp.float32)


@pytest.mark.parametrize("t", [32, 13])  # 13: tokens padded to a multiple of ep
def test_ep4_block_equals_ep1_with_unbalanced_routing(t):
    lp, x = _unbalanced_layer(t, seed=t)
    _, ids = moe.route(x, lp["router"], CFG)
    counts = np.bincount(np.asarray(ids).ravel(), minlength=CFG.num_experts)
    assert counts[0] >= 0.75 * t and counts[2:6].sum() > 0, counts
    assert counts[6] == counts[7] == 0, counts
    mesh = make_mesh(ep=4)
    ep4 = jax.jit(moe.MoeMlp(CFG, mesh))
    assert "all-to-all" in ep4.lower(lp, x).compile().as_text()
    want = jax.jit(moe.MoeMlp(CFG))(lp, x)
    np.testing.assert_allclose(np.asarray(ep4(lp, x)), np.asarray(want), atol=1e-5, rtol=1e-5)


def test_all_tokens_to_one_expert():
    """The worst case for the buffers: every pair goes to rank 0, nothing is dropped."""
    lp, x = _unbalanced_layer(16, seed=1)
    cfg = dataclasses.replace(CFG, num_experts_per_tok=2)
    router = jnp.zeros_like(lp["router"]).at[:, :2].set(lp["router"][:, :1] * 10)
    lp = {**lp, "router": router}
    _, ids = moe.route(x, router, cfg)
    assert set(np.asarray(ids).ravel()) <= {0, 1}
    got = jax.jit(moe.MoeMlp(cfg, make_mesh(ep=4)))(lp, x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(jax.jit(moe.MoeMlp(cfg))(lp, x)),
                               atol=1e-5, rtol=1e-5)


def test_ep4_model_equals_ep1_extend_then_decode():
    mesh = make_mesh(ep=4)
    rng = np.random.default_rng(0)
    a, b = (list(rng.integers(0, CFG.vocab_size, n)) for n in (11, 6))
    ext = make_batch(ForwardMode.EXTEND, [SimpleRow(a, 0, [1, 2, 3]), SimpleRow(b, 0, [4, 5])],
                     [], BucketShape(20, 2, 0, 3), PAGE)
    dec = make_batch(ForwardMode.DECODE, [], [SimpleRow([7], 11, [1, 2, 3]),
                                              SimpleRow([9], 6, [4, 5])],
                     BucketShape(0, 0, 3, 3), PAGE)
    outs = []
    for m in (None, mesh):
        fwd = jax.jit(lambda p, kv, batch, m=m: moe.forward(p, kv, batch, CFG, mesh=m))
        kv = init_kv_pool(CFG, CacheConfig(page_size=PAGE, num_pages=8), jnp.float32)
        l1, kv = fwd(PARAMS, kv, ext)
        l2, _ = fwd(PARAMS, kv, dec)
        outs.append((np.asarray(l1), np.asarray(l2)))
    # Logits reach |20|: the layers' f32 rounding differences (~1e-6 relative) show as up
    # to ~2e-5 absolute after 4 layers and the head.
    for got, want in zip(outs[1], outs[0], strict=True):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-5)
        np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))


def _gpt_oss_experts(rng: np.random.Generator, n: int) -> tuple:
    """gpt-oss's expert variant on tiny-moe's sizes: fused interleaved gate|up, biases on
    both products, the clamped SwiGLU; n local experts."""
    d, f = CFG.hidden_size, CFG.moe_intermediate_size
    cfg = dataclasses.replace(CFG, expert_bias=True, expert_act="clamped_swiglu",
                              swiglu_alpha=1.702, swiglu_limit=1.5)
    lp = {"we_gate_up": rng.standard_normal((n, d, 2 * f)) / np.sqrt(d),
          "be_gate_up": rng.standard_normal((n, 2 * f)),
          "we_down": rng.standard_normal((n, f, d)) / np.sqrt(f),
          "be_down": rng.standard_normal((n, d))}
    return cfg, {k: jnp.asarray(v, jnp.float32) for k, v in lp.items()}


def _gpu_path(monkeypatch, path: str) -> None:
    """models/moe.py's GPU expert product, as on a GPU: "loop", XLA's loop over the routed
    experts (forced for every token count); "kernel", the grouped Pallas kernel
    (interpreted on the CPU)."""
    monkeypatch.setattr(moe, "_on_gpu", lambda: True)
    monkeypatch.setattr(moe, "GPU_EXPERTS", "xla" if path == "loop" else "pallas")
    monkeypatch.setattr(moe, "routed_loop_pays", lambda *a: True)


@pytest.mark.parametrize("path", ["loop", "kernel"])
@pytest.mark.parametrize("variant", ["swiglu", "gpt_oss"])
def test_gpu_experts_equal_ragged_dot(variant, path, monkeypatch):
    """The GPU's expert products (models/moe.py: the loop over the routed local experts,
    `_routed_experts`, or the grouped kernel, `_tiled_experts`) give ragged_dot's results
    on every received pair, for random routings that leave experts empty (and one that
    routes nothing), with zeros in the empty slots."""
    rng = np.random.default_rng(3)
    n_local, r, c = 4, 4, 6
    if variant == "swiglu":
        cfg = CFG
        lp = {k: v[0, :n_local] for k, v in PARAMS["layers"].items()
              if k in ("we_gate", "we_up", "we_down")}
    else:
        cfg, lp = _gpt_oss_experts(rng, n_local)
    x = jnp.asarray(rng.standard_normal((r, c, CFG.hidden_size)), jnp.float32)
    for used in ([1], [0, 3], [0, 1, 2, 3], []):
        e = rng.choice(np.asarray(used + [n_local]), (r, c))  # n_local: an empty slot
        e = jnp.asarray(e, jnp.int32)
        want = moe.experts(x, e, lp, cfg)  # the CPU's ragged_dot
        _gpu_path(monkeypatch, path)
        # tokens = every slot: a group may fill all of them here (a real exchange has at
        # most one pair per token and expert; the EP tests below run shorter windows)
        got = jax.jit(moe.experts, static_argnums=(3, 4))(x, e, lp, cfg, r * c)
        monkeypatch.undo()
        real = np.asarray(e) < n_local
        np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real],
                                   atol=1e-5, rtol=1e-5)
        np.testing.assert_array_equal(np.asarray(got)[~real], 0)


@pytest.mark.parametrize("t", [1, 3, 13])  # padded to a multiple of ep: 3, 1 and 3 rows
def test_ep4_routed_expert_loop_equals_ep1(t, monkeypatch):
    """EP=4 with the routed-expert loop (a GPU's decode path with GPU_EXPERTS = "xla",
    forced here for every token count) equals EP=1's ragged_dot on the unbalanced routing;
    the padding rows send no pair (else their zero rows would route to experts 0 and 1).
    The grouped kernel has no EP=4 run here: Pallas' interpreter indexes a kernel's whole
    operands with grid indices that do not vary over `ep` while the operands do, which
    shard_map's type check refuses; its per-rank product is test_gpu_experts_equal_ragged_dot's,
    and tests/test_gpu_aot.py compiles it for eight GPUs."""
    lp, x = _unbalanced_layer(t, seed=t)
    want = jax.jit(moe.MoeMlp(CFG))(lp, x)
    _gpu_path(monkeypatch, "loop")
    got = jax.jit(moe.MoeMlp(CFG, make_mesh(ep=4)))(lp, x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


def test_padding_rows_send_no_pair():
    """One token on four ranks: the three padding rows' pairs go out empty, so only the
    token's top-k pairs reach the experts."""
    lp, x = _unbalanced_layer(1, seed=5)

    def sent(lp: dict, x: jax.Array) -> jax.Array:  # this rank's experts in lp
        prepare = moe.moe_stages(lp, CFG, moe.EP_AXIS, 4, tokens=1)[0]
        return prepare({"x": x})["send_e"][None]  # [1, R, C]

    xp = jnp.pad(x, ((0, 3), (0, 0)))
    specs = {k: P(moe.EP_AXIS) if k in moe.EXPERT_KEYS else P() for k in lp}
    f = jax.shard_map(sent, mesh=make_mesh(ep=4), in_specs=(specs, P(moe.EP_AXIS)),
                      out_specs=P(moe.EP_AXIS))
    send_e = np.asarray(jax.jit(f)(lp, xp))  # [4 ranks, R, C]
    n_local = CFG.num_experts // 4
    assert (send_e < n_local).sum() == CFG.num_experts_per_tok
    assert (send_e[1:] == n_local).all()


@pytest.mark.parametrize(("tokens", "pays"), [(1, True), (4, True), (8, False), (32, False)])
def test_routed_loop_pays_for_qwen3_30b_decode_at_ep8(tokens, pays):
    """Qwen3-30B-A3B at ep=8 (16 of 128 experts a GPU, top-8): the loop while a GPU expects
    at most a quarter of its experts routed (3.6 of 16 at 4 tokens, 6.3 at 8)."""
    assert moe.routed_loop_pays(16, 8, tokens, 8) is pays
