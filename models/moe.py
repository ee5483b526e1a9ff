"""Mixture-of-experts decoders (Qwen2-MoE, Qwen3-MoE, Mixtral) over a paged KV pool.

Attention, norms, the layer scan and the logits are the shared skeleton of
models/layers.py; this module adds the routed-expert MLP. Routing is softmax top-k (f32),
optionally renormalized (`norm_topk_prob`; Mixtral always), plus Qwen2-MoE's shared
expert scaled by a sigmoid gate. DeepSeek-MoE (models/deepseek.py) adds sigmoid scores
with a per-expert selection bias (V3), group-limited selection, a routed scaling factor
and an ungated shared expert.

Expert parallelism (EP): with a mesh whose `ep` axis has n > 1 devices, experts are
sharded over `ep` and the tokens split across it; each rank routes its own tokens,
sends every (token, expert) pair to the expert's owner with `all_to_all`, runs its local
experts on what it received and sends the results back with a second `all_to_all`
(SGLang's DeepEP dispatch / combine). Nothing is dropped: a rank's send buffer to each
peer holds every pair its tokens could send there (tokens x min(top_k, local experts)).
The stages (route, dispatch, exchange, experts, combine) are separate functions over
explicit arrays, so two micro-batches can interleave them (two-batch overlap).

gpt-oss's variant (cfg.router_bias, softmax_after_topk, expert_bias, expert_act): the
router has a bias and the softmax runs over the k selected logits; the experts hold gate
and up fused with their columns interleaved as the checkpoint has them, biases on both
products, and a clamped SwiGLU (expert_act).

Parameter layout (models/params_layout.md), per layer on top of the attention weights:
  router [L, D, E]; we_gate, we_up [L, E, D, Fm]; we_down [L, E, Fm, D];
  with a shared expert: ws_gate, ws_up [L, D, Fs], ws_down [L, Fs, D], and its gate
  ws_router [L, D, 1] (not DeepSeek's); router_bias [L, E]: gpt-oss's router bias or
  DeepSeek-V3's selection bias; gpt-oss: we_gate_up [L, E, D, 2Fm] (gate, up, gate, up, ...
  columns) and be_gate_up [L, E, 2Fm] instead of we_gate / we_up; be_down [L, E, D].
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import shard_map
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from models import layers
from models.config import ModelConfig
from models.fp8 import Fp8Weight, fp8_ragged_dot
from models.layers import compute_logits, embed, fuse_projections, gated_mlp, unstack_layers
from pallas_kernels import grouped_matmul

__all__ = ["compute_logits", "embed", "forward", "fuse_projections", "init_params",
           "pack_for_cpu", "param_shapes", "run_layer_range", "run_layers", "unstack_layers",
           "MoeMlp"]

EP_AXIS = "ep"
# The experts' product on a GPU (`experts`): "pallas", the grouped Triton kernel
# (pallas_kernels/grouped_matmul.py), which reads each routed expert's weights in place;
# "xla", XLA's products (a loop over the routed experts for few tokens, else ragged_dot;
# docs/gpu.md has why both read more). Unmeasured on a device, so it stays a switch
# (scripts/bench/gpu_aot.py --moe_gpu_experts). A CPU always takes ragged_dot.
GPU_EXPERTS = "pallas"
EXPERT_KEYS = ("we_gate", "we_up", "we_down", "we_gate_up", "be_gate_up", "be_down")


def mlp_shapes(cfg: ModelConfig, n_layers: int) -> dict:
    """The MoE MLP's weights stacked over n_layers (see the module docstring)."""
    L, D, E, F = n_layers, cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    mlp = {"router": (L, D, E), "we_gate": (L, E, D, F), "we_up": (L, E, D, F),
           "we_down": (L, E, F, D)}
    if cfg.router_bias:
        mlp["router_bias"] = (L, E)
    if cfg.expert_bias:  # gpt-oss: its fused, interleaved gate|up with biases
        del mlp["we_gate"], mlp["we_up"]
        mlp.update(we_gate_up=(L, E, D, 2 * F), be_gate_up=(L, E, 2 * F), be_down=(L, E, D))
    fs = cfg.shared_expert_intermediate_size
    if fs:
        mlp.update(ws_gate=(L, D, fs), ws_up=(L, D, fs), ws_down=(L, fs, D))
        if cfg.shared_expert_gate:
            mlp["ws_router"] = (L, D, 1)
    if cfg.moe_scoring == "sigmoid":
        mlp["router_bias"] = (L, E)
    return mlp


