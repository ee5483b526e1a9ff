"""Two-batch overlap (TBO) for the MoE decoders: one forward over two micro-batches A and
B (runtime/two_batch_overlap.py splits a batch into them) in which A's expert-parallel
all_to_all never waits for B's compute, nor B's for A's, so XLA's latency-hiding
scheduler can run one micro-batch's communication under the other's compute.

Per layer (one scan step, weights stacked):
  attention  A then B. The layer loop only reads the pool; both micro-batches' K/V come
             out of the scan and are written once after it (a pool written inside the
             loop is copied by XLA CPU on every trip). Where B may continue a sequence A
             began (the two-chunk split of extend and mixed batches), B attends over a
             one-layer copy of its own pages into which A's K/V of the layer are written
             (`_pages_with`), so it sees A's part of the cut sequence without the pool.
  MoE        both micro-batches' stages (models/moe.py moe_stages: prepare, dispatch +
             shared expert, experts, combine send, output) in one shard_map over `ep`,
             traced as an overlapped operation list with B one stage behind A: every
             exchange of one micro-batch sits beside a compute stage of the other.
XLA orders by dataflow, not by trace order, so the list is what the dependence structure
looks like, not a schedule; the proof of independence is the HLO (tests/test_tbo.py),
the proof of overlap a GPU compile (async all-to-all start/done pairs with the other
micro-batch's compute between them; tests/test_tbo_gpu.py).

Every op of micro-batch X is under the named scope `mb_x/<stage>` (HLO metadata op_name),
which is how the tests tell the chains apart.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from models import layers, llama, moe
from models.config import ModelConfig
from models.forward_batch import ForwardBatch
from models.kv_pool import KVPool, write_kv

# B runs each stage one step after A: A's dispatch beside B's prepare, A's experts beside
# B's dispatch, A's combine send beside B's experts, B's combine send beside A's output.
STAGE_DELAY = 1
MICRO_BATCHES = ("mb_a", "mb_b")


def run_overlapped(stages: list[moe.Stage], states: tuple[dict, dict],
                   delay: int = STAGE_DELAY) -> tuple[dict, dict]:
    """Both micro-batches through the same operation list, B `delay` stages behind A."""
    a, b = states
    for step in range(len(stages) + delay):
        if step < len(stages):
            with jax.named_scope(f"{MICRO_BATCHES[0]}/{stages[step].__name__}"):
                a = stages[step](a)
        if 0 <= step - delay < len(stages):
            with jax.named_scope(f"{MICRO_BATCHES[1]}/{stages[step - delay].__name__}"):
                b = stages[step - delay](b)
    return a, b


def moe_pair(lp: dict, xa: jax.Array, xb: jax.Array, cfg: ModelConfig,
             mesh: Mesh | None) -> tuple[jax.Array, jax.Array]:
    """The MoE MLP of both micro-batches, xa [Ta, D], xb [Tb, D] -> same shapes."""
    n = moe.ep_size(mesh)

    def body(lp: dict, xa: jax.Array, xb: jax.Array) -> tuple[jax.Array, jax.Array]:
        stages = moe.moe_stages(lp, cfg, moe.EP_AXIS if n > 1 else None, n)
        a, b = run_overlapped(stages, ({"x": xa}, {"x": xb}))
        return a["out"], b["out"]

    if n == 1:
        return body(lp, xa, xb)
    return moe.expert_parallel(mesh, body, lp, xa, xb)


def _attention(lp: dict, h: jax.Array, kv: KVPool, layer: jax.Array, batch: ForwardBatch,
               rope: tuple[jax.Array, jax.Array], cfg: ModelConfig, attention_backend: str,
               model_layer: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One micro-batch's attention with its residual, h [T, D] -> [T, D], and its K/V
    [T, Hkv, Dh] x 2 (not yet in the pool). model_layer: see layers.attend."""
    q, k, v = layers.qkv(lp, h, *rope, cfg)  # [T, Hq, Dh], [T, Hkv, Dh] x 2
    o = layers.attend(q, k, v, kv, layer, batch, cfg, attention_backend,
                      sinks=lp.get("sinks"), model_layer=model_layer)  # [T, Hq*Dh]
    return h + layers.attn_out(lp, o, cfg), k, v


