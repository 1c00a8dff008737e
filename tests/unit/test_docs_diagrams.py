"""The Mermaid diagrams of the docs (GitHub renders them): each block parses at least in
structure, and what it names is still in the code.

Mermaid's own parser needs a DOM (no browser runs in CI), so the structure is checked here: a
known diagram type on the first line, brackets and quotes that close, ``subgraph``/``loop``/``alt``
blocks that ``end``, sequence messages between declared participants and without ``;``
(Mermaid ends a statement there). What the pictures name is checked against the code: every
``*.py`` module and directory exists, and every ``dpcoord.`` subject is one the protocol defines.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from service.protocol.subjects import ADOPT, COMMIT_WEIGHTS, DISCARD_WEIGHTS, PREPARE_WEIGHTS, RESEND_REPLIES, Header

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT / "README.md", ROOT / "helm" / "dpcoord" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DIAGRAM_TYPES = ("flowchart", "graph", "sequenceDiagram", "stateDiagram-v2", "classDiagram", "erDiagram")
_BLOCK = re.compile(r"^```mermaid\n(.*?)^```$", re.MULTILINE | re.DOTALL)
_ARROW = re.compile(r"^\s*([A-Za-z0-9_]+)\s*(?:->>|-->>|-\)|--\)|->|-->|-x|--x)\s*([A-Za-z0-9_]+)\s*:(.*)$")
_PARTICIPANT = re.compile(r"^\s*(?:participant|actor)\s+([A-Za-z0-9_]+)")
_SEQUENCE_OPENERS = ("loop", "alt", "opt", "par", "critical", "break", "rect")
# Every subject the protocol defines, by its tokens after the prefix: <header>, <header>.<sender>,
# engine.<id>.<header>, engines.<broadcast>.
HEADERS = {header.value for header in Header}
ROUTED = HEADERS | {RESEND_REPLIES}
BROADCASTS = HEADERS | {ADOPT, PREPARE_WEIGHTS, COMMIT_WEIGHTS, DISCARD_WEIGHTS}


def blocks() -> list[tuple[str, str]]:
    found = []
    for document in DOCUMENTS:
        for index, match in enumerate(_BLOCK.finditer(document.read_text())):
            found.append((f"{document.relative_to(ROOT)}#{index}", match.group(1)))
    return found


BLOCKS = blocks()


def without_strings(line: str) -> str:
    return re.sub(r'"[^"]*"', '""', line)


def structure_problems(diagram: str) -> list[str]:
    """What keeps ``diagram`` from parsing, as far as its structure shows."""
    lines = [line for line in diagram.splitlines() if line.strip() and not line.strip().startswith("%%")]
    if not lines:
        return ["empty"]
    kind = lines[0].split()[0]
    if kind not in DIAGRAM_TYPES:
        return [f"first line {lines[0]!r} is not a diagram type Mermaid knows"]
    problems = []
    depth = 0
    declared: set[str] = set()
    for number, line in enumerate(lines[1:], start=2):
        if line.count('"') % 2:
            problems.append(f"line {number}: a quote does not close")
        arrow = _ARROW.match(line) if kind == "sequenceDiagram" else None
        bare = without_strings(arrow.group(3) if arrow else line)  # an arrow such as -) is no bracket
        if not _balanced(bare):
            problems.append(f"line {number}: brackets do not close")
        word = line.split()[0]
        if word in ("subgraph", *_SEQUENCE_OPENERS) and (word == "subgraph" or kind == "sequenceDiagram"):
            depth += 1
        elif word == "end":
            depth -= 1
            if depth < 0:
                problems.append(f"line {number}: end without a block")
        elif word == "else" and depth == 0:
            problems.append(f"line {number}: else outside alt")
        if kind != "sequenceDiagram":
            continue
        if participant := _PARTICIPANT.match(line):
            declared.add(participant.group(1))
        elif arrow:
            problems += [
                f"line {number}: {name} is no participant" for name in arrow.groups()[:2] if name not in declared
            ]
            if ";" in arrow.group(3):
                problems.append(f"line {number}: ';' ends a Mermaid statement")
        elif word == "Note" and ";" in line:
            problems.append(f"line {number}: ';' ends a Mermaid statement")
    if depth:
        problems.append(f"{depth} block(s) without end")
    return problems


def _balanced(text: str) -> bool:
    closing = {")": "(", "]": "[", "}": "{"}
    stack: list[str] = []
    for char in text:
        if char in "([{":
            stack.append(char)
        elif char in closing and (not stack or stack.pop() != closing[char]):
            return False
    return not stack


def unknown_names(diagram: str) -> list[str]:
    """Modules, directories and subjects the diagram names that the code does not have."""
    problems = []
    sources = {path.name for folder in ("service", "engines", "handlers") for path in (ROOT / folder).rglob("*.py")}
    for module in sorted(set(re.findall(r"\b([a-z_]+\.py)\b", diagram))):
        if module not in sources:
            problems.append(f"no module {module}")
    for folder in sorted(set(re.findall(r"\b((?:service|engines|handlers)(?:/[a-z_]+)*)/", diagram))):
        if not (ROOT / folder).is_dir():
            problems.append(f"no directory {folder}/")
    for subject in sorted(set(re.findall(r"\bdpcoord\.([A-Za-z0-9_{}.*]+[A-Za-z0-9_}*])", diagram))):
        tokens = subject.split(".")
        if tokens[0] == "engine":
            known = len(tokens) == 3 and tokens[2] in ROUTED
        elif tokens[0] == "engines":
            known = len(tokens) == 2 and (tokens[1] in BROADCASTS or tokens[1] in ("{signal}", "*"))
        else:
            known = tokens[0] in HEADERS or tokens[0] == "*"
        if not known:
            problems.append(f"no subject dpcoord.{subject}")
    return problems


def test_the_architecture_draws_what_newcomers_look_for() -> None:
    architecture = (ROOT / "docs" / "architecture.md").read_text()
    for title in (
        "## The system",
        "### One streamed request",
        "### A migration from the exact token",
        "### A dead replica's adoption",
        "### The two-phase weight update",
    ):
        following = architecture.partition(f"\n{title}\n")[2]
        assert following.lstrip().startswith("```mermaid"), f"{title} has no picture under it"
    assert "(docs/architecture.md#the-system)" in (ROOT / "README.md").read_text()


@pytest.mark.parametrize(("where", "diagram"), BLOCKS, ids=[where for where, _ in BLOCKS])
def test_each_diagram_parses_in_structure_and_names_real_code(where: str, diagram: str) -> None:
    assert structure_problems(diagram) == []
    assert unknown_names(diagram) == []


def test_the_checks_catch_the_usual_mistakes() -> None:
    assert structure_problems("flowhcart LR\n  a --> b") != []
    assert structure_problems("flowchart LR\n  subgraph s\n  a[x --> b") == [
        "line 3: brackets do not close",
        "1 block(s) without end",
    ]
    sequence = "sequenceDiagram\n  participant A\n  participant B\n  A->>B: one; two\n  A->>C: hi\n  loop x\n  A->>B: y"
    assert structure_problems(sequence) == [
        "line 4: ';' ends a Mermaid statement",
        "line 5: C is no participant",
        "1 block(s) without end",
    ]
    assert unknown_names(
        "a --> b: relay.py, nothere.py, dpcoord.engines.prepare_weights, dpcoord.engine.e0.submit"
    ) == [
        "no module nothere.py",
        "no subject dpcoord.engine.e0.submit",
    ]
