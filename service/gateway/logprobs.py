"""Log-probabilities in OpenAI's formats, from the wire's fields (docs/protocol.md).

Per token the wire gives its log-probability, the most likely tokens at its position as
``[token_id, logprob]`` pairs (most likely first; none when the top count is 0), and, per reply,
``token_bytes``: every token id its logprob fields name, mapped to that token's bytes decoded
alone. This module turns them into:

- chat: ``{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}``, the
  k most likely tokens per position;
- completions (the legacy format): ``{tokens, token_logprobs, top_logprobs, text_offset}``, where
  a position's ``top_logprobs`` is a dict text -> logprob of the k most likely tokens and the
  sampled one (up to k + 1 entries, as OpenAI documents), so that a reader deciding "greedy" by
  comparing a token's logprob with its position's best (lm-eval-harness) compares the engine's
  own floats.

A token's text is its bytes decoded as UTF-8 with each byte of an invalid or incomplete sequence
written as a ``\\xNN`` escape, as OpenAI writes a token that holds part of a character; ``bytes``
are the raw bytes. Where a token's text lies in the choice's text (``text_offset``, and which
tokens a stop string cut from the text takes with it) is counted in characters by decoding the
tokens' bytes in order (:class:`TokenText`): a character split across tokens counts once, at the
token that starts it, and a token holding part of a character reaches that character.

Log-probabilities go out as the engine's floats, unchanged (the wire keeps them finite), so a
token's logprob and the same token's among its position's best are one float in the JSON. A
token's text and byte list are made once per token id a choice names.
"""

from __future__ import annotations

import codecs
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from service.gateway.errors import GatewayError
from service.gateway.schemas import ChatLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob

MAX_TOP = 20  # the wire's bound on ``logprobs`` and ``prompt_logprobs``

Pair = Sequence[float]  # [token_id, logprob], as the wire sends it
Tops = Sequence[Pair]


@dataclass(slots=True)
class Scores:
    """Tokens of one choice with their log-probabilities, their most likely alternatives (None
    where the wire sent none) and where each one's text starts in the choice's text."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    tops: list[Tops | None] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, other: Scores) -> None:
        self.tokens += other.tokens
        self.logprobs += other.logprobs
        self.tops += other.tops
        self.offsets += other.offsets


class TokenText:
    """Where each token's text lies in the text its bytes decode to, in order: characters, the
    bytes decoded incrementally with invalid ones replaced, as the engines' detokenizers do."""

    __slots__ = ("_decoder", "chars")

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.chars = 0  # characters decoded so far

    def place(self, raw: bytes) -> tuple[int, int]:
        """The token of bytes ``raw``: where its text starts, and where it ends (a character it
        holds only part of counted in)."""
        start = self.chars
        self.chars += len(self._decoder.decode(raw))
        return start, self.chars + (1 if self._decoder.getstate()[0] else 0)


class TokenNames:
    """The bytes of every token a choice's replies named (``token_bytes``), and each one's text
    and byte list, made once per token id."""

    __slots__ = ("_bytes", "_texts", "_lists")

    def __init__(self) -> None:
        self._bytes: dict[int, bytes] = {}
        self._texts: dict[int, str] = {}
        self._lists: dict[int, list[int]] = {}

    def learn(self, names: Mapping[int, bytes] | None) -> None:
        """Keep the bytes of the tokens a reply names."""
        if names:
            self._bytes.update(names)

    def raw(self, token: int) -> bytes:
        raw = self._bytes.get(token)
        if raw is None:
            raise GatewayError(502, f"the engine's reply names no bytes for token {token} (token_bytes)")
        return raw

    def text(self, token: int) -> str:
        text = self._texts.get(token)
        if text is None:
            text = self._texts[token] = token_text(self.raw(token))
        return text

    def byte_list(self, token: int) -> list[int]:
        """The token's bytes as JSON carries them (shared: encoded, never changed)."""
        listed = self._lists.get(token)
        if listed is None:
            listed = self._lists[token] = list(self.raw(token))
        return listed


def token_text(raw: bytes) -> str:
    return raw.decode("utf-8", "backslashreplace")