def param_shapes(cfg: ModelConfig) -> dict:
    """The parameter tree as {key: shape tuple} (see the module docstring)."""
    return layers.model_shapes(cfg, {**layers.attention_shapes(cfg),
                                     **mlp_shapes(cfg, cfg.num_layers)})


def init_params(cfg: ModelConfig, key: jax.Array, dtype: jnp.dtype = jnp.float32) -> dict:
    """Random weights with the real layout (see layers.init_from_shapes)."""
    return layers.init_from_shapes(param_shapes(cfg), key, dtype)


def pack_for_cpu(params: dict, quantization: str | None = None) -> dict:
    raise ValueError("cpu_matmul='packed' is the dense Llama path; MoE models run XLA's dot "
                     "(cpu_matmul='xla')")


# ---------------------------------------------------------------- the stages


def _limit_groups(choice: jax.Array, cfg: ModelConfig) -> jax.Array:
    """choice [T, E] with the experts outside each token's topk_group best groups at -inf;
    a group scores its best expert (DeepSeek-V2) or its best two summed (V3, sigmoid)."""
    t, e = choice.shape
    g = choice.reshape(t, cfg.n_group, e // cfg.n_group)  # [T, G, E/G]
    if cfg.moe_scoring == "sigmoid":
        group_score = jax.lax.top_k(g, 2)[0].sum(-1)  # [T, G]
    else:
        group_score = g.max(-1)
    _, top = jax.lax.top_k(group_score, cfg.topk_group)  # [T, topk_group]
    keep = (top[:, :, None] == jnp.arange(cfg.n_group)[None, None, :]).any(1)  # [T, G]
    return jnp.where(keep[:, :, None], g, -jnp.inf).reshape(t, e)


def route(x: jax.Array, router: jax.Array, cfg: ModelConfig,
          bias: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """x [T, D] -> top-k weights [T, k] (f32) and expert ids [T, k] int32. `bias` [E]:
    with cfg.router_bias (gpt-oss) the router's own bias, added to the logits; with sigmoid
    scoring (DeepSeek-V3) a selection bias, which shifts which experts are chosen, not
    their weights."""
    logits = x @ router if bias is None or not cfg.router_bias else x @ router + bias
    logits = logits.astype(jnp.float32)  # [T, E]
    if cfg.softmax_after_topk:  # gpt-oss: the k best logits, then a softmax over them
        top, ids = jax.lax.top_k(logits, cfg.num_experts_per_tok)  # [T, k]
        return jax.nn.softmax(top, axis=-1), ids.astype(jnp.int32)
    if cfg.router_bias:
        bias = None
    if cfg.moe_scoring == "sigmoid":
        scores = jax.nn.sigmoid(logits)
    else:
        scores = jax.nn.softmax(logits, axis=-1)
    choice = scores if bias is None else scores + bias.astype(jnp.float32)
    if cfg.n_group > 1:
        choice = _limit_groups(choice, cfg)
    _, ids = jax.lax.top_k(choice, cfg.num_experts_per_tok)  # [T, k]
    w = jnp.take_along_axis(scores, ids, axis=-1)  # [T, k]
    if cfg.norm_topk_prob:
        w = w / (w.sum(-1, keepdims=True) + 1e-20)
    if cfg.routed_scaling_factor != 1.0:
        w = w * cfg.routed_scaling_factor
    return w, ids.astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class Dispatch:
    """Where each of a rank's (token, expert) pairs went: peer rank and buffer slot."""

    dest: jax.Array  # [N] int32 rank owning the pair's expert; N = T * k
    slot: jax.Array  # [N] int32 position in the send buffer to that rank


def dispatch(x: jax.Array, ids: jax.Array, num_ranks: int,
             experts_per_rank: int) -> tuple[jax.Array, jax.Array, Dispatch]:
    """Pack pairs into per-peer send buffers: x [T, D], ids [T, k] ->
    send_x [R, C, D], send_e [R, C] (the expert's local id; experts_per_rank = empty)."""
    t, k = ids.shape
    cap = t * min(k, experts_per_rank)  # the most pairs of these tokens one peer can own
    flat = ids.reshape(-1)  # [N]
    dest = flat // experts_per_rank  # [N]
    onehot = (dest[:, None] == jnp.arange(num_ranks)[None, :]).astype(jnp.int32)  # [N, R]
    slot = jnp.take_along_axis(jnp.cumsum(onehot, axis=0), dest[:, None], 1)[:, 0] - 1  # [N]
    tok = jnp.arange(t * k) // k  # [N]
    send_x = jnp.zeros((num_ranks, cap, x.shape[-1]), x.dtype).at[dest, slot].set(x[tok])
    send_e = jnp.full((num_ranks, cap), experts_per_rank, jnp.int32).at[dest, slot].set(
        flat % experts_per_rank)
    return send_x, send_e, Dispatch(dest=dest, slot=slot)


def exchange(buf: jax.Array, axis: str | None) -> jax.Array:
    """[R, ...] -> [R, ...]: row r goes to rank r; row r of the result came from rank r."""
    if axis is None:
        return buf
    return jax.lax.all_to_all(buf, axis, split_axis=0, concat_axis=0)


def clamped_swiglu(gate: jax.Array, up: jax.Array, alpha: float, limit: float) -> jax.Array:
    """gpt-oss's expert activation: gate clamped above at limit, up to [-limit, limit],
    (up + 1) * gate * sigmoid(alpha * gate)."""
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * alpha))


