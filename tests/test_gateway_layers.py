"""The gateway is a role: it imports the client library and layers 1-3 (protocol, bus, ops), never
the coordinator, the handlers or the engines."""

from __future__ import annotations

import ast
from pathlib import Path

GATEWAY = Path(__file__).resolve().parents[1] / "service" / "gateway"
ALLOWED = ("service.client", "service.protocol", "service.bus", "service.ops", "service.gateway")
OURS = ("service", "handlers", "engines", "benchmarks")


def imported(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_the_gateway_imports_only_the_client_library_and_lower_layers() -> None:
    modules = sorted(GATEWAY.glob("*.py"))
    assert len(modules) >= 5
    for module in modules:
        ours = {name for name in imported(module) if name.split(".")[0] in OURS}
        stray = {name for name in ours if not name.startswith(ALLOWED)}
        assert not stray, f"{module.name} imports {stray}"
