"""What a stream's replies must add up to, checked on the receiving side.

A streamed request's partials may arrive twice (a reply sent again after a reconnect), may go
missing (one lost inside a NATS server that restarted), and may come from more than one run of
the request (``attempt``: a migration to another engine, which resumes after the tokens
already streamed, or a retry). :class:`StreamCheck` passes on exactly one run's tokens, in
order, and nothing that does not continue them:

- a partial whose tokens were all passed on already (the same tokens at a lower ``offset``) is
  a duplicate: dropped, with its text;
- a partial of an older run than the newest seen is dropped, with its text: two runs never
  interleave;
- a partial that continues at exactly the tokens passed on is passed on (a newer run's first
  partial only so);
- anything else (a gap, an overlap, tokens that disagree, a newer run that does not join, a
  partial without an offset after partials with one) breaks the stream: from then on no partial
  is passed on, and the final, which carries every token, decides. The final's
  ``generated_tokens`` must begin with the tokens passed on and its ``generated_text`` with
  their text: then it repairs the stream (the rest of the text is the final's beyond what was
  passed on, as the gateway sends it); otherwise :class:`StreamBroken` (502). Never silently
  wrong text.

Partials from engines of earlier releases carry no offset; a stream made only of them is taken
as it comes (nothing to check).
"""

from __future__ import annotations

from service.protocol.errors import ErrorCode, WireError
from service.protocol.messages import Final, Partial


class StreamBroken(WireError):
    """A stream's replies do not add up and its final does not repair them."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.BROKEN_STREAM, f"stream broken: {message}")


class StreamCheck:
    """The tokens and text one stream passed on so far; feed it every reply in arrival order."""

    __slots__ = ("attempt", "broken", "dropped", "text", "tokens", "_offsets")

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.text: list[str] = []
        self.attempt = 0  # the newest run seen
        self.dropped = 0  # partials not passed on: duplicates, older runs', and all after a break
        self.broken: str | None = None  # why partials stopped being passed on
        self._offsets = False  # whether partials carried offsets

    def accept(self, partial: Partial) -> bool:
        """True: ``partial`` continues the stream (pass it on); False: drop it."""
        problem = self._problem(partial)
        if problem is None:
            self.tokens.extend(partial.new_tokens)
            self.text.append(partial.text)
            return True
        if problem and self.broken is None:
            self.broken = problem
        self.dropped += 1
        return False

    def finish(self, final: Final) -> None:
        """Raises :class:`StreamBroken` when ``final`` does not extend what was passed on."""
        received = len(self.tokens)
        if final.engine_id is None and final.finish_reason == "abort" and not final.generated_tokens:
            return  # the coordinator ended it while it waited for an engine: it holds no tokens
        why = f" (after {self.broken})" if self.broken else ""
        if final.generated_tokens[:received] != self.tokens:
            raise StreamBroken(
                f"the final's {len(final.generated_tokens)} tokens do not begin with the {received} tokens streamed{why}"
            )
        if not final.generated_text.startswith("".join(self.text)):
            raise StreamBroken(f"the final's text does not begin with the text streamed{why}")

    def _problem(self, partial: Partial) -> str | None:
        """None: it continues the stream; "": drop it harmlessly; else why it breaks the stream."""
        if self.broken is not None:
            return ""
        received = len(self.tokens)
        offset = partial.offset
        if offset is None:
            return f"a partial without an offset after {received} tokens with offsets" if self._offsets else None
        if not self._offsets and received and offset != received:
            return f"a partial at token {offset} after {received} tokens without offsets"
        self._offsets = True
        attempt = partial.attempt
        if attempt < self.attempt:
            return ""
        end = offset + len(partial.new_tokens)
        if attempt > self.attempt:
            if offset != received:
                return f"run {attempt} continues at token {offset}, but {received} tokens were received"
            self.attempt = attempt
            return None
        if offset < received:
            if end <= received and self.tokens[offset:end] == partial.new_tokens:
                return ""
            return f"tokens {offset}..{end} disagree with the {received} tokens received"
        if offset > received:
            return f"tokens {received}..{offset} are missing (a gap)"
        return None