def _grouped(xs: jax.Array, w: jax.Array | Fp8Weight, sizes: jax.Array,
             own: jax.Array) -> jax.Array:
    """xs [M, K] grouped by expert (sizes [E]) through each group's expert w [E, K, N] ->
    [M, N]; FP8 experts (models/fp8.py) take their block-scaled product."""
    if isinstance(w, Fp8Weight):
        return fp8_ragged_dot(xs, w, sizes, own)
    return jax.lax.ragged_dot(xs, w, sizes)


def _on_gpu() -> bool:
    """Whether this process traces its programs for a GPU (scripts/bench/gpu_programs.py
    patches it while compiling for compile-only GPUs from a CPU process)."""
    return jax.default_backend() == "gpu"


def _interpret_kernels() -> bool:
    """Whether Pallas kernels run interpreted (a CPU backend; scripts/bench/gpu_programs.py
    patches it to compile them for compile-only GPUs from a CPU process)."""
    return jax.default_backend() == "cpu"


def routed_loop_pays(n_local: int, num_ranks: int, tokens: int, k: int) -> bool:
    """Whether the loop over the routed local experts (`_routed_experts`) moves fewer bytes
    than ragged_dot, which XLA's GPU compiler makes a dense product of every received row
    with every local expert. Each loop trip copies its expert's slices before the gemms (a
    gemm does not read a dynamic slice in place): ~3.2 experts' worth of bytes a trip at
    decode sizes (30 MB for Qwen3-30B-A3B's 9.4 MB, docs/gpu.md), so it is chosen while a
    rank's expected routed local experts under uniform routing, for `tokens` tokens of the
    step on all ranks, stay under a quarter of its experts: at most 4 tokens for
    Qwen3-30B-A3B (128 experts, top-8)."""
    num_experts = n_local * num_ranks
    routed = n_local * (1 - (1 - 1 / num_experts) ** (tokens * k))
    return 4 * routed <= n_local


def _expert_mlp(x: jax.Array, lp: dict, e: jax.Array, cfg: ModelConfig | None) -> jax.Array:
    """x [M, D] through local expert e's gated MLP -> [M, D] (see `experts`)."""
    if "we_gate_up" in lp:
        gu = x @ lp["we_gate_up"][e] + lp["be_gate_up"][e]  # [M, 2Fm]
        g, u = gu[:, ::2], gu[:, 1::2]  # the columns interleave
    else:
        g, u = x @ lp["we_gate"][e], x @ lp["we_up"][e]  # [M, Fm] each
    if cfg is not None and cfg.expert_act == "clamped_swiglu":
        act = clamped_swiglu(g, u, cfg.swiglu_alpha, cfg.swiglu_limit)
    else:
        act = jax.nn.silu(g) * u
    y = act @ lp["we_down"][e]  # [M, D]
    return y + lp["be_down"][e] if "be_down" in lp else y


