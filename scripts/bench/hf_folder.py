"""Write Hugging Face folders (config.json + safetensors shards) without holding them in
memory: the benchmark's random 8B-shaped checkpoint and the tests' tiny FP8 ones.

A shard is written tensor by tensor from `fill(name) -> array`, so the writer's memory is
one tensor; shards split at `shard_bytes` as real releases do (~5 GB), with the
`model.safetensors.index.json` that maps each tensor to its file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import ml_dtypes
import numpy as np

ST_NAMES = {np.dtype(np.float32): "F32", np.dtype(ml_dtypes.bfloat16): "BF16",
            np.dtype(np.float16): "F16", np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3",
            np.dtype(np.int8): "I8", np.dtype(np.uint8): "U8"}
Spec = tuple[str, tuple[int, ...], np.dtype]  # name, shape, dtype


def _nbytes(spec: Spec) -> int:
    return int(np.prod(spec[1], dtype=np.int64)) * np.dtype(spec[2]).itemsize


def write_shard(path: str, specs: list[Spec], fill: Callable[[str], np.ndarray]) -> None:
    header, offset = {}, 0
    for name, shape, dtype in specs:
        n = _nbytes((name, shape, dtype))
        header[name] = {"dtype": ST_NAMES[np.dtype(dtype)], "shape": list(shape),
                        "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for name, shape, dtype in specs:
            arr = np.ascontiguousarray(fill(name), dtype=dtype)
            assert arr.shape == tuple(shape), (name, arr.shape, shape)
            f.write(arr.reshape(-1).view(np.uint8).data)


def write_folder(folder: str, config: dict, specs: list[Spec],
                 fill: Callable[[str], np.ndarray], shard_bytes: int = 5 << 30) -> list[str]:
    """config.json, shards of at most ~shard_bytes (one tensor may exceed it) and the
    index; returns the shard paths."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    groups: list[list[Spec]] = [[]]
    size = 0
    for spec in specs:
        if groups[-1] and size + _nbytes(spec) > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(spec)
        size += _nbytes(spec)
    paths, weight_map = [], {}
    for i, group in enumerate(groups):
        name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        write_shard(os.path.join(folder, name), group, fill)
        paths.append(os.path.join(folder, name))
        weight_map.update({s[0]: name for s in group})
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return paths


def llama_config(hidden: int, ffn: int, layers: int, heads: int, kv_heads: int,
                 vocab: int) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": hidden, "intermediate_size": ffn, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv_heads,
            "vocab_size": vocab, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
            "max_position_embeddings": 8192, "tie_word_embeddings": False,
            "torch_dtype": "bfloat16", "bos_token_id": 128000, "eos_token_id": 128001}


def llama_specs(cfg: dict, dtype: np.dtype) -> list[Spec]:
    """Every tensor of a Llama checkpoint, in the order releases store them."""
    d, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    dh = d // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * dh, cfg["num_key_value_heads"] * dh
    specs: list[Spec] = [("model.embed_tokens.weight", (v, d), dtype)]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        specs += [(p + "input_layernorm.weight", (d,), dtype),
                  (p + "self_attn.q_proj.weight", (q, d), dtype),
                  (p + "self_attn.k_proj.weight", (kv, d), dtype),
                  (p + "self_attn.v_proj.weight", (kv, d), dtype),
                  (p + "self_attn.o_proj.weight", (d, q), dtype),
                  (p + "post_attention_layernorm.weight", (d,), dtype),
                  (p + "mlp.gate_proj.weight", (f, d), dtype),
                  (p + "mlp.up_proj.weight", (f, d), dtype),
                  (p + "mlp.down_proj.weight", (d, f), dtype)]
    return specs + [("model.norm.weight", (d,), dtype), ("lm_head.weight", (v, d), dtype)]


def quantize_fp8_blocks(w: np.ndarray, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """w [out, in] f32 -> (e4m3 [out, in], scale_inv f32 [ceil(out/bo), ceil(in/bi)]) with
    W ~= q * scale per block, each block's largest magnitude at e4m3's 448."""
    bo, bi = block
    so, si = -(-w.shape[0] // bo), -(-w.shape[1] // bi)
    pad = np.zeros((so * bo, si * bi), np.float32)
    pad[:w.shape[0], :w.shape[1]] = w
    blocks = pad.reshape(so, bo, si, bi)
    scale = np.maximum(np.abs(blocks).max(axis=(1, 3)), 1e-12) / 448.0  # [so, si]
    q = (blocks / scale[:, None, :, None]).reshape(pad.shape)[:w.shape[0], :w.shape[1]]
    return q.astype(ml_dtypes.float8_e4m3fn), scale.astype(np.float32)
