"""dpcoord's final replies into OpenAI's responses: the text a client sees, the log-probabilities
that go with it, the usage.

As OpenAI does, a stop string that ended a choice is left out of its text (:func:`rest_of`;
the engines' wire ``generated_text`` keeps it), and so are its tokens' log-probabilities (the
tokens any of whose text lies in what was cut, service/gateway/logprobs.py); and
``usage.prompt_tokens`` counts each prompt once, however many samples ``n`` draws from it.

With ``echo`` a completion's text starts with its prompt (the string as given, or the text of its
token ids' bytes) and its logprobs with the prompt's tokens (the first without a logprob); with
``max_tokens: 0`` the one token generated is left out of the text, the logprobs and
``usage.completion_tokens``. A stream holds an echoed choice whole until its final, which alone
carries the prompt's logprobs.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from service.gateway.errors import GatewayError
from service.gateway.logprobs import ChoiceScores, Scores, TokenNames, chat_logprobs, completion_logprobs, prompt_scores
from service.gateway.schemas import (
    ChatChoice,
    ChatCompletion,
    ChatLogprobs,
    ChatMessageOut,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    PromptTokensDetails,
    Usage,
)
from service.gateway.translate import Job, Plan
from service.protocol.messages import Final


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
        completion += 0 if plan.echo_only else len(final.generated_tokens)
        if final.timings is None:
            timed = False
        else:
            cached[group] = max(cached.get(group, 0), final.timings.cached_prompt_tokens)
    prompt = sum(prompts.values())
    details = PromptTokensDetails(sum(cached.values())) if timed and cached else None
    return Usage(prompt, completion, prompt + completion, details)


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


class Rest(msgspec.Struct, frozen=True, gc=False):
    """What a choice's final adds to what a stream sent of it (all of it when nothing was): its
    text, and the tokens whose logprobs go with it (None when none were asked)."""

    text: str
    finish_reason: str
    tokens: Scores | None = None
    names: TokenNames | None = None  # the bytes of every token ``tokens`` names

    def completion_logprobs(self, plan: Plan) -> CompletionLogprobs | None:
        if self.tokens is None or self.names is None or plan.logprobs is None:
            return None
        return completion_logprobs(self.tokens, self.names, plan.logprobs)

    def chat_logprobs(self, plan: Plan) -> ChatLogprobs | None:
        if self.tokens is None or self.names is None or plan.logprobs is None:
            return None
        return chat_logprobs(self.tokens, self.names, plan.logprobs)


def rest_of(plan: Plan, job: Job, final: Final, sent: str = "", scores: ChoiceScores | None = None) -> Rest:
    """The text after ``sent`` (with ``echo``, the prompt's first) and the tokens ``scores`` did
    not send yet (a fresh one: all of them); a stream holds an echoed choice whole until its
    final, so ``sent`` is empty there."""
    cut = stop_cut(final.generated_text, plan) if final.finish_reason == "stop" else None
    text = "" if plan.echo_only else final.generated_text if cut is None else final.generated_text[:cut]
    text = text[len(sent) :] if text.startswith(sent) else ""
    reason = "length" if plan.echo_only else final.finish_reason
    if plan.logprobs is None and not plan.echo:
        return Rest(text, reason)
    scores = scores if scores is not None else ChoiceScores()
    scores.names.learn(final.token_bytes)
    if plan.logprobs is None:  # an echo without logprobs
        return Rest(_echoed(job, final, scores.names, False)[1] + text, reason)
    if plan.echo_only:
        tokens = Scores()
    else:
        tokens = scores.rest(final.generated_tokens, final.token_logprobs, final.top_logprobs, final.token_bytes, cut)
    if not plan.echo:
        return Rest(text, reason, tokens, scores.names)
    prompt, prompt_text = _echoed(job, final, scores.names, True)
    tokens.offsets = [offset + len(prompt_text) for offset in tokens.offsets]
    prompt.extend(tokens)
    return Rest(prompt_text + text, reason, prompt, scores.names)


def _echoed(job: Job, final: Final, names: TokenNames, asked: bool) -> tuple[Scores, str]:
    """An echoed prompt's tokens and its text: the prompt string as given, or the tokens' bytes
    decoded (token ids); ``asked``: whether the prompt's logprobs were."""
    if final.prompt_token_ids is None:
        if isinstance(job.prompt, str) and not asked:  # echo without logprobs asks nothing of the engine
            return Scores(), job.prompt
        if final.finish_reason == "abort":  # aborted before an engine ran its prompt
            raise GatewayError(503, "the request was aborted before its prompt's logprobs were computed")
        raise GatewayError(502, "the engine's final carries no prompt_token_ids to echo")
    prompt, decoded = prompt_scores(final.prompt_token_ids, final.prompt_logprobs, final.prompt_top_logprobs, names)
    return prompt, job.prompt if isinstance(job.prompt, str) else decoded


def answered_usage(plan: Plan, finals: list[Final]) -> Usage:
    """:func:`usage_of` every choice of ``plan``, ``finals`` in the order of its jobs; one choice
    (the common case) needs no grouping by prompt."""
    if len(finals) == 1:
        final = finals[0]
        prompt, completion = final.prompt_tokens or 0, 0 if plan.echo_only else len(final.generated_tokens)
        timings = final.timings
        details = None if timings is None else PromptTokensDetails(timings.cached_prompt_tokens)
        return Usage(prompt, completion, prompt + completion, details)
    return usage_of(plan, zip([job.index for job in plan.jobs], finals, strict=True))


def completion_response(plan: Plan, finals: list[Final], usage: Usage) -> Completion:
    choices = []
    for job, final in zip(plan.jobs, finals, strict=True):
        rest = rest_of(plan, job, final)
        choices.append(CompletionChoice(job.index, rest.text, rest.finish_reason, rest.completion_logprobs(plan)))
    return Completion(plan.id, plan.created, plan.model, choices, usage)


def chat_response(plan: Plan, finals: list[Final], usage: Usage) -> ChatCompletion:
    choices = []
    for job, final in zip(plan.jobs, finals, strict=True):
        rest = rest_of(plan, job, final)
        message = ChatMessageOut("assistant", rest.text)
        choices.append(ChatChoice(job.index, message, rest.finish_reason, rest.chat_logprobs(plan)))
    return ChatCompletion(plan.id, plan.created, plan.model, choices, usage)
