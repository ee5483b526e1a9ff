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
