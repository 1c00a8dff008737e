"""Each token's own bytes, for the logprob fields (``token_bytes``: OpenAI reports a token's
text and bytes): what the token contributes to a text, without its neighbours, so a byte-level
piece may be part of a UTF-8 character.

A ``tokenizer.json``'s decoder says how its pieces become text: read from its JSON once.

- ByteLevel (GPT-2, Llama 3, Qwen): each character of the piece stands for one byte (GPT-2's
  byte-to-unicode table), mapped back.
- Otherwise the piece's text after its Replace and Metaspace rules (SentencePiece's ``▁`` is a
  space), a byte-fallback piece ``<0xNN>`` being that one byte. A Strip rule, which only trims the
  start of a whole decode, does not apply to a token in its text.
- Any other decoder: the UTF-8 of the token decoded alone.

Special tokens carry no text (the engine's text leaves them out, ``skip_special_tokens``), so
they have no bytes. Results are cached per id: the vocabulary bounds the cache.
"""

from __future__ import annotations

import json
import re
from typing import Any

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-to-unicode table, inverted: the character each byte is written as -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(char): byte for byte, char in zip(printable, chars, strict=True)}


class TokenBytes:
    """``rust``: a ``tokenizers.Tokenizer``."""

    def __init__(self, rust: Any) -> None:
        self._rust = rust
        spec = json.loads(rust.to_str())
        decoders = _flatten(spec.get("decoder"))
        kinds = {decoder.get("type") for decoder in decoders}
        self._byte_level = byte_level_alphabet() if "ByteLevel" in kinds else None
        self._rules = [_rule(decoder) for decoder in decoders if decoder.get("type") in ("Replace", "Metaspace")]
        self._byte_fallback = "ByteFallback" in kinds
        self._piecewise = self._byte_level is not None or bool(kinds) and kinds <= _PIECEWISE
        self._special = {token_id for token_id, added in rust.get_added_tokens_decoder().items() if added.special}
        self._cache: dict[int, bytes] = {}

    def __call__(self, token: int) -> bytes:
        cached = self._cache.get(token)
        if cached is None:
            cached = self._cache[token] = self._bytes(token)
        return cached

    def _bytes(self, token: int) -> bytes:
        piece = self._rust.id_to_token(token)
        if piece is None or token in self._special:
            return b""
        if not self._piecewise:
            return str(self._rust.decode([token], skip_special_tokens=True)).encode()
        alphabet = self._byte_level
        if alphabet is not None and all(char in alphabet for char in piece):
            return bytes(alphabet[char] for char in piece)
        if self._byte_fallback and (match := _BYTE_FALLBACK.fullmatch(piece)) is not None:
            return bytes((int(match.group(1), 16),))
        for pattern, content in self._rules:
            piece = piece.replace(pattern, content)
        return piece.encode()


# Decoders whose pieces map to text one by one, which TokenBytes reads (Fuse joins, Strip trims
# the start of a whole decode only).
_PIECEWISE = {"ByteLevel", "Replace", "Metaspace", "ByteFallback", "Fuse", "Strip"}


def _flatten(decoder: dict[str, Any] | None) -> list[dict[str, Any]]:
    if decoder is None:
        return []
    if decoder.get("type") == "Sequence":
        return [inner for child in decoder.get("decoders", []) for inner in _flatten(child)]
    return [decoder]


def _rule(decoder: dict[str, Any]) -> tuple[str, str]:
    if decoder["type"] == "Metaspace":
        return decoder.get("replacement", "▁"), " "
    pattern = decoder.get("pattern", {})
    return pattern.get("String", ""), decoder.get("content", "")
