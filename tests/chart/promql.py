"""What a PromQL expression reads: the metric names and the label names it selects and groups by.

No PromQL parser runs offline in Python, so this is a small lexer for the expressions the chart
writes (its dashboard, alerts and KEDA query). It removes string literals, range and subquery
brackets and Grafana's ``$variables``, takes ``name{matchers}`` selectors and ``by``/``without``/
``on``/``ignoring`` label lists apart, and refuses what it does not know: a call to anything but
a PromQL function or aggregation, unbalanced brackets. A word left over is a metric name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# The PromQL functions and aggregation operators an expression may call.
FUNCTIONS = frozenset(
    {
        "abs", "absent", "absent_over_time", "avg", "avg_over_time", "bottomk", "ceil", "changes", "clamp",
        "clamp_max", "clamp_min", "count", "count_over_time", "count_values", "delta", "deriv", "exp", "floor",
        "group", "histogram_quantile", "increase", "irate", "label_join", "label_replace", "last_over_time", "ln",
        "max", "max_over_time", "min", "min_over_time", "quantile", "quantile_over_time", "rate", "resets",
        "round", "scalar", "sort", "sort_desc", "sqrt", "stddev", "sum", "sum_over_time", "time", "timestamp",
        "topk", "vector",
    }
)  # fmt: skip
KEYWORDS = frozenset({"and", "or", "unless", "bool", "offset"})
_LABEL_LISTS = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^()]*)\)")
_SELECTOR = re.compile(r"(?<![\w:.$])([A-Za-z_:][\w:]*)\s*\{([^{}]*)\}")
_MATCHER = re.compile(r"^\s*([A-Za-z_]\w*)\s*(=~|!~|!=|=)\s*\"")
_WORD = re.compile(r"(?<![\w:.$])([A-Za-z_:][\w:]*)")


@dataclass
class Reads:
    """What one expression reads: ``selectors`` maps each metric to the labels its matchers name."""

    selectors: dict[str, set[str]] = field(default_factory=dict)
    grouped_by: set[str] = field(default_factory=set)

    @property
    def metrics(self) -> set[str]:
        return set(self.selectors)


def reads(expression: str) -> Reads:
    """Raises ValueError for what this lexer cannot vouch for."""
    if not _balanced(expression):
        raise ValueError(f"unbalanced brackets or quotes: {expression}")
    found = Reads()
    # Strings go first (their contents are not PromQL), but matchers keep theirs as "".
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expression)
    text = re.sub(r"\[[^\[\]]*\]", "", text)  # ranges, subqueries, Grafana's [$__rate_interval]
    for match in _LABEL_LISTS.finditer(text):
        found.grouped_by.update(label.strip() for label in match.group(2).split(",") if label.strip())
    text = _LABEL_LISTS.sub(" ", text)
    for match in _SELECTOR.finditer(text):
        labels = found.selectors.setdefault(match.group(1), set())
        for matcher in filter(str.strip, match.group(2).split(",")):
            parsed = _MATCHER.match(matcher)
            if parsed is None:
                raise ValueError(f"not a label matcher: {matcher!r} in {expression}")
            labels.add(parsed.group(1))
    text = re.sub(r"\{[^{}]*\}", " ", text)
    for match in _WORD.finditer(text):
        word = match.group(1)
        called = text[match.end() :].lstrip().startswith("(")
        if called:
            if word not in FUNCTIONS:
                raise ValueError(f"{word}() is not a PromQL function this lexer knows: {expression}")
        elif word not in KEYWORDS:
            found.selectors.setdefault(word, set())
    return found


def _balanced(expression: str) -> bool:
    closing = {")": "(", "]": "[", "}": "{"}
    stack: list[str] = []
    for char in re.sub(r'"(?:[^"\\]|\\.)*"', "", expression):
        if char == '"':
            return False
        if char in "([{":
            stack.append(char)
        elif char in closing and (not stack or stack.pop() != closing[char]):
            return False
    return not stack
