"""OpenAI requests into dpcoord submissions.

One HTTP request becomes one submission per choice: a completion's prompts (a string, a list of
strings, token ids, or a list of token-id lists) times ``n``, choice ``i * n + j`` being sample
``j`` of prompt ``i``; a chat request's ``messages`` times ``n``. The engine renders ``messages``
with its chat template. What the engines cannot honour is a 400 naming the parameter.

The responses are built in service/gateway/responses.py.

Log-probabilities (service/gateway/logprobs.py): a completion's ``logprobs: k`` and a chat's
``logprobs: true`` with ``top_logprobs: k`` ask the engines for ``sampling_params.logprobs: k``.
A completion's ``echo`` asks for the prompt's too (``prompt_logprobs``; without ``logprobs``
only where a prompt is token ids, whose text the gateway has only from their bytes) and puts the
prompt's text and tokens before the generated ones. ``max_tokens: 0`` with ``echo`` (scoring a
text, as lm-eval-harness does) is submitted as ``max_tokens: 1`` and the generated token is left
out: text, logprobs and ``usage.completion_tokens``.
"""

from __future__ import annotations

import os
import time
from typing import Any

import msgspec

from service.gateway.errors import GatewayError
from service.gateway.logprobs import MAX_TOP
from service.gateway.schemas import ChatCompletionRequest, ChatMessageIn, CompletionRequest
from service.protocol.messages import ChatMessage

MAX_CHOICES = 128  # submissions one HTTP request may fan out into
MAX_TOKEN_ID = 2**31 - 1  # every tokenizer's ids fit 31 bits (service.protocol.messages.TokenId)


class Job(msgspec.Struct, frozen=True, gc=False):
    """One submission: choice ``index`` of the response. (A Struct, as :class:`Plan`: made per
    request, it builds several times faster than a frozen dataclass.)"""

    index: int
    prompt: str | list[int] | None = None
    messages: list[ChatMessage] | None = None


class Plan(msgspec.Struct, frozen=True, gc=False):
    """What one HTTP request asks of the fleet."""

    id: str
    created: int
    model: str
    jobs: list[Job]
    sampling: dict[str, Any]  # SamplingParams fields for the client library
    stream: bool
    include_usage: bool
    n: int = 1  # samples per prompt: choices ``i * n .. i * n + n - 1`` share prompt ``i``
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage in every chunk
    stops: tuple[str, ...] = ()
    min_tokens: int = 0
    logprobs: int | None = None  # alternatives per token; None: no logprobs asked
    echo: bool = False  # a completion's prompt comes first in its text (and logprobs)
    echo_only: bool = False  # max_tokens 0 with echo: the generated token is left out


def completion_plan(request: CompletionRequest) -> Plan:
    if request.best_of is not None and request.best_of != request.n:
        raise unsupported("best_of")
    if request.suffix:
        raise unsupported("suffix")
    logprobs, echo, max_tokens = request.logprobs, request.echo, request.max_tokens
    if logprobs is not None and not 0 <= logprobs <= MAX_TOP:
        raise invalid("logprobs", f"must be between 0 and {MAX_TOP}")
    echo_only = echo and max_tokens == 0
    if echo_only:
        if request.min_tokens:
            raise invalid("min_tokens", "must be at most max_tokens")
        max_tokens = 1  # a prompt-only request: the one token generated is left out
    prompt = request.prompt
    n = request.n
    if isinstance(prompt, str) and n == 1 and not echo:  # the common case, without the general case's loops
        return _plan("cmpl", request, [Job(0, prompt=prompt)], max_tokens, "max_tokens", 1, logprobs)
    prompts = _prompts(prompt)
    _check_choices(n, len(prompts))
    jobs = [Job(i * n + j, prompt=prompt) for i, prompt in enumerate(prompts) for j in range(n)]
    prompt_logprobs = (
        (logprobs or 0) if echo and (logprobs is not None or any(isinstance(p, list) for p in prompts)) else None
    )
    return _plan("cmpl", request, jobs, max_tokens, "max_tokens", n, logprobs, prompt_logprobs, echo_only)


def chat_plan(request: ChatCompletionRequest) -> Plan:
    top = request.top_logprobs
    if top is not None and not 0 <= top <= MAX_TOP:
        raise invalid("top_logprobs", f"must be between 0 and {MAX_TOP}")
    if top is not None and not request.logprobs:
        raise invalid("top_logprobs", "needs logprobs set to true")
    if request.tools:
        raise unsupported("tools")
    if request.tool_choice not in (None, "none"):
        raise unsupported("tool_choice")
    if request.functions:
        raise unsupported("functions")
    if request.function_call not in (None, "none"):
        raise unsupported("function_call")
    if request.response_format is not None and request.response_format.get("type") != "text":
        raise unsupported("response_format")
    if not request.messages:
        raise GatewayError(400, "messages must hold at least one message", "messages")
    messages = [_message(message) for message in request.messages]
    n = request.n
    _check_choices(n, 1)
    max_tokens, name = (
        (request.max_completion_tokens, "max_completion_tokens")
        if request.max_completion_tokens is not None
        else (request.max_tokens, "max_tokens")
    )
    logprobs = (top or 0) if request.logprobs else None
    return _plan("chatcmpl", request, [Job(j, messages=messages) for j in range(n)], max_tokens, name, n, logprobs)


