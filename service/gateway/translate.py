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
from dataclasses import dataclass
from typing import Any

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
    Usage,
)
from service.protocol.messages import ChatMessage, Final

MAX_CHOICES = 128  # submissions one HTTP request may fan out into
MAX_TOKEN_ID = 2**31 - 1  # every tokenizer's ids fit 31 bits (service.protocol.messages.TokenId)


@dataclass(frozen=True, slots=True)
class Job:
    """One submission: choice ``index`` of the response."""

    index: int
    prompt: str | list[int] | None = None
    messages: list[ChatMessage] | None = None


@dataclass(frozen=True, slots=True)
class Plan:
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
    _refuse_unsupported(
        [
            ("logprobs", request.logprobs is not None),
            ("echo", request.echo),
            ("best_of", request.best_of is not None and request.best_of != request.n),
            ("suffix", bool(request.suffix)),
        ]
    )
    prompts = _prompts(request.prompt)
    n = _choices(request.n, len(prompts))
    jobs = [Job(i * n + j, prompt=prompt) for i, prompt in enumerate(prompts) for j in range(n)]
    return _plan("cmpl", request, jobs, request.max_tokens, "max_tokens", n)


def chat_plan(request: ChatCompletionRequest) -> Plan:
    _refuse_unsupported(
        [
            ("logprobs", request.logprobs),
            ("top_logprobs", bool(request.top_logprobs)),
            ("tools", bool(request.tools)),
            ("tool_choice", request.tool_choice not in (None, "none")),
            ("functions", bool(request.functions)),
            ("function_call", request.function_call not in (None, "none")),
            ("response_format", request.response_format is not None and request.response_format.get("type") != "text"),
        ]
    )
    if not request.messages:
        raise GatewayError(400, "messages must hold at least one message", "messages")
    messages = [_message(message) for message in request.messages]
    n = _choices(request.n, 1)
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
    _refuse_unsupported(
        [
            ("presence_penalty", bool(request.presence_penalty)),
            ("frequency_penalty", bool(request.frequency_penalty)),
            ("logit_bias", bool(request.logit_bias)),
        ]
    )
    if not request.model:
        raise GatewayError(400, "you must provide a model parameter", "model")
    if request.stream_options is not None and not request.stream:
        raise GatewayError(400, "stream_options is only allowed when stream is true", "stream_options")
    _check(max_tokens is None or max_tokens >= 1, max_tokens_name, "must be at least 1")
    _check(request.temperature is None or request.temperature >= 0, "temperature", "must be at least 0")
    _check(request.top_p is None or 0 < request.top_p <= 1, "top_p", "must be in (0, 1]")
    _check(request.top_k is None or request.top_k >= -1, "top_k", "must be -1 or 0 (off) or a positive count")
    _check(request.min_tokens >= 0, "min_tokens", "must be at least 0")
    _check(max_tokens is None or request.min_tokens <= max_tokens, "min_tokens", f"must be at most {max_tokens_name}")
    stop = [request.stop] if isinstance(request.stop, str) else request.stop
    sampling: dict[str, Any] = {
        "max_tokens": max_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "top_k": max(request.top_k, 0) if request.top_k is not None else None,
        "seed": request.seed,
        "stop": stop or None,
        "ignore_eos": request.ignore_eos or None,
        "min_tokens": request.min_tokens or None,
    }
    options = request.stream_options
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
        stops=tuple(stop or ()),
        min_tokens=request.min_tokens,
    )


def _refuse_unsupported(checks: Iterable[tuple[str, bool]]) -> None:
    for name, used in checks:
        if used:
            raise GatewayError(
                400, f"{name} is not supported by this server's engines; leave it out or at its default", name
            )


def _check(ok: bool, param: str, problem: str) -> None:
    if not ok:
        raise GatewayError(400, f"{param} {problem}", param)


def _choices(n: int, prompts: int) -> int:
    _check(n >= 1, "n", "must be at least 1")
    _check(n * prompts <= MAX_CHOICES, "n", f"times the number of prompts must be at most {MAX_CHOICES}")
    return n


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
    prompt (the largest count among its samples, which all share it)."""
    prompts: dict[int, int] = {}
    completion = 0
    for index, final in finals:
        group = index // plan.n
        prompts[group] = max(prompts.get(group, 0), final.prompt_tokens or 0)
        completion += len(final.generated_tokens)
    prompt = sum(prompts.values())
    return Usage(prompt, completion, prompt + completion)


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


def completion_response(plan: Plan, finals: list[Final]) -> Completion:
    choices = [CompletionChoice(index, text, final.finish_reason) for index, final, text in _with_text(plan, finals)]
    usage = usage_of(plan, ((job.index, final) for job, final in zip(plan.jobs, finals, strict=True)))
    return Completion(plan.id, plan.created, plan.model, choices, usage)


def chat_response(plan: Plan, finals: list[Final]) -> ChatCompletion:
    choices = [
        ChatChoice(index, ChatMessageOut("assistant", text), final.finish_reason)
        for index, final, text in _with_text(plan, finals)
    ]
    usage = usage_of(plan, ((job.index, final) for job, final in zip(plan.jobs, finals, strict=True)))
    return ChatCompletion(plan.id, plan.created, plan.model, choices, usage)
