"""Expected two-batch-overlap gain on GPUs, from a per-layer cost model (docs/tbo.md).

    .venv/bin/python scripts/bench/tbo_cost_model.py --out_dir=/tmp/tbo

Per MoE layer and device, with n tokens on the device:
  compute(n) = max(n * flops_per_token / (peak * mfu), weight_bytes / hbm)   matmuls
               + n * kv_bytes_per_token / hbm                             decode attention
               + launch                                                    fixed per pass
  comm(n)    = n * top_k * hidden * (dispatch + combine bytes) spread over NVLink (peers in
               the node) and InfiniBand (peers in other nodes) + 2 * latency
  plain      = compute(N) + comm(N)
  TBO        = 2 * max(sm_share * compute(N / 2), comm(N / 2))
(steady state of the layer pipeline: each micro-batch's compute runs beside the other's
communication; the communication kernels hold some SMs, slowing the compute beside them
by sm_share; the weights are read once per micro-batch, which is why small decode batches
lose). Every constant is a flag; the defaults are DeepSeek-V3 on H100 / H200 and are listed
with their sources in docs/tbo.md. Writes tbo_cost_model.json.
"""

from __future__ import annotations

import json
import os

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("out_dir", "bench_out", "where tbo_cost_model.json goes")
flags.DEFINE_list("gpus", ["8", "16", "32"], "expert-parallel GPUs (8 per node)")
flags.DEFINE_list("decode_tokens", ["32", "128", "256"], "decode tokens per device")
flags.DEFINE_list("prefill_tokens", ["4096", "16384"], "prefill tokens per device")
# DeepSeek-V3 (config.json): 256 routed experts top-8, moe_intermediate 2048, hidden 7168,
# one shared expert; MLA kv_lora_rank 512 + rope 64 cached per token and layer.
flags.DEFINE_integer("hidden", 7168, "")
flags.DEFINE_integer("moe_intermediate", 2048, "")
flags.DEFINE_integer("experts", 256, "")
flags.DEFINE_integer("top_k", 8, "")
flags.DEFINE_float("dense_mflops_per_token", 460.0, "attention projections + shared expert "
                   "+ router per token and layer (MLA: ~187M weights, shared 44M)")
flags.DEFINE_integer("kv_bytes_per_token", 1152, "cached K/V read per context token and "
                     "layer (576 bf16 values)")
flags.DEFINE_integer("decode_context", 2000, "context per decode sequence")
flags.DEFINE_float("prefill_attn_mflops_per_token", 200.0, "causal attention core per "
                   "prefill token (128 heads x 192 dims x 4 x half of 4096)")
flags.DEFINE_float("dispatch_bytes", 1.0, "bytes per element sent to experts (FP8)")
flags.DEFINE_float("combine_bytes", 2.0, "bytes per element sent back (BF16)")
flags.DEFINE_float("weight_bytes", 1.0, "bytes per expert weight (FP8)")
# H100 SXM datasheet: 989 TFLOP/s dense BF16, 1979 dense FP8, 3.35 TB/s HBM3; NVLink 4
# 900 GB/s total = 450 GB/s per direction; ConnectX-7 400 Gb/s = 50 GB/s per GPU.
flags.DEFINE_float("peak_tflops", 1979.0, "dense FP8 tensor TFLOP/s")
flags.DEFINE_float("mfu", 0.5, "share of peak the grouped GEMMs reach")
flags.DEFINE_float("hbm_gbps", 3350.0, "")
flags.DEFINE_float("nvlink_gbps", 450.0, "per direction")
flags.DEFINE_float("ib_gbps", 50.0, "per GPU per direction")
flags.DEFINE_float("latency_us", 15.0, "fixed cost of one dispatch or combine")
flags.DEFINE_float("launch_us", 40.0, "fixed cost of one pass over a layer (kernel launches)")
flags.DEFINE_float("sm_share", 132 / 108, "compute slowdown while communication kernels "
                   "hold SMs (DeepEP: 24 of 132)")


def layer_costs(n: float, gpus: int, decode: bool) -> tuple[float, float]:
    """(compute, comm) seconds of one MoE layer for n tokens on one device."""
    f = FLAGS
    expert_flops = 2 * 3 * f.hidden * f.moe_intermediate * f.top_k  # per token
    flops = n * (expert_flops + 1e6 * f.dense_mflops_per_token
                 + (0 if decode else 1e6 * f.prefill_attn_mflops_per_token))
    weights = f.experts / gpus * 3 * f.hidden * f.moe_intermediate * f.weight_bytes
    compute = max(flops / (f.peak_tflops * 1e12 * f.mfu), weights / (f.hbm_gbps * 1e9))
    if decode:
        compute += n * f.decode_context * f.kv_bytes_per_token / (f.hbm_gbps * 1e9)
    compute += f.launch_us * 1e-6
    volume = n * f.top_k * f.hidden * (f.dispatch_bytes + f.combine_bytes)
    remote = volume * (gpus - 1) / gpus  # routing spread evenly over the experts
    cross_node = volume * max(gpus - 8, 0) / gpus
    comm = ((remote - cross_node) / (f.nvlink_gbps * 1e9) + cross_node / (f.ib_gbps * 1e9)
            + 2 * f.latency_us * 1e-6)
    return compute, comm


def gain(n: int, gpus: int, decode: bool) -> dict[str, float]:
    compute, comm = layer_costs(n, gpus, decode)
    half_compute, half_comm = layer_costs(n / 2, gpus, decode)
    plain = compute + comm
    tbo = 2 * max(FLAGS.sm_share * half_compute, half_comm)
    return {"tokens_per_device": n, "gpus": gpus, "mode": "decode" if decode else "prefill",
            "compute_us": compute * 1e6, "comm_us": comm * 1e6, "plain_us": plain * 1e6,
            "tbo_us": tbo * 1e6, "gain": plain / tbo - 1}


def main(argv: list[str]) -> None:
    del argv
    rows = [gain(int(n), int(g), decode) for decode, ns in (
        (True, FLAGS.decode_tokens), (False, FLAGS.prefill_tokens))
        for n in ns for g in FLAGS.gpus]
    for r in rows:
        print(f"{r['mode']:<8} {r['tokens_per_device']:>6} tok/dev {r['gpus']:>3} GPUs: "
              f"compute {r['compute_us']:7.0f} us  comm {r['comm_us']:7.0f} us  plain "
              f"{r['plain_us']:7.0f}  TBO {r['tbo_us']:7.0f}  gain {r['gain']:+.0%}")
    os.makedirs(FLAGS.out_dir, exist_ok=True)
    with open(os.path.join(FLAGS.out_dir, "tbo_cost_model.json"), "w") as fh:
        json.dump({"assumptions": {k: FLAGS[k].value for k in FLAGS if k in _ASSUMPTIONS},
                   "rows": rows}, fh, indent=1)


_ASSUMPTIONS = ("hidden", "moe_intermediate", "experts", "top_k", "dense_mflops_per_token",
                "kv_bytes_per_token", "decode_context", "prefill_attn_mflops_per_token",
                "dispatch_bytes", "combine_bytes", "weight_bytes", "peak_tflops", "mfu",
                "hbm_gbps", "nvlink_gbps", "ib_gbps", "latency_us", "launch_us", "sm_share")

if __name__ == "__main__":
    app.run(main)
