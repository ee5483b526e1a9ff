"""Host-side tokenizer: text <-> ids, the model's chat template, and streaming detokenization.

Built on the `tokenizers` library, from either a GGUF file's embedded vocabulary or a Hugging
Face folder. Token ids, decoded text and rendered chat templates match transformers'
`AutoTokenizer` on the same files (tests/test_tokenizer.py checks this against a fixture that
scripts/make_tokenizer_fixture.py records). Host code: this module never imports jax.
"""

from __future__ import annotations

import json
import mmap
import struct
from collections.abc import Iterable, Sequence
from datetime import datetime
from functools import cache
from pathlib import Path
from typing import Any

import jinja2
from gguf import GGUF_MAGIC, GGUFValueType
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp's token types (gguf.TokenType)

# Pre-tokenizer splits that differ from GPT-2's, by `tokenizer.ggml.pre`; the same table as
# transformers' GGUF loader for these families. Any other name gets GPT-2's regex, as there.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(["llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe"], _LLAMA3_SPLIT),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen"], _QWEN2_SPLIT),
}


class Tokenizer:
    """A byte-level BPE (or any `tokenizer.json`) tokenizer plus the model's special tokens."""

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        pad_token_id: int | None = None,
        unk_token_id: int | None = None,
        extra_eos_token_ids: Iterable[int] = (),
        add_bos_token: bool = False,
        chat_template: str | None = None,
    ) -> None:
        self._backend = backend
        self._bos, self._eos = bos_token_id, eos_token_id
        self._pad, self._unk = pad_token_id, unk_token_id
        eos_ids = ([] if eos_token_id is None else [eos_token_id]) + list(extra_eos_token_ids)
        self._eos_ids = tuple(dict.fromkeys(eos_ids))  # ordered, without repeats
        self._add_bos = add_bos_token
        self._chat_template = chat_template

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """The tokenizer embedded in a GGUF file (only byte-level BPE, llama.cpp's `gpt2`)."""
        meta = read_gguf_metadata(path)
        kind = meta.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(
                f"{path}: tokenizer.ggml.model is {kind!r}; only 'gpt2' (byte-level BPE) is "
                "supported. Convert the model with its Hugging Face tokenizer.json instead."
            )
        types = meta.get("tokenizer.ggml.token_type") or [1] * len(meta["tokenizer.ggml.tokens"])
        backend = _byte_level_bpe(
            meta["tokenizer.ggml.tokens"], meta.get("tokenizer.ggml.merges", []), types
        )
        _use_split_regex(backend, meta.get("tokenizer.ggml.pre"))
        ids = {k: meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "padding")}
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
        add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
        _set_post_processor(backend, ids["bos"], ids["eos"], add_bos, add_eos)
        # Chat models end a turn with end-of-turn / end-of-message tokens besides EOS.
        extra_eos = [meta[k] for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
                     if k in meta]
        return cls(
            backend,
            bos_token_id=ids["bos"],
            eos_token_id=ids["eos"],
            pad_token_id=ids["padding"],
            unk_token_id=meta.get("tokenizer.ggml.unknown_token_id"),
            extra_eos_token_ids=extra_eos,
            add_bos_token=add_bos,
            chat_template=meta.get("tokenizer.chat_template"),
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """A Hugging Face folder: tokenizer.json, tokenizer_config.json (and, if there,
        chat_template.jinja and generation_config.json for extra EOS ids)."""
        folder = Path(path)
        backend = BackendTokenizer.from_file(str(_required(folder, "tokenizer.json")))
        config = json.loads(_required(folder, "tokenizer_config.json").read_text("utf-8"))
        bos, eos, pad, unk = (_token_id(backend, config.get(name))
                              for name in ("bos_token", "eos_token", "pad_token", "unk_token"))
        add_bos = bool(config.get("add_bos_token", False))
        # transformers keeps tokenizer.json's post-processor unless the config sets the flags.
        if {"add_bos_token", "add_eos_token"} & config.keys() or backend.post_processor is None:
            _set_post_processor(backend, bos, eos, add_bos, bool(config.get("add_eos_token")))
        return cls(
            backend,
            bos_token_id=bos,
            eos_token_id=eos,
            pad_token_id=pad,
            unk_token_id=unk,
            extra_eos_token_ids=_generation_eos_ids(folder),
            add_bos_token=add_bos,
            chat_template=_hf_chat_template(folder, config),
        )

    @property
    def backend(self) -> BackendTokenizer:
        """The underlying `tokenizers.Tokenizer` (e.g. to save it as tokenizer.json)."""
        return self._backend

    @property
    def bos_token_id(self) -> int | None:
        return self._bos

    @property
    def eos_token_id(self) -> int | None:
        return self._eos

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends generation: EOS first, then end-of-turn ids the model declares."""
        return self._eos_ids

    @property
    def pad_token_id(self) -> int | None:
        return self._pad

    @property
    def unk_token_id(self) -> int | None:
        return self._unk

    @property
    def add_bos_token(self) -> bool:
        return self._add_bos

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Ids for `text`; special tokens written in it (like `<|im_start|>`) stay whole.
        `add_special_tokens` adds BOS/EOS only where the model asks for them."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        **template_kwargs: Any,
    ) -> str | list[int]:
        """Render `messages` with the model's own template, as transformers does; with
        `tokenize`, return the ids (the template writes its own special tokens, so none are
        added). Extra keyword arguments (e.g. `tools`) reach the template as variables."""
        if self._chat_template is None:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        text = _render_chat(
            self._chat_template,
            _normalize_messages(messages),
            add_generation_prompt=add_generation_prompt,
            **self._special_token_strings(),
            **template_kwargs,
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def _special_token_strings(self) -> dict[str, str]:
        """The `bos_token`-style variables templates read, for the tokens the model has."""
        ids = {"bos_token": self._bos, "eos_token": self._eos,
               "unk_token": self._unk, "pad_token": self._pad}
        strings = {name: self.id_to_token(i) for name, i in ids.items() if i is not None}
        return {name: s for name, s in strings.items() if s is not None}


class IncrementalDetokenizer:
    """Turns a stream of generated ids into text deltas for streaming and stop strings.

    Decodes a short window of recent ids rather than each id alone: one token may hold only
    part of a UTF-8 character, and some decoders (SentencePiece) change a token's text by what
    precedes it. A delta is released only once the window's text no longer ends in U+FFFD, so
    no half character ever reaches a client. The deltas, followed by `flush()`, concatenate to
    `tokenizer.decode(all_ids)`.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0  # window start: ids before it are fully emitted
        self._read_offset = 0  # ids before it are emitted; [prefix, read) gives context
        self._text: list[str] = []

    @property
    def token_ids(self) -> list[int]:
        return list(self._ids)

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return "".join(self._text)

    def feed(self, token_ids: int | Iterable[int]) -> str:
        """Add one or more ids; return the text they complete (possibly empty)."""
        # Ids read back from the device arrive as numpy scalars or arrays, not Python ints.
        new_ids = token_ids if isinstance(token_ids, Iterable) else [token_ids]
        self._ids.extend(int(i) for i in new_ids)
        prefix_text, new_text = self._window_texts()
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""  # nothing new yet, or a character still waits for its other bytes
        return self._emit(new_text[len(prefix_text):])

    def flush(self) -> str:
        """At end of stream, release held-back text, U+FFFD included if a character was cut."""
        prefix_text, new_text = self._window_texts()
        return self._emit(new_text[len(prefix_text):]) if len(new_text) > len(prefix_text) else ""

    def _window_texts(self) -> tuple[str, str]:
        window = self._ids[self._prefix_offset:]
        decode = self._tokenizer.decode
        prefix_len = self._read_offset - self._prefix_offset
        prefix_text = decode(window[:prefix_len], skip_special_tokens=self._skip_special)
        return prefix_text, decode(window, skip_special_tokens=self._skip_special)

    def _emit(self, delta: str) -> str:
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._text.append(delta)
        return delta


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """A GGUF file's key/value metadata, without its tensors.

    `gguf.GGUFReader` builds a numpy view per string and takes ~1.6 s on the ~100k vocabulary
    strings of a small model; reading the header with `struct` takes a tenth of that.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        magic, version = struct.unpack_from("<II", buf, 0)
        if magic != GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file (magic {magic:#010x})")
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not supported (need 2 or 3)")
        _, kv_count = struct.unpack_from("<QQ", buf, 8)
        reader = _MetadataReader(buf, offset=24)
        try:
            return dict(reader.key_value() for _ in range(kv_count))
        except (struct.error, ValueError) as e:
            raise ValueError(f"{path}: malformed GGUF metadata ({e})") from e


_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h", GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?", GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d",
}


class _MetadataReader:
    """Sequential little-endian reader of GGUF metadata values."""

    def __init__(self, buf: mmap.mmap, offset: int) -> None:
        self._buf, self._pos = buf, offset

    def key_value(self) -> tuple[str, Any]:
        key = self._string()
        return key, self._value(GGUFValueType(self._unpack("<I")[0]))

    def _unpack(self, fmt: str) -> tuple[Any, ...]:
        values = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        (length,) = self._unpack("<Q")
        raw = self._buf[self._pos:self._pos + length]
        self._pos += length
        return raw.decode("utf-8")

    def _value(self, kind: GGUFValueType) -> Any:
        if kind == GGUFValueType.STRING:
            return self._string()
        if kind == GGUFValueType.ARRAY:
            item_kind, count = GGUFValueType(self._unpack("<I")[0]), self._unpack("<Q")[0]
            if item_kind in _SCALAR_FORMATS:  # one unpack for the whole array
                return list(self._unpack(f"<{count}{_SCALAR_FORMATS[item_kind]}"))
            return [self._value(item_kind) for _ in range(count)]
        return self._unpack("<" + _SCALAR_FORMATS[kind])[0]


@cache
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map: the alphabet byte-level tokens are spelled in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    chars = [chr(b) for b in printable] + [chr(256 + n) for n in range(len(others))]
    return dict(zip(printable + others, chars, strict=True))


def _byte_level_bpe(
    tokens: Sequence[str], merges: Sequence[str], token_types: Sequence[int]
) -> BackendTokenizer:
    """GPT-2 byte-level BPE, built the way transformers builds it from the same GGUF fields."""
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    # A token outside the byte alphabet was written as raw text: respell it byte by byte.
    vocab = {
        tok if set(tok) <= alphabet else "".join(spelling[b] for b in tok.encode("utf-8")): i
        for i, tok in enumerate(tokens)
    }
    bpe = models.BPE(vocab, [tuple(m.split(" ")) for m in merges], dropout=None,
                     continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False)
    backend = BackendTokenizer(bpe)
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    # Control tokens stay whole and are special (skipped on decode). One spelled outside the
    # alphabet is a converter mislabel, and adding it would grow the vocabulary: skip it.
    backend.add_special_tokens([
        AddedToken(tok, normalized=False, special=True)
        for tok, kind in zip(tokens, token_types, strict=True)
        if kind == _CONTROL and set(tok) <= alphabet
    ])
    # User-defined tokens (like `<think>`) also stay whole, but are ordinary text.
    backend.add_tokens([
        AddedToken(tok, normalized=False, special=False)
        for tok, kind in zip(tokens, token_types, strict=True)
        if kind == _USER_DEFINED and tok in vocab
    ])
    return backend


def _use_split_regex(backend: BackendTokenizer, pre: str | None) -> None:
    """Split text the way this vocabulary's merges were learned, where that isn't GPT-2's way."""
    split = _PRE_TOKENIZER_SPLITS.get(pre or "")
    if split is not None:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])


