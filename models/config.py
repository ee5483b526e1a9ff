"""The model's architecture config (a frozen, hashable dataclass: a static argument of
`jax.jit`), read from a Hugging Face config.json. Nothing here imports jax."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

__all__ = ["MlaConfig", "ModelConfig", "RopeScaling"]


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style rope scaling ("rope_type": "llama3")."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class MlaConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): the pool caches one latent row per
    token, [c_kv (kv_lora_rank) | k_pe (qk_rope_head_dim)], which every head reads."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int = 0  # 0: q_proj straight from the hidden state (V2-Lite)
    rope_interleave: bool = True  # rope pairs (x0, x1), (x2, x3), ... as DeepSeek lays them out

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder: the Llama family (Llama 2/3, SmolLM2, Qwen2 dense) or,
    with num_experts > 0, a mixture of experts (Qwen2-MoE, Qwen3-MoE, Mixtral)."""

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
    qk_norm: bool = False  # RMSNorm over each q / k head before rope (Qwen3)
    # Mixture of experts (0 experts: a dense MLP of intermediate_size).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0  # 0: no shared expert (Qwen2-MoE has one)
    norm_topk_prob: bool = False  # renormalize the top-k routing weights to sum to 1
    # DeepSeek-MoE: an ungated shared expert, scaled routing weights, sigmoid scores with a
    # selection bias (V3), group-limited routing, and dense MLPs in the first layers.
    shared_expert_gate: bool = True  # Qwen2-MoE's sigmoid gate on the shared expert
    routed_scaling_factor: float = 1.0
    moe_scoring: str = "softmax"  # or "sigmoid" (V3; with a per-expert selection bias)
    n_group: int = 1  # > 1: pick topk_group groups first (V2: by best, V3: by top-2 sum)
    topk_group: int = 1
    first_k_dense_replace: int = 0  # the first layers' MLP is dense (intermediate_size)
    # Multi-head latent attention: num_kv_heads = 1 and head_dim = the latent row's width.
    mla: MlaConfig | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must be in "
                             f"[1, num_experts={self.num_experts}]")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def rope_dim(self) -> int:
        """The rotated dims of a head (MLA rotates only qk_rope_head_dim of them)."""
        return self.head_dim if self.mla is None else self.mla.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        return (self.head_dim if self.mla is None else self.mla.qk_head_dim) ** -0.5

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
                 "qwen2": "qwen2", "MistralForCausalLM": "llama",
                 "DeepseekV2ForCausalLM": "deepseek_v2", "DeepseekV3ForCausalLM": "deepseek_v3",
                 **{a: m for m, a in _MOE_ARCHS.items()}, **{m: m for m in _MOE_ARCHS}}
        if arch not in known:
            supported = sorted(a for a in known if a[0].isupper())
            raise ValueError(f"unknown architecture {arch!r}; supported: {supported}")
        family = known[arch]
        heads = cfg["num_attention_heads"]
        # transformers >= 5 writes the scaling into rope_parameters
        rs = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
        kind = rs.get("rope_type", rs.get("type", "default"))
        rope_scaling = None
        if kind != "default":
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
        fields = dict(
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
            # Qwen2-MoE names its q/k/v bias qkv_bias (default on)
            attention_bias=bool(cfg.get("attention_bias", cfg.get(
                "qkv_bias", family in ("qwen2", "qwen2_moe")))),
            rope_scaling=rope_scaling,
            architecture=family,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            **_moe_fields(cfg, family),
        )
        if family.startswith("deepseek"):
            fields.update(_deepseek_fields(cfg, family))
        return cls(**fields)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ModelConfig:
        d = json.loads(text)
        if d.get("rope_scaling") is not None:
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        if d.get("mla") is not None:
            d["mla"] = MlaConfig(**d["mla"])
        return cls(**d)


_MOE_ARCHS = {"qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
              "mixtral": "MixtralForCausalLM"}


def _moe_fields(cfg: dict[str, Any], family: str) -> dict[str, Any]:
    """The ModelConfig fields of an HF MoE config (none for a dense family)."""
    if family not in _MOE_ARCHS:
        return {}
    if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
        raise ValueError("dense layers inside a MoE model (mlp_only_layers / "
                         "decoder_sparse_step != 1) are not supported")
    if cfg.get("use_sliding_window") or (family == "mixtral" and cfg.get("sliding_window")):
        raise ValueError("sliding-window attention is not supported")
    if family == "mixtral":  # top-k renormalized; experts are intermediate_size wide
        return dict(num_experts=cfg["num_local_experts"],
                    num_experts_per_tok=cfg["num_experts_per_tok"],
                    moe_intermediate_size=cfg["intermediate_size"], norm_topk_prob=True)
    # transformers >= 5 writes Qwen3-MoE's num_experts as num_local_experts
    experts = cfg["num_experts"] if "num_experts" in cfg else cfg["num_local_experts"]
    return dict(num_experts=experts, num_experts_per_tok=cfg["num_experts_per_tok"],
                moe_intermediate_size=cfg["moe_intermediate_size"],
                shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size", 0),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                qk_norm=family == "qwen3_moe")


def _deepseek_fields(cfg: dict[str, Any], family: str) -> dict[str, Any]:
    """The ModelConfig fields of a DeepSeek-V2/V3 config: MLA and DeepSeek-MoE."""
    if cfg.get("attention_bias"):
        raise ValueError("attention_bias with multi-head latent attention is not supported")
    if cfg.get("moe_layer_freq", 1) != 1:
        raise ValueError(f"moe_layer_freq={cfg['moe_layer_freq']} is not supported (only 1)")
    v3 = family == "deepseek_v3"
    # transformers runs V3 as noaux_tc whatever the config says, V2 as its topk_method
    method = "noaux_tc" if v3 else cfg.get("topk_method", "greedy")
    if method not in ("greedy", "group_limited_greedy", "noaux_tc"):
        raise ValueError(f"unsupported topk_method {method!r}")
    grouped = method != "greedy"
    mla = MlaConfig(kv_lora_rank=cfg["kv_lora_rank"], qk_nope_head_dim=cfg["qk_nope_head_dim"],
                    qk_rope_head_dim=cfg["qk_rope_head_dim"], v_head_dim=cfg["v_head_dim"],
                    q_lora_rank=cfg.get("q_lora_rank") or 0,
                    rope_interleave=bool(cfg.get("rope_interleave", True)) if v3 else True)
    return dict(
        num_kv_heads=1, head_dim=mla.latent_dim, mla=mla, qk_norm=False, attention_bias=False,
        num_experts=cfg["n_routed_experts"], num_experts_per_tok=cfg["num_experts_per_tok"],
        moe_intermediate_size=cfg["moe_intermediate_size"],
        shared_expert_intermediate_size=cfg.get("n_shared_experts", 0) *
        cfg["moe_intermediate_size"], shared_expert_gate=False,
        # transformers' V2 router never renormalizes
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)) and v3,
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
        moe_scoring="sigmoid" if v3 else "softmax",
        n_group=(cfg.get("n_group") or 1) if grouped else 1,
        topk_group=(cfg.get("topk_group") or 1) if grouped else 1,
        first_k_dense_replace=cfg.get("first_k_dense_replace") or 0)
