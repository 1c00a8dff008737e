"""The chaos suite's report: each scenario adds its table line to ``chaos_report``, and the
terminal summary prints them at the end of the run (so the counts show in ``make test``'s
output whether the tests passed or failed, with or without ``-s``)."""

from __future__ import annotations

import pytest

CHAOS_LINES = pytest.StashKey[list[str]]()


@pytest.fixture
def chaos_report(request: pytest.FixtureRequest) -> list[str]:
    """Lines for the terminal summary; a test appends to it and prints them too."""
    return request.config.stash.setdefault(CHAOS_LINES, [])


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    lines = config.stash.get(CHAOS_LINES, [])
    if lines:
        terminalreporter.section("chaos suite (tests/faults/test_chaos.py, test_chaos_torch.py)")
        for line in lines:
            terminalreporter.write_line(line)