def _set_post_processor(
    backend: BackendTokenizer, bos: int | None, eos: int | None, add_bos: bool, add_eos: bool
) -> None:
    """Make `add_special_tokens=True` add exactly the BOS/EOS the model declares."""
    bos_token = backend.id_to_token(bos) if add_bos and bos is not None else None
    eos_token = backend.id_to_token(eos) if add_eos and eos is not None else None

    def template(sequence: str, type_id: int) -> str:
        pieces = [bos_token, f"${sequence}", eos_token]
        return " ".join(f"{piece}:{type_id}" for piece in pieces if piece is not None)

    special = {t: i for t, i in ((bos_token, bos), (eos_token, eos)) if t is not None}
    backend.post_processor = processors.TemplateProcessing(
        single=template("A", 0),
        pair=f"{template('A', 0)} {template('B', 1)}",
        special_tokens=list(special.items()),
    )


def _required(folder: Path, name: str) -> Path:
    path = folder / name
    if not path.is_file():
        raise FileNotFoundError(f"{name} not found in {folder} (expected a Hugging Face folder)")
    return path


def _token_id(backend: BackendTokenizer, token: str | dict[str, Any] | None) -> int | None:
    """tokenizer_config.json names special tokens as strings or as AddedToken dicts."""
    if isinstance(token, dict):
        token = token.get("content")
    if not token:
        return None
    token_id = backend.token_to_id(token)
    if token_id is None:
        raise ValueError(f"tokenizer_config.json names special token {token!r}, not in vocab")
    return token_id


