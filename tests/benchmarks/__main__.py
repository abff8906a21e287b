"""Run the benchmarks: every `bench_*.py` module in this folder, or the ones named.

    python -m tests.benchmarks [NAME ...] [OPTIONS ...]

A NAME is a module name with or without its `bench_` prefix (`store`, `bench_store`).
Every other argument is passed to each selected module's `main(argv)`, which prints its
figures as JSON and returns them.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
from pathlib import Path

PREFIX = "bench_"


def available() -> list[str]:
    """The benchmark names in this folder, without their prefix, sorted."""
    here = str(Path(__file__).resolve().parent)
    return sorted(
        info.name[len(PREFIX) :]
        for info in pkgutil.iter_modules([here])
        if info.name.startswith(PREFIX) and not info.ispkg
    )


def split_args(argv: list[str], names: list[str]) -> tuple[list[str], list[str]]:
    """(selected benchmark names, arguments for the benchmarks)."""
    selected: list[str] = []
    passed: list[str] = []
    previous_is_option = False
    for arg in argv:
        name = arg.removeprefix(PREFIX)
        if name in names:
            selected.append(name)
            previous_is_option = False
            continue
        if not previous_is_option and not arg.startswith("-"):
            raise SystemExit(f"unknown benchmark {arg!r}; known: {', '.join(names)}")
        passed.append(arg)
        # `--events 100`: the next argument is this option's value, not a benchmark.
        previous_is_option = arg.startswith("-") and "=" not in arg
    return selected, passed


def main(argv: list[str] | None = None) -> int:
    names = available()
    selected, passed = split_args(sys.argv[1:] if argv is None else argv, names)
    for name in selected or names:
        module = importlib.import_module(f"{__package__ or 'tests.benchmarks'}.{PREFIX}{name}")
        module.main(list(passed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
