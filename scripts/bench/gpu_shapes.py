"""The model shape the GPU suite serves with random weights (scripts/bench/bench_engine.py) and
whose CUDA lowering tests/test_gpu_lowering.py checks from the CPU. No absl flags here, so
a test can import it beside other scripts without their flags colliding."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from models.config import ModelConfig  # noqa: E402

# Llama-3-8B (Meta-Llama-3-8B config.json): the shape only, weights are random.
LLAMA3_8B = ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                        rope_theta=500000.0, max_position_embeddings=8192,
                        bos_token_id=128000, eos_token_ids=(128001, 128009))
KV_LEN = 8192  # the one kv-length bucket (page-table width): the model's context

# Llama-3-70B (Meta-Llama-3-70B config.json): the TP=8 shape.
LLAMA3_70B = ModelConfig(vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                         num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128,
                         rope_theta=500000.0, max_position_embeddings=8192,
                         bos_token_id=128000, eos_token_ids=(128001, 128009))
# Qwen3-30B-A3B (Qwen/Qwen3-30B-A3B config.json): 128 experts, 8 per token; the EP=8 shape.
QWEN3_30B_A3B = ModelConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                            num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128,
                            rope_theta=1000000.0, rms_norm_eps=1e-6,
                            max_position_embeddings=8192, architecture="qwen3_moe",
                            qk_norm=True, num_experts=128, num_experts_per_tok=8,
                            moe_intermediate_size=768, norm_topk_prob=True,
                            bos_token_id=None, eos_token_ids=(151645,))