def _routed_experts(xs: jax.Array, es: jax.Array, lp: dict, cfg: ModelConfig | None,
                    window: int) -> jax.Array:
    """xs [M, D], es [M] (n_local: empty) -> [M, D]: a while loop over the local experts
    that received a pair. The trip count is data dependent, so a step reads only the routed
    experts' weights. The pairs are sorted by expert and each trip runs the `window` sorted
    rows from its group's start (a group holds at most one pair per token, so `window` >=
    the step's tokens covers it), keeping the rows of its expert."""
    m = xs.shape[0]
    n_local = lp["we_down"].shape[0]
    window = min(window, m)
    order = jnp.argsort(es, stable=True)  # group the pairs by expert; empties last
    xs, sorted_e = xs[order], es[order]  # [M, D], [M]
    sizes = jnp.bincount(es, length=n_local)  # [El]
    starts = jnp.cumsum(sizes) - sizes  # [El] each group's first sorted row
    routed = jnp.argsort(sizes == 0, stable=True).astype(jnp.int32)  # routed experts first
    trips = jnp.count_nonzero(sizes).astype(jnp.int32)

    def trip(i: jax.Array, ys: jax.Array) -> jax.Array:
        e = routed[i]
        s0 = jnp.minimum(starts[e], m - window)  # the window stays inside; still holds e's
        y = _expert_mlp(jax.lax.dynamic_slice_in_dim(xs, s0, window), lp, e, cfg)  # [W, D]
        mine = jax.lax.dynamic_slice_in_dim(sorted_e, s0, window) == e  # [W]
        kept = jnp.where(mine[:, None], y, jax.lax.dynamic_slice_in_dim(ys, s0, window))
        return jax.lax.dynamic_update_slice_in_dim(ys, kept, s0, 0)

    ys = jax.lax.fori_loop(0, trips, trip, jnp.zeros_like(xs))
    return jnp.zeros_like(ys).at[order].set(ys)


def tile_rows(rows_per_expert: float) -> int:
    """Rows of a grouped-kernel tile: the expected rows of an expert rounded up to a power
    of 2, within 16 (Triton's smallest dot) and 128."""
    bm = 16
    while bm < min(rows_per_expert, 128):
        bm *= 2
    return bm


def tiled_kernel_fits(lp: dict) -> bool:
    """Whether these experts can take the grouped kernel: plain arrays (not FP8) whose
    dimensions take Triton blocks."""
    ws = [lp[key] for key in ("we_gate", "we_up", "we_gate_up", "we_down") if key in lp]
    return all(not isinstance(w, Fp8Weight) and grouped_matmul.available(*w.shape[1:])
               for w in ws)


def _tiled_experts(xs: jax.Array, es: jax.Array, lp: dict, cfg: ModelConfig | None,
                   bm: int) -> jax.Array:
    """xs [M, D], es [M] (n_local: empty) -> [M, D] through the grouped kernel: the rows
    as tiles of bm rows of one expert (pallas_kernels/grouped_matmul.py), which stay
    tiles from the gate to the down product."""
    m = xs.shape[0]
    n_local = lp["we_down"].shape[0]
    plan = grouped_matmul.plan_tiles(es, n_local, bm)
    own = jnp.minimum(plan.expert, n_local - 1)  # [T] each tile's expert, for its biases
    mm = functools.partial(grouped_matmul.tile_matmul, expert=plan.expert,
                           interpret=_interpret_kernels())
    xt = grouped_matmul.gather_tiles(xs, plan)  # [T, bm, D]
    if "we_gate_up" in lp:
        gu = mm(xt, lp["we_gate_up"]) + lp["be_gate_up"][own][:, None, :]  # [T, bm, 2Fm]
        g, u = gu[..., ::2], gu[..., 1::2]  # the columns interleave
    else:
        g, u = mm(xt, lp["we_gate"]), mm(xt, lp["we_up"])  # [T, bm, Fm] each
    if cfg is not None and cfg.expert_act == "clamped_swiglu":
        act = clamped_swiglu(g, u, cfg.swiglu_alpha, cfg.swiglu_limit)
    else:
        act = jax.nn.silu(g) * u
    y = mm(act, lp["we_down"])  # [T, bm, D]
    if "be_down" in lp:
        y = y + lp["be_down"][own][:, None, :]
    return grouped_matmul.scatter_tiles(y, plan, m)


