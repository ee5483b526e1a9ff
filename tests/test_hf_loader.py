"""Hugging Face folders straight onto the device (runtime/hf_loader.py), FP8 checkpoints
(runtime/fp8_checkpoint.py, models/fp8.py) and the errors they raise."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file

from models.fp8 import Fp8Weight, dequantize, fp8_linear
from runtime import checkpoint, hf_loader, sharding
from runtime.checkpoint import CheckpointError

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tests" / "fixtures" / "tiny_models"
sys.path.insert(0, str(ROOT / "scripts" / "bench"))
import hf_folder  # noqa: E402

# The projection weights FP8 checkpoints quantize: attention (MLA's too), MLPs and every
# expert's (DeepSeek-V3 / Qwen3-MoE FP8 releases); routers and norms stay as they are.
_PROJ = re.compile(r"_proj(_with_mqa)?\.weight$")


def _flat(params: dict) -> dict:
    return checkpoint._flatten(params)


@pytest.mark.parametrize("name", sorted(p.name for p in TINY.iterdir()))
def test_restore_equals_f32_import(name):
    """Every family's fixture folder: the direct restore holds what the f32 importer reads."""
    _, ref = checkpoint.load_hf_safetensors(str(TINY / name))
    _, got, stats = hf_loader.restore_hf(str(TINY / name), "float32")
    ref, got = _flat(ref), _flat(got)
    assert ref.keys() == got.keys()
    for k in ref:
        assert got[k].dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(got[k]), ref[k], err_msg=k)
    assert stats.params_bytes == sum(v.nbytes for v in ref.values())


def test_bf16_restores_as_bf16(tmp_path):
    _, ref = checkpoint.load_hf_safetensors(str(TINY / "llama_untied"))
    _, got, _ = hf_loader.restore_hf(str(TINY / "llama_untied"), "bfloat16")
    for k, v in _flat(got).items():
        assert v.dtype == jnp.bfloat16, k
        np.testing.assert_array_equal(np.asarray(v),
                                      _flat(ref)[k].astype(ml_dtypes.bfloat16), err_msg=k)


def test_restore_onto_mesh():
    if jax.device_count() < 4:
        pytest.skip("needs 4 (fake) devices: tests/conftest.py sets them")
    mesh = sharding.make_mesh(dp=2, tp=2)
    cfg, got, _ = hf_loader.restore_hf(str(TINY / "llama_untied"), "float32", mesh=mesh)
    _, ref = checkpoint.load_hf_safetensors(str(TINY / "llama_untied"))
    want = _flat(sharding.param_shardings(cfg, mesh))
    for k, v in _flat(got).items():
        assert v.sharding.is_equivalent_to(want[k], v.ndim), k
        np.testing.assert_array_equal(np.asarray(v), _flat(ref)[k], err_msg=k)


# ---------------------------------------------------------------- FP8


