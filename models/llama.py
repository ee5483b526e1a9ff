"""Llama family decoder (Llama 2/3, SmolLM2, Qwen2 dense) over a paged KV pool.

Parameter layout: models/params_layout.md.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

import cpu_kernels
from models.layers import (
    apply_rope,
    fused_gated_mlp,
    gated_mlp,
    linear,
    rms_norm,
    rope_cos_sin,
    rope_inv_freq,
)
from pallas_kernels import get_paged_attention_fn
from runtime.config import ModelConfig
from runtime.forward_batch import ForwardBatch
from runtime.kv_pool import KVPool, write_kv


def param_shapes(cfg: ModelConfig) -> dict:
    """The parameter tree as {key: shape tuple} (see params_layout.md)."""
    L, D, F = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
    layers = {
        "attn_norm": (L, D),
        "wq": (L, D, cfg.q_size),
        "wk": (L, D, cfg.kv_size),
        "wv": (L, D, cfg.kv_size),
        "wo": (L, cfg.q_size, D),
        "mlp_norm": (L, D),
        "w_gate": (L, D, F),
        "w_up": (L, D, F),
        "w_down": (L, F, D),
    }
    if cfg.attention_bias:
        layers.update(bq=(L, cfg.q_size), bk=(L, cfg.kv_size), bv=(L, cfg.kv_size))
    tree = {"embed": (cfg.vocab_size, D), "final_norm": (D,), "layers": layers}
    if not cfg.tie_word_embeddings:
        tree["lm_head"] = (D, cfg.vocab_size)
    return tree


def init_params(cfg: ModelConfig, key: jax.Array, dtype: jnp.dtype = jnp.float32) -> dict:
    """Random weights with the real layout: norms near 1, biases small, matrices
    ~ N(0, 1/fan_in) so activations keep unit scale through depth, embeddings N(0, 1)."""
    is_shape = lambda x: isinstance(x, tuple)  # noqa: E731
    flat, treedef = jax.tree_util.tree_flatten_with_path(param_shapes(cfg), is_leaf=is_shape)
    keys = jax.random.split(key, len(flat))
    out = []
    for (path, shape), k in zip(flat, keys, strict=True):
        name = path[-1].key
        x = jax.random.normal(k, shape)
        if "norm" in name:
            w = 1.0 + 0.1 * x
        elif name in ("bq", "bk", "bv"):
            w = 0.1 * x
        elif name == "embed":
            w = x
        else:
            w = x * shape[-2] ** -0.5
        out.append(w.astype(dtype))
    return jax.tree.unflatten(treedef, out)


def embed(params: dict, input_ids: jax.Array) -> jax.Array:
    """input_ids [T] -> hidden [T, D]."""
    return params["embed"][input_ids]


def _qkv(lp: dict, h: jax.Array, cos: jax.Array, sin: jax.Array,
         cfg: ModelConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
    """h [T, D] -> q [T, Hq, Dh], k, v [T, Hkv, Dh] (normed, projected, rope applied)."""
    t = h.shape[0]
    x = rms_norm(h, lp["attn_norm"], cfg.rms_norm_eps)
    if "wqkv" in lp:  # packed (pack_for_cpu): one matmul for all three
        q, k, v = jnp.split(linear(x, lp["wqkv"]), [cfg.q_size, cfg.q_size + cfg.kv_size], -1)
    else:
        q = x @ lp["wq"]  # [T, Hq*Dh]
        k = x @ lp["wk"]  # [T, Hkv*Dh]
        v = x @ lp["wv"]
    if cfg.attention_bias:
        q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
    q = apply_rope(q.reshape(t, cfg.num_heads, cfg.head_dim), cos, sin)
    k = apply_rope(k.reshape(t, cfg.num_kv_heads, cfg.head_dim), cos, sin)
    return q, k, v.reshape(t, cfg.num_kv_heads, cfg.head_dim)


def _attend(q: jax.Array, k: jax.Array, v: jax.Array, kv: KVPool, layer: jax.Array,
            batch: ForwardBatch, cfg: ModelConfig, attention_backend: str) -> jax.Array:
    """Paged attention over earlier context (pool) and this step's k, v -> [T, Hq*Dh]."""
    attn = get_paged_attention_fn(attention_backend)
    o = attn(q, k, v, kv.k, kv.v, layer, batch.page_table, batch.seq_lens, batch.query_start,
             batch.positions, num_extend_tokens=batch.num_extend_tokens,
             num_extend_seqs=batch.num_extend_seqs, sm_scale=cfg.head_dim ** -0.5)
    return o.reshape(q.shape[0], cfg.q_size)


