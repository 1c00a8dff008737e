"""Log-probabilities in OpenAI's formats (service/gateway/logprobs.py): token texts and bytes,
the sampled token among a completion's top dict, where each token's text lies, and which tokens
a stop string cut from the text takes with it, streamed or not."""

from __future__ import annotations

import pytest

from service.gateway.errors import GatewayError
from service.gateway.logprobs import (
    ChoiceScores,
    Scores,
    TokenNames,
    TokenText,
    chat_logprobs,
    completion_logprobs,
    prompt_scores,
    token_text,
)

# Byte tokens, as the echo engine's: id = byte value, 300 a special token without text.
BYTES = {byte: bytes((byte,)) for byte in range(256)} | {300: b""}
NAMES = TokenNames()
NAMES.learn(BYTES)


def _tokens(text: str) -> list[int]:
    return list(text.encode())


def test_a_character_split_across_tokens_counts_once_at_the_token_that_starts_it() -> None:
    text = TokenText()
    assert [text.place(raw) for raw in [b"a", b"\xc3", b"\xa9", b"b", b""]] == [(0, 1), (1, 2), (1, 2), (2, 3), (3, 3)]


def test_a_partial_character_is_written_as_escapes_and_its_bytes_kept() -> None:
    assert token_text(b"\xe2\x82") == "\\xe2\\x82" and token_text("€".encode()) == "€"
    content = chat_logprobs(Scores([0xE2], [-0.5], [[(0xE2, -0.5), (0x41, -1.0)]], [0]), NAMES, 2).content
    assert content is not None
    [entry] = content
    assert (entry.token, entry.logprob, entry.bytes) == ("\\xe2", -0.5, [0xE2])
    assert [(top.token, top.logprob, top.bytes) for top in entry.top_logprobs] == [
        ("\\xe2", -0.5, [0xE2]),
        ("A", -1.0, [65]),
    ]


def test_a_completions_top_dict_holds_the_k_best_and_the_sampled_token() -> None:
    scores = Scores(_tokens("ab"), [-2.0, -0.25], [[(0x78, -0.5)], [(0x62, -0.25)]], [0, 1])
    out = completion_logprobs(scores, NAMES, 1)
    assert out.tokens == ["a", "b"] and out.token_logprobs == [-2.0, -0.25] and out.text_offset == [0, 1]
    assert out.top_logprobs == [{"x": -0.5, "a": -2.0}, {"b": -0.25}]  # the greedy one: one entry
    assert completion_logprobs(scores, NAMES, 0).top_logprobs == [{"a": -2.0}, {"b": -0.25}]


def test_an_echoed_prompt_has_no_logprob_for_its_first_token_and_decodes_its_bytes() -> None:
    prompt, text = prompt_scores([0x68, 0xC3, 0xA9, 300], [None, -1.0, -2.0, -3.0], None, NAMES)
    assert text == "hé" and prompt.offsets == [0, 1, 1, 2]
    out = completion_logprobs(prompt, NAMES, 0)
    assert out.token_logprobs == [None, -1.0, -2.0, -3.0] and out.top_logprobs[0] is None
    assert out.tokens == ["h", "\\xc3", "\\xa9", ""]


def test_a_token_the_reply_names_no_bytes_for_is_a_502() -> None:
    with pytest.raises(GatewayError) as raised:
        chat_logprobs(Scores([999], [-1.0], [None], [0]), NAMES, 0)
    assert raised.value.status == 502 and "999" in raised.value.message


def test_logprobs_not_aligned_with_the_tokens_are_a_502() -> None:
    with pytest.raises(GatewayError):
        ChoiceScores().partial([65, 66], [-1.0], None, BYTES)


def _partials(scores: ChoiceScores, pieces: list[str], cut_after: list[int] | None) -> list[list[int]]:
    """Feed ``pieces`` as partials; ``cut_after[i]``: characters sent after piece i (None: no
    stop strings, all released)."""
    released = []
    position = 0
    for at, piece in enumerate(pieces):
        tokens = _tokens(piece)
        scores.partial(tokens, [-(position + i) / 8 for i in range(len(tokens))], None, BYTES)
        position += len(tokens)
        released.append(scores.release(None if cut_after is None else cut_after[at]).tokens)
    return released


def test_without_stop_strings_a_partials_tokens_go_with_it() -> None:
    scores = ChoiceScores()
    assert _partials(scores, ["He", "llo"], None) == [_tokens("He"), _tokens("llo")]
    text = "Hello"
    rest = scores.rest(_tokens(text), [-i / 8 for i in range(5)], None, BYTES, None)
    assert rest.tokens == [] and scores.sent == 5


def test_a_token_goes_once_its_text_was_sent_and_a_cut_stop_string_keeps_its_tokens() -> None:
    """ "Hello wor" stopped by "wor": "Hello " sent in steps as a stream holds text back (the
    last two characters, then up to the stop string); "wor" never goes, here or at the final."""
    scores = ChoiceScores()
    assert _partials(scores, ["Hel", "lo w", "or"], [1, 4, 0]) == [_tokens("H"), _tokens("ello"), []]
    text = "Hello wor"
    rest = scores.rest(_tokens(text), [-i / 8 for i in range(9)], None, BYTES, 6)
    assert rest.tokens == _tokens(" ") and rest.offsets == [5] and rest.logprobs == [-5 / 8] and scores.sent == 6


def test_a_token_holding_part_of_the_stop_strings_first_character_is_cut_with_it() -> None:
    tokens = [0x41, 0xE2, 0x82, 0xAC]  # "A€" in bytes; the stop string is "€"
    rest = ChoiceScores().rest(tokens, [-1.0] * 4, None, BYTES, 1)
    assert rest.tokens == [0x41]


def test_the_final_fills_in_what_a_broken_stream_never_passed_on() -> None:
    scores = ChoiceScores()
    _partials(scores, ["ab"], None)
    rest = scores.rest(_tokens("abcd"), [-1.0, -2.0, -3.0, -4.0], [[], [], [(0x63, -3.0)], []], BYTES, None)
    assert rest.tokens == _tokens("cd") and rest.offsets == [2, 3] and rest.tops == [[(0x63, -3.0)], []]
