"""Checkpoint importers, orbax save/restore, sharding rules and error reporting.

Transformers is not needed here: scripts/make_reference.py recorded its answers in
tests/fixtures (SmolLM2 checksums and logits, tiny models' logits).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file, save_file

from models.config import ModelConfig
from models.llama import param_shapes
from runtime import checkpoint, sharding
from runtime.checkpoint import CheckpointError, load_gguf, load_hf_safetensors

FIXTURES = Path(__file__).parent / "fixtures"
TINY = FIXTURES / "tiny_models"
TINY_NAMES = ["llama3_untied", "qwen2_bias_tied", "llama_tied", "llama_untied"]
ROOT = Path(__file__).parent.parent


def leaves(params: dict) -> dict[str, np.ndarray]:
    flat = {k: v for k, v in params.items() if k != "layers"}
    flat.update({f"layers.{k}": v for k, v in params["layers"].items()})
    return flat


def assert_same(a: dict, b: dict, dtype: np.dtype = np.float32) -> None:
    la, lb = leaves(a), leaves(b)
    assert la.keys() == lb.keys()
    for k in la:
        np.testing.assert_array_equal(np.asarray(la[k]).astype(dtype),
                                      np.asarray(lb[k]).astype(dtype), err_msg=k)


# ---------------------------------------------------------------- GGUF writing helpers


def permute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of Q/K rows (what the importer undoes)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def gguf_tensors(cfg: ModelConfig, params: dict, permute: bool) -> dict[str, np.ndarray]:
    """Our layout -> llama.cpp names in HF [out, in] order."""
    lay = params["layers"]
    out = {"token_embd.weight": params["embed"], "output_norm.weight": params["final_norm"]}
    if not cfg.tie_word_embeddings:
        out["output.weight"] = params["lm_head"].T
    names = {"attn_norm": "attn_norm", "mlp_norm": "ffn_norm", "wq": "attn_q", "wk": "attn_k",
             "wv": "attn_v", "wo": "attn_output", "w_gate": "ffn_gate", "w_up": "ffn_up",
             "w_down": "ffn_down", "bq": "attn_q", "bk": "attn_k", "bv": "attn_v"}
    heads = {"wq": cfg.num_heads, "bq": cfg.num_heads, "wk": cfg.num_kv_heads,
             "bk": cfg.num_kv_heads}
    for i in range(cfg.num_layers):
        for key, name in names.items():
            if key not in lay:
                continue
            w = lay[key][i].T if lay[key].ndim == 3 else lay[key][i]
            if permute and key in heads:
                w = permute_rows(w, heads[key])
            kind = "bias" if key.startswith("b") else "weight"
            out[f"blk.{i}.{name}.{kind}"] = w
    return {k: np.ascontiguousarray(v, np.float32) for k, v in out.items()}


def write_gguf(path: Path, cfg: ModelConfig, tensors: dict[str, np.ndarray],
               arch: str = "llama") -> Path:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for name, arr in tensors.items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny_llama() -> tuple[ModelConfig, dict]:
    return load_hf_safetensors(str(TINY / "llama_untied"))


@pytest.fixture
def tiny_gguf(tmp_path: Path, tiny_llama) -> Path:
    cfg, params = tiny_llama
    return write_gguf(tmp_path / "tiny.gguf", cfg, gguf_tensors(cfg, params, permute=True))


# ---------------------------------------------------------------- SmolLM2 GGUF


@pytest.fixture(scope="module")
def smollm2() -> tuple[ModelConfig, dict]:
    return load_gguf(checkpoint.default_gguf_path())


@pytest.fixture(scope="module")
def smollm2_ref() -> dict:
    return json.loads((FIXTURES / "smollm2_reference.json").read_text())


def test_smollm2_config_and_shapes(smollm2):
    cfg, params = smollm2
    assert (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == (30, 576, 1536)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (9, 3, 64)
    assert cfg.tie_word_embeddings and not cfg.attention_bias
    assert cfg.rope_theta == 1e5 and cfg.rms_norm_eps == 1e-5 and cfg.vocab_size == 49152
    assert cfg.max_position_embeddings == 8192 and cfg.rope_scaling is None
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == (2,)
    got = jax.tree.map(lambda a: a.shape, params)
    assert got == param_shapes(cfg)
    assert all(a.dtype == np.float32 for a in leaves(params).values())
    assert sum(a.size for a in leaves(params).values()) == 134_515_008


def test_smollm2_weights_equal_transformers(smollm2, smollm2_ref):
    """transformers' state_dict checksums ([out, in]); the Q/K rows straddle head halves,
    so a missing or wrong un-permutation fails here."""
    _, params = smollm2
    lay = params["layers"]
    ours = {"model.layers.0.self_attn.q_proj.weight": lay["wq"][0].T,
            "model.layers.5.self_attn.k_proj.weight": lay["wk"][5].T,
            "model.layers.29.mlp.down_proj.weight": lay["w_down"][29].T,
            "model.embed_tokens.weight": params["embed"]}
    for name, w in ours.items():
        ref = smollm2_ref["checksums"][name]
        assert list(w.shape) == ref["shape"], name
        np.testing.assert_array_equal(w[np.ix_(ref["rows"], ref["cols"])], ref["values"], name)
        np.testing.assert_allclose(w.astype(np.float64).sum(), ref["sum"], rtol=1e-9, atol=1e-6)
        np.testing.assert_allclose(np.abs(w.astype(np.float64)).sum(), ref["abs_sum"],
                                   rtol=1e-9)


def test_smollm2_logits_match_reference(smollm2):
    """A plain numpy forward on the imported weights reproduces transformers' logits."""
    from tests.model_utils import dense_llama_logits

    cfg, params = smollm2
    ref = np.load(FIXTURES / "smollm2_reference.npz")
    logits = dense_llama_logits(params, cfg, ref["p0_prompt_ids"].tolist())[-1]  # [V]
    np.testing.assert_allclose(logits, ref["p0_last_logits"], atol=2e-3, rtol=0)
    assert int(np.argmax(logits)) == int(ref["p0_greedy_ids"][0]) == 504


