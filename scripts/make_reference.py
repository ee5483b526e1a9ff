"""Generate the committed numerical reference fixtures with Hugging Face transformers.

Dev-time tool (needs the `reference` extra: torch, transformers, accelerate); CI never
runs it, the tests only read what it writes:

  tests/fixtures/smollm2_reference.npz / .json  SmolLM2 chat prompts: prompt ids, f32
      last-position logits, greedy tokens (EOS ignored) with top-2 margins, teacher-forced
      top-1, and checksums of transformers' state_dict for the GGUF importer test.
  tests/fixtures/smollm2_reference_bf16.npz      the same prompts with the same weights
      rounded to bfloat16, run by transformers in bf16 (the --dtype=bfloat16 parity test).
  tests/fixtures/smollm2_reference_int8.npz      the same prompts, transformers in f32 on
      the weights as --quantization=int8 holds them (every linear layer's rows quantized
      to int8 with a scale per row, then multiplied back; the embedding lookup unquantized).
  tests/fixtures/tiny_models/<name>/             seeded random HF models (safetensors +
      config.json) and ref_logits.npz: logits [T, V] of a fixed token sequence; the dense
      families (--only=tiny_dense: mistral with a 5-token sliding window, qwen3; --only=gemma3)
      also greedy.npz / greedy(): transformers' greedy tokens over 32 steps from a short prompt.
  tests/fixtures/tiny_models/gpt_oss/             a tiny gpt-oss (alternating sliding-window
      and full layers, sinks, YaRN, clamped-SwiGLU experts) saved in bf16; its ref_logits.npz
      adds greedy() over a 20-token prompt, layer 0's MoE block on seeded inputs, the YaRN
      frequencies and attention factor, and an MXFP4 tensor with transformers' dequantization.

Usage: .venv/bin/python scripts/make_reference.py
           [--only=smollm2|smollm2_bf16|smollm2_int8|tiny|tiny_moe|tiny_dense|gemma3|gptoss|deepseek]
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local; never reach the Hub

import numpy as np
import torch
from absl import app, flags
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GptOssConfig,
    GptOssForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from runtime.checkpoint import default_gguf_path  # noqa: E402

FLAGS = flags.DEFINE_string("out_dir", "tests/fixtures", "fixture folder")
ONLY = flags.DEFINE_enum("only", None, ["smollm2", "smollm2_bf16", "smollm2_int8", "tiny",
                                        "tiny_moe", "tiny_dense", "gemma3", "gptoss",
                                        "deepseek"],
                        "generate just one group")
NUM_GREEDY = flags.DEFINE_integer("num_greedy", 32, "greedy tokens per prompt")

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
]
# Fixed input of the tiny models (ids < 256, positions 0..11).
TINY_TOKENS = [1, 17, 42, 99, 128, 255, 3, 7, 64, 200, 31, 2]
# Rows of q_proj / k_proj that straddle rope half-head and head boundaries, so a missing
# or wrong Q/K un-permutation changes at least one of them.
CHECK_ROWS = [0, 1, 2, 31, 32, 33, 63, 64, 65, 127, 128, 191]
CHECK_COLS = [0, 1, 100, 575]


@torch.no_grad()
def greedy(model: torch.nn.Module, prompt: list[int], n: int) -> dict[str, np.ndarray]:
    """Manual greedy loop with the KV cache, EOS ignored; plus a teacher-forced pass."""
    ids = torch.tensor([prompt])
    out = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True)
    last_logits = out.logits[0, -1].float().numpy().copy()  # [V]
    toks, margins, top_logits = [], [], []
    for step in range(n):
        top2 = torch.topk(out.logits[0, -1].float(), 2)
        tok = int(top2.indices[0])
        toks.append(tok)
        margins.append(float(top2.values[0] - top2.values[1]))
        top_logits.append(float(top2.values[0]))
        if step == n - 1:
            break
        mask = torch.ones(1, len(prompt) + step + 1, dtype=torch.long)
        out = model(input_ids=torch.tensor([[tok]]), past_key_values=out.past_key_values,
                    attention_mask=mask, use_cache=True)
    # One full forward over prompt + continuation: the top-1 at every continuation step.
    full = torch.tensor([prompt + toks[:-1]])
    tf_logits = model(input_ids=full, attention_mask=torch.ones_like(full)).logits[0]
    tf = tf_logits[len(prompt) - 1:].float()  # [n, V]
    tf_top2 = torch.topk(tf, 2, dim=-1)
    return {
        "prompt_ids": np.array(prompt, np.int32),
        "last_logits": last_logits.astype(np.float32),
        "greedy_ids": np.array(toks, np.int32),
        "greedy_margins": np.array(margins, np.float32),
        "greedy_top_logits": np.array(top_logits, np.float32),
        "tf_top1": tf_top2.indices[:, 0].numpy().astype(np.int32),
        "tf_margins": (tf_top2.values[:, 0] - tf_top2.values[:, 1]).numpy().astype(np.float32),
    }


def checksums(state: dict[str, torch.Tensor]) -> dict[str, dict]:
    """Sums and chosen elements of a few HF-layout ([out, in]) weights."""
    names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.5.self_attn.k_proj.weight",
             "model.layers.29.mlp.down_proj.weight", "model.embed_tokens.weight"]
    out = {}
    for name in names:
        w = state[name].double().numpy()
        rows = [r for r in CHECK_ROWS if r < w.shape[0]]
        cols = [c for c in CHECK_COLS if c < w.shape[1]]
        out[name] = {"shape": list(w.shape), "sum": float(w.sum()),
                     "abs_sum": float(np.abs(w).sum()), "rows": rows, "cols": cols,
                     "values": w[np.ix_(rows, cols)].tolist()}
    return out


def make_smollm2(out_dir: str) -> None:
    path = default_gguf_path()
    folder, name = os.path.split(path)
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model.eval()
    print(f"loaded SmolLM2 in {time.perf_counter() - t0:.1f}s")
    arrays: dict[str, np.ndarray] = {}
    meta: dict = {"gguf": name, "num_greedy": NUM_GREEDY.value, "prompts": []}
    for i, messages in enumerate(PROMPTS):
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt = tok(text, add_special_tokens=False).input_ids
        res = greedy(model, prompt, NUM_GREEDY.value)
        arrays.update({f"p{i}_{k}": v for k, v in res.items()})
        meta["prompts"].append({
            "messages": messages, "text": text, "prompt_ids": prompt,
            "greedy_ids": res["greedy_ids"].tolist(),
            "greedy_text": tok.decode(res["greedy_ids"].tolist()),
            "greedy_margins": [round(float(m), 5) for m in res["greedy_margins"]],
            "tf_matches_greedy": int((res["tf_top1"] == res["greedy_ids"]).sum()),
        })
        print(f"prompt {i}: {len(prompt)} ids, greedy {meta['prompts'][-1]['greedy_text']!r}, "
              f"min margin {res['greedy_margins'].min():.4f}")
    meta["checksums"] = checksums(model.state_dict())
    np.savez_compressed(os.path.join(out_dir, "smollm2_reference.npz"), **arrays)
    with open(os.path.join(out_dir, "smollm2_reference.json"), "w") as f:
        json.dump(meta, f, indent=1)


def _greedy_fixture(model: torch.nn.Module, tok, label: str, path: str) -> None:
    """greedy() on every chat prompt, saved as p<i>_<key> arrays in the .npz at path."""
    arrays: dict[str, np.ndarray] = {}
    for i, messages in enumerate(PROMPTS):
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt = tok(text, add_special_tokens=False).input_ids
        res = greedy(model, prompt, NUM_GREEDY.value)
        arrays.update({f"p{i}_{k}": v for k, v in res.items()})
        print(f"prompt {i} ({label}): greedy {tok.decode(res['greedy_ids'].tolist())!r}, "
              f"min margin {res['greedy_margins'].min():.4f}")
    np.savez_compressed(path, **arrays)


def _smollm2_f32() -> tuple:
    """(tokenizer, transformers model in f32) of the default GGUF."""
    folder, name = os.path.split(default_gguf_path())
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return tok, AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                     dtype=torch.float32).eval()


def make_smollm2_bf16(out_dir: str) -> None:
    """transformers in bf16 on the GGUF's weights rounded to bf16 (as xlaserve's bf16
    checkpoint rounds them): greedy tokens, margins and teacher-forced top-1."""
    tok, model = _smollm2_f32()
    _greedy_fixture(model.to(torch.bfloat16).eval(), tok, "bf16",
                    os.path.join(out_dir, "smollm2_reference_bf16.npz"))


def int8_rows(w: torch.Tensor) -> torch.Tensor:
    """An HF linear weight [out, in] as cpu_kernels.pack_int8 holds it: each output row
    (our column) q = round(w / s) in [-127, 127], s = max |row| / 127, times s again (the
    same f32 operations as pack_int8, so the same q and s)."""
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.clamp(torch.round(w / scale[:, None]), -127, 127)
    return q * scale[:, None]


def make_smollm2_int8(out_dir: str) -> None:
    """transformers in f32 on the GGUF's weights quantized as --quantization=int8 does:
    every linear layer's weight and the output head (untied from the embedding, whose
    lookup xlaserve keeps in f32) through int8_rows."""
    tok, model = _smollm2_f32()
    for module in model.model.layers.modules():
        if isinstance(module, torch.nn.Linear):
            module.weight = torch.nn.Parameter(int8_rows(module.weight.data))
    # A new Parameter unties the head from embed_tokens.
    model.lm_head.weight = torch.nn.Parameter(int8_rows(model.model.embed_tokens.weight.data))
    _greedy_fixture(model, tok, "int8", os.path.join(out_dir, "smollm2_reference_int8.npz"))


def tiny_configs() -> dict[str, tuple[type, object]]:
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=4096, rms_norm_eps=1e-5, bos_token_id=1,
                  eos_token_id=2)
    # original_max_position_embeddings=32 puts the llama3 smoothing band (wavelengths
    # 8..32) inside head_dim 16's frequencies, so scaling changes logits within 12 tokens.
    llama3_rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 32}
    return {
        "llama3_untied": (LlamaForCausalLM, LlamaConfig(
            **common, rope_parameters=llama3_rope, tie_word_embeddings=False)),
        "qwen2_bias_tied": (Qwen2ForCausalLM, Qwen2Config(
            **common, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
            tie_word_embeddings=True)),
        "llama_tied": (LlamaForCausalLM, LlamaConfig(
            **common, rope_parameters={"rope_type": "default", "rope_theta": 1e5},
            tie_word_embeddings=True)),
        "llama_untied": (LlamaForCausalLM, LlamaConfig(
            **common, rope_parameters={"rope_type": "default", "rope_theta": 1e4},
            tie_word_embeddings=False)),
    }


def tiny_moe_configs() -> dict[str, tuple[type, object]]:
    """8 experts, top-2 over 12 tokens: 24 assignments, so some experts get none."""
    common = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                  rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, num_experts_per_tok=2,
                  tie_word_embeddings=False)
    rope = {"rope_type": "default", "rope_theta": 1e4}
    return {
        "qwen2_moe": (Qwen2MoeForCausalLM, Qwen2MoeConfig(
            **common, rope_parameters=rope, num_experts=8, intermediate_size=96,
            moe_intermediate_size=32, shared_expert_intermediate_size=48,
            norm_topk_prob=False)),
        "qwen3_moe": (Qwen3MoeForCausalLM, Qwen3MoeConfig(
            **common, rope_parameters=rope, num_experts=8, intermediate_size=96,
            moe_intermediate_size=32, norm_topk_prob=True)),
        "mixtral": (MixtralForCausalLM, MixtralConfig(
            **common, rope_parameters=rope, num_local_experts=8, intermediate_size=32,
            sliding_window=None)),
    }


# The dense families' greedy prompt: decode runs from position 5 to 36, so a 5-token window
# slides over the prompt and then over the generated tokens.
DENSE_PROMPT = TINY_TOKENS[:5]


def tiny_dense_configs() -> dict[str, tuple[type, object]]:
    """Mistral with a sliding window of 5 (the 12-token fixed input and the greedy decode
    both run past it) and Qwen3 dense (q/k norm, no bias); 3 layers."""
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=4096, rms_norm_eps=1e-5, bos_token_id=1,
                  eos_token_id=2, tie_word_embeddings=False)
    return {
        "mistral": (MistralForCausalLM, MistralConfig(
            **common, rope_parameters={"rope_type": "default", "rope_theta": 1e4},
            sliding_window=5)),
        "qwen3": (Qwen3ForCausalLM, Qwen3Config(
            **common, rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    }


def make_tiny_dense(out_dir: str) -> None:
    """make_tiny's fixtures, then transformers' greedy decode from DENSE_PROMPT."""
    configs = tiny_dense_configs()
    make_tiny(out_dir, configs, seed0=208)  # seeds whose greedy runs have no near-tie
    for name, (cls, _) in configs.items():
        folder = os.path.join(out_dir, "tiny_models", name)
        model = cls.from_pretrained(folder, dtype=torch.float32).eval()
        np.savez_compressed(os.path.join(folder, "greedy.npz"),
                            **greedy(model, DENSE_PROMPT, NUM_GREEDY.value))


def deepseek_configs() -> dict[str, tuple[type, object]]:
    """MLA + DeepSeek-MoE, 3 layers: V2-Lite style (no q_lora, softmax greedy top-k, all
    layers MoE but the first) and V3 style (q_lora, sigmoid + correction bias, group-limited
    top-2-sum routing, first layer dense, YaRN rope)."""
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
                  qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                  moe_intermediate_size=24, n_shared_experts=2, num_experts_per_tok=2,
                  first_k_dense_replace=1, max_position_embeddings=4096, rms_norm_eps=1e-5,
                  bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    # V3 as released: YaRN, here over an original context of 8 so that it changes the
    # logits within the fixture's tokens, and mscale_all_dim scaling the softmax.
    yarn = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
            "original_max_position_embeddings": 8, "beta_fast": 32, "beta_slow": 1,
            "mscale": 1.0, "mscale_all_dim": 1.0}
    return {
        "deepseek_v2": (DeepseekV2ForCausalLM, DeepseekV2Config(
            **common, q_lora_rank=None, n_routed_experts=8, topk_method="greedy",
            routed_scaling_factor=1.5)),
        "deepseek_v3": (DeepseekV3ForCausalLM, DeepseekV3Config(
            **{**common, "rope_parameters": yarn}, q_lora_rank=24, n_routed_experts=8,
            n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True)),
    }


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights with O(1) logits: HF's 0.02 init leaves them near-uniform and uninformative.
    Norms and biases move off 1/0 so that a misplaced one shows in the logits."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        noise = torch.randn(p.shape, generator=gen)
        if "norm" in name:
            p.copy_(1.0 + 0.2 * noise)
        elif name.endswith("bias"):
            p.copy_(0.5 * noise)
        elif "embed" in name:
            p.copy_(0.3 * noise)  # tied heads reuse it: keeps logits O(1)
        else:
            p.copy_(noise * p.shape[-1] ** -0.5)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's routing bias
            b.copy_(0.1 * torch.randn(b.shape, generator=gen))


def make_tiny(out_dir: str, configs: dict[str, tuple[type, object]], seed0: int = 0,
              greedy_steps: int = 0) -> None:
    tokens = torch.tensor([TINY_TOKENS])
    for seed, (name, (cls, cfg)) in enumerate(configs.items(), start=seed0):
        torch.manual_seed(seed)
        model = cls(cfg).eval()
        randomize(model, seed)
        folder = os.path.join(out_dir, "tiny_models", name)
        os.makedirs(folder, exist_ok=True)
        for old in os.listdir(folder):
            os.remove(os.path.join(folder, old))
        # One model in bf16 (like real Qwen2 releases) and one sharded, to cover those paths.
        if name == "qwen2_bias_tied":
            model = model.to(torch.bfloat16)
        shard = "100KB" if name == "llama3_untied" else "50MB"
        model.save_pretrained(folder, max_shard_size=shard)
        # Reload in f32: the reference is what transformers computes from the saved files
        # (casting the live bf16 model back would keep its bf16-rounded rope buffers).
        model = cls.from_pretrained(folder, dtype=torch.float32).eval()
        logits = model(input_ids=tokens, attention_mask=torch.ones_like(tokens)).logits[0]
        extra = {}
        block = model.model.layers[0].mlp
        if name.startswith("deepseek"):  # layer 0 is dense: the first MoE layer's block
            block = model.model.layers[cfg.first_k_dense_replace].mlp
        if hasattr(block, "experts"):  # MoE: layer 0's block alone on seeded inputs
            x = torch.randn(1, 16, cfg.hidden_size, generator=torch.Generator().manual_seed(seed))
            extra = {"moe_in": x[0].numpy(), "moe_out": block(x)[0].float().numpy()}  # [16, D]
        if greedy_steps:  # greedy continuation of the first 6 tokens
            res = greedy(model, TINY_TOKENS[:6], greedy_steps)
            extra.update({f"greedy_{k}": v for k, v in res.items()})
        np.savez_compressed(os.path.join(folder, "ref_logits.npz"),
                            tokens=np.array(TINY_TOKENS, np.int32),
                            logits=logits.float().numpy(), **extra)  # [T, V]
        print(f"{name}: {sorted(os.listdir(folder))}, logits std {float(logits.std()):.3f}")


def gemma3_configs() -> dict[str, Gemma3TextConfig]:
    """Both layer types, each with its own rope (global: linear scaling), a query scale
    that is not head_dim's. "gemma3": a 4-token window, which the 12 fixed tokens and the
    8 + 32 greedy ones exceed, and final soft-capping; "gemma3_wide": a window longer than
    any sequence here, to check everything else apart from the window. (transformers'
    Gemma 3 ignores attn_logit_softcapping, so no fixture here can test it.)"""
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=4096, rms_norm_eps=1e-6, bos_token_id=2,
                  eos_token_id=1, pad_token_id=0, query_pre_attn_scalar=24,
                  layer_types=["sliding_attention", "full_attention", "sliding_attention",
                               "full_attention"],
                  rope_parameters={
                      "full_attention": {"rope_type": "linear", "factor": 4.0,
                                         "rope_theta": 1e5},
                      "sliding_attention": {"rope_type": "default", "rope_theta": 1e3}})
    return {"gemma3": Gemma3TextConfig(**common, sliding_window=4, final_logit_softcapping=10.0),
            "gemma3_wide": Gemma3TextConfig(**common, sliding_window=64)}


def make_gemma3(out_dir: str, seed0: int = 200) -> None:
    """Tiny random Gemma3ForCausalLM folders with ref_logits.npz: logits [T, V] of the
    fixed tokens and greedy() of their first 8 over NUM_GREEDY steps."""
    tokens = torch.tensor([TINY_TOKENS])
    for seed, (name, cfg) in enumerate(gemma3_configs().items(), start=seed0):
        torch.manual_seed(seed)
        model = Gemma3ForCausalLM(cfg).eval()
        randomize(model, seed)
        for pname, p in model.named_parameters():
            # The lookup is scaled by sqrt(D) = 8: at randomize's scale the token's own
            # embedding swamps every layer's output and greedy repeats the token. A small
            # table and a large final norm keep the tied logits O(1).
            if "norm" in pname:  # Gemma stores norm weights minus 1
                p.data += 7.0 if pname == "model.norm.weight" else -1.0
            elif "embed" in pname:
                p.data /= 8.0
        folder = os.path.join(out_dir, "tiny_models", name)
        os.makedirs(folder, exist_ok=True)
        for old in os.listdir(folder):
            os.remove(os.path.join(folder, old))
        model.save_pretrained(folder)
        model = Gemma3ForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                  attn_implementation="eager").eval()
        logits = model(input_ids=tokens, attention_mask=torch.ones_like(tokens)).logits[0]
        res = greedy(model, TINY_TOKENS[:8], NUM_GREEDY.value)
        np.savez_compressed(os.path.join(folder, "ref_logits.npz"),
                            tokens=np.array(TINY_TOKENS, np.int32),
                            logits=logits.float().numpy(), **res)  # [T, V]
        print(f"{name}: {sorted(os.listdir(folder))}, logits std {float(logits.std()):.3f}, "
              f"greedy {res['greedy_ids'].tolist()}, min margin "
              f"{res['greedy_margins'].min():.4f}")


def gptoss_config() -> GptOssConfig:
    """4 layers alternating sliding (window 4) and full attention; YaRN over an original
    context of 16 positions, so the scaled frequencies matter within the prompt; 8 experts
    top-2; swiglu_limit 1.5 so the clamps bind on O(1) activations."""
    return GptOssConfig(
        vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"] * 2, num_local_experts=8,
        num_experts_per_tok=2, max_position_embeddings=512, rms_norm_eps=1e-5,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, swiglu_limit=1.5,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                         "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 16},
        attn_implementation="eager")


def make_gptoss(out_dir: str, seed: int = 201) -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    cfg = gptoss_config()
    torch.manual_seed(seed)
    model = GptOssForCausalLM(cfg).eval()
    randomize(model, seed)
    folder = os.path.join(out_dir, "tiny_models", "gpt_oss")
    os.makedirs(folder, exist_ok=True)
    for old in os.listdir(folder):
        os.remove(os.path.join(folder, old))
    model.to(torch.bfloat16).save_pretrained(folder)
    model = GptOssForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                              attn_implementation="eager").eval()
    tokens = torch.tensor([TINY_TOKENS])
    logits = model(input_ids=tokens, attention_mask=torch.ones_like(tokens)).logits[0]
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, cfg.vocab_size, (20,), generator=gen).tolist()
    res = greedy(model, prompt, NUM_GREEDY.value)
    x = torch.randn(1, 16, cfg.hidden_size, generator=gen)
    moe_out = model.model.layers[0].mlp(x)[0][0]  # [16, D]
    rope = model.model.rotary_emb
    # [E, out, in / 32, 16] codes and [E, out, in / 32] exponents of 2 experts 8 x 64
    blocks = torch.randint(0, 256, (2, 8, 2, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(120, 134, (2, 8, 2), generator=gen, dtype=torch.uint8)
    mx = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]
    np.savez_compressed(
        os.path.join(folder, "ref_logits.npz"), tokens=np.array(TINY_TOKENS, np.int32),
        logits=logits.float().numpy(), moe_in=x[0].numpy(), moe_out=moe_out.float().numpy(),
        yarn_inv_freq=rope.inv_freq.float().numpy(),
        yarn_attention_scaling=np.float64(rope.attention_scaling),
        mxfp4_blocks=blocks.numpy(), mxfp4_scales=scales.numpy(), mxfp4_hf=mx.numpy(),
        **{f"p0_{k}": v for k, v in res.items()})
    print(f"gpt_oss: {sorted(os.listdir(folder))}, logits std {float(logits.std()):.3f}, "
          f"greedy {res['greedy_ids'].tolist()}, min margin {res['greedy_margins'].min():.4f}")


def main(argv: list[str]) -> None:
    del argv
    out_dir = os.path.abspath(FLAGS.value)
    os.makedirs(out_dir, exist_ok=True)
    torch.set_grad_enabled(False)
    t0 = time.perf_counter()
    if ONLY.value in (None, "tiny"):
        make_tiny(out_dir, tiny_configs())
    if ONLY.value in (None, "tiny_moe"):
        make_tiny(out_dir, tiny_moe_configs(), seed0=100)
    if ONLY.value in (None, "tiny_dense"):
        make_tiny_dense(out_dir)
    if ONLY.value in (None, "gemma3"):
        make_gemma3(out_dir)
    if ONLY.value in (None, "gptoss"):
        make_gptoss(out_dir)
    if ONLY.value in (None, "deepseek"):
        make_tiny(out_dir, deepseek_configs(), seed0=200, greedy_steps=NUM_GREEDY.value)
    if ONLY.value in (None, "smollm2"):
        make_smollm2(out_dir)
    if ONLY.value in (None, "smollm2_bf16"):
        make_smollm2_bf16(out_dir)
    if ONLY.value in (None, "smollm2_int8"):
        make_smollm2_int8(out_dir)
    print(f"fixtures written to {out_dir} in {time.perf_counter() - t0:.1f}s")


if __name__ == "__main__":
    app.run(main)
