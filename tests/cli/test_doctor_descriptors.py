"""`turnkeeper doctor` on file descriptors (issue 32): the limit the daemon will get (the
unit's LimitNOFILE, else the hard limit doctor runs under) against http.max_connections
and what the daemon keeps open besides. The shipped LimitNOFILE=65536 passes; a limit
that would clamp the connections is a WARN naming the value to set; one below what the
daemon keeps is a FAIL."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from supervisor.cli.doctor import FAIL, PASS, WARN
from supervisor.cli.doctor_descriptors import check_unit, judge, parse_limit
from supervisor.contract import fdlimit
from supervisor.contract.config import Config
from tests.cli.test_doctor import UNIT, doctor

RESERVE = fdlimit.needs(Config()).reserve()


def unit_with(limit: str | None) -> str:
    """The shipped unit with `LimitNOFILE=limit` as its only one (None: none at all)."""
    lines = [line for line in UNIT.splitlines() if not line.startswith("LimitNOFILE=")]
    text = "\n".join(lines) + "\n"
    if limit is None:
        return text
    return text.replace("[Service]\n", f"[Service]\nLimitNOFILE={limit}\n", 1)


@pytest.mark.parametrize(
    ("raw", "hard"),
    [("65536", 65536), ("1024:524288", 524288), ("infinity", 1 << 20), (" 4096 ", 4096)],
)
def test_limit_nofile_values(raw: str, hard: int) -> None:
    assert parse_limit(raw) == hard


@pytest.mark.parametrize("raw", ["", "lots", "64K", "1024:"])
def test_bad_limit_nofile_values(raw: str) -> None:
    with pytest.raises(ValueError):
        parse_limit(raw)


def test_the_units_65536_passes_for_the_shipped_configuration() -> None:
    found = check_unit(unit_with("65536"), "turnkeeper.service", Config())
    assert found.status == PASS, found
    assert "LimitNOFILE=65536: 65536 holds http.max_connections (1024)" in found.detail


def test_a_limit_that_would_clamp_the_connections_warns_with_what_to_set() -> None:
    found = check_unit(unit_with("1024"), "turnkeeper.service", Config())
    assert found.status == WARN, found
    assert f"http.max_connections (1024) will be clamped to {1024 - RESERVE}" in found.detail
    assert "LimitNOFILE=65536" in found.fix
    assert f"at least {1024 + RESERVE}" in found.fix
    assert f"http.max_connections = {1024 - RESERVE}" in found.fix
    # The same configuration with fewer connections fits.
    fewer = Config.model_validate({"http": {"max_connections": 1024 - RESERVE}})
    assert check_unit(unit_with("1024"), "u", fewer).status == PASS


def test_a_limit_below_what_the_daemon_keeps_fails() -> None:
    found = check_unit(unit_with("200"), "turnkeeper.service", Config())
    assert found.status == FAIL, found
    assert f"below the {RESERVE} the daemon keeps" in found.detail
    # A bigger pool keeps more: a limit that passed before may not any more.
    assert judge(2048, "here", Config()).status == PASS
    big = Config.model_validate({"pool": {"workers": 100, "spare": 20}})
    assert judge(2048, "here", big).status == WARN


def test_a_unit_without_limit_nofile_warns_and_an_unreadable_one_fails() -> None:
    found = check_unit(unit_with(None), "turnkeeper.service", Config())
    assert found.status == WARN and "no LimitNOFILE=" in found.detail
    assert found.fix == "set LimitNOFILE=65536"
    assert check_unit(unit_with("many"), "u", Config()).status == FAIL


def run_doctor(tmp_path: Path, unit: str, limit: str) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "turnkeeper.service"
    path.write_text(unit_with(limit))
    return doctor(tmp_path, "--unit", str(path))


def test_doctor_says_what_to_set_and_exits_1_for_a_limit_too_low(tmp_path: Path) -> None:
    low = run_doctor(tmp_path, UNIT, "200")
    assert low.returncode == 1, low.stdout
    assert "FAIL  file descriptors:" in low.stdout
    assert "fix: raise it to at least" in low.stdout and "LimitNOFILE=65536" in low.stdout
    shipped = run_doctor(tmp_path, UNIT, "65536")
    assert "PASS  file descriptors:" in shipped.stdout
    assert "FAIL  file descriptors" not in shipped.stdout
    assert "WARN  file descriptors" not in shipped.stdout
