"""Tokenizers and incremental detokenisation.

A checkpoint's ``tokenizer.json`` is read with the ``tokenizers`` package; without one the
byte-level tokenizer maps each UTF-8 byte to its own id (no BOS, no EOS).

Streaming text must never split a multi-byte character, yet one character can span several
tokens (UTF-8 bytes, byte-fallback and byte-level BPE pieces). :class:`IncrementalDetokenizer`
decodes a short window of recent tokens and emits only the text that grew past the window's
previous decode, holding it back while it ends in U+FFFD (an incomplete character). A few
prompt tokens seed the window so that tokenizers which drop a leading space at the start of
a decode still produce it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

_INCOMPLETE = "\ufffd"


class Tokenizer(Protocol):
    name: str
    context_tokens: int  # prompt tokens an IncrementalDetokenizer starts its window with

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids; ``add_special_tokens=False`` for text that already holds them (a rendered chat template)."""
        ...

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of the tokens, special tokens left out, invalid UTF-8 as U+FFFD."""
        ...


class ByteTokenizer:
    name = "bytes"
    context_tokens = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: Sequence[int]) -> str:
        return bytes(token for token in token_ids if token < 256).decode("utf-8", "replace")


class HFTokenizer:
    """A ``tokenizer.json`` (the ``tokenizers`` package); its post-processor adds BOS if it says so."""

    context_tokens = 5

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as RustTokenizer

        self.name = str(path)
        self._tokenizer = RustTokenizer.from_file(str(path))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=True)


def load_tokenizer(model_dir: Path | None) -> Tokenizer:
    if model_dir is not None and (model_dir / "tokenizer.json").is_file():
        return HFTokenizer(model_dir / "tokenizer.json")
    return ByteTokenizer()


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        context = tokenizer.context_tokens
        self._window: list[int] = list(prompt[-context:]) if context else []
        self._read = len(self._window)  # tokens before it are in the text emitted so far

    def push(self, token: int) -> str:
        """Add a generated token; return the text it completes ("" while a character is incomplete)."""
        self._window.append(token)
        return self._emit(final=False)

    def flush(self) -> str:
        """Text still held back, incomplete characters as U+FFFD; call once when the request ends."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        decode = self._tokenizer.decode
        emitted = decode(self._window[: self._read])
        text = decode(self._window)
        if len(text) <= len(emitted) or (text.endswith(_INCOMPLETE) and not final):
            return ""
        self._window = self._window[self._read :]
        self._read = len(self._window)
        return text[len(emitted) :]
