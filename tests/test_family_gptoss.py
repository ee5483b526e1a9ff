"""gpt-oss (GptOssForCausalLM) against transformers' tiny random fixture
(scripts/make_reference.py --only=gptoss): config parsing, YaRN, MXFP4 dequantization,
the MoE block, prefill logits (f32, 1e-4), 32 greedy tokens through the Engine on the
plain path and with split prefill, and EP=4 with two-batch overlap equal to EP=1."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

from models import layers, moe, moe_overlap
from models.config import ModelConfig, RopeScaling
from runtime import checkpoint, mxfp4
from runtime.config import ServerArgs
from runtime.engine import Engine
from runtime.request import SamplingParams
from runtime.sharding import make_mesh
from tests.engine_utils import check_same
from tests.model_utils import all_position_logits

FOLDER = Path(__file__).parent / "fixtures" / "tiny_models" / "gpt_oss"
REF = np.load(FOLDER / "ref_logits.npz")
NEAR_TIE = 1e-3  # f32 against f32: only a top-2 gap this small may flip


@pytest.fixture(scope="module")
def model() -> tuple[ModelConfig, dict]:
    return checkpoint.load_hf_safetensors(str(FOLDER))


def test_config_from_hf():
    cfg = checkpoint.load_hf_config(str(FOLDER))
    assert (cfg.architecture, cfg.num_experts, cfg.num_experts_per_tok) == ("gpt_oss", 8, 2)
    assert cfg.moe_intermediate_size == 32 and cfg.attention_bias and cfg.attention_out_bias
    assert (cfg.router_bias, cfg.softmax_after_topk, cfg.expert_bias) == (True, True, True)
    assert (cfg.expert_act, cfg.swiglu_alpha, cfg.swiglu_limit) == ("clamped_swiglu", 1.702, 1.5)
    assert cfg.rope_scaling == RopeScaling(factor=32.0, original_max_position_embeddings=16,
                                           rope_type="yarn", beta_fast=32.0, beta_slow=1.0,
                                           truncate=False)
    assert ModelConfig.from_json(cfg.to_json()) == cfg


def test_yarn_matches_transformers():
    cfg = checkpoint.load_hf_config(str(FOLDER))
    inv = layers.rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    np.testing.assert_allclose(inv, REF["yarn_inv_freq"], rtol=1e-6)
    # Only the fastest dimension keeps its frequency over 16 original positions.
    assert inv[0] == 1.0 and np.allclose(inv[1:] * 32, 150000.0 ** (-np.arange(2, 16, 2) / 16),
                                         rtol=1e-5)
    assert layers.rope_attention_scale(cfg.rope_scaling) == pytest.approx(
        float(REF["yarn_attention_scaling"]), rel=1e-12)


def test_yarn_attention_factor_forms():
    yarn = RopeScaling(factor=40.0, rope_type="yarn", original_max_position_embeddings=4096)
    assert layers.rope_attention_scale(yarn) == pytest.approx(0.1 * math.log(40) + 1)
    # DeepSeek-V3: mscale == mscale_all_dim cancels (its softmax scale carries mscale^2).
    ds = RopeScaling(factor=40.0, rope_type="yarn", mscale=1.0, mscale_all_dim=1.0)
    assert layers.rope_attention_scale(ds) == 1.0
    given = RopeScaling(factor=40.0, rope_type="yarn", attention_factor=0.5)
    assert layers.rope_attention_scale(given) == 0.5
    assert layers.rope_attention_scale(RopeScaling()) == 1.0  # llama3: none
    # truncate (the default) rounds the ramp's ends to whole dimensions: Dh 64, theta 1e4,
    # 4096 positions, betas 32 / 1 -> dims [10.3, 22.9] -> ramp over [10, 23].
    inv = layers.rope_inv_freq(64, 1e4, yarn)
    base = 1e4 ** (-np.arange(0, 64, 2) / 64)
    np.testing.assert_allclose(inv[:11], base[:11], rtol=1e-6)
    np.testing.assert_allclose(inv[23:], base[23:] / 40, rtol=1e-6)
    ramp = np.clip((np.arange(32) - 10) / 13, 0, 1)
    np.testing.assert_allclose(inv, base / 40 * ramp + base * (1 - ramp), rtol=1e-5)


def test_mxfp4_dequantize_matches_transformers():
    got = mxfp4.dequantize(REF["mxfp4_blocks"], REF["mxfp4_scales"])  # [E, in, out]
    np.testing.assert_array_equal(got, REF["mxfp4_hf"])
    # One byte 0x2F (low nibble 0xF = -6, high 0x2 = 1.0) at exponent 2^(128-127).
    one = mxfp4.dequantize(np.full((1, 1, 16), 0x2F, np.uint8), np.full((1, 1), 128, np.uint8))
    assert one.shape == (32, 1) and list(one[:4, 0]) == [-12.0, 2.0, -12.0, 2.0]


def _mxfp4_folder(tmp: Path, rng: np.random.Generator) -> tuple[Path, dict[str, np.ndarray]]:
    """The fixture's weights with every layer's experts as MXFP4 pairs of random codes;
    returns the folder and each expert tensor's dequantized value."""
    owners = checkpoint._open_safetensors(str(FOLDER))
    tensors, want = {}, {}
    for name, st in owners.items():
        arr = np.asarray(st.read(name), np.float32)
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            e, d_in, d_out = arr.shape
            blocks = rng.integers(0, 256, (e, d_out, d_in // 32, 16), dtype=np.uint8)
            scales = rng.integers(122, 130, (e, d_out, d_in // 32), dtype=np.uint8)
            tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
            want[name] = mxfp4.dequantize(blocks, scales)
        else:
            tensors[name] = arr
    out = tmp / "mxfp4"
    out.mkdir()
    shutil.copy(FOLDER / "config.json", out / "config.json")
    save_file(tensors, str(out / "model.safetensors"))
    return out, want


def test_mxfp4_experts_load_dequantized(tmp_path):
    folder, want = _mxfp4_folder(tmp_path, np.random.default_rng(0))
    _, params = checkpoint.load_hf_safetensors(str(folder))
    for i in range(4):
        pre = f"model.layers.{i}.mlp.experts."
        np.testing.assert_array_equal(params["layers"]["we_gate_up"][i], want[pre + "gate_up_proj"])
        np.testing.assert_array_equal(params["layers"]["we_down"][i], want[pre + "down_proj"])


def test_mxfp4_without_scales_names_the_tensor_and_file(tmp_path):
    folder, _ = _mxfp4_folder(tmp_path, np.random.default_rng(1))
    path = folder / "model.safetensors"
    owners = checkpoint._open_safetensors(str(folder))
    name = "model.layers.2.mlp.experts.down_proj_scales"
    save_file({n: np.asarray(st.read(n)) for n, st in owners.items() if n != name}, str(path))
    with pytest.raises(checkpoint.CheckpointError,
                       match=r"model.safetensors: MXFP4 tensor 'model.layers.2.mlp.experts."
                             r"down_proj_blocks'.*no matching"):
        checkpoint.load_hf_safetensors(str(folder))


def test_moe_block_matches_transformers(model):
    cfg, params = model
    lp = jax.tree.map(lambda w: jnp.asarray(w[0]), params["layers"])
    got = jax.jit(moe.MoeMlp(cfg))(lp, jnp.asarray(REF["moe_in"]))
    np.testing.assert_allclose(np.asarray(got), REF["moe_out"], atol=1e-5, rtol=1e-5)


def test_moe_block_ep4_and_micro_batch_pair_equal_ep1():
    """gpt-oss's biased experts sharded over ep=4 (the biases with their experts), alone
    and as TBO's overlapped pair, equal the one-device block; 13 tokens pad to 16."""
    cfg = checkpoint.load_hf_config(str(FOLDER))
    lp = jax.tree.map(lambda w: w[1], moe.init_params(cfg, jax.random.key(0))["layers"])
    x = jax.random.normal(jax.random.key(1), (13, cfg.hidden_size))  # [T, D]
    want = np.asarray(jax.jit(moe.MoeMlp(cfg))(lp, x))
    mesh = make_mesh(ep=4)
    np.testing.assert_allclose(np.asarray(jax.jit(moe.MoeMlp(cfg, mesh))(lp, x)), want,
                               atol=1e-5, rtol=1e-5)
    ya, yb = jax.jit(lambda lp, a, b: moe_overlap.moe_pair(lp, a, b, cfg, mesh))(lp, x[:5], x[5:])
    np.testing.assert_allclose(np.concatenate([ya, yb]), want, atol=1e-5, rtol=1e-5)


# Pallas in interpret mode: ~30 s here, so with the slow tests (make test-slow).
@pytest.mark.parametrize("backend", ["xla", "cpu", pytest.param("pallas", marks=pytest.mark.slow)])
def test_prefill_logits_match_transformers(model, backend):
    cfg, params = model
    # Page size 4 with window 4: the sliding layers' keys span page boundaries.
    logits = all_position_logits(params, cfg, REF["tokens"].tolist(), page_size=4,
                                 attention_backend=backend)
    np.testing.assert_allclose(logits, REF["logits"], atol=1e-4, rtol=1e-4)
    # And the 20-token greedy prompt's last position.
    prompt = REF["p0_prompt_ids"].tolist()
    last = all_position_logits(params, cfg, prompt, page_size=4, attention_backend=backend)[-1]
    np.testing.assert_allclose(last, REF["p0_last_logits"], atol=1e-4, rtol=1e-4)


GREEDY = SamplingParams(temperature=0, max_new_tokens=32, ignore_eos=True, top_logprobs=2)


def _args(**kw) -> ServerArgs:
    base = dict(max_running_requests=4, decode_buckets=(4,), extend_token_buckets=(64,),
                kv_len_buckets=(64,), max_prefill_tokens=64,
                chunked_prefill_size=64, max_extend_seqs=2, max_total_tokens=1024, page_size=4,
                compilation_cache_dir=None, strict_compile=True, max_top_logprobs=2,
                attention_backend="xla", cpu_matmul="xla", disable_prefix_cache=True)
    return ServerArgs(**{**base, **kw})


def _prompts() -> list[list[int]]:
    """The fixture's prompt and three random ones of 7..30 tokens."""
    rng = np.random.default_rng(5)
    return [REF["p0_prompt_ids"].tolist(),
            *[rng.integers(3, 256, n).tolist() for n in (7, 30, 16)]]


@pytest.fixture(scope="module")
def plain(model) -> list:
    eng = Engine(_args(), model=model)
    outs = eng.generate(_prompts(), GREEDY)
    eng.runner.check_no_compiles()
    return outs


def test_greedy_32_matches_transformers(plain):
    margins = REF["p0_greedy_margins"]
    n = next((i for i, m in enumerate(margins) if m < NEAR_TIE), len(margins))
    assert n == 32, margins  # the fixture has no near-tie: every step is compared
    assert plain[0].output_ids == REF["p0_greedy_ids"].tolist()


def test_split_prefill_equals_plain(model, plain):
    eng = Engine(_args(enable_split_prefill=True, split_prefill_layers=2,
                       split_prefill_min_tokens=0), model=model)
    outs = eng.generate(_prompts(), GREEDY)
    check_same(outs, plain)
    # Two intervals of two layers each: a sliding and a full layer in each.
    assert all(o.meta_info["prefill_intervals"] >= 2 for o in outs)
    eng.runner.check_no_compiles()


def test_ep4_with_two_batch_overlap_equals_ep1(model, plain, monkeypatch):
    eng = Engine(_args(ep=4, enable_two_batch_overlap=True, tbo_min_tokens=0), model=model)
    tbo = eng.runner.paths["tbo"]
    ran = []
    forward = tbo.forward
    monkeypatch.setattr(tbo, "forward", lambda batch: ran.append(forward(batch)) or ran[-1])
    outs = eng.generate(_prompts(), GREEDY)
    check_same(outs, plain)
    assert sum(r is not None for r in ran) >= 10, "two-batch overlap ran too few steps"
    eng.runner.check_no_compiles()
