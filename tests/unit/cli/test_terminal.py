"""Generated text as a terminal gets it: what a terminal would act on is written as an escape."""

from __future__ import annotations

import json

from service.cli.terminal import escape_nonprintable

# ESC sequence, bell, carriage return, a bidi override, DEL, a C1 control, an astral private-use character.
HOSTILE = "\x1b[31mred\x07\rok \u202eevil\x7f\x9b\U000f0000 fine: é 漢 🙂"
ESCAPED = "\\u001b[31mred\\u0007\\u000dok \\u202eevil\\u007f\\u009b\\udb80\\udc00 fine: é 漢 🙂"


def test_escaping_writes_what_a_terminal_would_act_on_as_json_escapes() -> None:
    assert escape_nonprintable(HOSTILE) == ESCAPED
    assert escape_nonprintable("line one\n\tline two") == "line one\n\tline two"


def test_an_escaped_json_line_is_still_json() -> None:
    assert json.loads(f'"{escape_nonprintable(HOSTILE)}"') == HOSTILE
