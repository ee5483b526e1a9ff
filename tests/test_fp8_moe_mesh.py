"""FP8 weights kept FP8 (the GPU path, run here on the CPU) for MoE experts
(models/fp8.fp8_ragged_dot behind models/moe.py) and under tensor / expert parallelism
(scales split with their weights: runtime/sharding.fp8_scale_spec), against the same
weights dequantized, on the 4 fake CPU devices of tests/conftest.py."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from models import fp8, moe
from models.fp8 import FP8, Fp8Weight, dequantize, fp8_ragged_dot
from runtime import checkpoint, hf_loader, sharding
from runtime.checkpoint import CheckpointError
from tests.model_utils import TINY, all_position_logits
from tests.test_hf_loader import _fp8_copy

PAGE = 4
needs_4 = pytest.mark.skipif(jax.device_count() < 4,
                             reason="needs 4 (fake) devices: tests/conftest.py sets them")


@pytest.mark.parametrize("block,n", [((16, 8), 24), ((16, 8), 96), ((40, 1), 24),
                                     ((40, 24), 24)],
                         ids=["block-ragged-k", "block-ragged-k-by-pairs", "per-channel",
                              "per-tensor"])
@pytest.mark.parametrize("blocked_max_rows", [64, 1], ids=["blocked", "dequantized"])
def test_ragged_product_equals_dequantized(block, n, blocked_max_rows, monkeypatch):
    """Each of fp8_ragged_dot's products (K-block partials from (expert, K-block) groups
    where 2 * M * Kb <= N, else with the K-block as a batch dimension, weighed by each
    row's expert's scales; one dequantized copy past BLOCKED_MAX_ROWS rows per expert)
    equals ragged_dot over the dequantized experts, including an empty expert and a row
    past sum(sizes) (zeros)."""
    monkeypatch.setattr(fp8, "BLOCKED_MAX_ROWS", blocked_max_rows)
    e, k, m = 4, 40, 10
    kb, nb = -(-k // block[0]), -(-n // block[1])
    w = Fp8Weight(jax.random.normal(jax.random.key(1), (e, k, n)).astype(FP8),
                  jax.random.uniform(jax.random.key(2), (e, kb, nb), minval=0.5, maxval=2.0),
                  block)
    x = jax.random.normal(jax.random.key(0), (m, k))
    sizes = jnp.array([3, 0, 5, 1], jnp.int32)  # 9 real rows; row 9 is padding
    own = jnp.array([0, 0, 0, 2, 2, 2, 2, 2, 3, 3], jnp.int32)
    want = jax.lax.ragged_dot(x, dequantize(w), sizes)
    got = jax.jit(fp8_ragged_dot)(x, w, sizes, own)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4, rtol=1e-5)
    assert not np.asarray(got[9]).any()


def _logits(params: dict, cfg, tokens: list[int], mesh=None) -> np.ndarray:
    return all_position_logits(params, cfg, tokens, page_size=PAGE, mesh=mesh)


def _tokens(cfg) -> list[int]:
    return np.random.default_rng(0).integers(0, cfg.vocab_size, 19).tolist()


# Qwen3-MoE's FP8 experts also run, at model level, in the tp2-ep2 mesh test below.
@pytest.mark.parametrize("model", [pytest.param("qwen3_moe", marks=pytest.mark.slow),
                                   "deepseek_v3"])
def test_fp8_experts_match_dequantized(tmp_path, model):
    """A DeepSeek-V3 / Qwen3-MoE style folder with every projection FP8 (experts, shared
    expert, attention, MLA's, kv_b_proj included; 16 x 16 blocks, a ragged last K-block
    in DeepSeek's 24-wide experts): kept FP8 the experts stay e4m3 and the model's logits
    are the dequantized folder's; the MoE layer alone matches too, expert-parallel (ep=4)
    with each rank holding its experts' scales."""
    fp8_dir, deq_dir = _fp8_copy(tmp_path, (16, 16), model=model)
    cfg, kept, _ = hf_loader.restore_hf(str(fp8_dir), "float32", keep_fp8=True)
    _, deq = checkpoint.load_hf_safetensors(str(deq_dir))
    we = kept["layers"]["we_gate"]
    assert isinstance(we, Fp8Weight) and we.w.dtype == FP8
    assert isinstance(kept["layers"]["we_down"], Fp8Weight)
    np.testing.assert_array_equal(np.asarray(dequantize(we)), deq["layers"]["we_gate"])
    tokens = _tokens(cfg)
    np.testing.assert_allclose(_logits(kept, cfg, tokens), _logits(deq, cfg, tokens),
                               atol=1e-4, rtol=1e-4)

    lp = jax.tree.map(lambda w: w[0], kept["layers"])  # Fp8Weight.__getitem__ per leaf
    lp_deq = jax.tree.map(lambda w: w[0], deq["layers"])
    lp = {k: v for k, v in lp.items() if k in lp_deq and k in moe.mlp_shapes(cfg, 1)}
    lp_deq = {k: lp_deq[k] for k in lp}
    x = jax.random.normal(jax.random.key(3), (13, cfg.hidden_size))
    want = jax.jit(moe.MoeMlp(cfg))(lp_deq, x)
    got = jax.jit(moe.MoeMlp(cfg))(lp, x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
    if jax.device_count() >= 4:
        mesh = sharding.make_mesh(ep=4)
        ep4 = jax.jit(moe.MoeMlp(cfg, mesh))  # shard_map splits the experts and scales
        rep = NamedSharding(mesh, P())
        got = ep4(jax.device_put(lp, rep), jax.device_put(x, rep))
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


@needs_4
@pytest.mark.parametrize("model,block,mesh_shape", [
    ("llama_untied", (16, 16), dict(tp=2)),
    ("llama_untied", None, dict(tp=2)),  # per channel: row-parallel K under one scale
    ("qwen3_moe", (16, 16), dict(tp=2, ep=2)),
], ids=["llama-block-tp2", "llama-channel-tp2", "qwen3moe-tp2-ep2"])
def test_fp8_on_a_mesh_matches_one_device_and_dequantized(tmp_path, model, block, mesh_shape):
    """Kept FP8 on a tp (and ep) mesh: each weight's scale grid is split with it (column-
    parallel N with Nb, row-parallel K with Kb, experts with E), and the logits equal the
    one-device FP8 model's and the dequantized weights' (f32 tolerance)."""
    fp8_dir, deq_dir = _fp8_copy(tmp_path, block, per_channel=block is None, model=model)
    mesh = sharding.make_mesh(**mesh_shape)
    cfg, on_mesh, _ = hf_loader.restore_hf(str(fp8_dir), "float32", mesh=mesh, keep_fp8=True)
    _, one, _ = hf_loader.restore_hf(str(fp8_dir), "float32", keep_fp8=True)
    _, deq = checkpoint.load_hf_safetensors(str(deq_dir))
    lay = on_mesh["layers"]
    for key, split in (("wq", "N"), ("wk", "N"), ("wo", "K"), ("w_down", "K")):
        if key not in lay:
            continue
        w = lay[key]
        assert isinstance(w, Fp8Weight), key
        want = P(None, None, "tp") if split == "N" else P(None, "tp", None)
        assert w.w.sharding.is_equivalent_to(NamedSharding(mesh, want), 3), key
        scale_dim = 2 if split == "N" else 1
        whole = w.scale.shape[scale_dim] == 1  # per channel along K: one scale row
        assert w.scale.sharding.is_equivalent_to(
            NamedSharding(mesh, P() if whole else want), 3), (key, w.scale.sharding)
    if "we_gate" in lay:
        assert lay["we_gate"].scale.sharding.is_equivalent_to(
            NamedSharding(mesh, P(None, "ep")), 4)
    tokens = _tokens(cfg)
    got = _logits(on_mesh, cfg, tokens, mesh)
    np.testing.assert_allclose(got, _logits(one, cfg, tokens), atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(got, _logits(deq, cfg, tokens), atol=1e-4, rtol=1e-4)


@needs_4
def test_unaligned_fp8_split_is_refused_with_the_tensor_name(tmp_path):
    """tp=4 over 32-wide blocks: q_proj's 64 output columns would put 16 per device, half
    a scale block; the load (and the runner's placement of FP8 params) names the tensor."""
    fp8_dir, _ = _fp8_copy(tmp_path, (32, 32))
    mesh = sharding.make_mesh(tp=4)
    with pytest.raises(CheckpointError, match=r"q_proj\.weight \(wq\).*split 4 ways over "
                                              r"'tp' along N = 64: a shard's 16 of N is not "
                                              r"a whole number of blocks of 32"):
        hf_loader.restore_hf(str(fp8_dir), "float32", mesh=mesh, keep_fp8=True)
    cfg, one, _ = hf_loader.restore_hf(str(fp8_dir), "float32", keep_fp8=True)
    with pytest.raises(ValueError, match=r"\['layers'\]\['wo'\].*along K = 64: a shard's 16 of "
                                         r"K is not a whole number of blocks of 32"):
        sharding.fp8_shardings(one, sharding.param_shardings(cfg, mesh), mesh)


@pytest.mark.slow  # ~60 s: two runners compile; the mesh logits test covers the model
@needs_4
def test_runner_on_a_tp_mesh_with_fp8_weights_generates_as_dequantized(tmp_path):
    """The serving runner on a tp=2 mesh with FP8 weights (loaded onto the mesh, kept FP8)
    gives the one-device dequantized model's greedy tokens and logprobs."""
    from runtime.request import SamplingParams
    from tests.engine_utils import check_same, each_alone, prompts, small_runner

    fp8_dir, _ = _fp8_copy(tmp_path, (16, 16))
    cfg = checkpoint.load_hf_config(str(fp8_dir))
    mesh = sharding.serving_mesh(cfg, tp=2)
    _, kept, _ = hf_loader.restore_hf(str(fp8_dir), "float32", mesh=mesh, keep_fp8=True)
    _, deq, _ = hf_loader.restore_hf(str(fp8_dir), "float32")
    runner = small_runner(cfg, kept, mesh)
    assert isinstance(runner.params["layer_list"][0]["wo"], Fp8Weight)
    greedy = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True, top_logprobs=2)
    ps = prompts(cfg.vocab_size)[:3]
    check_same(each_alone(runner, ps, greedy, 64),
               each_alone(small_runner(cfg, deq), ps, greedy, 64))


def test_routed_expert_loop_takes_fp8_experts(monkeypatch):
    """The GPU's loop over the routed local experts (models/moe.py `_routed_experts`) indexes
    FP8 experts per trip (Fp8Weight[e]) and gives the dequantized experts' results."""
    rng = np.random.default_rng(5)
    n, d, f, block = 4, 32, 24, (16, 8)

    def fp8(key: int, k: int, cols: int) -> Fp8Weight:
        w = jax.random.normal(jax.random.key(key), (n, k, cols)) / np.sqrt(k)
        scale = jax.random.uniform(jax.random.key(key + 1),
                                   (n, -(-k // block[0]), -(-cols // block[1])),
                                   minval=0.5, maxval=2.0)
        return Fp8Weight(w.astype(FP8), scale, block)

    lp = {"we_gate": fp8(1, d, f), "we_up": fp8(3, d, f), "we_down": fp8(5, f, d)}
    deq = {k: dequantize(v) for k, v in lp.items()}
    cfg = dataclasses.replace(TINY, hidden_size=d, moe_intermediate_size=f)
    x = jnp.asarray(rng.standard_normal((2, 3, d)), jnp.float32)
    e = jnp.asarray(rng.choice(np.asarray([0, 2, n]), (2, 3)), jnp.int32)  # n: empty slot
    want = moe.experts(x, e, deq, cfg)
    monkeypatch.setattr(moe, "_on_gpu", lambda: True)
    monkeypatch.setattr(moe, "routed_loop_pays", lambda *a: True)
    assert not moe.tiled_kernel_fits(lp)  # FP8 experts keep XLA's products
    got = jax.jit(moe.experts, static_argnums=(3, 4))(x, e, lp, cfg, 6)
    real = np.asarray(e) < n
    np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real],
                               atol=1e-4, rtol=1e-4)
