"""``dpcoord submit --logprobs K`` on a terminal: each token with its log-probability and the K
most likely alternatives, one line per token, after the final's JSON (which carries them all,
for pipes). The prompt's, with ``--prompt-logprobs``, come first."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from service.protocol.messages import Final, TopLogprob


def logprob_lines(final: Final, shown: Callable[[str], str]) -> list[str]:
    """``final``'s logprobs as lines: ``position  logprob  probability  'token'  | alternatives``."""
    names = final.token_bytes or {}

    def token(token_id: int) -> str:
        text = names.get(token_id, b"").decode("utf-8", "backslashreplace")
        return shown(repr(text)) if text else f"<{token_id}>"

    def line(label: str, token_id: int, logprob: float | None, top: Sequence[TopLogprob] | None) -> str:
        value = "" if logprob is None else f"{logprob:10.4f} {math.exp(logprob):7.2%}"
        alternatives = "  ".join(f"{token(other)} {other_logprob:.4f}" for other, other_logprob in top or ())
        text = f"{label:>6} {value:>19}  {token(token_id):<12}"
        return f"{text} | {alternatives}" if alternatives else text.rstrip()

    lines: list[str] = []
    if final.prompt_token_ids is not None and final.prompt_logprobs is not None:
        lines.append("prompt:")
        tops = final.prompt_top_logprobs or [None] * len(final.prompt_token_ids)
        for position, (token_id, logprob, top) in enumerate(
            zip(final.prompt_token_ids, final.prompt_logprobs, tops, strict=True)
        ):
            lines.append(line(str(position), token_id, logprob, top))
    if final.token_logprobs is not None:
        lines.append("generated:")
        for position, (token_id, logprob) in enumerate(zip(final.generated_tokens, final.token_logprobs, strict=True)):
            lines.append(
                line(str(position), token_id, logprob, final.top_logprobs[position] if final.top_logprobs else None)
            )
    return lines
