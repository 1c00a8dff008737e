"""Tokenizers and incremental detokenisation: streamed text never splits a character."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engines.torch_backend.tokenizer import ByteTokenizer, HFTokenizer, IncrementalDetokenizer, load_tokenizer


def stream(tokenizer: ByteTokenizer | HFTokenizer, prompt: list[int], generated: list[int]) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer, prompt)
    pieces = [detokenizer.push(token) for token in generated]
    pieces.append(detokenizer.flush())
    return pieces


def test_byte_tokenizer_round_trip_and_no_specials() -> None:
    tokenizer = ByteTokenizer()
    assert tokenizer.encode("hé") == [104, 195, 169]
    assert tokenizer.decode([104, 195, 169, 300]) == "hé"  # ids past the bytes carry no text


def test_multi_byte_characters_are_held_until_complete() -> None:
    euro = list("€".encode())  # three bytes
    assert stream(ByteTokenizer(), [65], euro + [66]) == ["", "", "€", "B", ""]


def test_invalid_bytes_come_out_as_replacement_characters() -> None:
    pieces = stream(ByteTokenizer(), [], [0xE2, 0x82, 0x41, 0xFF])
    # An invalid byte is replaced as soon as it is known to be invalid, not held to the end.
    assert pieces == ["", "", "\ufffdA", "\ufffd", ""]


def test_an_incomplete_character_at_the_end_is_released_by_the_flush() -> None:
    assert stream(ByteTokenizer(), [], [0x41, 0xE2, 0x82]) == ["A", "", "", "\ufffd"]


@settings(max_examples=150, deadline=None)
@given(st.text(min_size=0, max_size=40))
def test_byte_stream_equals_the_whole_decode_and_splits_no_character(text: str) -> None:
    generated = list(text.encode("utf-8"))
    pieces = stream(ByteTokenizer(), [1, 2, 3], generated)
    assert "".join(pieces) == text
    assert "\ufffd" not in "".join(pieces) or "\ufffd" in text


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=30))
def test_arbitrary_bytes_stream_as_their_lossy_decode(data: bytes) -> None:
    assert "".join(stream(ByteTokenizer(), [], list(data))) == data.decode("utf-8", "replace")


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> HFTokenizer:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 10, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    directory = tmp_path_factory.mktemp("tokenizer")
    tokenizer.save(str(directory / "tokenizer.json"))
    loaded = load_tokenizer(Path(directory))
    assert isinstance(loaded, HFTokenizer)
    return loaded


def test_hf_tokenizer_adds_bos_and_skips_specials_in_text(hf_tokenizer: HFTokenizer) -> None:
    ids = hf_tokenizer.encode("the fox")
    assert ids[0] == 0
    assert hf_tokenizer.encode("") == [0]  # an empty text is the prompt [BOS], which runs (docs/engines.md)
    assert hf_tokenizer.decode(ids + [1]) == "the fox"


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet="the quick brown fox €😀ü", max_size=30))
def test_hf_stream_equals_the_whole_decode(hf_tokenizer: HFTokenizer, text: str) -> None:
    prompt = hf_tokenizer.encode("the lazy")
    generated = hf_tokenizer.encode(text)[1:]  # without BOS
    pieces = stream(hf_tokenizer, prompt, generated)
    assert "".join(pieces) == hf_tokenizer.decode(generated)
    assert all("\ufffd" not in piece for piece in pieces)  # byte-level pieces never split a character


@pytest.fixture(scope="module")
def sentencepiece_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> HFTokenizer:
    """A Llama-2-style tokenizer: SentencePiece pieces (``▁`` for a space) with byte fallback
    for characters outside its vocabulary, and a decoder that drops the leading space."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=False)
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=200,
        special_tokens=["<unk>", "<s>", "</s>", *(f"<0x{byte:02X}>" for byte in range(256))],
        show_progress=False,
    )
    tokenizer.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 10, trainer)
    directory = tmp_path_factory.mktemp("sentencepiece")
    tokenizer.save(str(directory / "tokenizer.json"))
    loaded = load_tokenizer(Path(directory))
    assert isinstance(loaded, HFTokenizer)
    return loaded


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet="the quick fox €😀üж", max_size=30))
def test_byte_fallback_stream_equals_the_whole_decode(sentencepiece_tokenizer: HFTokenizer, text: str) -> None:
    """Multi-byte characters the vocabulary lacks are several ``<0xNN>`` tokens each; the
    first generated token's space survives the decoder's leading-space strip."""
    tokenizer = sentencepiece_tokenizer
    prompt = tokenizer.encode("the lazy")
    generated = tokenizer.encode(" " + text)
    pieces = stream(tokenizer, prompt, generated)
    assert "".join(pieces) == tokenizer.decode([*prompt, *generated])[len(tokenizer.decode(prompt)) :]
    assert all("\ufffd" not in piece for piece in pieces)