def experts(recv_x: jax.Array, recv_e: jax.Array, lp: dict,
            cfg: ModelConfig | None = None, tokens: int | None = None) -> jax.Array:
    """The gated MLP of each received pair through its local expert: recv_x [R, C, D],
    recv_e [R, C] -> [R, C, D]; empty slots (id = local experts) come back as zeros.
    SwiGLU, or cfg.expert_act; gpt-oss's fused interleaved gate|up and biases where lp
    has them (cfg.expert_bias). `tokens`: the step's tokens on all R ranks (static; None:
    R * the tokens whose pairs fill C). On a GPU (GPU_EXPERTS): the grouped kernel; or XLA's:
    for few tokens (routed_loop_pays) a loop over the routed local experts, otherwise
    ragged_dot (and always on a CPU)."""
    r, c, d = recv_x.shape
    n_local = lp["we_down"].shape[0]
    xs, es = recv_x.reshape(r * c, d), recv_e.reshape(r * c)
    if cfg is not None and _on_gpu():
        k = cfg.num_experts_per_tok
        tokens = r * c // min(k, n_local) if tokens is None else tokens
        if GPU_EXPERTS == "pallas" and tiled_kernel_fits(lp):
            bm = tile_rows(tokens * k / (n_local * r))
            return _tiled_experts(xs, es, lp, cfg, bm).reshape(r, c, d)
        if routed_loop_pays(n_local, r, tokens, k):
            # >= 8 rows a trip: a one-row product would become a multiply + reduce that
            # writes a weight-sized product (docs/gpu.md)
            return _routed_experts(xs, es, lp, cfg, max(tokens, 8)).reshape(r, c, d)
    order = jnp.argsort(es, stable=True)  # group the pairs by expert; empties last
    sizes = jnp.bincount(es, length=n_local).astype(jnp.int32)  # [El]
    xs = xs[order]  # [R*C, D]
    # Each sorted pair's expert, for its biases and FP8 scales; the empties take expert
    # n_local - 1's, and their rows of the result are never read (combine reads the real
    # pairs only).
    own = jnp.minimum(es[order], n_local - 1)  # [R*C]
    if "we_gate_up" in lp:
        gu = _grouped(xs, lp["we_gate_up"], sizes, own) + lp["be_gate_up"][own]
        g, u = gu[:, ::2], gu[:, 1::2]  # [R*C, Fm] each: the columns interleave
    else:
        g = _grouped(xs, lp["we_gate"], sizes, own)  # [R*C, Fm]
        u = _grouped(xs, lp["we_up"], sizes, own)
    if cfg is not None and cfg.expert_act == "clamped_swiglu":
        act = clamped_swiglu(g, u, cfg.swiglu_alpha, cfg.swiglu_limit)
    else:
        act = jax.nn.silu(g) * u
    ys = _grouped(act, lp["we_down"], sizes, own)  # [R*C, D]
    if "be_down" in lp:
        ys = ys + lp["be_down"][own]
    return jnp.zeros_like(ys).at[order].set(ys).reshape(r, c, d)


def combine(back: jax.Array, where: Dispatch, w: jax.Array) -> jax.Array:
    """back [R, C, D] (results of the pairs sent to each peer), weights w [T, k] -> [T, D]."""
    t, k = w.shape
    ys = back[where.dest, where.slot].reshape(t, k, -1)  # [T, k, D]
    return jnp.einsum("tkd,tk->td", ys, w.astype(ys.dtype))


Stage = Callable[[dict], dict]