def _pages_with(kv: KVPool, layer: jax.Array, batch: ForwardBatch, slots: jax.Array,
                k: jax.Array, v: jax.Array) -> tuple[KVPool, ForwardBatch]:
    """A one-layer pool of `batch`'s pages of `layer`, with k, v [T, Hkv, Dh] written at
    the pool slots [T] that fall on those pages (others dropped), and `batch` reading it.

    Reads what attention reads anyway (the batch's pages of the layer), writes nothing of
    the pool. A page listed twice (padding's page 0) gets the new K/V in one copy only;
    the new K/V of a step land on pages their own request owns, which no other row of the
    batch lists."""
    rows, width = batch.page_table.shape
    pages = batch.page_table.reshape(-1)  # [n] pool page of each local page
    n, size = pages.shape[0], kv.page_size
    # [1, Hkv, n, S, Dh] each
    local = KVPool(k=kv.k[layer][:, pages][None], v=kv.v[layer][:, pages][None])
    # Local page of each pool page; n (out of range: the write drops it) where not listed.
    where = jnp.full(kv.num_pages, n, jnp.int32).at[pages].set(jnp.arange(n, dtype=jnp.int32))
    local_slots = where[slots // size] * size + slots % size  # [T]
    local = write_kv(local, jnp.zeros(1, jnp.int32), local_slots, k[None], v[None])
    table = jnp.arange(n, dtype=jnp.int32).reshape(rows, width)  # [B, Np]
    return local, batch.replace(page_table=table)


def forward(params: dict, kv: KVPool, batches: tuple[ForwardBatch, ForwardBatch],
            cfg: ModelConfig, attention_backend: str = "xla", mesh: Mesh | None = None,
            two_chunk: bool = True) -> tuple[jax.Array, jax.Array, KVPool]:
    """Both micro-batches through every layer: logits [Ba, V], [Bb, V] and the pool.

    The layer loop reads the pool and writes nothing into it; both micro-batches' K/V
    are written once after it. two_chunk (static): B may continue a sequence A began, so
    B's attention reads its pages with A's K/V of the layer written in (`_pages_with`);
    decode splits never cut a sequence and read the pool directly."""
    if "layers" not in params:
        raise ValueError("two-batch overlap runs the stacked layer weights "
                         "(per_layer_weights=False)")
    if mesh is not None and mesh.shape.get("tp", 1) > 1:
        raise ValueError("two-batch overlap runs expert parallelism without tp")
    a, b = batches
    ropes = tuple(layers.rope_for(x.positions, cfg) for x in batches)
    attention = functools.partial(_attention, cfg=cfg, attention_backend=attention_backend)
    write = functools.partial(layers.write_step_kv, mesh=None,
                              attention_backend=attention_backend)

    def layer_step(h: tuple, layer: jax.Array) -> tuple[tuple, tuple]:
        ha, hb = h
        lp = layers.layer_weights(params["layers"], layer)
        with jax.named_scope(f"{MICRO_BATCHES[0]}/attention"):
            ha, ka, va = attention(lp, ha, kv, layer, a, ropes[0])
        with jax.named_scope(f"{MICRO_BATCHES[1]}/attention"):
            pool, b_layer, b_batch = kv, layer, b
            if two_chunk:
                pool, b_batch = _pages_with(kv, layer, b, a.out_cache_loc, ka, va)
                b_layer = jnp.zeros((), jnp.int32)
            hb, kb, vb = attention(lp, hb, pool, b_layer, b_batch, ropes[1], model_layer=layer)
        norm = functools.partial(layers.rms_norm, w=lp["mlp_norm"], eps=cfg.rms_norm_eps)
        if "dense_layer" in lp:  # DeepSeek's first layers: the dense MLP, no exchange
            ya, yb = jax.lax.cond(
                lp["dense_layer"], lambda lp, xa, xb: (llama.mlp(lp, xa), llama.mlp(lp, xb)),
                lambda lp, xa, xb: moe_pair(lp, xa, xb, cfg, mesh), lp, norm(ha), norm(hb))
        else:
            ya, yb = moe_pair(lp, norm(ha), norm(hb), cfg, mesh)
        return (ha + ya, hb + yb), (ka, va, kb, vb)

    h0 = (moe.embed(params, a.input_ids), moe.embed(params, b.input_ids))  # [Ta, D], [Tb, D]
    ids = jnp.arange(cfg.num_layers, dtype=jnp.int32)
    # The pool is closed over (read only); the K/V come out of the scan [L, T, Hkv, Dh].
    (ha, hb), (ka, va, kb, vb) = jax.lax.scan(layer_step, h0, ids)
    kv = write(write(kv, ids, a.out_cache_loc, ka, va), ids, b.out_cache_loc, kb, vb)
    return (moe.compute_logits(params, ha, a.logits_indices, cfg),
            moe.compute_logits(params, hb, b.logits_indices, cfg), kv)