@pytest.mark.parametrize("name", ["bytes", "byte-level BPE", "byte fallback"])
def test_a_long_output_costs_the_same_per_token(
    name: str, hf_tokenizer: HFTokenizer, sentencepiece_tokenizer: HFTokenizer
) -> None:
    """O(1) per token: no call decodes more than a bounded window, however long the output
    (a test double counts the tokens each decode is given)."""
    tokenizers: dict[str, ByteTokenizer | HFTokenizer] = {
        "bytes": ByteTokenizer(),
        "byte-level BPE": hf_tokenizer,
        "byte fallback": sentencepiece_tokenizer,
    }
    tokenizer = tokenizers[name]
    text = "the quick brown fox € jumps 😀 over the lazy dog " * 40
    generated = tokenizer.encode(text)[1:] if isinstance(tokenizer, HFTokenizer) else tokenizer.encode(text)
    longest = 0
    decode = tokenizer.decode

    def counting(token_ids: Sequence[int]) -> str:
        nonlocal longest
        longest = max(longest, len(token_ids))
        return decode(token_ids)

    tokenizer.decode = counting  # type: ignore[method-assign]
    try:
        pieces = stream(tokenizer, [], generated)
    finally:
        del tokenizer.decode
    assert len(generated) > 500
    assert longest <= 8  # Python-side decodes, if any, see a few tokens only
    assert "".join(pieces) == decode(generated)


def test_special_tokens_that_add_no_text_do_not_grow_the_window(hf_tokenizer: HFTokenizer) -> None:
    specials = [1] * 100  # "</s>", skipped in text
    fox = hf_tokenizer.encode(" fox")[1:]
    assert "".join(stream(hf_tokenizer, [], [*specials, *fox])) == " fox"


def test_without_tokenizer_json_the_byte_tokenizer_is_used(tmp_path: Path) -> None:
    assert isinstance(load_tokenizer(tmp_path), ByteTokenizer)
    assert isinstance(load_tokenizer(None), ByteTokenizer)


@pytest.mark.parametrize("name", ["bytes", "byte-level BPE", "byte fallback"])
def test_token_bytes_add_up_to_the_text(
    name: str, hf_tokenizer: HFTokenizer, sentencepiece_tokenizer: HFTokenizer
) -> None:
    """Each token's own bytes (the logprob fields' ``token_bytes``), a byte-level piece part of
    a character, concatenate to the text the tokens add after a prompt; special tokens add none."""
    tokenizers: dict[str, ByteTokenizer | HFTokenizer] = {
        "bytes": ByteTokenizer(),
        "byte-level BPE": hf_tokenizer,
        "byte fallback": sentencepiece_tokenizer,
    }
    tokenizer = tokenizers[name]
    prompt = tokenizer.encode("the lazy")
    generated = tokenizer.encode(" the quick € fox 😀 jumps ü")
    if name == "byte-level BPE":
        generated = [*generated[1:], 1]  # without BOS, with "</s>"
    text = tokenizer.decode([*prompt, *generated])[len(tokenizer.decode(prompt)) :]
    assert b"".join(tokenizer.token_bytes(token) for token in generated) == text.encode()
    if name != "byte fallback":  # whose byte tokens are special here, so the text leaves them out
        pieces = [tokenizer.token_bytes(token) for token in generated]
        assert any(piece.decode("utf-8", "replace") != piece.decode("utf-8", "ignore") for piece in pieces)
