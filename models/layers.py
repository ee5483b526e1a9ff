"""Building blocks shared by the model families: norms, rope, MLPs, and the decoder
skeleton (attention, residuals, the layer scan, logits) that takes a family's MLP.

A family's MLP is `mlp(lp, x) -> [T, D]` over one layer's weights `lp` and the normed
hidden states x [T, D]; it must be hashable (a module-level function or a frozen
dataclass), since it is a static argument of the per-layer jitted halves.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import shard_map
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import cpu_kernels
from cpu_kernels import PackedWeight, at_layer, packed_matmul
from models import mla
from models.config import ModelConfig, RopeScaling
from models.forward_batch import ForwardBatch, ForwardMode, real_row_mask, real_token_mask
from models.fp8 import Fp8Weight, concat_columns, fp8_linear
from models.kv_pool import KVPool, ring_layers, write_kv
from pallas_kernels import get_paged_attention_fn

Mlp = Callable[[dict, jax.Array], jax.Array]


def rms_norm(x: jax.Array, w: jax.Array, eps: float, offset: float = 0.0) -> jax.Array:
    """x [..., D], w [D]; the mean of squares in f32 as in the HF reference. The scale is
    offset + w (Gemma stores w zero-centred: offset 1), added in f32 as HF does."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    scale = w.astype(jnp.float32)
    if offset:
        scale = scale + offset
    return (y * scale).astype(x.dtype)


def norm(x: jax.Array, w: jax.Array, cfg: ModelConfig) -> jax.Array:
    """rms_norm with the model's eps and offset."""
    return rms_norm(x, w, cfg.rms_norm_eps, cfg.norm_offset)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
    """[Dh/2] inverse frequencies, with Llama-3 frequency-dependent, linear or YaRN scaling."""
    if scaling is not None and scaling.rope_type == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling)
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if scaling is None:
        return inv.astype(np.float32)
    if scaling.rope_type == "linear":
        return (inv / scaling.factor).astype(np.float32)
    lo_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    hi_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    scaled = np.where(wavelen > lo_wavelen, inv / scaling.factor, inv)
    mid = (wavelen <= lo_wavelen) & (wavelen >= hi_wavelen)
    scaled = np.where(mid, (1 - smooth) * inv / scaling.factor + smooth * inv, scaled)
    return scaled.astype(np.float32)


def _yarn_inv_freq(dim: int, theta: float, s: RopeScaling) -> np.ndarray:
    """YaRN: interpolated (divided by factor) frequencies for the dimensions that turn
    fewer than beta_slow times over the original context, the original ones above
    beta_fast turns, a linear ramp between; f32 as transformers computes them."""
    pos = np.float32(theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))

    def correction_dim(rotations: float) -> float:  # dimension that turns `rotations` times
        return dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)
                              ) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolate = (1 - ramp).astype(np.float32)  # [Dh/2] 1: keep the original frequency
    inv = (1 / (s.factor * pos)) * (1 - extrapolate) + (1 / pos) * extrapolate
    return inv.astype(np.float32)