def _generation_eos_ids(folder: Path) -> list[int]:
    """Llama-3-style models list several stop ids in generation_config.json."""
    path = folder / "generation_config.json"
    if not path.is_file():
        return []
    eos = json.loads(path.read_text("utf-8")).get("eos_token_id")
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


def _hf_chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one is the chat template
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default")
    jinja_file = folder / "chat_template.jinja"  # newer transformers save it on its own
    if template is None and jinja_file.is_file():
        template = jinja_file.read_text("utf-8")
    return template


def _normalize_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Drop None-valued keys, as transformers does: OpenAI clients send `content: null` with
    tool calls, and templates handle a missing key better than a None one."""
    if not messages:
        raise ValueError("cannot apply the chat template to an empty conversation")
    for message in messages:
        if not isinstance(message, dict):
            raise TypeError(f"chat messages must be dicts, got {message!r}")
    return [{k: v for k, v in m.items() if v is not None} for m in messages]


def _render_chat(template: str, messages: list[dict[str, Any]], **variables: Any) -> str:
    try:
        return _compile_template(template).render(messages=messages, **variables)
    except jinja2.TemplateError as e:  # incl. the template's own raise_exception(...)
        raise ValueError(f"chat template failed: {e}") from e


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja's own tojson escapes HTML characters, which would change what the model reads.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@cache
def _compile_template(template: str) -> jinja2.Template:
    """The environment transformers renders chat templates in; templates are untrusted code,
    so it is sandboxed."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)