def _out_mlp(lp: dict, h: jax.Array, o: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Attention output projection and the MLP, both residual: h [T, D] -> [T, D]."""
    h = h + linear(o, lp["wo"])
    x = rms_norm(h, lp["mlp_norm"], cfg.rms_norm_eps)
    if "w_gate_up" in lp:  # packed (pack_for_cpu)
        return h + fused_gated_mlp(x, lp["w_gate_up"], lp["w_down"])
    return h + gated_mlp(x, lp["w_gate"], lp["w_up"], lp["w_down"])


_qkv_jit = jax.jit(_qkv, static_argnames="cfg")
_out_mlp_jit = jax.jit(_out_mlp, static_argnames="cfg")


def unstack_layers(params: dict) -> dict:
    """Replace the stacked `layers` by `layer_list`, one dict of arrays per layer, for
    run_layers' switch dispatch (same memory: the stacked copy is dropped)."""
    layers = params["layers"]
    n = layers["attn_norm"].shape[0]
    per_layer = [jax.tree.map(lambda w, i=i: w[i], layers) for i in range(n)]
    return {**{k: v for k, v in params.items() if k != "layers"}, "layer_list": per_layer}


def pack_for_cpu(params: dict) -> dict:
    """Weights for cpu_kernels.packed_matmul: per layer wq|wk|wv as `wqkv` and
    w_gate|w_up as `w_gate_up` (fewer, wider calls), wo and w_down packed, and the output
    head as a packed `lm_head` (for tied embeddings a transposed copy beside `embed`,
    which the token lookup keeps using). Stacked or per-layer (unstack_layers) trees."""
    fused = {"wqkv": ("wq", "wk", "wv"), "wo": ("wo",), "w_gate_up": ("w_gate", "w_up"),
             "w_down": ("w_down",)}
    dropped = {name for parts in fused.values() for name in parts}

    def pack_layer(lp: dict) -> dict:
        out = {k: v for k, v in lp.items() if k not in dropped}
        for name, parts in fused.items():
            out[name] = cpu_kernels.pack(jnp.concatenate([lp[p] for p in parts], axis=-1))
        return out

    out = dict(params)
    if "layer_list" in params:
        out["layer_list"] = [pack_layer(lp) for lp in params["layer_list"]]
    else:
        out["layers"] = pack_layer(params["layers"])
    head = params["lm_head"] if "lm_head" in params else params["embed"].T  # [D, V]
    out["lm_head"] = cpu_kernels.pack(head)
    return out


def _layer_body(params: dict, kv: KVPool, batch: ForwardBatch, cfg: ModelConfig,
                cos: jax.Array, sin: jax.Array, attention_backend: str):
    """body(h [T, D], layer) -> (h, (k, v)): one decoder layer, the layer index traced.

    Weights come stacked (`layers`, sliced by the index) or per layer (`layer_list`, see
    unstack_layers), where a `lax.switch` on the index picks the layer's own buffers:
    XLA CPU copies a dynamic slice of the stacked weights before every dot, which halves
    the speed of a memory-bound decode step."""
    if "layer_list" in params:
        # Only the weight-bearing halves are switched; attention (no weights, most of the
        # HLO) is traced once, which keeps compile and cache-load time down.
        # Each branch calls one jitted function: its jaxpr is traced once per step shape
        # and lowered once, not 30 times, which halves start-up tracing.
        qkv = [functools.partial(_qkv_jit, lp, cfg=cfg) for lp in params["layer_list"]]
        out = [functools.partial(_out_mlp_jit, lp, cfg=cfg) for lp in params["layer_list"]]

        def body(h, layer):
            q, k, v = jax.lax.switch(layer, qkv, h, cos, sin)
            o = _attend(q, k, v, kv, layer, batch, cfg, attention_backend)
            return jax.lax.switch(layer, out, h, o), (k, v)
    else:
        def body(h, layer):
            lp = jax.tree.map(lambda w: w[layer], params["layers"])
            q, k, v = _qkv(lp, h, cos, sin, cfg)
            o = _attend(q, k, v, kv, layer, batch, cfg, attention_backend)
            return _out_mlp(lp, h, o, cfg), (k, v)
    return body


def _rope(batch: ForwardBatch, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    return rope_cos_sin(batch.positions, rope_inv_freq(cfg.head_dim, cfg.rope_theta,
                                                       cfg.rope_scaling))


def run_layers(params: dict, kv: KVPool, h: jax.Array, batch: ForwardBatch, cfg: ModelConfig,
               *, start: jax.Array | int = 0, num_layers: int | None = None,
               attention_backend: str = "xla") -> tuple[jax.Array, KVPool]:
    """Run decoder layers [start, start + num_layers) over hidden h [T, D].

    `start` may be traced (split prefill advances it call by call); `num_layers` is
    static, so every layer chunk of the same size shares one trace. The pool is only
    read inside the loop; this step's K/V are written once after it.
    """
    n = cfg.num_layers if num_layers is None else num_layers
    cos, sin = _rope(batch, cfg)
    body = _layer_body(params, kv, batch, cfg, cos, sin, attention_backend)
    layers = jnp.arange(n, dtype=jnp.int32) + start
    h, (k, v) = jax.lax.scan(body, h, layers)  # k, v [n, T, Hkv, Dh]
    return h, write_kv(kv, layers, batch.out_cache_loc, k, v)


def run_layer_range(params: dict, kv: KVPool, h: jax.Array, batch: ForwardBatch,
                    cfg: ModelConfig, start: jax.Array, stop: jax.Array,
                    attention_backend: str = "xla") -> tuple[jax.Array, KVPool]:
    """Layers [start, stop) with both bounds traced (a while loop): each layer writes its
    K/V into the pool as it ends, since the count is not known at trace time. The decode
    rows of a fused multiplexed step run the layers outside its prefill interval this way."""
    cos, sin = _rope(batch, cfg)

    def step(layer, carry):
        h, kv = carry
        body = _layer_body(params, kv, batch, cfg, cos, sin, attention_backend)
        h, (k, v) = body(h, layer)
        return h, write_kv(kv, layer[None], batch.out_cache_loc, k[None], v[None])

    return jax.lax.fori_loop(start, stop, step, (h, kv))


def compute_logits(params: dict, h: jax.Array, logits_indices: jax.Array,
                   cfg: ModelConfig) -> jax.Array:
    """h [T, D] -> logits [B, V] in f32, only for the tokens that are sampled."""
    x = rms_norm(h[logits_indices], params["final_norm"], cfg.rms_norm_eps)  # [B, D]
    if isinstance(params.get("lm_head"), cpu_kernels.PackedWeight):
        return linear(x, params["lm_head"])
    if cfg.tie_word_embeddings:
        return jnp.einsum("bd,vd->bv", x, params["embed"], preferred_element_type=jnp.float32)
    return jnp.einsum("bd,dv->bv", x, params["lm_head"], preferred_element_type=jnp.float32)


def forward(params: dict, kv: KVPool, batch: ForwardBatch, cfg: ModelConfig,
            attention_backend: str = "xla") -> tuple[jax.Array, KVPool]:
    """One full forward: logits [B, V] for each row's sampled token, and the updated pool."""
    h = embed(params, batch.input_ids)
    h, kv = run_layers(params, kv, h, batch, cfg, attention_backend=attention_backend)
    return compute_logits(params, h, batch.logits_indices, cfg), kv
