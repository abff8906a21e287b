"""The import contracts of pyproject.toml bind: each of our own contract types
(tests/import_contracts.py), given the options pyproject.toml gives it, keeps on the code
as it is and breaks when one bad import is added to the graph; and `lint-imports` itself,
run in this process on a small package, fails on a third-party import in a pure module."""

from __future__ import annotations

import copy
import textwrap
from pathlib import Path
from typing import Any

import grimp
import pytest

pytest.importorskip("importlinter")

from importlinter import api, cli

from tests.conftest import REPO
from tests.import_contracts import AllowedImportsContract, CoveringLayersContract

CONFIG = api.read_configuration(str(REPO / "pyproject.toml"))
SESSION = CONFIG["session_options"]
PURE = "the rules are pure: the standard library and other rules only"
RUNNER = "the task runner imports only the shared contract, the store and the rules"


def contract_options(name_start: str) -> dict[str, Any]:
    matching = [c for c in CONFIG["contracts_options"] if c["name"].startswith(name_start)]
    assert len(matching) == 1, f"one contract in pyproject.toml named {name_start!r}"
    return matching[0]


def make(contract_class: type[Any], name_start: str) -> Any:
    options = contract_options(name_start)
    assert options["type"] == contract_class.type_name
    fields = {k: v for k, v in options.items() if k not in ("name", "type", "id")}
    return contract_class(name=options["name"], session_options=SESSION, contract_options=fields)


@pytest.fixture(scope="module")
def code_graph() -> grimp.ImportGraph:
    return grimp.build_graph(
        *SESSION["root_packages"], include_external_packages=True, cache_dir=None
    )


def with_import(graph: grimp.ImportGraph, importer: str, imported: str) -> grimp.ImportGraph:
    changed = copy.deepcopy(graph)
    changed.add_import(
        importer=importer, imported=imported, line_number=1, line_contents=f"import {imported}"
    )
    return changed


def violations(check: Any) -> set[tuple[str, str]]:
    return {(v["importer"], v["imported"]) for v in check.metadata["violations"]}


def test_the_rules_are_pure_today(code_graph: grimp.ImportGraph) -> None:
    check = make(AllowedImportsContract, PURE).check(copy.deepcopy(code_graph), verbose=False)
    assert check.kept, violations(check)


@pytest.mark.parametrize(
    ("importer", "imported"),
    [
        ("supervisor.core.slots", "cronsim"),  # third-party, installed, in no deny-list
        ("supervisor.core.slots", "supervisor.store"),
        ("supervisor.core.vocabulary", "supervisor.contract.clock"),
        ("supervisor.tasks.rules", "peewee"),
        ("supervisor.subagents.rules", "supervisor.runtime.bus"),
        ("supervisor.core.engine", "supervisor"),  # the root package is no rule either
    ],
)
def test_a_rule_importing_anything_else_breaks_it(
    code_graph: grimp.ImportGraph, importer: str, imported: str
) -> None:
    graph = with_import(code_graph, importer, imported)
    check = make(AllowedImportsContract, PURE).check(graph, verbose=False)
    assert not check.kept
    assert violations(check) == {(importer, imported)}


@pytest.mark.parametrize(
    ("importer", "imported"),
    [
        ("supervisor.core.slots", "json"),
        ("supervisor.core.slots", "supervisor.subagents.rules"),
        ("supervisor.tasks.rules", "supervisor.core.backoff"),
    ],
)
def test_the_standard_library_and_other_rules_are_allowed(
    code_graph: grimp.ImportGraph, importer: str, imported: str
) -> None:
    graph = with_import(code_graph, importer, imported)
    assert make(AllowedImportsContract, PURE).check(graph, verbose=False).kept


def test_the_task_runner_contract_follows_imports_through_the_store(
    code_graph: grimp.ImportGraph,
) -> None:
    contract = make(AllowedImportsContract, RUNNER)
    assert contract.check(copy.deepcopy(code_graph), verbose=False).kept

    direct = contract.check(
        with_import(code_graph, "supervisor.tasks.spec", "supervisor.pool.drain"), verbose=False
    )
    assert violations(direct) == {("supervisor.tasks.spec", "supervisor.pool.drain")}

    # Allowed itself, the store may not bring the daemon's runtime along.
    indirect = contract.check(
        with_import(code_graph, "supervisor.store.models", "supervisor.runtime.bus"),
        verbose=False,
    )
    assert violations(indirect) == {("supervisor.store.models", "supervisor.runtime.bus")}
    [violation] = indirect.metadata["violations"]
    assert violation["route"][0] in {"supervisor.tasks.runner", "supervisor.tasks.pulse"}