# ---------------------------------------------------------------- HF safetensors


@pytest.mark.parametrize("name", TINY_NAMES)
def test_tiny_safetensors_import(name):
    cfg, params = load_hf_safetensors(str(TINY / name))
    assert jax.tree.map(lambda a: a.shape, params) == param_shapes(cfg)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (2, 64, 4, 2)
    assert cfg.tie_word_embeddings == name.endswith("_tied")
    assert cfg.attention_bias == name.startswith("qwen2")
    assert (cfg.rope_scaling is not None) == name.startswith("llama3")
    if name.startswith("llama3"):
        assert cfg.rope_scaling.original_max_position_embeddings == 32
        assert cfg.rope_scaling.factor == 8.0


@pytest.mark.parametrize("name", ["llama3_untied", "llama_untied", "llama_tied"])
def test_tiny_weights_equal_safetensors(name):
    """Transposition and stacking against the raw file (f32 models; the index-sharded one
    included)."""
    folder = TINY / name
    raw: dict[str, np.ndarray] = {}
    for f in folder.glob("*.safetensors"):
        raw.update(load_file(str(f)))
    cfg, params = load_hf_safetensors(str(folder))
    np.testing.assert_array_equal(params["embed"], raw["model.embed_tokens.weight"])
    np.testing.assert_array_equal(params["layers"]["wk"][1],
                                  raw["model.layers.1.self_attn.k_proj.weight"].T)
    np.testing.assert_array_equal(params["layers"]["w_down"][0],
                                  raw["model.layers.0.mlp.down_proj.weight"].T)
    if not cfg.tie_word_embeddings:
        np.testing.assert_array_equal(params["lm_head"], raw["lm_head.weight"].T)


