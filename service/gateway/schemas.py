"""OpenAI HTTP API bodies, as msgspec Structs: what the gateway accepts and what it answers.

Requests follow OpenAI's ``/v1/completions`` and ``/v1/chat/completions``. Fields the engines
honour are read; fields they cannot honour are declared too, so that a non-default value gets a
400 naming the parameter (service/gateway/translate.py) instead of being ignored; fields that
change nothing here (``user``, ``metadata``, ``store``, ``service_tier``) are accepted. Any other
field is a 400 naming it, as OpenAI answers an unrecognised argument.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from service.protocol.messages import Int64, ModelName

# Integers the engines take fit 31 bits; a bigger one is a 400 naming its field, here, rather
# than an error on its way to the wire (JSON integers have no bound).
Count = Annotated[int, Meta(ge=-(2**31), le=2**31 - 1)]

# ---------------------------------------------------------------- requests


class StreamOptions(Struct, forbid_unknown_fields=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's extension: usage in every chunk


class ContentPart(Struct):
    """One part of a message's content; only ``text`` parts can be served."""

    type: str
    text: str | None = None


class ChatMessageIn(Struct):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class _Common(Struct, forbid_unknown_fields=True, kw_only=True):
    """Fields both endpoints share."""

    model: ModelName | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Count | None = None  # an extension, as vLLM has it
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    n: Count = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Accepted and without effect here.
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    # Declared so that a value the engines cannot honour is refused by name.
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extensions that load generators (guidellm, aiperf) send, honoured by the engines.
    ignore_eos: bool = False
    min_tokens: Count = 0
    # An extension: whose log-probabilities ``logprobs`` reports (the wire's
    # ``sampling_params.logprobs_mode``): the model's (``raw``) or the sampled distribution's.
    logprobs_mode: Literal["raw", "processed"] | None = None


class CompletionRequest(_Common, kw_only=True):
    prompt: str | list[Any]  # or a list of strings, token ids, or lists of token ids: see translate.prompts
    max_tokens: Count | None = None
    logprobs: Count | None = None
    echo: bool = False
    best_of: Count | None = None
    suffix: str | None = None


class ChatCompletionRequest(_Common, kw_only=True):
    messages: list[ChatMessageIn]
    max_tokens: Count | None = None
    max_completion_tokens: Count | None = None
    logprobs: bool = False
    top_logprobs: Count | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None


# ---------------------------------------------------------------- responses


class PromptTokensDetails(Struct):
    cached_tokens: int  # prompt tokens read from the engines' prefix cache (Final.timings)


class Usage(Struct, omit_defaults=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # Where every choice's final carried timings (docs/gateway.md, *Usage*); left out otherwise.
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(Struct):
    """The legacy completions format: per token its text, its log-probability (None for the
    first prompt token of an ``echo``), the most likely tokens with the sampled one (a dict text
    -> log-probability), and where its text starts in the choice's text."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(Struct):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None


class Completion(Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    object: Literal["text_completion"] = "text_completion"


class TopLogprob(Struct):
    """One of the most likely tokens at a position: its text, log-probability and UTF-8 bytes."""

    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(Struct):
    """A chosen token, as :class:`TopLogprob`, with the most likely tokens at its position."""

    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Struct):
    content: list[TokenLogprob] | None
    refusal: None = None


class ChatMessageOut(Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class ChatChoice(Struct):
    index: int
    message: ChatMessageOut
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None


class ChatCompletion(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: Literal["chat.completion"] = "chat.completion"


class ChatDeltaChoice(Struct):
    index: int
    delta: ChatMessageOut
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatDeltaChoice]
    usage: Usage | None = None
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"


class ModelCard(Struct):
    id: str
    created: int
    owned_by: str = "dpcoord"
    object: Literal["model"] = "model"


class ModelCards(Struct):
    data: list[ModelCard]
    object: Literal["list"] = "list"


class ErrorDetail(Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(Struct):
    error: ErrorDetail


json_encoder = msgspec.json.Encoder()
completion_decoder = msgspec.json.Decoder(CompletionRequest)
chat_decoder = msgspec.json.Decoder(ChatCompletionRequest)