def rope_attention_scale(scaling: RopeScaling | None) -> float:
    """The factor transformers multiplies rope's cos and sin by (so q.k by its square):
    YaRN's attention factor, given or 0.1 ln(factor) + 1 (DeepSeek: the ratio of that
    with mscale and mscale_all_dim); 1 otherwise."""
    if scaling is None or scaling.rope_type != "yarn":
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor

    def mscale(factor: float, m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    if scaling.mscale and scaling.mscale_all_dim:
        return mscale(scaling.factor, scaling.mscale) / mscale(scaling.factor,
                                                                scaling.mscale_all_dim)
    return mscale(scaling.factor)


def rope_for(positions: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """positions [T] -> cos, sin [T, Dh/2] of cfg's rope, times its attention scale."""
    cos, sin = rope_cos_sin(positions, rope_inv_freq(cfg.rope_dim, cfg.rope_theta,
                                                     cfg.rope_scaling))
    scale = rope_attention_scale(cfg.rope_scaling)
    return (cos, sin) if scale == 1.0 else (cos * scale, sin * scale)


def rope_cos_sin(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """positions [T] -> cos, sin [T, Dh/2] in f32, computed once per forward."""
    ang = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]
    return jnp.cos(ang), jnp.sin(ang)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE (HF layout). x [T, H, Dh], cos/sin [T, Dh/2]."""
    half = x.shape[-1] // 2
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


def linear(x: jax.Array, w: jax.Array | PackedWeight | Fp8Weight) -> jax.Array:
    """x [..., K] @ w [K, N]; a PackedWeight runs the CPU kernel (cpu_kernels), an
    Fp8Weight the FP8 product (models/fp8.py)."""
    if isinstance(w, PackedWeight):
        return packed_matmul(x, w)
    return fp8_linear(x, w) if isinstance(w, Fp8Weight) else x @ w


def gated_mlp(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """SwiGLU: x [T, D] -> [T, D]."""
    return (jax.nn.silu(x @ w_gate) * (x @ w_up)) @ w_down


def fused_gated_mlp(x: jax.Array, w_gate_up: jax.Array | PackedWeight,
                    w_down: jax.Array | PackedWeight) -> jax.Array:
    """SwiGLU with gate and up in one matrix [D, 2F] (gate columns first): x [T, D] -> [T, D]."""
    gate, up = jnp.split(linear(x, w_gate_up), 2, axis=-1)  # [T, F] each
    return linear(jax.nn.silu(gate) * up, w_down)


# ---------------------------------------------------------------- parameters


def init_from_shapes(shapes: dict, key: jax.Array, dtype: jnp.dtype = jnp.float32) -> dict:
    """Random weights for a {key: shape} tree: norms near 1, biases small, matrices
    ~ N(0, 1/fan_in) (fan-in is the second-to-last dim) so activations keep unit scale
    through depth, embeddings N(0, 1)."""
    is_shape = lambda x: isinstance(x, tuple)  # noqa: E731
    flat, treedef = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=is_shape)
    keys = jax.random.split(key, len(flat))
    out = []
    for (path, shape), k in zip(flat, keys, strict=True):
        name = path[-1].key
        x = jax.random.normal(k, shape)
        if "norm" in name:
            w = 1.0 + 0.1 * x
        elif name in ("bq", "bk", "bv", "bo"):
            w = 0.1 * x
        elif name in ("embed", "sinks"):
            w = x
        else:
            w = x * shape[-2] ** -0.5
        out.append(w.astype(dtype))
    return jax.tree.unflatten(treedef, out)


def attention_shapes(cfg: ModelConfig) -> dict:
    """The per-layer attention weights every family has (see params_layout.md)."""
    if cfg.mla is not None:
        return mla.attention_shapes(cfg)
    L, D = cfg.num_layers, cfg.hidden_size
    out = {"attn_norm": (L, D), "wq": (L, D, cfg.q_size), "wk": (L, D, cfg.kv_size),
           "wv": (L, D, cfg.kv_size), "wo": (L, cfg.q_size, D), "mlp_norm": (L, D)}
    if cfg.attention_bias:
        out.update(bq=(L, cfg.q_size), bk=(L, cfg.kv_size), bv=(L, cfg.kv_size))
    if cfg.attention_out_bias:
        out.update(bo=(L, D))
    if cfg.qk_norm:
        out.update(q_norm=(L, cfg.head_dim), k_norm=(L, cfg.head_dim))
    if cfg.attention_sinks:
        out.update(sinks=(L, cfg.num_heads))
    return out


def model_shapes(cfg: ModelConfig, layer_shapes: dict) -> dict:
    """Embedding, final norm and (untied) head around a family's per-layer shapes."""
    tree = {"embed": (cfg.vocab_size, cfg.hidden_size), "final_norm": (cfg.hidden_size,),
            "layers": layer_shapes}
    if not cfg.tie_word_embeddings:
        tree["lm_head"] = (cfg.hidden_size, cfg.vocab_size)
    return tree


# A model whose first layers are dense and the rest MoE (DeepSeek's first_k_dense_replace)
# stacks the dense MLP's weights over its first layers only and the MoE's over the rest;
# every other per-layer weight covers all layers.
DENSE_MLP_KEYS = frozenset({"w_gate", "w_up", "w_down", "w_gate_up"})


def layer_span(key: str, n: int, n_layers: int) -> tuple[int, int]:
    """(first layer, count) of a per-layer weight `key` stacked over n of n_layers layers."""
    return (0, n) if n == n_layers or key in DENSE_MLP_KEYS else (n_layers - n, n)


def layer_spans(stacked: dict) -> dict[str, tuple[int, int]]:
    """{key: (first layer, layer count)} of a stacked layer tree (see DENSE_MLP_KEYS)."""
    n_layers = stacked["attn_norm"].shape[0]
    return {key: layer_span(key, n_layers if isinstance(w, PackedWeight) else w.shape[0],
                            n_layers) for key, w in stacked.items()}


def num_dense_layers(stacked: dict) -> int:
    """How many first layers run the dense MLP where the others run the MoE (0: all alike)."""
    spans = layer_spans(stacked)
    n_layers = stacked["attn_norm"].shape[0]
    if all(n == n_layers for _, n in spans.values()):
        return 0
    return next((n for k, (_, n) in spans.items() if k in DENSE_MLP_KEYS), 0)


def unstack_layers(params: dict) -> dict:
    """Replace the stacked `layers` by `layer_list`, one dict of arrays per layer, for
    run_layers' switch dispatch (same memory: the stacked copy is dropped). A layer's
    dict holds the weights it has (dense MLP or MoE: see DENSE_MLP_KEYS)."""
    layers = params["layers"]
    spans = layer_spans(layers)
    per_layer = [{k: w[i - spans[k][0]] for k, w in layers.items()
                  if spans[k][0] <= i < sum(spans[k])}
                 for i in range(layers["attn_norm"].shape[0])]
    return {**{k: v for k, v in params.items() if k != "layers"}, "layer_list": per_layer}


# Matrices that read the same activations, fused into one along their output columns: one
# wider product instead of two or three. On a GPU this is also what keeps a one-row decode
# product a gemm: XLA GPU strength-reduces x [1, D] @ w [D, N] with a narrow N (Llama-3-8B's
# wk / wv, N = 1024) into a multiply + reduce whose multiply writes a weight-sized
# temporary, so the weight is read once and its size in bf16 written and read again.
FUSED_PROJECTIONS = {"wqkv": ("wq", "wk", "wv"), "w_gate_up": ("w_gate", "w_up")}


def fuse_projections(params: dict) -> dict:
    """wq|wk|wv as `wqkv` [..., D, Hq*Dh + 2*Hkv*Dh] and w_gate|w_up as `w_gate_up`
    [..., D, 2F] (gate columns first) where a layer has them; qkv and the dense MLP read
    either form. Stacked or per-layer (unstack_layers) trees, XLA's dot only (the packed
    CPU path fuses at packing: llama.pack_for_cpu). Not for a `tp` mesh: column shards of
    the fused matrix would not be each device's own q, k, v heads."""

    def fuse_layer(lp: dict) -> dict:
        out = dict(lp)
        for name, parts in FUSED_PROJECTIONS.items():
            if not all(p in lp for p in parts):
                continue
            if all(isinstance(lp[p], Fp8Weight) for p in parts):
                fused = concat_columns([lp[p] for p in parts])  # None: scale grids differ
            elif any(isinstance(lp[p], Fp8Weight) for p in parts):
                fused = None
            else:
                fused = jnp.concatenate([lp[p] for p in parts], axis=-1)
            if fused is not None:
                out[name] = fused
                for p in parts:
                    del out[p]
        return out

    if "layer_list" in params:
        return {**params, "layer_list": [fuse_layer(lp) for lp in params["layer_list"]]}
    return {**params, "layers": fuse_layer(params["layers"])}


# ---------------------------------------------------------------- decoder skeleton


def embed(params: dict, input_ids: jax.Array) -> jax.Array:
    """input_ids [T] -> hidden [T, D] (f32 on the packed CPU path, whose table is f32)."""
    if input_ids.shape[0] == 1:
        # XLA folds a one-index gather into a dynamic-slice, and a dynamic-slice of a
        # vocab-split table (tp) all-gathers the whole table first; two indices stay a
        # gather, which each shard answers for its own rows.
        return params["embed"][jnp.concatenate([input_ids, input_ids])][:1]  # [1, D]
    return params["embed"][input_ids]


def qkv(lp: dict, h: jax.Array, cos: jax.Array, sin: jax.Array,
        cfg: ModelConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
    """h [T, D] -> q [T, Hq, Dh], k, v [T, Hkv, Dh] (normed, projected, rope applied)."""
    if cfg.mla is not None:
        return mla.qkv(lp, h, cos, sin, cfg)
    t = h.shape[0]
    x = norm(h, lp["attn_norm"], cfg)
    if "wqkv" in lp:  # fused (fuse_projections, llama.pack_for_cpu): one matmul for all three
        q, k, v = jnp.split(linear(x, lp["wqkv"]), [cfg.q_size, cfg.q_size + cfg.kv_size], -1)
    else:
        q = x @ lp["wq"]  # [T, Hq*Dh]
        k = x @ lp["wk"]  # [T, Hkv*Dh]
        v = x @ lp["wv"]
    if cfg.attention_bias:
        q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
    q = q.reshape(t, cfg.num_heads, cfg.head_dim)
    k = k.reshape(t, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm:  # Qwen3, Gemma 3: per-head RMSNorm before rope
        q = norm(q, lp["q_norm"], cfg)
        k = norm(k, lp["k_norm"], cfg)
    return (apply_rope(q, cos, sin), apply_rope(k, cos, sin),
            v.reshape(t, cfg.num_kv_heads, cfg.head_dim))


def _tp(mesh: Mesh | None) -> int:
    return 1 if mesh is None else mesh.shape.get("tp", 1)


def _dp(mesh: Mesh | None) -> int:
    return 1 if mesh is None else mesh.shape.get("dp", 1)


def _split_axes(mesh: Mesh | None) -> tuple[str | None, str | None]:
    """(token / row axis, head axis) of attention's shard_map: `dp` splits the tokens,
    rows and pool pages into ranks (DP attention, runtime/dp_attention.py), `tp` the
    heads; None where that axis is 1."""
    return ("dp" if _dp(mesh) > 1 else None), ("tp" if _tp(mesh) > 1 else None)


def layer_window(cfg: ModelConfig, layer: jax.Array) -> jax.Array | None:
    """Layer `layer`'s sliding window (traced int32, 0: full attention) from the static
    per-layer table; None when no layer slides (the kernels then emit no window code)."""
    if not cfg.has_window:
        return None
    return jnp.asarray(cfg.layer_windows, jnp.int32)[layer]


def attend(q: jax.Array, k: jax.Array, v: jax.Array, kv: KVPool, layer: jax.Array,
           batch: ForwardBatch, cfg: ModelConfig, attention_backend: str,
           mesh: Mesh | None = None, sinks: jax.Array | None = None,
           model_layer: jax.Array | None = None) -> jax.Array:
    """Paged attention over earlier context (pool) and this step's k, v -> [T, Hq*Dh].

    The layer's variants come from cfg: its sliding window (layer_window), the logit soft
    cap; `sinks` [Hq] is the layer's sink logits (lp["sinks"]) or None. `model_layer`: the
    model's layer index where `layer` indexes another pool (moe_overlap's one-layer copy).

    With a `tp` mesh axis each device attends with its own heads over its own KV pages
    (shard_map; the sinks split with the heads): left to GSPMD, the page gather
    all-gathers the whole pool every step. With a `dp` axis each rank attends with its own
    rows over its own pages: the batch's statics (num_extend_tokens / seqs) are then one
    rank's, its arrays dp ranks' long."""
    # This step's K/V as the pool will hold them: a key then reads the same whether it is
    # new or cached, so chunking and prefix caching cannot change a bf16 pool's results.
    k, v = k.astype(kv.k.dtype), v.astype(kv.v.dtype)
    v_pool = kv.v
    if cfg.mla is not None:  # MQA over the latent: the value is the key row (models/mla.py)
        v, v_pool = k, kv.k
    fn = functools.partial(get_paged_attention_fn(attention_backend),
                           num_extend_tokens=batch.num_extend_tokens,
                           num_extend_seqs=batch.num_extend_seqs, sm_scale=cfg.sm_scale,
                           logit_softcap=cfg.attn_logit_softcapping)
    if batch.mode is ForwardMode.TARGET_VERIFY and attention_backend == "xla":
        # Rows of 1 + k tokens on their caches: the jnp decode walk reads each row's prefix
        # once (attention_ref._verify); the CPU and Pallas extend kernels already do.
        fn = functools.partial(fn, verify_width=batch.num_extend_tokens // batch.num_extend_seqs)
    variants = {"window": layer_window(cfg, layer if model_layer is None else model_layer),
                "sinks": sinks}
    variants = {name: x for name, x in variants.items() if x is not None}

    def attn(*args):  # the 10 operands of the kernel signature, then the variants
        return fn(*args[:10], **args[10])

    tok, heads = _split_axes(mesh)
    if tok or heads:
        qkv_spec, pool, row = P(tok, heads), P(None, heads, tok), P(tok)
        var_specs = {name: P(heads) if name == "sinks" else P() for name in variants}
        attn = shard_map(attn, mesh=mesh, out_specs=qkv_spec,
                         in_specs=(qkv_spec, qkv_spec, qkv_spec, pool, pool, P(), *[row] * 4,
                                   var_specs))
    o = attn(q, k, v, kv.k, v_pool, layer, batch.page_table, batch.seq_lens, batch.query_start,
             batch.positions, variants)
    return o.reshape(q.shape[0], -1)  # [T, Hq*Dh]


def attend_layer(q: jax.Array, k: jax.Array, v: jax.Array, kv: KVPool, layer: jax.Array,
                 batch: ForwardBatch, cfg: ModelConfig, attention_backend: str,
                 mesh: Mesh | None = None, sinks: jax.Array | None = None) -> jax.Array:
    """attend for model layer `layer` (traced). With sliding-window rings (kv.ring_pages,
    models/kv_pool.py) a sliding layer reads its row of the ring pool through the batch's
    ring page table and a global layer its row of the main pool; lax.cond runs only the
    layer's own, so one scan body serves both kinds."""
    if not kv.ring_pages:
        return attend(q, k, v, kv, layer, batch, cfg, attention_backend, mesh, sinks)
    glob, slide = ring_layers(cfg)
    rows = np.zeros(cfg.num_layers, np.int32)  # each layer's row in its own pool
    rows[list(glob)] = np.arange(len(glob))
    rows[list(slide)] = np.arange(len(slide))
    row = jnp.asarray(rows)[layer]
    sliding = jnp.asarray(cfg.layer_windows, jnp.int32)[layer] > 0
    main, rings = KVPool(k=kv.k, v=kv.v), KVPool(k=kv.sk, v=kv.sv)
    ring_batch = batch.replace(page_table=batch.ring_page_table)
    return jax.lax.cond(
        sliding,
        lambda: attend(q, k, v, rings, row, ring_batch, cfg, attention_backend, mesh, sinks,
                       model_layer=layer),
        lambda: attend(q, k, v, main, row, batch, cfg, attention_backend, mesh, sinks,
                       model_layer=layer))


def write_step_kv(kv: KVPool, layers: jax.Array, slots: jax.Array, k: jax.Array,
                  v: jax.Array, mesh: Mesh | None, attention_backend: str,
                  after: jax.Array | None = None) -> KVPool:
    """write_kv (layers or slots outside the pool are dropped); under tensor parallelism
    each device scatters its own heads' K/V, under data parallelism each rank its own
    tokens into its own pages. With the CPU kernels the kernel side writes in place (XLA
    CPU's scatter converts a whole bf16 pool each step, see cpu_kernels/write_kv.cc)."""
    # after: see cpu_kernels.write_kv. An MLA pool (no V) takes XLA's scatter.
    if attention_backend == "cpu" and kv.v.shape[-1]:
        return KVPool(*cpu_kernels.write_kv(kv.k, kv.v, layers, slots, k, v, after))
    tok, heads = _split_axes(mesh)
    if not (tok or heads):
        return write_kv(kv, layers, slots, k, v)
    # k, v [N, T, Hkv, Dh]; under dp the slots are each rank's own (its pages from 0).
    pool, new = KVPool(k=P(None, heads, tok), v=P(None, heads, tok)), P(None, tok, heads)
    return shard_map(write_kv, mesh=mesh, in_specs=(pool, P(), P(tok), new, new),
                     out_specs=pool)(kv, layers, slots, k, v)


def attn_out(lp: dict, o: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Attention's output projection o [T, Hq*Dh] -> [T, D]: through MLA's value weights
    first (models/mla.py), with the family's o_proj bias where it has one (gpt-oss)."""
    if cfg.mla is not None:
        o = mla.output(lp, o, cfg)  # [T, H*Dv]
    y = linear(o, lp["wo"])
    return y + lp["bo"] if "bo" in lp else y


def out_mlp(lp: dict, h: jax.Array, o: jax.Array, cfg: ModelConfig, mlp: Mlp) -> jax.Array:
    """Attention output projection and the MLP, both residual: h [T, D] -> [T, D]. Where
    the layer has them (Gemma 3), `post_attn_norm` / `post_mlp_norm` norm the attention
    and MLP outputs before their residual adds."""
    a = attn_out(lp, o, cfg)  # [T, D]
    if "post_attn_norm" in lp:
        a = norm(a, lp["post_attn_norm"], cfg)
    h = h + a
    m = mlp(lp, norm(h, lp["mlp_norm"], cfg))  # [T, D]
    if "post_mlp_norm" in lp:
        m = norm(m, lp["post_mlp_norm"], cfg)
    return h + m


_qkv_jit = jax.jit(qkv, static_argnames="cfg")
_out_mlp_jit = jax.jit(out_mlp, static_argnames=("cfg", "mlp"))


def layer_weights(stacked: dict, layer: jax.Array) -> dict:
    """Layer `layer`'s weights from the stacked tree: packed matrices stay whole and the
    CPU kernel reads the layer's panels in place (cpu_kernels.at_layer); the rest (norm
    vectors; XLA's dot operands off the packed path) are sliced. Where the first layers
    are dense and the rest MoE (DENSE_MLP_KEYS), both MLPs' weights are sliced (the
    other's clamped to its nearest layer) and `dense_layer` [] bool says which runs."""
    dense = num_dense_layers(stacked)
    if dense:
        spans = layer_spans(stacked)
        lp = {k: w[jnp.clip(layer - spans[k][0], 0, spans[k][1] - 1)]
              for k, w in stacked.items()}
        return {**lp, "dense_layer": layer < dense}
    return jax.tree.map(
        lambda w: at_layer(w, layer) if isinstance(w, PackedWeight) else w[layer], stacked,
        is_leaf=lambda w: isinstance(w, PackedWeight))


def _layer_body(params: dict, kv: KVPool, batch: ForwardBatch, cfg: ModelConfig, mlp: Mlp,
                cos: jax.Array, sin: jax.Array, attention_backend: str,
                mesh: Mesh | None) -> Callable:
    """body(h [T, D], layer) -> (h, (k, v)): one decoder layer, the layer index traced;
    cos, sin as _rope gives them.

    Weights come stacked (`layers`: see layer_weights) or per layer (`layer_list`, see
    unstack_layers), where a `lax.switch` on the index picks the layer's own buffers. The
    switch is for XLA's dot on a CPU: XLA CPU copies a dynamic slice of the stacked
    weights before every dot, which halves the speed of a memory-bound decode step. The
    packed CPU matmul reads the stack in place and needs neither."""
    if "layer_list" in params:
        # Only the weight-bearing halves are switched; attention (no weights, most of the
        # HLO) is traced once, which keeps compile and cache-load time down.
        # Each branch calls one jitted function: its jaxpr is traced once per step shape
        # and lowered once, not 30 times, which halves start-up tracing.
        qkv_fns = [functools.partial(_qkv_jit, lp, cfg=cfg) for lp in params["layer_list"]]
        out_fns = [functools.partial(_out_mlp_jit, lp, cfg=cfg, mlp=mlp)
                   for lp in params["layer_list"]]
        sink_fns = [functools.partial(lambda w: w, lp["sinks"]) for lp in params["layer_list"]
                    if "sinks" in lp]

        def body(h, layer):
            q, k, v = jax.lax.switch(layer, qkv_fns, h, *_layer_rope(cos, sin, layer, cfg))
            sinks = jax.lax.switch(layer, sink_fns) if sink_fns else None
            o = attend_layer(q, k, v, kv, layer, batch, cfg, attention_backend, mesh, sinks)
            return jax.lax.switch(layer, out_fns, h, o), (k, v)
    else:
        # The packed CPU matmul skips the bucket's padding tokens (their rows come out
        # zero): on that compute-bound path each costs what a real token does. Under a
        # `dp` mesh the batch's statics are one rank's, so the mask is not built there.
        rows = real_token_mask(batch) if mesh is None else None

        def body(h, layer):
            lp = layer_weights(params["layers"], layer)
            if rows is not None:
                lp = cpu_kernels.only_rows(lp, rows)
            q, k, v = qkv(lp, h, *_layer_rope(cos, sin, layer, cfg), cfg)
            o = attend_layer(q, k, v, kv, layer, batch, cfg, attention_backend, mesh,
                             lp.get("sinks"))
            return out_mlp(lp, h, o, cfg, mlp), (k, v)
    return body


def _rope(batch: ForwardBatch, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """cos, sin [T, Dh/2] (times the rope's attention scale, see rope_for); with a local
    rope for the sliding layers (rope_local_theta), [2, T, Dh/2]: the global layers' then
    the sliding layers'."""
    cos, sin = rope_for(batch.positions, cfg)
    if cfg.rope_local_theta is None:
        return cos, sin
    lcos, lsin = rope_cos_sin(batch.positions, rope_inv_freq(cfg.rope_dim,
                                                             cfg.rope_local_theta, None))
    return jnp.stack([cos, lcos]), jnp.stack([sin, lsin])


def _layer_rope(cos: jax.Array, sin: jax.Array, layer: jax.Array,
                cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """Layer `layer`'s (traced) cos, sin [T, Dh/2] out of _rope's."""
    if cfg.rope_local_theta is None:
        return cos, sin
    which = jnp.asarray(cfg.sliding_layers, jnp.int32)[layer]  # 1: a sliding layer
    return cos[which], sin[which]


def run_decoder_layers(params: dict, kv: KVPool, h: jax.Array, batch: ForwardBatch,
                       cfg: ModelConfig, mlp: Mlp, *, start: jax.Array | int = 0,
                       num_layers: int | None = None, attention_backend: str = "xla",
                       mesh: Mesh | None = None) -> tuple[jax.Array, KVPool]:
    """Run decoder layers [start, start + num_layers) over hidden h [T, D].

    `start` may be traced (split prefill advances it call by call); `num_layers` is
    static, so every layer chunk of the same size shares one trace. The pool is only
    read inside the loop; this step's K/V are written once after it. `mesh`: see attend.
    """
    n = cfg.num_layers if num_layers is None else num_layers
    if kv.ring_pages and (n != cfg.num_layers or not isinstance(start, int) or start):
        raise ValueError("sliding-window rings run the whole layer stack in one call")
    cos, sin = _rope(batch, cfg)
    body = _layer_body(params, kv, batch, cfg, mlp, cos, sin, attention_backend, mesh)
    layers = jnp.arange(n, dtype=jnp.int32) + start
    h, (k, v) = jax.lax.scan(body, h, layers)  # k, v [n, T, Hkv, Dh]
    # h comes from every layer's attention, so the write follows their pool reads even
    # when XLA unrolls a one-layer scan (cpu_kernels.write_kv: else it copies the pool).
    if not kv.ring_pages:
        return h, write_step_kv(kv, layers, batch.out_cache_loc, k, v, mesh,
                                attention_backend, after=h)
    glob, slide = (np.asarray(ids, np.int32) for ids in ring_layers(cfg))
    main = write_step_kv(KVPool(k=kv.k, v=kv.v), jnp.arange(len(glob), dtype=jnp.int32),
                         batch.out_cache_loc, k[glob], v[glob], mesh, attention_backend,
                         after=h)
    rings = write_step_kv(KVPool(k=kv.sk, v=kv.sv), jnp.arange(len(slide), dtype=jnp.int32),
                          batch.ring_out_cache_loc, k[slide], v[slide], mesh,
                          attention_backend, after=h)
    return h, KVPool(k=main.k, v=main.v, sk=rings.k, sv=rings.v, ring_pages=kv.ring_pages)


def run_decoder_layer_range(params: dict, kv: KVPool, h: jax.Array, batch: ForwardBatch,
                            cfg: ModelConfig, mlp: Mlp, start: jax.Array, stop: jax.Array,
                            new_kv: tuple[jax.Array, jax.Array], attention_backend: str = "xla",
                            mesh: Mesh | None = None
                            ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """Layers [start, stop) with both bounds traced (a while loop). The pool is only read:
    each layer's K/V go into row `layer` of new_kv = (k, v) [L, T, Hkv, Dh] (the pool's
    dtype), which the caller writes once after (write_step_kv). Writing the pool inside
    the loop made XLA CPU copy all of it every trip: a fused multiplexed step took 6-8 s.
    The decode rows of a fused multiplexed step run the layers outside its prefill
    interval this way."""
    if kv.ring_pages:
        raise ValueError("sliding-window rings run the whole layer stack in one call")
    cos, sin = _rope(batch, cfg)
    body = _layer_body(params, kv, batch, cfg, mlp, cos, sin, attention_backend, mesh)

    def step(layer, carry):
        h, (kb, vb) = carry
        h, (k, v) = body(h, layer)
        return h, (kb.at[layer].set(k.astype(kb.dtype)), vb.at[layer].set(v.astype(vb.dtype)))

    return jax.lax.fori_loop(start, stop, step, (h, new_kv))


def compute_logits(params: dict, h: jax.Array, logits_indices: jax.Array,
                   cfg: ModelConfig, rows: jax.Array | None = None) -> jax.Array:
    """h [T, D] -> logits [B, V] in f32, only for the tokens that are sampled. `rows`
    [B] (forward_batch.real_row_mask): the packed CPU head skips the padding rows (their
    logits come out zero)."""
    x = norm(h[logits_indices], params["final_norm"], cfg)  # [B, D]
    if isinstance(params.get("lm_head"), PackedWeight):
        head = params["lm_head"]
        logits = linear(x, head if rows is None else cpu_kernels.only_rows(head, rows))
    elif cfg.tie_word_embeddings:
        logits = jnp.einsum("bd,vd->bv", x, params["embed"], preferred_element_type=jnp.float32)
    else:
        logits = jnp.einsum("bd,dv->bv", x, params["lm_head"],
                            preferred_element_type=jnp.float32)
    if cfg.final_logit_softcap:
        cap = cfg.final_logit_softcap
        logits = cap * jnp.tanh(logits / cap)
    return logits


@dataclasses.dataclass(frozen=True)
class Decoder:
    """A family's decoder on the shared skeleton: `mlp(cfg, mesh)` is its MLP (hashable,
    see Mlp), `embed(params, input_ids)` its token lookup. A model module exposes these
    methods as its run_layers, run_layer_range and forward."""

    mlp: Callable[[ModelConfig, Mesh | None], Mlp]
    embed: Callable[[dict, jax.Array], jax.Array] = embed

    def run_layers(self, params: dict, kv: KVPool, h: jax.Array, batch: ForwardBatch,
                   cfg: ModelConfig, *, start: jax.Array | int = 0,
                   num_layers: int | None = None, attention_backend: str = "xla",
                   mesh: Mesh | None = None) -> tuple[jax.Array, KVPool]:
        """Decoder layers [start, start + num_layers) (see run_decoder_layers)."""
        return run_decoder_layers(params, kv, h, batch, cfg, self.mlp(cfg, mesh), start=start,
                                  num_layers=num_layers, attention_backend=attention_backend,
                                  mesh=mesh)

    def run_layer_range(self, params: dict, kv: KVPool, h: jax.Array, batch: ForwardBatch,
                        cfg: ModelConfig, start: jax.Array, stop: jax.Array,
                        new_kv: tuple[jax.Array, jax.Array], attention_backend: str = "xla",
                        mesh: Mesh | None = None
                        ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """Layers [start, stop), both traced; K/V into new_kv (see run_decoder_layer_range)."""
        return run_decoder_layer_range(params, kv, h, batch, cfg, self.mlp(cfg, mesh), start,
                                       stop, new_kv, attention_backend, mesh)

    def forward(self, params: dict, kv: KVPool, batch: ForwardBatch, cfg: ModelConfig,
                attention_backend: str = "xla",
                mesh: Mesh | None = None) -> tuple[jax.Array, KVPool]:
        """One full forward: logits [B, V] for each row's sampled token, and the updated
        pool. On a `mesh` the matmuls follow the parameters' shardings (GSPMD) and
        attention runs per device on its heads (attend)."""
        h = self.embed(params, batch.input_ids)
        h, kv = self.run_layers(params, kv, h, batch, cfg,
                                attention_backend=attention_backend, mesh=mesh)
        return compute_logits(params, h, batch.logits_indices, cfg,
                              real_row_mask(batch.seq_lens)), kv