@pytest.mark.parametrize("name", TINY_NAMES)
def test_tiny_logits_match_transformers(name):
    from tests.model_utils import dense_llama_logits

    cfg, params = load_hf_safetensors(str(TINY / name))
    ref = np.load(TINY / name / "ref_logits.npz")
    logits = dense_llama_logits(params, cfg, ref["tokens"].tolist())  # [T, V]
    np.testing.assert_allclose(logits, ref["logits"], atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------- tiny GGUF


def test_tiny_gguf_unpermutes_to_hf(tiny_gguf, tiny_llama):
    cfg, params = tiny_llama
    gcfg, gparams = load_gguf(str(tiny_gguf))
    assert gcfg.num_kv_heads == 2 and not gcfg.tie_word_embeddings
    assert gcfg.rms_norm_eps == cfg.rms_norm_eps and gcfg.rope_theta == cfg.rope_theta
    assert_same(gparams, params)


def test_qwen2_gguf_is_not_permuted(tmp_path):
    cfg, params = load_hf_safetensors(str(TINY / "qwen2_bias_tied"))
    path = write_gguf(tmp_path / "q.gguf", cfg, gguf_tensors(cfg, params, permute=False),
                      arch="qwen2")
    gcfg, gparams = load_gguf(str(path))
    assert gcfg.architecture == "qwen2" and gcfg.attention_bias and gcfg.tie_word_embeddings
    assert_same(gparams, params)


# ---------------------------------------------------------------- orbax


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_orbax_round_trip(tmp_path, tiny_llama, dtype):
    cfg, params = tiny_llama
    out = checkpoint.save_checkpoint(str(tmp_path / "ck"), cfg, params, dtype)
    assert os.path.isabs(out)
    cfg2, restored = checkpoint.restore_checkpoint(out)
    assert cfg2 == cfg
    np_dtype = checkpoint.DTYPES[dtype]
    assert all(a.dtype == np_dtype for a in leaves(restored).values())
    assert_same(restored, jax.tree.map(lambda a: a.astype(np_dtype), params), np_dtype)
    assert json.loads((tmp_path / "ck" / "checkpoint_meta.json").read_text())["dtype"] == dtype
    assert ModelConfig.from_json((tmp_path / "ck" / "model_config.json").read_text()) == cfg


def test_orbax_casts_on_restore(tmp_path, tiny_llama):
    cfg, params = tiny_llama
    out = checkpoint.save_checkpoint(str(tmp_path / "ck"), cfg, params, "float32")
    _, bf = checkpoint.restore_checkpoint(out, dtype="bfloat16")
    assert bf["layers"]["wq"].dtype == jnp.bfloat16
    assert_same(bf, jax.tree.map(lambda a: a.astype(ml_dtypes.bfloat16), params),
                ml_dtypes.bfloat16)


def _need_devices(n: int) -> None:
    if jax.device_count() < n:
        pytest.skip(f"needs {n} devices (XLA_FLAGS=--xla_force_host_platform_device_count)")


@pytest.mark.parametrize("dp,tp", [(1, 4), (2, 2)])
def test_restore_onto_mesh(tmp_path, tiny_llama, dp, tp):
    _need_devices(4)
    cfg, params = tiny_llama
    out = checkpoint.save_checkpoint(str(tmp_path / "ck"), cfg, params, "float32")
    mesh = sharding.make_mesh(dp=dp, tp=tp)
    assert dict(mesh.shape) == {"dp": dp, "tp": tp, "ep": 1}
    _, restored = checkpoint.restore_checkpoint(out, mesh=mesh)
    lay = restored["layers"]
    # 4 query heads split on tp; 2 KV heads only when tp divides them.
    kv = "tp" if tp == 2 else None
    expect = {"wq": P(None, None, "tp"), "wk": P(None, None, kv), "wo": P(None, "tp", None),
              "w_up": P(None, None, "tp"), "w_down": P(None, "tp", None),
              "attn_norm": P(None, None)}
    for key, spec in expect.items():
        assert lay[key].sharding.mesh.shape == mesh.shape
        assert lay[key].sharding.spec == spec, key
    assert restored["embed"].sharding.spec == P("tp", None)
    assert restored["lm_head"].sharding.spec == P(None, "tp")
    assert restored["final_norm"].sharding.spec == P(None)
    shard = lay["wq"].addressable_shards[0].data
    assert shard.shape == (2, 64, 64 // tp)  # [L, D, Hq*Dh / tp]
    assert len(lay["wq"].addressable_shards) == 4
    assert_same(restored, params)


def test_restore_with_explicit_shardings(tmp_path, tiny_llama):
    _need_devices(4)
    cfg, params = tiny_llama
    out = checkpoint.save_checkpoint(str(tmp_path / "ck"), cfg, params, "bfloat16")
    mesh = sharding.make_mesh(dp=4, tp=1)
    replicated = jax.sharding.NamedSharding(mesh, P())
    _, restored = checkpoint.restore_checkpoint(out, dtype="float32", shardings=replicated)
    assert restored["layers"]["wq"].sharding == replicated
    assert restored["layers"]["wq"].dtype == jnp.float32


def test_smollm2_tp_rules(smollm2):
    """9 query / 3 KV heads: tp=4 cannot split heads, so attention stays replicated while
    vocab (49152) and FFN (1536) still split."""
    _need_devices(4)
    cfg, _ = smollm2
    specs = sharding.param_specs(cfg, sharding.make_mesh(tp=4))
    assert specs["embed"] == P("tp", None) and "lm_head" not in specs
    assert specs["layers"]["wq"] == P(None, None, None)
    assert specs["layers"]["wo"] == P(None, None, None)
    assert specs["layers"]["w_gate"] == P(None, None, "tp")
    assert specs["layers"]["w_down"] == P(None, "tp", None)
    specs3 = sharding.param_specs(cfg, sharding.make_mesh(tp=3, devices=jax.devices()[:3]))
    assert specs3["layers"]["wq"] == P(None, None, "tp")
    assert specs3["layers"]["wk"] == P(None, None, "tp")
    assert specs3["embed"] == P("tp", None)


def test_logical_to_spec_counts_heads(tiny_llama):
    """`kv_heads` splits whole heads whether the dim is fused [Hkv*Dh] or a KV cache's [Hkv]."""
    _need_devices(4)
    cfg, _ = tiny_llama  # 4 query heads, 2 KV heads of 16
    mesh = sharding.make_mesh(dp=2, tp=2)
    cache_axes = (None, None, "kv_heads", None)
    assert sharding.logical_to_spec(cache_axes, (8, 16, 2, 16), mesh, cfg) == P(
        None, None, "tp", None)
    tp4 = sharding.make_mesh(tp=4)
    assert sharding.logical_to_spec(cache_axes, (8, 16, 2, 16), tp4, cfg) == P(
        None, None, None, None)
    assert sharding.logical_to_spec(("embed", "q_heads"), (64, 64), tp4, cfg) == P(None, "tp")


def test_make_mesh_rejects_too_many_devices():
    with pytest.raises(ValueError, match="needs"):
        sharding.make_mesh(dp=4, tp=jax.device_count())


# ---------------------------------------------------------------- default checkpoint


def test_ensure_default_checkpoint(tmp_path, tiny_gguf, monkeypatch, capsys):
    monkeypatch.setattr(checkpoint, "default_gguf_path", lambda: str(tiny_gguf))
    path = checkpoint.ensure_default_checkpoint(str(tmp_path / "cache"))
    assert path == str(tmp_path / "cache" / "smollm2-135m-instruct-float32")
    assert os.listdir(tmp_path / "cache") == ["smollm2-135m-instruct-float32"]  # no temp dir
    assert checkpoint.read_tokenizer_source(path) == str(tiny_gguf)
    assert "imported" in capsys.readouterr().out

    def boom(*args, **kwargs):
        raise AssertionError("must not convert again")

    monkeypatch.setattr(checkpoint, "convert", boom)
    assert checkpoint.ensure_default_checkpoint(str(tmp_path / "cache")) == path


def test_ensure_default_checkpoint_crash_leaves_nothing(tmp_path, tiny_gguf, monkeypatch):
    monkeypatch.setattr(checkpoint, "default_gguf_path", lambda: str(tiny_gguf))

    def crash(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint, "save_checkpoint", crash)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.ensure_default_checkpoint(str(tmp_path / "cache"), dtype="bfloat16")
    assert os.listdir(tmp_path / "cache") == []


def test_convert_script(tmp_path):
    out = tmp_path / "ck"
    res = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "convert_checkpoint.py"),
         f"--input={TINY / 'qwen2_bias_tied'}", f"--output={out}", "--dtype=bfloat16"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert res.returncode == 0, res.stderr
    assert "converted qwen2" in res.stdout
    cfg, _ = checkpoint.read_checkpoint_info(str(out))
    assert cfg.attention_bias


# ---------------------------------------------------------------- bad inputs


def test_gguf_missing_tensor(tmp_path, tiny_llama):
    cfg, params = tiny_llama
    tensors = gguf_tensors(cfg, params, permute=True)
    del tensors["blk.1.ffn_up.weight"]
    path = write_gguf(tmp_path / "m.gguf", cfg, tensors)
    with pytest.raises(CheckpointError, match=r"missing tensor.*blk\.1\.ffn_up\.weight") as e:
        load_gguf(str(path))
    assert str(path) in str(e.value)


def test_gguf_shape_mismatch(tmp_path, tiny_llama):
    cfg, params = tiny_llama
    tensors = gguf_tensors(cfg, params, permute=True)
    tensors["blk.0.attn_k.weight"] = np.zeros((48, 64), np.float32)
    path = write_gguf(tmp_path / "s.gguf", cfg, tensors)
    with pytest.raises(CheckpointError, match=r"blk\.0\.attn_k\.weight.*\(48, 64\).*\(32, 64\)"):
        load_gguf(str(path))


def test_gguf_unknown_architecture(tmp_path, tiny_llama):
    cfg, params = tiny_llama
    path = write_gguf(tmp_path / "a.gguf", cfg, gguf_tensors(cfg, params, True), arch="mamba")
    with pytest.raises(CheckpointError, match="unknown architecture 'mamba'"):
        load_gguf(str(path))


def test_gguf_truncated_mid_tensor(tmp_path, tiny_gguf):
    data = tiny_gguf.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match=r"truncated GGUF: tensor '.+' needs bytes") as e:
        load_gguf(str(cut))
    assert str(cut) in str(e.value)


