"""Request bodies of the native and the OpenAI-compatible APIs (pydantic, strict types).

Strict: a string where a number belongs is an error, not a conversion. Unknown fields are
errors too ("Unrecognized request argument supplied", as OpenAI says). Range checks that
SamplingParams.validate also makes are kept here only where the OpenAI name differs, so a
client reads its own parameter name in the error.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from runtime.grammar import JSON_OBJECT_SCHEMA, schema_text
from runtime.request import SamplingParams

MAX_N = 64  # choices per request: more is almost surely a client bug


def logit_bias_pairs(bias: dict[str, float], param: str) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} as (id, bias) pairs; range checks are SamplingParams'."""
    try:
        return tuple((int(k), float(v)) for k, v in bias.items())
    except ValueError as e:
        raise ValueError(f"{param}: keys must be token ids (integers as strings)") from e


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class ProfileRequest(_Strict):
    """POST /start_profile: where jax.profiler writes (default: --trace_dir, else a temp
    folder)."""

    output_dir: str | None = None


class StreamOptions(_Strict):
    include_usage: bool = False


class NativeSampling(_Strict):
    """SGLang's `sampling_params`; unset fields take SamplingParams' defaults."""

    max_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    sampling_seed: int | None = None
    # Constraints (at most one; runtime/grammar.py): the schema as text or as an object.
    json_schema: str | dict[str, Any] | None = None
    regex: str | None = None
    ebnf: str | None = None
    logit_bias: dict[str, float] | None = None

    def to_params(self, logprobs: bool, top_logprobs: int) -> SamplingParams:
        d = self.model_dump(exclude_none=True, exclude={"n", "sampling_seed", "json_schema",
                                                        "logit_bias"})
        if self.json_schema is not None:
            d["json_schema"] = schema_text(self.json_schema)
        if self.logit_bias:
            d["logit_bias"] = logit_bias_pairs(self.logit_bias, "sampling_params.logit_bias")
        if self.sampling_seed is not None:
            d["seed"] = self.sampling_seed
        return SamplingParams.from_dict(d | {"logprobs": logprobs, "top_logprobs": top_logprobs})


class GenerateRequest(_Strict):
    """POST /generate: one of `text` / `input_ids`, each a single prompt or a batch, with
    SGLang's GenerateReqInput fields (a per-prompt field may be a list, one per prompt)."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: NativeSampling | list[NativeSampling] = Field(
        default_factory=NativeSampling)
    stream: bool = False
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] = False
    # -1: output tokens only. >= 0 asks for prompt-token logprobs too, which are not built.
    logprob_start_len: int | list[int] = -1
    top_logprobs_num: int | list[int] = 0
    return_text_in_logprobs: bool = False
    # Accepted as SGLang's clients send them (null); a value needs what this server lacks.
    lora_path: str | list[str | None] | None = None
    image_data: Any = None

    @model_validator(mode="after")
    def _one_prompt_kind(self) -> GenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of `text` and `input_ids`")
        lora = self.lora_path if isinstance(self.lora_path, list) else [self.lora_path]
        if any(p is not None for p in lora):
            raise ValueError("lora_path: this server serves no LoRA adapters (only null is "
                             "accepted)")
        if self.image_data not in (None, [], [None]):
            raise ValueError("image_data: this model takes no images (only null is accepted)")
        return self

    def per_prompt(self, name: str, i: int) -> Any:
        """Field `name` for prompt i (a list gives one value per prompt)."""
        value = getattr(self, name)
        return value[i] if isinstance(value, list) else value

    @property
    def is_batch(self) -> bool:
        if self.text is not None:
            return isinstance(self.text, list)
        return bool(self.input_ids) and isinstance(self.input_ids[0], list)


class OpenAISampling(_Strict):
    """Fields /v1/completions and /v1/chat/completions share, plus SGLang's extensions."""

    model: str | None = None
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # SGLang's constraint extensions (response_format is OpenAI's way)
    regex: str | None = None
    ebnf: str | None = None
    # SGLang extensions (the openai client sends them through `extra_body`)
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True

    @model_validator(mode="after")
    def _check_common(self) -> OpenAISampling:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if self.regex is not None and self.ebnf is not None:
            raise ValueError("give at most one of regex and ebnf")
        return self

    def json_schema(self) -> str | None:
        """The constraint's schema text (chat's response_format); None elsewhere."""
        return None

    def to_params(self, max_tokens: int, choice: int, logprobs: bool,
                  top_logprobs: int) -> SamplingParams:
        """Choice j of n samples with seed + j, so a seeded request's choices still differ."""
        return SamplingParams(
            json_schema=self.json_schema(), regex=self.regex, ebnf=self.ebnf,
            logit_bias=logit_bias_pairs(self.logit_bias or {}, "logit_bias"),
            max_new_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
            top_k=self.top_k, min_p=self.min_p, frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            repetition_penalty=self.repetition_penalty,
            stop=(self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ()),
            stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
            seed=None if self.seed is None else self.seed + choice,
            logprobs=logprobs, top_logprobs=top_logprobs)


class CompletionRequest(OpenAISampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _check_unsupported(self) -> CompletionRequest:
        if self.echo:
            raise ValueError("echo is not supported")
        if self.best_of not in (None, self.n):
            raise ValueError("best_of must equal n (no server-side reranking)")
        if self.suffix:
            raise ValueError("suffix is not supported")
        return self


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """A message; extra keys (tool_calls, name, ...) pass through to the chat template."""

    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def to_template(self) -> dict[str, Any]:
        d = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):  # text parts only: join them as the model reads
            d["content"] = "".join(p.text for p in self.content)
        return d


class JsonSchemaFormat(BaseModel):
    """response_format.json_schema; OpenAI's `name` and `description` are accepted."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    # Enforced either way: the grammar engine always constrains to the whole schema.
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and (self.json_schema is None
                                           or self.json_schema.schema_ is None):
            raise ValueError("response_format.json_schema.schema is required for type "
                             "json_schema")
        return self


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(OpenAISampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise ValueError("tool_choice: needs `tools`")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tools and all(
                t.function.name != self.tool_choice.function.name for t in self.tools):
            raise ValueError(f"tool_choice: no tool named {self.tool_choice.function.name!r}")
        if self.forced_tools is not None and (self.response_format is not None
                                              or self.regex or self.ebnf):
            raise ValueError("tool_choice: a forced tool call cannot be combined with "
                             "response_format / regex / ebnf")
        return self

    @property
    def forced_tools(self) -> list[Tool] | None:
        """The tools a reply must call (tool_choice required or named), else None."""
        if not self.tools or self.tool_choice in (None, "none", "auto"):
            return None
        if isinstance(self.tool_choice, NamedToolChoice):
            return [t for t in self.tools if t.function.name == self.tool_choice.function.name]
        return self.tools

    def json_schema(self) -> str | None:
        rf = self.response_format
        if rf is None or rf.type == "text":
            return None
        if rf.type == "json_object":
            return JSON_OBJECT_SCHEMA
        assert rf.json_schema is not None and rf.json_schema.schema_ is not None
        return schema_text(rf.json_schema.schema_)

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_tokens is None else self.max_tokens
