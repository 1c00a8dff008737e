"""Tokenizers and incremental detokenisation.

A checkpoint's ``tokenizer.json`` is read with the ``tokenizers`` package; without one the
byte-level tokenizer maps each UTF-8 byte to its own id (no BOS, no EOS).

Streaming text must never split a multi-byte character, yet one character can span several
tokens (UTF-8 bytes, byte-fallback and byte-level BPE pieces). :class:`IncrementalDetokenizer`
does a bounded amount of work per token, whatever the length of the output:

- the byte tokenizer feeds each byte to Python's incremental UTF-8 decoder, which holds an
  incomplete character's bytes (at most three) and replaces an invalid byte as soon as it is
  known to be invalid;
- a ``tokenizer.json`` goes through the ``tokenizers`` package's ``DecodeStream``, vLLM's
  prefix/read-offset scheme in Rust: it decodes only the tokens since the text it last
  emitted, and emits nothing while the text ends in U+FFFD (an incomplete character). A few
  prompt tokens seed it, so that decoders which drop a leading space at the start of a
  decode (SentencePiece's) still produce the first generated token's space. Tokens that add
  no text (skipped special tokens) would keep growing what it decodes: after
  :data:`MAX_HELD_TOKENS` of them it starts again from the last few tokens.

The text streamed for a request, flush included, equals the decode of all its generated tokens
(tests/torch/test_torch_tokenizer.py).
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from engines.torch_backend.token_bytes import TokenBytes

if TYPE_CHECKING:
    from tokenizers.decoders import DecodeStream


class Tokenizer(Protocol):
    name: str
    context_tokens: int  # prompt tokens an IncrementalDetokenizer starts its window with

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids; ``add_special_tokens=False`` for text that already holds them (a rendered chat template)."""
        ...

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of the tokens, special tokens left out, invalid UTF-8 as U+FFFD."""
        ...

    def token_bytes(self, token_id: int) -> bytes:
        """The token's own bytes (:mod:`engines.torch_backend.token_bytes`)."""
        ...


class ByteTokenizer:
    name = "bytes"
    context_tokens = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: Sequence[int]) -> str:
        return bytes(token for token in token_ids if token < 256).decode("utf-8", "replace")

    def token_bytes(self, token_id: int) -> bytes:
        return _BYTES[token_id] if token_id < 256 else b""


class HFTokenizer:
    """A ``tokenizer.json`` (the ``tokenizers`` package); its post-processor adds BOS if it says so."""

    context_tokens = 5

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as RustTokenizer

        self.name = str(path)
        self._tokenizer = RustTokenizer.from_file(str(path))
        self._token_bytes = TokenBytes(self._tokenizer)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def token_bytes(self, token_id: int) -> bytes:
        return self._token_bytes(token_id)

    def stream(self, context: list[int]) -> DecodeStream:
        """An incremental decoder that continues after ``context`` (whose text it does not emit)."""
        from tokenizers.decoders import DecodeStream

        stream = DecodeStream(skip_special_tokens=True)
        for token in context:  # stepped rather than passed as ``ids``, which older releases lack
            stream.step(self._tokenizer, token)
        return stream

    def step(self, stream: DecodeStream, token: int) -> str | None:
        """The text ``token`` completes on ``stream``; None while a character is incomplete."""
        return stream.step(self._tokenizer, token)


def load_tokenizer(model_dir: Path | None) -> Tokenizer:
    if model_dir is not None and (model_dir / "tokenizer.json").is_file():
        return HFTokenizer(model_dir / "tokenizer.json")
    return ByteTokenizer()


MAX_HELD_TOKENS = 16  # a UTF-8 character is at most 4 bytes: more held tokens carry no text yet


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt: Sequence[int]) -> None:
        self._stream: _ByteStream | _HFStream
        if isinstance(tokenizer, HFTokenizer):
            self._stream = _HFStream(tokenizer, prompt)
        elif isinstance(tokenizer, ByteTokenizer):
            self._stream = _ByteStream()
        else:
            raise TypeError(f"no incremental detokeniser for {type(tokenizer).__name__}")

    def push(self, token: int) -> str:
        """Add a generated token; return the text it completes ("" while a character is incomplete)."""
        return self._stream.push(token)

    def flush(self) -> str:
        """Text still held back, incomplete characters as U+FFFD; call once when the request ends."""
        return self._stream.flush()


_ASCII = [chr(byte) for byte in range(128)]
_BYTES = [bytes((byte,)) for byte in range(256)]


class _ByteStream:
    """Byte ids through an incremental UTF-8 decoder; ids past the bytes carry no text. An ASCII
    byte while no character is incomplete is its own text (most bytes: no decoder call)."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._held = False  # the decoder holds the first bytes of a character

    def push(self, token: int) -> str:
        if token < 128 and not self._held:
            return _ASCII[token]
        if token >= 256:
            return ""
        text = self._decoder.decode(_BYTES[token])
        self._held = bool(self._decoder.getstate()[0])
        return text

    def flush(self) -> str:
        self._held = False
        return self._decoder.decode(b"", final=True)


class _HFStream:
    """``DecodeStream`` with what it holds back tracked, so that :meth:`flush` can release it."""

    def __init__(self, tokenizer: HFTokenizer, prompt: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self._held: list[int] = []  # tokens since the last text emitted
        self._emitted: list[int] = list(prompt[-tokenizer.context_tokens :])  # the tokens that emitted it
        self._stream = tokenizer.stream(self._emitted)

    def push(self, token: int) -> str:
        held = self._held
        held.append(token)
        text = self._tokenizer.step(self._stream, token)
        if text is not None:
            self._emitted, self._held = held, []
            return text
        if len(held) <= MAX_HELD_TOKENS:
            return ""
        # No character spans this many tokens: release what they hold (U+FFFD for invalid
        # bytes, nothing for special tokens) and continue after them.
        text = self.pending()
        context = [*self._emitted, *held][-self._tokenizer.context_tokens :]
        self._emitted, self._held = context, []
        self._stream = self._tokenizer.stream(context)
        return text

    def pending(self) -> str:
        """The text the held tokens complete so far, incomplete characters as U+FFFD."""
        decode = self._tokenizer.decode
        before = decode(self._emitted)
        return decode([*self._emitted, *self._held])[len(before) :]

    def flush(self) -> str:
        text = self.pending() if self._held else ""
        self._held = []
        return text
