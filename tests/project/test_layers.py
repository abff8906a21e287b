"""The structure holds: the import contracts in pyproject.toml, no import cycle anywhere,
and no module grown past the size where it wants splitting."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grimp
import pytest

from tests.conftest import REPO


def test_the_import_contracts_hold() -> None:
    lint = Path(sys.executable).parent / "lint-imports"
    if not lint.exists():
        pytest.skip("import-linter is not installed (it comes with the `test` extra)")
    result = subprocess.run(
        [str(lint), "--no-cache"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_no_module_imports_itself_through_others() -> None:
    # Type-only imports count too: a cycle there is a cycle in the design.
    graph = grimp.build_graph("supervisor", "workers")
    cycles = []
    for module in sorted(graph.modules):
        for imported in sorted(graph.find_modules_directly_imported_by(module)):
            if imported == module or imported.startswith(module + "."):
                continue  # a package importing its own parts
            chain = graph.find_shortest_chain(importer=imported, imported=module)
            if chain is not None and not module.startswith(imported + "."):
                cycles.append(" -> ".join((module, *chain)))
    assert cycles == []
