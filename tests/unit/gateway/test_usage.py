"""The usage the gateway reports, from the finals: prompt tokens once per prompt, and OpenAI's
``prompt_tokens_details.cached_tokens`` from the engines' timings, only where every final has them."""

from __future__ import annotations

import json

from service.gateway.responses import answered_usage, usage_of
from service.gateway.schemas import PromptTokensDetails, Usage, completion_decoder
from service.gateway.translate import completion_plan
from service.protocol.messages import Final, Timings


def final(prompt_tokens: int, generated: int, cached: int | None) -> Final:
    timings = None if cached is None else Timings(0.1, 0.2, 0.3, cached)
    return Final(
        "r", None, "e", [1] * generated, "x" * generated, "length", prompt_tokens=prompt_tokens, timings=timings
    )


def test_cached_prompt_tokens_count_once_per_prompt_like_its_tokens() -> None:
    body = {"model": "m", "prompt": ["ab", "cde"], "n": 2, "max_tokens": 2}
    plan = completion_plan(completion_decoder.decode(json.dumps(body).encode()))
    finals = [(0, final(2, 2, 0)), (1, final(2, 2, 2)), (2, final(3, 1, 1)), (3, final(3, 2, 1))]
    assert usage_of(plan, finals) == Usage(5, 7, 12, PromptTokensDetails(2 + 1))
    assert usage_of(plan, [*finals[:3], (3, final(3, 2, None))]) == Usage(5, 7, 12)  # an engine without timings


def test_one_choice_reports_its_final_s_cached_tokens() -> None:
    plan = completion_plan(completion_decoder.decode(b'{"model": "m", "prompt": "abc"}'))
    assert answered_usage(plan, [final(3, 4, 3)]) == Usage(3, 4, 7, PromptTokensDetails(3))
    assert answered_usage(plan, [final(3, 4, None)]) == Usage(3, 4, 7)
