"""StreamCheck: duplicates and older runs dropped with their text, runs joined only at the exact
token; after a gap or a disagreement nothing more is passed on and the final decides: it
repairs the stream when it extends what was passed on, else the stream is broken (502)."""

from __future__ import annotations

import pytest

from service.protocol.errors import ErrorCode
from service.protocol.messages import Final, Partial
from service.protocol.streams import StreamBroken, StreamCheck


def partial(tokens: list[int], offset: int | None, attempt: int = 0) -> Partial:
    return Partial("r1", "c1", tokens, "".join(chr(token) for token in tokens), offset, attempt)


def final(tokens: list[int], engine_id: str | None = "e1", finish: str = "length") -> Final:
    return Final("r1", "c1", engine_id, tokens, "".join(chr(token) for token in tokens), finish)  # type: ignore[arg-type]


def fed(check: StreamCheck, *partials: Partial) -> list[bool]:
    return [check.accept(item) for item in partials]


def test_in_order_partials_are_all_accepted() -> None:
    check = StreamCheck()
    assert fed(check, partial([97], 0), partial([98, 99], 1), partial([100], 3)) == [True, True, True]
    assert check.tokens == [97, 98, 99, 100] and "".join(check.text) == "abcd"
    check.finish(final([97, 98, 99, 100, 101]))


def test_a_duplicate_is_dropped_with_its_text() -> None:
    check = StreamCheck()
    assert fed(check, partial([97], 0), partial([98], 1), partial([97], 0), partial([98], 1)) == [
        True,
        True,
        False,
        False,
    ]
    assert "".join(check.text) == "ab" and check.dropped == 2


def test_a_newer_run_continues_at_the_exact_token_and_the_older_one_is_dropped() -> None:
    check = StreamCheck()
    assert fed(check, partial([97], 0), partial([98], 1), partial([99], 2, attempt=1), partial([120], 2)) == [
        True,
        True,
        True,
        False,
    ]
    assert check.attempt == 1 and check.tokens == [97, 98, 99]
    assert check.accept(partial([100], 3, attempt=1))
    check.finish(final([97, 98, 99, 100]))


@pytest.mark.parametrize(
    ("second", "reason"),
    [
        (partial([100], 3), "missing"),  # a gap in the same run
        (partial([98], 1, attempt=1), "continues at token 1"),  # a newer run starting inside what was received
        (partial([100], 3, attempt=1), "continues at token 3"),  # a newer run starting past it
        (partial([120], 0), "disagree"),  # a "duplicate" with other tokens
        (partial([97, 98, 99], 0), "disagree"),  # overlapping what was received and past it
        (partial([99], None), "without an offset"),
    ],
)
def test_a_break_passes_on_nothing_more_and_the_final_decides(second: Partial, reason: str) -> None:
    check = StreamCheck()
    assert fed(check, partial([97], 0), partial([98], 1)) == [True, True]
    assert fed(check, second, partial([99], 2), partial([99], 2, attempt=2)) == [False, False, False]
    assert check.broken is not None and reason in check.broken and check.tokens == [97, 98]
    check.finish(final([97, 98, 99, 100]))  # it carries every token: the stream is repaired
    with pytest.raises(StreamBroken, match=reason) as raised:
        check.finish(final([97, 120, 99]))
    assert raised.value.code == ErrorCode.BROKEN_STREAM == 502


def test_a_final_that_does_not_extend_the_stream_breaks_it() -> None:
    check = StreamCheck()
    fed(check, partial([97], 0), partial([98], 1))
    with pytest.raises(StreamBroken, match="tokens"):
        check.finish(final([97, 120, 99]))
    with pytest.raises(StreamBroken, match="tokens"):
        check.finish(final([97]))
    mismatched_text = Final("r1", "c1", "e1", [97, 98], "xy", "length")
    with pytest.raises(StreamBroken, match="text"):
        check.finish(mismatched_text)


def test_the_coordinators_abort_of_a_request_between_runs_ends_it_as_it_is() -> None:
    check = StreamCheck()
    fed(check, partial([97], 0))
    check.finish(final([], engine_id=None, finish="abort"))
    with pytest.raises(StreamBroken):
        check.finish(final([], engine_id="e1", finish="abort"))


def test_partials_of_an_earlier_release_without_offsets_pass_as_they_come() -> None:
    check = StreamCheck()
    assert fed(check, partial([97], None), partial([97], None)) == [True, True]
    check.finish(final([97, 97]))
    later = StreamCheck()
    assert fed(later, partial([97], None), partial([98], 1)) == [True, True]
    mixed = StreamCheck()
    assert mixed.accept(partial([97], None))
    assert not mixed.accept(partial([99], 5))
    assert mixed.broken is not None and "without offsets" in mixed.broken
