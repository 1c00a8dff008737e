"""What a stream's replies must add up to, checked on the receiving side.

A streamed request's partials may arrive twice (a reply sent again after a reconnect) and may
come from more than one run of the request (``attempt``: a migration to another engine, which
resumes after the tokens already streamed, or a retry). :class:`StreamCheck` turns what arrives
into exactly one run's tokens, in order:

- a partial whose tokens were all received already (``offset`` below the count received, the
  same tokens) is a duplicate: dropped, with its text;
- a partial of an older run than the newest seen is dropped, with its text: two runs never
  interleave;
- a newer run's first partial must continue at exactly the tokens received;
- anything else that does not continue at the tokens received (a gap, an overlap, tokens that
  disagree) cannot be repaired: :class:`StreamBroken` (502), never silently wrong text;
- the final's ``generated_tokens`` must begin with the tokens received, and its
  ``generated_text`` with the text received (an ``abort`` final the coordinator sends for a
  request waiting for an engine, say between two runs, holds no tokens and ends it as it is).

Partials from engines of earlier releases carry no offset; a stream made only of them is
taken as it comes (nothing to check), but one without an offset after partials that had one
cannot be checked and breaks the stream.
"""

from __future__ import annotations

from service.protocol.errors import ErrorCode, WireError
from service.protocol.messages import Final, Partial


class StreamBroken(WireError):
    """A stream's replies do not add up; the stream cannot go on exactly."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.BROKEN_STREAM, f"stream broken: {message}")


class StreamCheck:
    """The tokens and text one stream delivered so far; feed it every reply in arrival order."""

    __slots__ = ("attempt", "dropped", "text", "tokens", "_offsets")

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.text: list[str] = []
        self.attempt = 0  # the newest run seen
        self.dropped = 0  # duplicates and older runs' partials
        self._offsets = False  # whether partials carried offsets

    def accept(self, partial: Partial) -> bool:
        """True: ``partial`` continues the stream (pass it on); False: drop it (a duplicate, or
        an older run's). Raises :class:`StreamBroken` for what cannot be repaired."""
        received = len(self.tokens)
        offset = partial.offset
        if offset is None:
            if self._offsets:
                raise StreamBroken(f"a partial without an offset after {received} tokens with offsets")
            self._take(partial)
            return True
        if not self._offsets and received:
            if offset != received:  # partials of an earlier release's engine, then checked ones
                raise StreamBroken(f"a partial at token {offset} after {received} tokens without offsets")
        self._offsets = True
        attempt = partial.attempt
        if attempt < self.attempt:
            self.dropped += 1
            return False
        end = offset + len(partial.new_tokens)
        if attempt > self.attempt:
            if offset != received:
                raise StreamBroken(f"run {attempt} continues at token {offset}, but {received} tokens were received")
            self.attempt = attempt
        elif offset < received:
            if end <= received and self.tokens[offset:end] == partial.new_tokens:
                self.dropped += 1
                return False
            raise StreamBroken(f"tokens {offset}..{end} disagree with the {received} tokens received")
        elif offset > received:
            raise StreamBroken(f"tokens {received}..{offset} are missing (a gap)")
        self._take(partial)
        return True

    def finish(self, final: Final) -> None:
        """Raises :class:`StreamBroken` when ``final`` does not extend what was streamed."""
        received = len(self.tokens)
        if final.engine_id is None and final.finish_reason == "abort" and not final.generated_tokens:
            return  # the coordinator ended it while it waited for an engine: it holds no tokens
        if final.generated_tokens[:received] != self.tokens:
            raise StreamBroken(
                f"the final's {len(final.generated_tokens)} tokens do not begin with the {received} tokens streamed"
            )
        if not final.generated_text.startswith("".join(self.text)):
            raise StreamBroken("the final's text does not begin with the text streamed")

    def _take(self, partial: Partial) -> None:
        self.tokens.extend(partial.new_tokens)
        self.text.append(partial.text)
