"""Check that llama-server serves the same model as xlaserve: greedy completions of a few
chat prompts (the same token ids, rendered with xlaserve's chat template) from both
servers, compared token by token.

    .venv/bin/python scripts/bench/check_llama_peer.py --out_dir=bench_out     # ~1 minute

The F32 and BF16 GGUFs are written from xlaserve's own weights with llama.cpp's Q/K row
order: a wrong permutation garbles attention and the texts part within a token or two.
Each variant is compared with xlaserve in the same dtype (BF16 with --dtype=bfloat16, the
others with float32). Greedy outputs agree up to the first near-tie (REFERENCE.md: top-2
margins are often below 0.1), so `agree_tokens` (the shared leading tokens) is reported,
not only equality; the Q4_1 file is a different model (quantized weights and
activations) and expected to part earlier. Writes check_llama_peer.json.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import bench_common as bc
import bench_servers as bs
import httpx
import llama_peer
from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("out_dir", "bench_out", "where the JSON and server logs go")
flags.DEFINE_list("variants", ["f32", "bf16", "q4_1"], "llama-server model files to check")
flags.DEFINE_integer("max_tokens", 32, "greedy tokens per prompt")
flags.DEFINE_multi_string("prompt", ["What is the capital of France?",
                                     "Write a haiku about the sea.",
                                     "List three prime numbers.",
                                     "Explain what a CPU cache is in one sentence."],
                          "user messages (rendered with the chat template)")
flags.DEFINE_string("xlaserve_cmd", "{python} scripts/serve.py", "xlaserve launch command")
flags.DEFINE_string("xlaserve_flags", "--max_total_tokens=32768", "xlaserve flags (as "
                    "bench_serving.py's, so the compilation cache of one serves the other)")
flags.DEFINE_string("llama_server_cmd", "{llama_server}", "llama-server launch command")
flags.DEFINE_integer("llama_threads", 2, "llama-server threads")
flags.DEFINE_string("checkpoint_cache_dir", "~/.cache/xlaserve/checkpoints", "see "
                    "bench_serving.py")


def prompt_ids() -> list[list[int]]:
    from runtime.checkpoint import default_gguf_path
    from runtime.tokenizer import Tokenizer
    tok = Tokenizer.from_gguf(default_gguf_path())
    return [list(tok.apply_chat_template([{"role": "user", "content": p}], tokenize=True))
            for p in FLAGS.prompt]


def greedy_choice(base_url: str, ids: list[int]) -> dict[str, Any]:
    """The greedy completion's choice from /v1/completions: its text and, asked for with
    logprobs, the text piece of every chosen token (compared piece by piece)."""
    body = {"model": "default", "prompt": ids, "max_tokens": FLAGS.max_tokens,
            "temperature": 0.0, "logprobs": 1}
    r = httpx.post(base_url + "/v1/completions", json=body, timeout=300, trust_env=False)
    r.raise_for_status()
    return r.json()["choices"][0]


def _pieces(choice: dict[str, Any]) -> list[str]:
    lp = choice.get("logprobs") or {}
    if lp.get("tokens"):
        return list(lp["tokens"])
    if lp.get("content"):  # llama-server's OpenAI logprobs in the chat layout
        return [c["token"] for c in lp["content"]]
    return [choice.get("text", "")]


def complete_all(target: bs.Target, prompts: list[list[int]]) -> list[dict[str, Any]]:
    with bs.running(target, Path(FLAGS.out_dir), 600) as srv:
        return [greedy_choice(srv.base_url, ids) for ids in prompts]


# The xlaserve dtype each llama-server variant is compared with (Q4_1 against float32: the
# weights it was quantized from).
XLASERVE_DTYPE = {"f32": "float32", "bf16": "bfloat16", "q4_1": "float32"}


def main(argv: list[str]) -> None:
    del argv
    logging.getLogger("httpx").setLevel(logging.WARNING)
    prompts = prompt_ids()
    unknown = sorted(set(FLAGS.variants) - set(XLASERVE_DTYPE))
    if unknown:
        raise app.UsageError(f"--variants: {unknown} not in {sorted(XLASERVE_DTYPE)}")
    result: dict[str, Any] = {"script": "check_llama_peer", "command": bc.command_line(),
                              "max_tokens": FLAGS.max_tokens, "xlaserve": {}, "variants": {}}
    refs = {}
    for dtype in dict.fromkeys(XLASERVE_DTYPE[v] for v in FLAGS.variants):
        target = bs.xlaserve_target(f"xlaserve_{dtype}=", FLAGS.xlaserve_cmd,
                                    f"{FLAGS.xlaserve_flags} --dtype={dtype}", "openai")
        refs[dtype] = complete_all(target, prompts)
        result["xlaserve"][dtype] = {"argv": list(target.argv)}
    for v in FLAGS.variants:
        ref = refs[XLASERVE_DTYPE[v]]
        t = llama_peer.llama_target(v, 1, 512, FLAGS.llama_threads, FLAGS.llama_server_cmd,
                                    FLAGS.checkpoint_cache_dir)
        rows = []
        for p, x, y in zip(FLAGS.prompt, ref, complete_all(t, prompts), strict=True):
            a, b = _pieces(x), _pieces(y)
            rows.append({"prompt": p, "xlaserve": x["text"], "llama_server": y["text"],
                         "agree_tokens": bc.common_prefix(a, b), "tokens": len(a),
                         "equal": x["text"] == y["text"]})
            bc.log(f"{v}: {p!r}: {rows[-1]['agree_tokens']}/{len(a)} tokens agree")
        result["variants"][v] = {"argv": list(t.argv), "xlaserve_dtype": XLASERVE_DTYPE[v],
                                 "prompts": rows,
                                 "all_equal": all(r["equal"] for r in rows)}
    bc.write_json(FLAGS.out_dir, "check_llama_peer.json", result)


if __name__ == "__main__":
    app.run(main)
