"""FP8 checkpoints: which quantization_config we read, and each weight's scale.

Two layouts ship today, both e4m3 weights [out, in] with float32 scales beside them:
- `quant_method: "fp8"` (transformers' FineGrainedFP8: DeepSeek-V3, Qwen3-FP8): per-block
  `<name>_scale_inv` [ceil(out / bo), ceil(in / bi)], `weight_block_size: [bo, bi]`;
  W = w * scale_inv (the name notwithstanding, it multiplies).
- `quant_method: "compressed-tensors"` or `"fbgemm_fp8"` (FP8-Dynamic exports):
  `<name>_scale` per channel [out, 1] or per tensor [] / [1]; static activation scales
  (`input_scale`) and KV-cache scales are not used (activations stay in the serving dtype).
Scales come back as [out-blocks, in-blocks] with their (out, in) block size, the one form
models/fp8.py needs. Every error names the field or tensor and its file.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import numpy as np

from runtime.checkpoint import CheckpointError

_SCALE_SUFFIX = {"fp8": "_scale_inv", "compressed-tensors": "_scale", "fbgemm_fp8": "_scale"}
# Tensors some FP8 exports carry that this loader does not need.
_UNUSED_SUFFIXES = ("input_scale", "k_scale", "v_scale", "input_scale_ub")


@dataclasses.dataclass(frozen=True)
class Fp8Scheme:
    method: str
    block: tuple[int, int] | None  # (out, in) of a per-block scheme
    where: str  # the config file, for errors

    def scale_name(self, weight: str) -> str:
        return weight + _SCALE_SUFFIX[self.method]


def _compressed_block(qc: dict, where: str) -> tuple[int, int] | None:
    """compressed-tensors: float 8-bit weights; the block of a `block` strategy."""
    for name, group in (qc.get("config_groups") or {}).items():
        w = (group or {}).get("weights") or {}
        if w.get("num_bits") != 8 or w.get("type") != "float":
            raise CheckpointError(
                f"{where}: quantization_config.config_groups.{name}.weights "
                f"(num_bits={w.get('num_bits')}, type={w.get('type')!r}) is not FP8; only "
                "8-bit float weights are supported")
        if w.get("strategy") == "block":
            b = w.get("block_structure") or []
            if len(b) != 2:
                raise CheckpointError(f"{where}: quantization_config.config_groups.{name}."
                                      f"weights.block_structure {b!r} is not [out, in]")
            return int(b[0]), int(b[1])
    return None


def scheme(config: dict, where: str) -> Fp8Scheme | None:
    """The FP8 scheme of a config.json dict (None: not quantized)."""
    qc = config.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method not in _SCALE_SUFFIX:
        raise CheckpointError(f"{where}: quantization_config.quant_method {method!r} is not "
                              f"supported (supported: {sorted(_SCALE_SUFFIX)})")
    if method == "fp8":
        fmt = qc.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise CheckpointError(f"{where}: quantization_config.fmt {fmt!r} is not "
                                  "supported (only e4m3)")
        b = qc.get("weight_block_size")
        if b is not None and len(b) != 2:
            raise CheckpointError(f"{where}: quantization_config.weight_block_size {b!r} is "
                                  "not [out, in]")
        return Fp8Scheme(method, None if b is None else (int(b[0]), int(b[1])), where)
    block = _compressed_block(qc, where) if method == "compressed-tensors" else None
    return Fp8Scheme(method, block, where)


def auxiliary_names(fp8: Fp8Scheme | None, owners: dict[str, Any], weights: Iterable[str],
                    folder: str) -> set[str]:
    """The scale (and unused) tensors beside the FP8 weights, after checking that every
    FP8 weight has its scale and that FP8 tensors come with a quantization_config."""
    fp8_weights = [n for n in weights if n in owners and owners[n].dtype(n) == "F8_E4M3"]
    if fp8_weights and fp8 is None:
        n = fp8_weights[0]
        raise CheckpointError(f"{owners[n].path}: tensor {n!r} is F8_E4M3 but "
                              f"{folder}/config.json has no quantization_config")
    if fp8 is None:
        return set()
    out = {n for n in owners if n.endswith(_UNUSED_SUFFIXES)}
    for n in fp8_weights:
        s = fp8.scale_name(n)
        if s not in owners:
            raise CheckpointError(f"{owners[n].path}: FP8 tensor {n!r} has no scale tensor "
                                  f"{s!r} (quant_method {fp8.method!r})")
        out.add(s)
    return out


def read_scale(fp8: Fp8Scheme, owners: dict[str, Any],
               name: str) -> tuple[np.ndarray, tuple[int, int]]:
    """Weight `name`'s scale as f32 [ceil(out / bo), ceil(in / bi)] and (bo, bi)."""
    out_dim, in_dim = owners[name].shapes[name]
    s_name = fp8.scale_name(name)
    st = owners[s_name]
    scale = np.asarray(st.read_copy(s_name), np.float32)
    if scale.size == 1:  # per tensor
        return scale.reshape(1, 1), (out_dim, in_dim)
    if scale.shape in ((out_dim,), (out_dim, 1)):  # per output channel
        return scale.reshape(out_dim, 1), (1, in_dim)
    if fp8.block is not None:
        bo, bi = fp8.block
        want = (-(-out_dim // bo), -(-in_dim // bi))
        if scale.shape == want:
            return scale, (bo, bi)
    else:
        want = "[] / [1] (per tensor) or [out] / [out, 1] (per channel)"
    raise CheckpointError(f"{st.path}: scale tensor {s_name!r} has shape {scale.shape}, "
                          f"expected {want} for weight {name!r} of shape "
                          f"{(out_dim, in_dim)} (quant_method {fp8.method!r}, block "
                          f"{fp8.block})")