def test_smollm2_truncated(tmp_path):
    """The real file cut inside a Q4_1 tensor and inside the tokenizer metadata."""
    src = checkpoint.default_gguf_path()
    with open(src, "rb") as f:
        head = f.read(50_000_000)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(head)
    with pytest.raises(CheckpointError, match=r"tensor 'blk\.\d+\.\w+\.weight' needs bytes"):
        load_gguf(str(cut))
    cut.write_bytes(head[:1_000_000])
    with pytest.raises(CheckpointError, match="corrupt or truncated GGUF"):
        load_gguf(str(cut))


def test_not_a_gguf(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_text("this is plain text, not a model")
    with pytest.raises(CheckpointError, match="not a GGUF file") as e:
        load_gguf(str(bad))
    assert str(bad) in str(e.value)
    with pytest.raises(CheckpointError, match="no such GGUF file"):
        load_gguf(str(tmp_path / "absent.gguf"))


@pytest.fixture
def tiny_copy(tmp_path) -> Path:
    dst = tmp_path / "model"
    shutil.copytree(TINY / "llama_untied", dst)
    return dst


def test_safetensors_missing_tensor(tiny_copy):
    st = tiny_copy / "model.safetensors"
    tensors = load_file(str(st))
    del tensors["model.layers.1.self_attn.o_proj.weight"]
    save_file(tensors, str(st))
    with pytest.raises(CheckpointError,
                       match=r"missing tensor.*model\.layers\.1\.self_attn\.o_proj\.weight"):
        load_hf_safetensors(str(tiny_copy))


def test_safetensors_shape_mismatch(tiny_copy):
    st = tiny_copy / "model.safetensors"
    tensors = load_file(str(st))
    tensors["model.norm.weight"] = np.ones(65, np.float32)
    save_file(tensors, str(st))
    with pytest.raises(CheckpointError, match=r"'model\.norm\.weight' has shape \(65,\)"):
        load_hf_safetensors(str(tiny_copy))


def test_safetensors_unknown_architecture(tiny_copy):
    cfg = json.loads((tiny_copy / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (tiny_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="GPT2LMHeadModel") as e:
        load_hf_safetensors(str(tiny_copy))
    assert "config.json" in str(e.value)


def test_safetensors_corrupt_header(tiny_copy):
    st = tiny_copy / "model.safetensors"
    data = st.read_bytes()
    st.write_bytes(data[:8] + b"{not json" + data[17:])
    with pytest.raises(CheckpointError, match="invalid safetensors header") as e:
        load_hf_safetensors(str(tiny_copy))
    assert str(st) in str(e.value)
    st.write_bytes(b"\xff" * 8 + data[8:])
    with pytest.raises(CheckpointError, match="invalid safetensors header length"):
        load_hf_safetensors(str(tiny_copy))


def test_safetensors_truncated(tiny_copy):
    st = tiny_copy / "model.safetensors"
    data = st.read_bytes()
    st.write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match=r"tensor '.+': data \[\d+, \d+\) does not hold"):
        load_hf_safetensors(str(tiny_copy))


def test_restore_rejects_incomplete_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        checkpoint.restore_checkpoint(str(tmp_path))


def test_restore_detects_config_mismatch(tmp_path, tiny_llama):
    cfg, params = tiny_llama
    out = checkpoint.save_checkpoint(str(tmp_path / "ck"), cfg, params)
    cfg_file = Path(out, checkpoint.CONFIG_FILE)
    cfg_file.write_text(dataclasses.replace(cfg, intermediate_size=96).to_json())
    with pytest.raises(CheckpointError, match=r"w_gate has shape \(2, 64, 128\), expected"):
        checkpoint.restore_checkpoint(out)
    cfg_file.write_text(dataclasses.replace(cfg, tie_word_embeddings=True).to_json())
    with pytest.raises(CheckpointError, match=r"unexpected \['lm_head'\]"):
        checkpoint.restore_checkpoint(out)
