"""OpenAI requests into dpcoord submissions, and dpcoord replies into OpenAI responses.

One HTTP request becomes one submission per choice: a completion's prompts (a string, a list of
strings, token ids, or a list of token-id lists) times ``n``, choice ``i * n + j`` being sample
``j`` of prompt ``i``; a chat request's ``messages`` times ``n``. The engine renders ``messages``
with its chat template. What the engines cannot honour is a 400 naming the parameter.

As OpenAI does, a stop string that ended a choice is left out of its text (:func:`visible_text`;
the engines' wire ``generated_text`` keeps it), and ``usage.prompt_tokens`` counts each prompt
once, however many samples ``n`` draws from it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from typing import Any

import msgspec

from service.gateway.errors import GatewayError
from service.gateway.schemas import (
    ChatChoice,
    ChatCompletion,
    ChatCompletionRequest,
    ChatMessageIn,
    ChatMessageOut,
    Completion,
    CompletionChoice,
    CompletionRequest,
    PromptTokensDetails,
    Usage,
)
from service.protocol.messages import ChatMessage, Final

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


def completion_plan(request: CompletionRequest) -> Plan:
    if request.logprobs is not None:
        raise unsupported("logprobs")
    if request.echo:
        raise unsupported("echo")
    if request.best_of is not None and request.best_of != request.n:
        raise unsupported("best_of")
    if request.suffix:
        raise unsupported("suffix")
    prompt = request.prompt
    n = request.n
    if isinstance(prompt, str) and n == 1:  # the common case, without the general case's loops
        return _plan("cmpl", request, [Job(0, prompt=prompt)], request.max_tokens, "max_tokens", 1)
    prompts = _prompts(prompt)
    _check_choices(n, len(prompts))
    jobs = [Job(i * n + j, prompt=prompt) for i, prompt in enumerate(prompts) for j in range(n)]
    return _plan("cmpl", request, jobs, request.max_tokens, "max_tokens", n)


def chat_plan(request: ChatCompletionRequest) -> Plan:
    if request.logprobs:
        raise unsupported("logprobs")
    if request.top_logprobs:
        raise unsupported("top_logprobs")
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
    return _plan("chatcmpl", request, [Job(j, messages=messages) for j in range(n)], max_tokens, name, n)


def _plan(
    kind: str,
    request: CompletionRequest | ChatCompletionRequest,
    jobs: list[Job],
    max_tokens: int | None,
    max_tokens_name: str,
    n: int,
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


# ---------------------------------------------------------------- responses


def usage_of(plan: Plan, finals: Iterable[tuple[int, Final]]) -> Usage:
    """Usage of the choices ``(index, final)``: completion tokens of each, prompt tokens once per
    prompt (the largest count among its samples, which all share it), and so the cached ones."""
    prompts: dict[int, int] = {}
    cached: dict[int, int] = {}
    timed = True
    completion = 0
    for index, final in finals:
        group = index // plan.n
        prompts[group] = max(prompts.get(group, 0), final.prompt_tokens or 0)
        completion += len(final.generated_tokens)
        if final.timings is None:
            timed = False
        else:
            cached[group] = max(cached.get(group, 0), final.timings.cached_prompt_tokens)
    prompt = sum(prompts.values())
    details = PromptTokensDetails(sum(cached.values())) if timed and cached else None
    return Usage(prompt, completion, prompt + completion, details)


def visible_text(plan: Plan, final: Final) -> str:
    """The text a client sees: without the stop string that ended the choice, and what followed it
    in the same token."""
    cut = stop_cut(final.generated_text, plan) if final.finish_reason == "stop" else None
    return final.generated_text if cut is None else final.generated_text[:cut]


def stop_cut(text: str, plan: Plan) -> int | None:
    """Where the stop string that ended ``text`` starts, or None. Without ``min_tokens`` the first
    stop string to occur ended it; with ``min_tokens`` an earlier occurrence may have been passed
    over, so the last one found is taken."""
    if not plan.stops:
        return None
    found = [text.find(stop) if not plan.min_tokens else text.rfind(stop) for stop in plan.stops]
    found = [at for at in found if at >= 0]
    if not found:
        return None
    return min(found) if not plan.min_tokens else max(found)


def _with_text(plan: Plan, finals: list[Final]) -> list[tuple[int, Final, str]]:
    return [(job.index, final, visible_text(plan, final)) for job, final in zip(plan.jobs, finals, strict=True)]


def answered_usage(plan: Plan, finals: list[Final]) -> Usage:
    """:func:`usage_of` every choice of ``plan``, ``finals`` in the order of its jobs; one choice
    (the common case) needs no grouping by prompt."""
    if len(finals) == 1:
        final = finals[0]
        prompt, completion = final.prompt_tokens or 0, len(final.generated_tokens)
        timings = final.timings
        details = None if timings is None else PromptTokensDetails(timings.cached_prompt_tokens)
        return Usage(prompt, completion, prompt + completion, details)
    return usage_of(plan, zip([job.index for job in plan.jobs], finals, strict=True))


def completion_response(plan: Plan, finals: list[Final], usage: Usage) -> Completion:
    choices = [CompletionChoice(index, text, final.finish_reason) for index, final, text in _with_text(plan, finals)]
    return Completion(plan.id, plan.created, plan.model, choices, usage)


def chat_response(plan: Plan, finals: list[Final], usage: Usage) -> ChatCompletion:
    choices = [
        ChatChoice(index, ChatMessageOut("assistant", text), final.finish_reason)
        for index, final, text in _with_text(plan, finals)
    ]
    return ChatCompletion(plan.id, plan.created, plan.model, choices, usage)