class ChoiceScores:
    """One choice's generated tokens as they arrive: where each one's text lies, which of them
    went out already, the bytes of every token named so far. A stream keeps one per choice; a
    response not streamed makes one for its final."""

    __slots__ = ("names", "pending", "sent", "_text", "_starts", "_ends", "_within")

    def __init__(self) -> None:
        self.names = TokenNames()
        self.pending = Scores()  # tokens of the partials not sent yet
        self.sent = 0  # generated tokens whose logprobs went out
        self._text = TokenText()
        self._starts: list[int] = []  # per generated token placed: where its text starts
        self._ends: list[int] = []  # and ends
        self._within = 0  # characters of the choice's text sent so far (told to release)

    def _place(self, tokens: Sequence[int]) -> None:
        names = self.names
        for token in tokens:
            start, end = self._text.place(names.raw(token))
            self._starts.append(start)
            self._ends.append(end)

    def partial(
        self,
        tokens: Sequence[int],
        logprobs: Sequence[float] | None,
        tops: Sequence[Tops] | None,
        names: Mapping[int, bytes] | None,
    ) -> None:
        """A partial's tokens arrived (held until :meth:`release` lets them go)."""
        self.names.learn(names)
        first = len(self._starts)
        self._place(tokens)
        pending = self.pending
        pending.tokens += tokens
        pending.logprobs += _logprobs_of(logprobs, len(tokens))
        pending.tops += _tops_of(tops, len(tokens))
        pending.offsets += self._starts[first:]

    def release(self, sent: int | None) -> Scores:
        """The pending tokens that go out now: with ``sent`` more characters of the choice's text
        sent, those whose text ends within all the text sent so far; with None, all of them."""
        pending = self.pending
        if sent is None:
            count = len(pending)
        else:
            self._within += sent
            ends, base, within, count = self._ends, self.sent, self._within, 0
            while count < len(pending) and ends[base + count] <= within:
                count += 1
        if count == len(pending):
            self.pending = Scores()
            self.sent += count
            return pending
        out = Scores(pending.tokens[:count], pending.logprobs[:count], pending.tops[:count], pending.offsets[:count])
        del pending.tokens[:count], pending.logprobs[:count], pending.tops[:count], pending.offsets[:count]
        self.sent += count
        return out

    def rest(
        self,
        tokens: Sequence[int],
        logprobs: Sequence[float] | None,
        tops: Sequence[Tops] | None,
        names: Mapping[int, bytes] | None,
        cut: int | None,
    ) -> Scores:
        """The final's tokens not sent yet, up to the stop string cut from the text at character
        ``cut`` (None: to the end): a token any of whose text lies at or past it is left out."""
        self.names.learn(names)
        self._place(tokens[len(self._starts) :])
        kept = len(tokens)
        if cut is not None:
            kept = next((at for at, end in enumerate(self._ends) if end > cut), kept)
        start = min(self.sent, kept)
        self.pending = Scores()
        self.sent = max(self.sent, kept)
        return Scores(
            list(tokens[start:kept]),
            _logprobs_of(logprobs, len(tokens))[start:kept],
            _tops_of(tops, len(tokens))[start:kept],
            self._starts[start:kept],
        )


def prompt_scores(
    tokens: Sequence[int],
    logprobs: Sequence[float | None] | None,
    tops: Sequence[Tops | None] | None,
    names: TokenNames,
) -> tuple[Scores, str]:
    """An echoed prompt's tokens (the first has no logprob) and the text their bytes decode to."""
    text = TokenText()
    raws = [names.raw(token) for token in tokens]
    offsets = [text.place(raw)[0] for raw in raws]
    scores = Scores(list(tokens), _logprobs_of(logprobs, len(tokens)), _tops_of(tops, len(tokens)), offsets)
    return scores, b"".join(raws).decode("utf-8", "replace")


def _logprobs_of(logprobs: Sequence[float | None] | None, count: int) -> list[float | None]:
    if logprobs is None and not count:  # an abort final before any token: none to carry
        return []
    if logprobs is None or len(logprobs) != count:
        raise GatewayError(502, "the engine's reply carries no logprob for each token (token_logprobs)")
    return list(logprobs)


def _tops_of(tops: Sequence[Tops | None] | None, count: int) -> list[Tops | None]:
    if tops is None:
        return [None] * count
    if len(tops) != count:
        raise GatewayError(502, "the engine's reply carries top_logprobs not aligned with its tokens")
    return list(tops)


def chat_logprobs(scores: Scores, names: TokenNames, top: int) -> ChatLogprobs:
    """``choices[i].logprobs`` of a chat: each token with its ``top`` most likely alternatives."""
    content = []
    text, byte_list = names.text, names.byte_list
    for token, logprob, tops in zip(scores.tokens, scores.logprobs, scores.tops, strict=True):
        if logprob is None:
            raise GatewayError(502, f"the engine's reply carries no logprob for generated token {token}")
        alternatives = [TopLogprob(text(int(pair[0])), pair[1], byte_list(int(pair[0]))) for pair in (tops or ())[:top]]
        content.append(TokenLogprob(text(token), logprob, byte_list(token), alternatives))
    return ChatLogprobs(content)


def completion_logprobs(scores: Scores, names: TokenNames, top: int) -> CompletionLogprobs:
    """``choices[i].logprobs`` of a completion."""
    text = names.text
    texts = [text(token) for token in scores.tokens]
    top_logprobs: list[dict[str, float] | None] = []
    for token_text_, logprob, tops in zip(texts, scores.logprobs, scores.tops, strict=True):
        if logprob is None:  # an echoed prompt's first token
            top_logprobs.append(None)
            continue
        best: dict[str, float] = {}
        for pair in (tops or ())[:top]:
            best.setdefault(text(int(pair[0])), pair[1])
        best.setdefault(token_text_, logprob)
        top_logprobs.append(best)
    return CompletionLogprobs(texts, scores.logprobs, top_logprobs, scores.offsets)