def moe_stages(lp: dict, cfg: ModelConfig, axis: str | None = None,
               num_ranks: int = 1, tokens: int | None = None) -> list[Stage]:
    """One rank's MoE MLP as an operation list (SGLang's per-layer stages): each stage
    takes and returns a micro-batch's state dict, starting from {"x": [T, D]} and ending
    with "out" [T, D]. Communication (exchange) opens the dispatch and combine stages, so
    an overlapped schedule can put the other micro-batch's compute beside it
    (models/moe_overlap.py); moe_block runs the list in order. `tokens`: the real tokens
    of all ranks (static; None: all of them), the rest padding (expert_parallel pads to a
    multiple of the ranks), whose pairs go out empty: a padding row's routing would
    otherwise run experts (zeros route to the lowest ids, all on rank 0)."""
    n_local = lp["we_down"].shape[0]

    def prepare(s: dict) -> dict:  # gate, select experts, pack the per-peer buffers
        w, ids = route(s["x"], lp["router"], cfg, lp.get("router_bias"))
        send_x, send_e, where = dispatch(s["x"], ids, num_ranks, n_local)
        t, k = ids.shape
        if axis is not None and tokens is not None and tokens < t * num_ranks:
            real = jax.lax.axis_index(axis) * t + jnp.arange(t) < tokens  # [T]
            pair_e = send_e[where.dest, where.slot]  # [N]
            send_e = send_e.at[where.dest, where.slot].set(
                jnp.where(jnp.repeat(real, k), pair_e, n_local))
        return {**s, "w": w, "where": where, "send_x": send_x, "send_e": send_e}

    def dispatch_shared(s: dict) -> dict:  # tokens out; the shared expert needs none of them
        out = {**s, "recv_x": exchange(s["send_x"], axis), "recv_e": exchange(s["send_e"], axis)}
        if "ws_gate" in lp:
            x = s["x"]
            shared = gated_mlp(x, lp["ws_gate"], lp["ws_up"], lp["ws_down"])  # [T, D]
            if "ws_router" in lp:  # Qwen2-MoE gates it; DeepSeek's is always on
                shared = jax.nn.sigmoid(x @ lp["ws_router"]) * shared
            out["shared"] = shared
        return out

    def run_experts(s: dict) -> dict:
        return {**s, "y": experts(s["recv_x"], s["recv_e"], lp, cfg, tokens)}  # [R, C, D]

    def combine_send(s: dict) -> dict:  # results back to the tokens' ranks
        return {**s, "back": exchange(s["y"], axis)}

    def output(s: dict) -> dict:
        out = combine(s["back"], s["where"], s["w"])  # [T, D]
        return {"out": out + s["shared"] if "shared" in s else out}

    return [prepare, dispatch_shared, run_experts, combine_send, output]


def moe_block(lp: dict, x: jax.Array, cfg: ModelConfig, axis: str | None = None,
              num_ranks: int = 1, tokens: int | None = None) -> jax.Array:
    """One rank's MoE MLP over its tokens x [T, D] -> [T, D]; with `axis`, inside a
    shard_map over it, lp holding this rank's experts (`tokens`: see moe_stages)."""
    state = {"x": x}
    for stage in moe_stages(lp, cfg, axis, num_ranks, tokens):
        state = stage(state)
    return state["out"]


def expert_parallel(mesh: Mesh, body: Callable, lp: dict, *xs: jax.Array) -> tuple:
    """body(lp, *xs) under shard_map over the `ep` axis: each x [T, D] padded to a multiple
    of ep and split over it, the expert weights split over it, the rest replicated;
    returns each output [T, D] with the padding cut off."""
    ep = mesh.shape[EP_AXIS]
    padded = [jnp.pad(x, ((0, -x.shape[0] % ep), (0, 0))) for x in xs]  # [T', D] each
    specs = {k: P(EP_AXIS) if k in EXPERT_KEYS else P() for k in lp}
    f = shard_map(body, mesh=mesh, in_specs=(specs, *[P(EP_AXIS)] * len(xs)),
                  out_specs=tuple(P(EP_AXIS) for _ in xs))
    return tuple(y[:x.shape[0]] for y, x in zip(f(lp, *padded), xs, strict=True))


@dataclasses.dataclass(frozen=True)
class MoeMlp:
    """The MoE MLP as layers.Mlp (hashable: a static argument). With a mesh whose `ep`
    axis is > 1, runs moe_block expert-parallel under shard_map."""

    cfg: ModelConfig
    mesh: Mesh | None = None

    @property
    def ep(self) -> int:
        return ep_size(self.mesh)

    def __call__(self, lp: dict, x: jax.Array) -> jax.Array:
        if self.ep == 1:
            return moe_block(lp, x, self.cfg, tokens=x.shape[0])
        body = functools.partial(moe_block, cfg=self.cfg, axis=EP_AXIS, num_ranks=self.ep,
                                 tokens=x.shape[0])
        return expert_parallel(self.mesh, lambda lp, x: (body(lp, x),), lp, x)[0]


def ep_size(mesh: Mesh | None) -> int:
    return 1 if mesh is None else mesh.shape.get(EP_AXIS, 1)


# The decoder skeleton of models/layers.py with the MoE MLP.
_DECODER = layers.Decoder(MoeMlp)
run_layers, run_layer_range, forward = (_DECODER.run_layers, _DECODER.run_layer_range,
                                        _DECODER.forward)
