"""Wall time of a CLI call that talks to the daemon: `turnkeeper status`.

One real daemon (`tests.daemon.Daemon`, one worker, the API on a unix socket) serves
every call. The calls are made by this checkout and, with `--base REV`, by the command
line of another revision (a `git worktree` of REV in a temporary directory, run with that
tree first on `PYTHONPATH`), alternating, so both are measured in the same run on the same
machine against the same daemon. Each call is a fresh `python -m supervisor status`
process, from fork to exit, as an operator's shell runs it.

`--production` runs the calls in a virtualenv with only the project's runtime
dependencies (no test or dev extras: an operator's install), created in the temporary
directory; `--python PATH` uses that interpreter instead (such a virtualenv made before);
without either the current interpreter is used.

    python -m tests.benchmarks cli [--calls 20] [--base REV] [--production | --python PATH]

Prints one JSON object: the median, min and max per command line, and the ratio of the
medians (base / this). It measures; it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.benchmarks.figures import shipped_pool
from tests.conftest import PYTHON, REPO, python_env
from tests.daemon import Daemon


def _call(python: str, tree: Path, config: Path) -> float:
    env = python_env()
    env["PYTHONPATH"] = str(tree)
    started = time.perf_counter()
    done = subprocess.run(
        [python, "-m", "supervisor", "--config", str(config), "status"],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    took = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"status failed ({done.returncode}): {done.stderr.strip()}")
    return took


def _summary(values: list[float]) -> dict[str, float]:
    return {
        "median_s": round(statistics.median(values), 3),
        "min_s": round(min(values), 3),
        "max_s": round(max(values), 3),
    }


def _production_python(root: Path) -> str:
    """A virtualenv with the runtime dependencies only; its python."""
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", str(REPO)]
    subprocess.run(pip, check=True, capture_output=True)
    return str(venv / "bin" / "python")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="bench cli", description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--base", default=None, help="a git revision to compare with")
    parser.add_argument("--production", action="store_true")
    parser.add_argument("--python", default=None, help="run the calls with this interpreter")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="tk-bench-cli-") as tmp:
        root = Path(tmp)
        python = args.python or (_production_python(root) if args.production else PYTHON)
        trees = {"this": REPO}
        if args.base:
            base = root / "base"
            subprocess.run(
                ["git", "-C", str(REPO), "worktree", "add", "-q", "--detach", str(base), args.base],
                check=True,
            )
            trees["base"] = base
        # The shipped pool timings (the tests' daemon beats 5 times a second).
        daemon = Daemon(root / "daemon", pool=shipped_pool(1, 0))
        times: dict[str, list[float]] = {name: [] for name in trees}
        try:
            daemon.start()
            for tree in trees.values():
                # Bytecode as an installed package has it (pip compiles at install; an
                # environment with PYTHONDONTWRITEBYTECODE would compile on every call).
                for package in ("supervisor", "workers"):
                    subprocess.run([python, "-m", "compileall", "-q", str(tree / package)])
                _call(python, tree, daemon.config_path)  # and the file cache warm
            for _ in range(args.calls):
                for name, tree in trees.items():
                    times[name].append(_call(python, tree, daemon.config_path))
        finally:
            daemon.kill_everything()
            if args.base:
                subprocess.run(
                    ["git", "-C", str(REPO), "worktree", "remove", "--force", str(trees["base"])],
                    check=False,
                )
        figures: dict[str, Any] = {
            "benchmark": "cli",
            "command": "turnkeeper status",
            "calls": args.calls,
            "production_install": args.production,
            "cpus": os.cpu_count(),
            "load_average_1m": round(os.getloadavg()[0], 2),
        }
        for name, values in times.items():
            figures[name] = _summary(values)
        if args.base:
            figures["base_revision"] = args.base
            figures["ratio_base_over_this"] = round(
                figures["base"]["median_s"] / figures["this"]["median_s"], 2
            )
    print(json.dumps(figures, indent=2))
    return figures


if __name__ == "__main__":
    main(sys.argv[1:])