def _plan(
    kind: str,
    request: CompletionRequest | ChatCompletionRequest,
    jobs: list[Job],
    max_tokens: int | None,
    max_tokens_name: str,
    n: int,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    echo_only: bool = False,
) -> Plan:
    if request.presence_penalty:
        raise unsupported("presence_penalty")
    if request.frequency_penalty:
        raise unsupported("frequency_penalty")
    if request.logit_bias:
        raise unsupported("logit_bias")
    if not request.model:
        raise GatewayError(400, "you must provide a model parameter", "model")
    options = request.stream_options
    if options is not None and not request.stream:
        raise GatewayError(400, "stream_options is only allowed when stream is true", "stream_options")
    if max_tokens is not None and max_tokens < 1:
        raise invalid(max_tokens_name, "must be at least 1")
    temperature, top_p, top_k, min_tokens = request.temperature, request.top_p, request.top_k, request.min_tokens
    if temperature is not None and temperature < 0:
        raise invalid("temperature", "must be at least 0")
    if top_p is not None and not 0 < top_p <= 1:
        raise invalid("top_p", "must be in (0, 1]")
    if top_k is not None and top_k < -1:
        raise invalid("top_k", "must be -1 or 0 (off) or a positive count")
    if min_tokens < 0:
        raise invalid("min_tokens", "must be at least 0")
    if max_tokens is not None and min_tokens > max_tokens:
        raise invalid("min_tokens", f"must be at most {max_tokens_name}")
    stop = [request.stop] if isinstance(request.stop, str) else request.stop
    sampling: dict[str, Any] = {
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": max(top_k, 0) if top_k is not None else None,
        "seed": request.seed,
        "stop": stop or None,
        "ignore_eos": request.ignore_eos or None,
        "min_tokens": min_tokens or None,
    }
    if logprobs is not None:  # only when asked: engines of earlier releases know no such field
        sampling["logprobs"] = logprobs
    if prompt_logprobs is not None:
        sampling["prompt_logprobs"] = prompt_logprobs
    if request.logprobs_mode is not None:
        sampling["logprobs_mode"] = request.logprobs_mode
    return Plan(
        f"{kind}-{os.urandom(16).hex()}",  # as random as uuid4().hex, at less cost
        int(time.time()),
        request.model,
        jobs,
        sampling,
        request.stream,
        include_usage=options is not None and options.include_usage,
        n=n,
        continuous_usage=options is not None and options.continuous_usage_stats,
        stops=tuple(stop) if stop else (),
        min_tokens=min_tokens,
        logprobs=logprobs,
        echo=isinstance(request, CompletionRequest) and request.echo,
        echo_only=echo_only,
    )


def unsupported(name: str) -> GatewayError:
    return GatewayError(400, f"{name} is not supported by this server's engines; leave it out or at its default", name)


def invalid(param: str, problem: str) -> GatewayError:
    return GatewayError(400, f"{param} {problem}", param)


def _check_choices(n: int, prompts: int) -> None:
    if n < 1:
        raise invalid("n", "must be at least 1")
    if n * prompts > MAX_CHOICES:
        raise invalid("n", f"times the number of prompts must be at most {MAX_CHOICES}")


def _prompts(prompt: str | list[Any]) -> list[str | list[int]]:
    """A completion's prompts: one string, strings, one list of token ids, or lists of them."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise GatewayError(400, "prompt must not be an empty list", "prompt")
    if all(isinstance(item, str) for item in prompt):
        return list(prompt)
    if all(_is_token_id(item) for item in prompt):
        return [list(prompt)]
    if all(isinstance(item, list) and item and all(_is_token_id(t) for t in item) for item in prompt):
        return [list(item) for item in prompt]
    raise GatewayError(
        400,
        f"prompt must be a string, a list of strings, token ids (0 to {MAX_TOKEN_ID}), or a list of token-id lists",
        "prompt",
    )


def _is_token_id(item: object) -> bool:
    return isinstance(item, int) and not isinstance(item, bool) and 0 <= item <= MAX_TOKEN_ID


def _message(message: ChatMessageIn) -> ChatMessage:
    content = message.content
    if isinstance(content, list):
        if any(part.type != "text" or part.text is None for part in content):
            raise GatewayError(400, "only text content parts are supported", "messages")
        content = "".join(part.text or "" for part in content)
    return ChatMessage(message.role, content or "", message.name)
