"""The model's architecture config (a frozen, hashable dataclass: a static argument of
`jax.jit`), read from a Hugging Face config.json. Nothing here imports jax."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

__all__ = ["MlaConfig", "ModelConfig", "RopeScaling"]


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Rope scaling: Llama-3's frequency-dependent scaling ("llama3"), "linear" (frequencies
    divided by `factor`; Gemma 3's global layers) or YaRN ("yarn": interpolation ramped
    between beta_fast and beta_slow rotations, and cos / sin multiplied by an attention
    factor; see models/layers.rope_inv_freq, rope_attention_scale)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    rope_type: str = "llama3"
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True  # round the YaRN correction range outwards to whole dimensions
    attention_factor: float | None = None  # None: derived from factor (and mscale)
    mscale: float = 0.0
    mscale_all_dim: float = 0.0

    @classmethod
    def from_hf(cls, rs: dict[str, Any]) -> RopeScaling:
        """From an HF `rope_scaling` / `rope_parameters` dict of type llama3 or yarn."""
        kind = rs.get("rope_type", rs.get("type"))
        if kind == "llama3":
            return cls(factor=float(rs["factor"]), low_freq_factor=float(rs["low_freq_factor"]),
                       high_freq_factor=float(rs["high_freq_factor"]),
                       original_max_position_embeddings=int(
                           rs["original_max_position_embeddings"]))
        if kind == "linear":
            return cls(factor=float(rs["factor"]), rope_type="linear")
        if kind == "yarn":
            af = rs.get("attention_factor")
            # transformers reads `x or default` for the betas: 0 / None mean the default
            return cls(factor=float(rs["factor"]), rope_type="yarn",
                       original_max_position_embeddings=int(
                           rs["original_max_position_embeddings"]),
                       beta_fast=float(rs.get("beta_fast") or 32.0),
                       beta_slow=float(rs.get("beta_slow") or 1.0),
                       truncate=bool(rs.get("truncate", True)),
                       attention_factor=None if af is None else float(af),
                       mscale=float(rs.get("mscale") or 0.0),
                       mscale_all_dim=float(rs.get("mscale_all_dim") or 0.0))
        raise ValueError(f"unsupported rope_scaling type {kind!r} "
                         "(only 'llama3', 'linear', 'yarn')")


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
    # Attention variants (pallas_kernels/attention_ref.py defines them).
    sliding_window: int = 0  # keys a sliding layer's query sees, itself included (0: none)
    # Per layer "sliding_attention" / "full_attention" (HF's layer_types); () with a
    # sliding_window: every layer slides (Mistral).
    layer_types: tuple[str, ...] = ()
    attn_logit_softcapping: float = 0.0  # scores -> cap * tanh(scores / cap); 0: off
    attention_sinks: bool = False  # a sink logit per query head and layer: lp["sinks"] [Hq]
    # Gemma 3 (see _gemma3_fields).
    norm_offset: float = 0.0  # RMSNorm scales by (norm_offset + w): Gemma stores w - 1
    query_pre_attn_scalar: float | None = None  # attention scale its**-0.5 (None: head_dim)
    final_logit_softcap: float | None = None  # logits = cap * tanh(logits / cap)
    rope_local_theta: float | None = None  # sliding layers' rope (unscaled); None: rope_theta
    # gpt-oss: an o_proj bias; a router bias and softmax over the top-k logits (not top-k
    # of the softmax); experts with biases, gate|up fused and interleaved, and the clamped
    # SwiGLU "clamped_swiglu" (models/moe.py expert_act) instead of "silu".
    attention_out_bias: bool = False
    router_bias: bool = False
    softmax_after_topk: bool = False
    expert_bias: bool = False
    expert_act: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
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
        if self.expert_act not in ("silu", "clamped_swiglu"):
            raise ValueError(f"expert_act={self.expert_act!r} is not 'silu' or 'clamped_swiglu'")
        if self.layer_types and (len(self.layer_types) != self.num_layers
                                 or not set(self.layer_types) <= set(_LAYER_TYPES)):
            raise ValueError(f"layer_types must list {self.num_layers} of {_LAYER_TYPES}, "
                             f"not {self.layer_types}")

    @property
    def layer_windows(self) -> tuple[int, ...]:
        """Each layer's sliding window (0: full attention), the static table a layer scan
        indexes with its traced layer index."""
        if not self.sliding_window:
            return (0,) * self.num_layers
        types = self.layer_types or ("sliding_attention",) * self.num_layers
        return tuple(self.sliding_window if t == "sliding_attention" else 0 for t in types)

    @property
    def has_window(self) -> bool:
        return any(self.layer_windows)

    @property
    def uniform_window(self) -> int:
        """The window when every layer slides (a page wholly outside it is dead for every
        layer and can be freed), else 0."""
        windows = set(self.layer_windows)
        return windows.pop() if len(windows) == 1 else 0

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def sm_scale(self) -> float:
        """The attention logits' scale: Gemma's query_pre_attn_scalar, MLA's full q/k head
        (nope + rope dims), else the head dim."""
        if self.mla is not None:
            scale = self.mla.qk_head_dim ** -0.5
            rs = self.rope_scaling  # DeepSeek's YaRN: times mscale(factor, mscale_all_dim)^2
            if rs is not None and rs.mscale_all_dim and rs.factor > 1:
                m = 0.1 * rs.mscale_all_dim * math.log(rs.factor) + 1.0
                scale *= m * m
            return scale
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def sliding_layers(self) -> tuple[bool, ...]:
        """Per layer: whether layer_types calls it a sliding layer (Gemma 3 picks its rope
        by that, window or not)."""
        return tuple(t == "sliding_attention" for t in self.layer_types) or (
            (False,) * self.num_layers)

    @property
    def rope_dim(self) -> int:
        """The rotated dims of a head (MLA rotates only qk_rope_head_dim of them)."""
        return self.head_dim if self.mla is None else self.mla.qk_rope_head_dim

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
                 "qwen2": "qwen2", "MistralForCausalLM": "llama", "mistral": "llama",
                 "Qwen3ForCausalLM": "qwen3", "qwen3": "qwen3",
                 "Gemma3ForCausalLM": "gemma3", "gemma3_text": "gemma3",
                 "DeepseekV2ForCausalLM": "deepseek_v2", "DeepseekV3ForCausalLM": "deepseek_v3",
                 **{a: m for m, a in _MOE_ARCHS.items()}, **{m: m for m in _MOE_ARCHS},
                 "GptOssForCausalLM": "gpt_oss", "gpt_oss": "gpt_oss"}
        if arch not in known:
            supported = sorted(a for a in known if a[0].isupper())
            raise ValueError(f"unknown architecture {arch!r}; supported: {supported}")
        family = known[arch]
        heads = cfg["num_attention_heads"]
        # transformers >= 5 writes the scaling into rope_parameters
        rs = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
        kind = rs.get("rope_type", rs.get("type", "default"))
        rope_scaling = None if kind == "default" else RopeScaling.from_hf(rs)
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
                "qkv_bias", family in ("qwen2", "qwen2_moe", "gpt_oss")))),
            rope_scaling=rope_scaling,
            architecture=family,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            qk_norm=family in ("qwen3", "qwen3_moe"),
            **(_gptoss_fields(cfg) if family == "gpt_oss" else _moe_fields(cfg, family)),
            **attention_variant_fields(cfg),
        )
        if family.startswith("deepseek"):
            fields.update(_deepseek_fields(cfg, family))
        return cls(**{**fields, **_gemma3_fields(cfg, family)})

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ModelConfig:
        d = json.loads(text)
        if d.get("rope_scaling") is not None:
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        d["layer_types"] = tuple(d.get("layer_types", ()))
        if d.get("mla") is not None:
            d["mla"] = MlaConfig(**d["mla"])
        return cls(**d)


_LAYER_TYPES = ("sliding_attention", "full_attention")


def attention_variant_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """sliding_window / layer_types / attn_logit_softcapping of an HF config, as
    transformers reads them: Qwen2/3 slide only with use_sliding_window; a layer_types list
    picks the sliding layers (Gemma 3, gpt-oss, Qwen3), else every layer slides (Mistral,
    Mixtral); a null window is none."""
    window = cfg.get("sliding_window") or 0
    if "use_sliding_window" in cfg and not cfg["use_sliding_window"]:
        window = 0
    types = tuple(cfg.get("layer_types") or ())
    if window and not types and "max_window_layers" in cfg:  # Qwen2/3: the later layers
        n, first = cfg["num_hidden_layers"], cfg["max_window_layers"]
        types = tuple("sliding_attention" if i >= first else "full_attention" for i in range(n))
    if not window or "sliding_attention" not in types:
        types = ()
        if cfg.get("layer_types"):  # listed, and none slides
            window = 0
    return dict(sliding_window=int(window), layer_types=types,
                attn_logit_softcapping=float(cfg.get("attn_logit_softcapping") or 0.0))


_MOE_ARCHS = {"qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
              "mixtral": "MixtralForCausalLM"}


def _moe_fields(cfg: dict[str, Any], family: str) -> dict[str, Any]:
    """The ModelConfig fields of an HF MoE config (none for a dense family)."""
    if family not in _MOE_ARCHS:
        return {}
    if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
        raise ValueError("dense layers inside a MoE model (mlp_only_layers / "
                         "decoder_sparse_step != 1) are not supported")
    if family == "mixtral":  # top-k renormalized; experts are intermediate_size wide
        return dict(num_experts=cfg["num_local_experts"],
                    num_experts_per_tok=cfg["num_experts_per_tok"],
                    moe_intermediate_size=cfg["intermediate_size"], norm_topk_prob=True)
    # transformers >= 5 writes Qwen3-MoE's num_experts as num_local_experts
    experts = cfg["num_experts"] if "num_experts" in cfg else cfg["num_local_experts"]
    return dict(num_experts=experts, num_experts_per_tok=cfg["num_experts_per_tok"],
                moe_intermediate_size=cfg["moe_intermediate_size"],
                shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size", 0),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)))


def _gemma3_fields(cfg: dict[str, Any], family: str) -> dict[str, Any]:
    """The ModelConfig fields of an HF Gemma 3 text config (none for another family):
    rope per layer type (transformers >= 5 nests it as rope_parameters.{full,sliding}_
    attention; older configs have rope_theta, rope_local_base_freq and rope_scaling)."""
    if family != "gemma3":
        return {}
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"hidden_activation={act!r}: Gemma 3 supports gelu_pytorch_tanh")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention (EmbeddingGemma) is not supported")
    if cfg.get("attn_logit_softcapping") is not None:
        # No release sets it; transformers' Gemma 3 ignores it, vLLM applies it.
        raise ValueError("attn_logit_softcapping is not supported for Gemma 3")
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types") or [
        "full_attention" if (i + 1) % cfg.get("sliding_window_pattern", 6) == 0
        else "sliding_attention" for i in range(n)]
    rp = cfg.get("rope_parameters") or {}
    full = dict(rp.get("full_attention") or {})
    full.setdefault("rope_theta", cfg.get("rope_theta", 1_000_000.0))
    if not rp and cfg.get("rope_scaling"):
        full.update(cfg["rope_scaling"])
    local = dict(rp.get("sliding_attention") or {})
    local.setdefault("rope_theta", cfg.get("rope_local_base_freq", 10_000.0))
    if local.get("rope_type", "default") != "default":
        raise ValueError(f"sliding_attention rope_type {local['rope_type']!r} is not supported")
    kind = full.get("rope_type", full.get("type", "default"))
    if kind not in ("default", "linear"):
        raise ValueError(f"full_attention rope_type {kind!r}: expected default or linear")
    return dict(
        rope_theta=float(full["rope_theta"]),
        rope_scaling=(RopeScaling(factor=float(full["factor"]), rope_type="linear")
                      if kind == "linear" else None),
        rope_local_theta=float(local["rope_theta"]),
        layer_types=tuple(types),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        qk_norm=True,
        norm_offset=1.0,
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)),
        final_logit_softcap=cfg.get("final_logit_softcapping"),
    )


def _gptoss_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields of an HF GptOssConfig beyond the shared ones (its experts are
    intermediate_size wide; attention_bias covers q, k, v and o)."""
    bias = bool(cfg.get("attention_bias", True))
    return dict(num_experts=cfg["num_local_experts"],
                num_experts_per_tok=cfg["num_experts_per_tok"],
                moe_intermediate_size=cfg["intermediate_size"], attention_out_bias=bias,
                router_bias=True, softmax_after_topk=True, expert_bias=True,
                expert_act="clamped_swiglu",
                swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
                swiglu_limit=float(cfg.get("swiglu_limit", 7.0)), attention_sinks=True)


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
