"""Contract types of our own for import-linter (`contract_types` in pyproject.toml).

`lint-imports` puts the directory it runs in on `sys.path`, so these load as
`tests.import_contracts` when it runs from the repository's root (tox, CI, tests).

- `allowed_imports`: an allow-list. The source modules may import only the allowed
  modules (and, unless told otherwise, the standard library), directly or through any
  chain of allowed modules. import-linter's `forbidden` is a deny-list: a third-party
  package nobody thought to list would pass it.
- `covering_layers`: import-linter's `layers`, which also fails when a module of the
  packages named in `cover` sits in no layer, so that nothing is outside the layering.
  (The built-in `exhaustive` option needs `containers`, whose layers cannot span two
  root packages or name a feature package's parts in different layers.)

This module imports import-linter and the standard library only.
"""

from __future__ import annotations

import sys
from collections import deque
from typing import Any

from grimp import ImportGraph
from importlinter import Contract, ContractCheck, fields, output
from importlinter.application import contract_utils
from importlinter.application.contract_utils import AlertLevel
from importlinter.contracts.layers import LayersContract
from importlinter.domain.contract import InvalidContractOptions
from importlinter.domain.helpers import module_expressions_to_modules

STDLIB = frozenset(sys.stdlib_module_names)


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _line_numbers(graph: ImportGraph, importer: str, imported: str) -> str:
    lines = sorted(
        {d["line_number"] for d in graph.get_import_details(importer=importer, imported=imported)}
    )
    return ", ".join(f"l.{n}" for n in lines) or "l.?"


class AllowedImportsContract(Contract):
    """The source modules (each with everything inside it) may import only:

    - each other;
    - the allowed modules (each with everything inside it): modules of the root packages,
      or the top-level names of external packages;
    - the standard library (`sys.stdlib_module_names`), unless `allow_stdlib` is false;
    - any external package at all, if `allow_any_external` is true.

    Imports are followed through allowed modules of the root packages, so importing an
    allowed module that itself imports something not allowed breaks the contract too.
    Needs `include_external_packages = true`: without it no third-party import is in the
    graph, and the contract could never fail on one.

    Options: source_modules, allowed_modules, allow_stdlib (default true),
    allow_any_external (default false), ignore_imports, unmatched_ignore_imports_alerting.
    """

    type_name = "allowed_imports"

    source_modules = fields.SetField(subfield=fields.ModuleExpressionField())
    allowed_modules = fields.SetField(subfield=fields.ModuleExpressionField(), required=False)
    allow_stdlib = fields.BooleanField(required=False, default=True)
    allow_any_external = fields.BooleanField(required=False, default=False)
    ignore_imports = fields.SetField(subfield=fields.ImportExpressionField(), required=False)
    unmatched_ignore_imports_alerting = fields.EnumField(AlertLevel, default=AlertLevel.ERROR)

    def check(self, graph: ImportGraph, verbose: bool) -> ContractCheck:
        if str(self.session_options.get("include_external_packages")).lower() != "true":
            raise ValueError(
                f"Contract '{self.name}' needs include_external_packages = true: without it "
                "the graph holds no third-party module to refuse."
            )
        removal = contract_utils.remove_ignored_imports_and_report(
            graph=graph,
            ignore_imports=self.ignore_imports,  # type: ignore[arg-type]
            unmatched_alerting=self.unmatched_ignore_imports_alerting,  # type: ignore[arg-type]
        )
        roots = tuple(self.session_options["root_packages"])

        sources = {
            m.name
            for m in module_expressions_to_modules(
                graph,
                self.source_modules,  # type: ignore[arg-type]
                as_packages=True,
                raise_if_unmatched=True,
            )
        }
        allowed_names = {
            m.name
            for m in module_expressions_to_modules(
                graph,
                self.allowed_modules or (),  # type: ignore[arg-type]
            )
        }
        for name in allowed_names:
            if any(_inside(name, root) for root in roots) and name not in graph.modules:
                raise ValueError(f"Allowed module '{name}' does not exist.")

        def is_internal(module: str) -> bool:
            return any(_inside(module, root) for root in roots)

        def is_allowed(module: str) -> bool:
            if module in sources or any(_inside(module, a) for a in allowed_names):
                return True
            if is_internal(module):
                return False
            if self.allow_any_external:
                return True
            return bool(self.allow_stdlib) and module.split(".")[0] in STDLIB

        # Breadth first from the sources, through allowed modules of the root packages:
        # every import out of a module reached that way must be allowed.
        reached_from: dict[str, str | None] = dict.fromkeys(sorted(sources))
        queue = deque(sorted(sources))
        violations: list[dict[str, Any]] = []
        while queue:
            importer = queue.popleft()
            for imported in sorted(graph.find_modules_directly_imported_by(importer)):
                if not is_allowed(imported):
                    violations.append(
                        {
                            "importer": importer,
                            "imported": imported,
                            "line_numbers": _line_numbers(graph, importer, imported),
                            "route": self._route(reached_from, importer),
                        }
                    )
                elif is_internal(imported) and imported not in reached_from:
                    reached_from[imported] = importer
                    queue.append(imported)
        output.verbose_print(verbose, f"Followed the imports of {len(reached_from)} modules.")
        return ContractCheck(
            kept=not violations,
            warnings=list(removal.warnings),
            ignored_import_count=removal.ignored_import_count,
            metadata={"violations": violations},
        )

    @staticmethod
    def _route(reached_from: dict[str, str | None], module: str) -> list[str]:
        """The chain of allowed imports from a source module to `module` (without it)."""
        route: list[str] = []
        step = reached_from.get(module)
        while step is not None:
            route.append(step)
            step = reached_from.get(step)
        return list(reversed(route))

    def render_broken_contract(self, check: ContractCheck) -> None:
        for violation in check.metadata["violations"]:
            importer, imported = violation["importer"], violation["imported"]
            output.print_error(
                f"{importer} is not allowed to import {imported} ({violation['line_numbers']})"
            )
            if violation["route"]:
                output.indent_cursor()
                output.print_error(
                    f"(reached through {' -> '.join([*violation['route'], importer])})",
                    bold=False,
                )
            output.new_line()