def test_the_allow_list_refuses_a_graph_without_third_party_modules() -> None:
    options = {k: v for k, v in contract_options(PURE).items() if k not in ("name", "type")}
    contract = AllowedImportsContract(
        name="pure",
        session_options={**SESSION, "include_external_packages": "False"},
        contract_options=options,
    )
    graph = grimp.build_graph(*SESSION["root_packages"], cache_dir=None)
    with pytest.raises(ValueError, match="include_external_packages"):
        contract.check(graph, verbose=False)


LAYERS = "every module in one layer"


def test_the_layers_hold_and_cover_every_module_today(code_graph: grimp.ImportGraph) -> None:
    check = make(CoveringLayersContract, LAYERS).check(copy.deepcopy(code_graph), verbose=False)
    assert check.kept, check.metadata


def test_a_module_in_no_layer_breaks_the_layers(code_graph: grimp.ImportGraph) -> None:
    graph = copy.deepcopy(code_graph)
    graph.add_module("supervisor.somewhere")
    check = make(CoveringLayersContract, LAYERS).check(graph, verbose=False)
    assert not check.kept
    assert check.metadata["uncovered_modules"] == ["supervisor.somewhere"]


def test_code_in_a_feature_package_itself_breaks_the_layers(
    code_graph: grimp.ImportGraph,
) -> None:
    # supervisor.tasks only holds layers; once it imports something it is code in no layer.
    graph = with_import(code_graph, "supervisor.tasks", "supervisor.store")
    check = make(CoveringLayersContract, LAYERS).check(graph, verbose=False)
    assert check.metadata["uncovered_modules"] == ["supervisor.tasks"]
    assert not check.kept


@pytest.mark.parametrize(
    ("importer", "imported"),
    [
        ("supervisor.store.models", "supervisor.pool.pool"),
        ("workers.budget", "supervisor.runtime.bus"),  # beside the runtime, not above it
        ("supervisor.runtime.bus", "workers.models"),
        ("supervisor.http.app", "supervisor.cli.common"),
        ("supervisor.pool.pool", "supervisor.tasks.service"),
        ("supervisor.contract.config", "supervisor.store"),
    ],
)
def test_an_import_upwards_breaks_the_layers(
    code_graph: grimp.ImportGraph, importer: str, imported: str
) -> None:
    graph = with_import(code_graph, importer, imported)
    check = make(CoveringLayersContract, LAYERS).check(graph, verbose=False)
    assert not check.kept
    assert check.metadata["uncovered_modules"] == []


def write_package(root: Path, name: str, rules_source: str) -> None:
    files = {
        f"{name}/__init__.py": "",
        f"{name}/core/__init__.py": "",
        f"{name}/core/rules.py": rules_source,
        f"{name}/store.py": "import sqlite3\n",
        "pyproject.toml": f"""
            [tool.importlinter]
            root_packages = ["{name}"]
            include_external_packages = true
            contract_types = ["allowed_imports: tests.import_contracts.AllowedImportsContract"]

            [[tool.importlinter.contracts]]
            name = "pure"
            type = "allowed_imports"
            source_modules = ["{name}.core"]
            allowed_modules = []
            """,
    }
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(textwrap.dedent(text))


@pytest.mark.parametrize(
    ("name", "rules_source", "exit_code"),
    [
        ("pure_fixture_ok", "import json\nfrom dataclasses import dataclass\n", 0),
        ("pure_fixture_cronsim", "import json\nimport cronsim\n", 1),
        (
            "pure_fixture_store",
            "def late() -> None:\n    from pure_fixture_store import store\n",
            1,
        ),
    ],
)
def test_lint_imports_fails_on_a_bad_import_in_a_pure_module(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    name: str,
    rules_source: str,
    exit_code: int,
) -> None:
    write_package(tmp_path, name, rules_source)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))  # also restores sys.path, which lint-imports grows
    code = cli.lint_imports(
        config_filename=str(tmp_path / "pyproject.toml"), no_cache=True, no_logo=True
    )
    out = capsys.readouterr().out
    assert code == exit_code, out
    if exit_code:
        assert "pure BROKEN" in out
        assert f"{name}.core.rules is not allowed to import" in out