def _fp8_copy(tmp_path: Path, block: tuple[int, int] | None, per_channel: bool = False,
              model: str = "llama_untied") -> tuple[Path, Path]:
    """A tiny fixture (the Llama unless `model`) quantized to e4m3 (per block, or per
    output channel as compressed-tensors ships it), and the same weights dequantized in
    f32."""
    src = TINY / model
    raw = load_file(str(src / "model.safetensors"))
    fp8, deq = {}, {}
    for name, w in raw.items():
        if not _PROJ.search(name):
            fp8[name] = deq[name] = w
            continue
        b = (1, w.shape[1]) if per_channel else block
        q, s = hf_folder.quantize_fp8_blocks(w, b)
        fp8[name] = q
        fp8[name + ("_scale" if per_channel else "_scale_inv")] = s
        scale = np.repeat(np.repeat(s, b[0], 0), b[1], 1)[:w.shape[0], :w.shape[1]]
        deq[name] = q.astype(np.float32) * scale
    cfg = json.loads((src / "config.json").read_text())
    out = {}
    for kind, tensors in (("fp8", fp8), ("deq", deq)):
        folder = tmp_path / kind
        c = dict(cfg)
        if kind == "fp8":
            c["quantization_config"] = (
                {"quant_method": "compressed-tensors", "config_groups": {"group_0": {
                    "weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}}}
                if per_channel else {"quant_method": "fp8", "weight_block_size": list(block)})
        specs = [(n, t.shape, t.dtype) for n, t in tensors.items()]
        hf_folder.write_folder(str(folder), c, specs, tensors.__getitem__)
        out[kind] = folder
    return out["fp8"], out["deq"]


def _logits(params: dict, cfg) -> np.ndarray:
    from tests.model_utils import all_position_logits

    ref = np.load(TINY / "llama_untied" / "ref_logits.npz")
    return all_position_logits(params, cfg, ref["tokens"].tolist())


@pytest.mark.parametrize("block,per_channel", [((32, 32), False), ((128, 128), False),
                                               (None, True)])
def test_fp8_checkpoint_logits_match_dequantized(tmp_path, block, per_channel):
    fp8, deq = _fp8_copy(tmp_path, block, per_channel)
    cfg, ref_params = checkpoint.load_hf_safetensors(str(deq))
    ref = _logits(ref_params, cfg)
    # The CPU path: dequantized at load, to the serving dtype.
    _, params, _ = hf_loader.restore_hf(str(fp8), "float32")
    np.testing.assert_allclose(_logits(params, cfg), ref, atol=1e-5, rtol=1e-5)
    # The GPU path's weights: FP8 + scales behind layers.linear.
    _, kept, _ = hf_loader.restore_hf(str(fp8), "float32", keep_fp8=True)
    wq = kept["layers"]["wq"]
    assert isinstance(wq, Fp8Weight) and wq.w.dtype == jnp.float8_e4m3fn
    np.testing.assert_array_equal(np.asarray(dequantize(wq)), ref_params["layers"]["wq"])
    np.testing.assert_allclose(_logits(kept, cfg), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("rows", [1, 5, 40])
@pytest.mark.parametrize("block", [(128, 128), (64, 32), (200, 1), (200, 96)])
def test_fp8_linear_matches_dequantize_then_matmul(rows, block):
    k, n = 200, 96  # ragged blocks in both dims for the 128 x 128 case
    rng = np.random.default_rng(0)
    w = rng.standard_normal((n, k)).astype(np.float32)
    q, s = hf_folder.quantize_fp8_blocks(w, (block[1], block[0]))  # [out, in] order
    weight = Fp8Weight(jnp.asarray(q.T), jnp.asarray(s.T), block)  # ours: [in, out]
    x = jnp.asarray(rng.standard_normal((rows, k)), jnp.float32)
    want = x @ dequantize(weight)
    np.testing.assert_allclose(fp8_linear(x, weight), want, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(x @ weight, want, rtol=1e-5, atol=1e-4)  # __rmatmul__


@pytest.mark.parametrize("block,fuses", [((32, 32), True), ((64, 1), True), ((64, 48), False)])
def test_fp8_fused_projections(block, fuses):
    """wq|wk|wv fuse as one Fp8Weight where the column blocks line up (the GPU runner's
    default), and the fused product equals the separate ones."""
    from models.fp8 import concat_columns
    from models.layers import fuse_projections

    rng = np.random.default_rng(1)
    parts = {}
    for name, n in (("wq", 64), ("wk", 32), ("wv", 32)):
        q, s = hf_folder.quantize_fp8_blocks(rng.standard_normal((n, 64)).astype(np.float32),
                                             (block[1], block[0]))
        parts[name] = Fp8Weight(jnp.asarray(q.T), jnp.asarray(s.T), block)
    fused = fuse_projections({"layers": dict(parts)})["layers"]
    assert ("wqkv" in fused) == fuses and (concat_columns(list(parts.values())) is None) != fuses
    if fuses:
        x = jnp.asarray(rng.standard_normal((3, 64)), jnp.float32)
        want = jnp.concatenate([fp8_linear(x, parts[n]) for n in ("wq", "wk", "wv")], -1)
        np.testing.assert_allclose(fp8_linear(x, fused["wqkv"]), want, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- errors


@pytest.fixture
def fp8_folder(tmp_path) -> Path:
    return _fp8_copy(tmp_path, (32, 32))[0]


def _edit_config(folder: Path, **changes) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


def _rewrite(folder: Path, edit) -> Path:
    """Apply `edit` to the folder's {name: array} and write it back (one shard)."""
    shard = next(folder.glob("*.safetensors"))
    from runtime.checkpoint import _SafetensorsFile

    st = _SafetensorsFile(str(shard))
    tensors = {n: st.read_copy(n) for n in st.shapes}
    edit(tensors)
    hf_folder.write_shard(str(shard), [(n, t.shape, t.dtype) for n, t in tensors.items()],
                          tensors.__getitem__)
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": dict.fromkeys(tensors, shard.name)}))
    return shard


def test_unknown_quant_method(fp8_folder):
    _edit_config(fp8_folder, quantization_config={"quant_method": "awq"})
    with pytest.raises(CheckpointError, match=r"quant_method 'awq' is not supported") as e:
        hf_loader.restore_hf(str(fp8_folder))
    assert "config.json" in str(e.value)


def test_missing_scale(fp8_folder):
    name = "model.layers.1.mlp.up_proj.weight"
    shard = _rewrite(fp8_folder, lambda t: t.pop(name + "_scale_inv"))
    with pytest.raises(CheckpointError, match=rf"{name}.* no scale tensor") as e:
        hf_loader.restore_hf(str(fp8_folder))
    assert str(shard) in str(e.value)


def test_fp8_without_quantization_config(fp8_folder):
    cfg = json.loads((fp8_folder / "config.json").read_text())
    del cfg["quantization_config"]
    (fp8_folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"is F8_E4M3 but .*config.json has no "
                                              "quantization_config"):
        hf_loader.restore_hf(str(fp8_folder))


def test_wrong_scale_shape(fp8_folder):
    name = "model.layers.0.self_attn.o_proj.weight_scale_inv"
    _rewrite(fp8_folder, lambda t: t.__setitem__(name, np.ones((3, 3), np.float32)))
    with pytest.raises(CheckpointError, match=rf"{name}' has shape \(3, 3\), expected \(2, 2\)"):
        hf_loader.restore_hf(str(fp8_folder))


def test_integer_dtype_named(tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(TINY / "llama_untied", folder)
    name = "model.layers.0.mlp.down_proj.weight"
    (folder / "model.safetensors.index.json").unlink(missing_ok=True)
    shard = _rewrite(folder, lambda t: t.__setitem__(name, np.zeros(t[name].shape, np.int8)))
    with pytest.raises(CheckpointError, match=rf"{name}' has dtype 'I8'") as e:
        hf_loader.restore_hf(str(folder))
    assert str(shard) in str(e.value)


def test_wrong_weight_shape(tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(TINY / "llama_untied", folder)
    name = "model.layers.1.self_attn.k_proj.weight"
    _rewrite(folder, lambda t: t.__setitem__(name, np.zeros((8, 64), np.float32)))
    with pytest.raises(CheckpointError, match=rf"'{name}' has shape \(8, 64\), expected"):
        hf_loader.restore_hf(str(folder))


# ---------------------------------------------------------------- peak host memory


def test_peak_memory_within_one_shard(tmp_path):
    """A ~360 MB bf16 folder in 128 MiB shards: the loader's own host memory during the
    restore stays under 1.3x one shard (+ a constant for XLA's compilations), where the
    f32 import held the whole model in f32 (~2x the folder) at once."""
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench" / "bench_hf_load.py"),
         f"--out_dir={out}", f"--work_dir={tmp_path}", "--num_layers=8", "--hidden=1024",
         "--ffn=4096", "--vocab=32000", "--shard_gb=0.125"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "XLA_FLAGS": ""})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads((out / "bench_hf_load.json").read_text())
    run, shard = result["runs"]["hf"], result["largest_shard_bytes"]
    assert result["num_shards"] >= 3
    assert run["params_bytes"] > 2.5 * shard
    assert run["transient_bytes"] <= 1.3 * shard + (96 << 20), run
    assert not list(tmp_path.glob("hf_load_*"))  # the folder is deleted


# ---------------------------------------------------------------- serving


def test_load_model_serves_fp8_folder(tmp_path, caplog):
    """--model_path=<FP8 folder> on the CPU: dequantized at load to the serving dtype; the
    start-up log gives the load's time and host memory against the largest shard."""
    import logging

    from runtime.engine_setup import load_model
    from tests.engine_utils import engine_args

    fp8, deq = _fp8_copy(tmp_path, (32, 32))
    with caplog.at_level(logging.INFO, logger="runtime.engine_setup"):
        cfg, params, tokenizer = load_model(engine_args(model=str(fp8), dtype="float32"))
    msgs = [r.getMessage() for r in caplog.records]
    assert any(re.search(r"loaded .* in [\d.]+ s: 1 shard\(s\), largest .* peak RSS .* GiB = "
                         r"-?[\d.]+x the largest shard", m) for m in msgs), msgs
    assert tokenizer is None  # the fixture folder has no tokenizer.json
    _, ref = checkpoint.load_hf_safetensors(str(deq))
    for k, v in _flat(params).items():
        np.testing.assert_array_equal(np.asarray(v), _flat(ref)[k], err_msg=k)


def test_fp8_folder_onto_mesh_and_orbax(tmp_path):
    """Dequantized at load (the CPU path), FP8 weights land in their tensor-parallel
    shards; the conversion to orbax reads the folder the same way. (Kept FP8 on a mesh:
    tests/test_fp8_moe_mesh.py.)"""
    if jax.device_count() < 4:
        pytest.skip("needs 4 (fake) devices: tests/conftest.py sets them")
    fp8, deq = _fp8_copy(tmp_path, (32, 32))
    _, ref = checkpoint.load_hf_safetensors(str(deq))
    mesh = sharding.make_mesh(dp=1, tp=4)
    cfg, got, _ = hf_loader.restore_hf(str(fp8), "float32", mesh=mesh)
    want = _flat(sharding.param_shardings(cfg, mesh))
    for k, v in _flat(got).items():
        assert v.sharding.is_equivalent_to(want[k], v.ndim), k
        np.testing.assert_array_equal(np.asarray(v), _flat(ref)[k], err_msg=k)
    checkpoint.convert(str(fp8), str(tmp_path / "orbax"), "float32")
    _, restored = checkpoint.restore_checkpoint(str(tmp_path / "orbax"))
    for k, v in _flat(restored).items():
        np.testing.assert_array_equal(np.asarray(v), _flat(ref)[k], err_msg=k)


def test_runner_with_fp8_weights_generates_as_dequantized(tmp_path):
    """The GPU path's FP8 weights through the runner (per-layer buffers, fused
    projections) give the dequantized model's greedy tokens."""
    from runtime.request import SamplingParams
    from tests.engine_utils import check_same, each_alone, prompts, small_runner

    fp8, _ = _fp8_copy(tmp_path, (32, 32))
    cfg, kept, _ = hf_loader.restore_hf(str(fp8), "float32", keep_fp8=True)
    _, deq, _ = hf_loader.restore_hf(str(fp8), "float32")
    runner = small_runner(cfg, kept, fuse_projections=True)
    assert isinstance(runner.params["layer_list"][0]["wqkv"], Fp8Weight)
    greedy = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True, top_logprobs=2)
    ps = prompts(cfg.vocab_size)[:3]
    check_same(each_alone(runner, ps, greedy, 64),
               each_alone(small_runner(cfg, deq), ps, greedy, 64))