def _layer_modules(raw_layers: list[str] | str) -> set[str]:
    """The module names in the raw `layers` option: 'a | b', 'a : b', '(optional)'."""
    names: set[str] = set()
    for raw in [raw_layers] if isinstance(raw_layers, str) else raw_layers:
        for part in raw.replace("|", ":").split(":"):
            name = part.strip()
            if name.startswith("(") and name.endswith(")"):
                name = name[1:-1].strip()
            if name:
                names.add(name)
    return names


class CoveringLayersContract(LayersContract):
    """import-linter's `layers` (without containers), and every module of the packages in
    `cover` inside one of the layers. A package that only holds layers (a feature package
    whose parts sit in different layers, or a root package) may be outside them if it
    imports no module of the root packages itself."""

    type_name = "covering_layers"

    cover = fields.SetField(subfield=fields.ModuleField())

    def validate(self) -> None:
        super().validate()
        if self.containers:
            raise InvalidContractOptions({"containers": "covering_layers takes no containers."})

    def check(self, graph: ImportGraph, verbose: bool) -> ContractCheck:
        roots = tuple(self.session_options["root_packages"])
        # Read before the parent removes the ignored imports from the graph.
        imports_of = {m: graph.find_modules_directly_imported_by(m) for m in graph.modules}
        layered = _layer_modules(self.contract_options["layers"])
        uncovered: list[str] = []
        for package in sorted(m.name for m in self.cover):  # type: ignore[attr-defined]
            if package not in graph.modules:
                raise ValueError(f"Module '{package}' (in cover) does not exist.")
            for module in sorted({package} | graph.find_descendants(package)):
                if any(_inside(module, layer) for layer in layered):
                    continue
                holds_layers = any(_inside(layer, module) for layer in layered)
                imports_own = any(
                    any(_inside(imported, root) for root in roots)
                    for imported in imports_of[module]
                )
                if not holds_layers or imports_own:
                    uncovered.append(module)
        check = super().check(graph, verbose)
        check.metadata["uncovered_modules"] = uncovered
        check.kept = check.kept and not uncovered
        return check

    def render_broken_contract(self, check: ContractCheck) -> None:
        super().render_broken_contract(check)
        if check.metadata["uncovered_modules"]:
            output.print("These modules are in no layer:")
            output.new_line()
            for module in check.metadata["uncovered_modules"]:
                output.print_error(f"- {module}", bold=False)
            output.new_line()
