"""Frozen configuration dataclasses.

Everything that decides a trace's shape or behaviour is here and is hashable, so a
config can be a static argument of `jax.jit`. Nothing in this module imports jax.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style rope scaling ("rope_type": "llama3")."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family decoder (Llama 2/3, SmolLM2, Qwen2 dense)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    rope_scaling: RopeScaling | None = None
    architecture: str = "llama"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face `config.json` dict (LlamaForCausalLM / Qwen2ForCausalLM)."""
        archs = cfg.get("architectures") or [cfg.get("model_type", "")]
        arch = archs[0]
        known = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "llama": "llama",
                 "qwen2": "qwen2", "MistralForCausalLM": "llama"}
        if arch not in known:
            supported = sorted(a for a in known if a[0].isupper())
            raise ValueError(f"unknown architecture {arch!r}; supported: {supported}")
        family = known[arch]
        heads = cfg["num_attention_heads"]
        rs = cfg.get("rope_scaling") or None
        rope_scaling = None
        if rs is not None:
            kind = rs.get("rope_type", rs.get("type"))
            if kind != "llama3":
                raise ValueError(f"unsupported rope_scaling type {kind!r} (only 'llama3')")
            rope_scaling = RopeScaling(
                factor=float(rs["factor"]),
                low_freq_factor=float(rs["low_freq_factor"]),
                high_freq_factor=float(rs["high_freq_factor"]),
                original_max_position_embeddings=int(rs["original_max_position_embeddings"]),
            )
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        rope_theta = cfg.get("rope_theta")
        if rope_theta is None:  # transformers >= 5 nests it under rope_parameters
            rope_theta = (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rope_theta=float(rope_theta),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=cfg.get("max_position_embeddings", 8192),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", family == "qwen2")),
            rope_scaling=rope_scaling,
            architecture=family,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ModelConfig:
        d = json.loads(text)
        if d.get("rope_scaling") is not None:
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        return cls(**d)


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """Paged KV pool geometry. Page 0 is reserved as the write target of padding tokens."""

    page_size: int = 16
    num_pages: int = 1024

    @property
    def num_slots(self) -> int:
        return self.page_size * self.num_pages
