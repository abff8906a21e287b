"""The configuration layer: defaults < file < environment, one-line errors, paths, masking."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from supervisor.contract import config as config_module
from supervisor.contract.config import (
    Config,
    ConfigError,
    McpServer,
    load_config,
    make_private_dir,
    parse_listen,
    render_config,
    resolve_paths,
)
from supervisor.contract.delivery_targets import DeliveryTarget
from tests.support import run_turnkeeper

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "etc" / "turnkeeper.toml"


@pytest.fixture(autouse=True)
def no_system_file(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Keep a real /etc/turnkeeper/turnkeeper.toml on the test host out of every test."""
    absent = tmp_path_factory.mktemp("etc") / "turnkeeper.toml"
    monkeypatch.setattr(config_module, "DEFAULT_PATH", absent)


def write(tmp_path: Path, text: str, name: str = "turnkeeper.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def error_of(path: str | None = None, environ: dict[str, str] | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, environ={} if environ is None else environ)
    message = str(info.value)
    assert "\n" not in message
    return message


# Defaults and the example file


def test_defaults_without_a_file() -> None:
    cfg = load_config(environ={})
    assert cfg == Config()
    assert cfg.pool.workers == 2
    assert cfg.http.listen == "127.0.0.1:8765"
    assert cfg.agent.class_ == "workers.agents.tool_loop:ToolLoopAgent"
    assert cfg.mcp.servers == []


def test_system_file_is_read_when_present(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        config_module, "DEFAULT_PATH", Path(write(tmp_path, "[pool]\nworkers = 5\n"))
    )
    assert load_config(environ={}).pool.workers == 5


def test_example_file_loads_to_exactly_the_defaults() -> None:
    cfg = load_config(str(EXAMPLE), environ={})
    assert cfg.model_dump() == Config().model_dump()
    assert cfg.source == EXAMPLE


def test_example_file_lists_every_key_in_order() -> None:
    raw = tomllib.loads(EXAMPLE.read_text())
    sections = [name for name in Config.model_fields if name != "mcp"]
    assert list(raw) == sections
    for name in sections:
        model = Config.model_fields[name].annotation
        assert isinstance(model, type)
        keys = {field.serialization_alias or key for key, field in model.model_fields.items()}
        # A list of tables is shown as a commented example block (see the tests below).
        assert set(raw[name]) == keys - {"kinds", "targets"}, name


def test_example_task_kind_block_is_a_valid_kind(tmp_path: Path) -> None:
    lines = EXAMPLE.read_text().splitlines()
    start = lines.index("# [[tasks.kinds]]")
    block = []
    for line in lines[start:]:
        if not line.startswith("# "):
            break
        block.append(line.removeprefix("# "))
    cfg = load_config(write(tmp_path, "\n".join(block)), environ={})
    kind = cfg.tasks.kinds[0]
    assert kind.name == "report" and kind.placeholders() == {"days"}
    assert kind.model_dump(exclude={"name", "command", "args"}) == {
        "timeout": 3600.0,
        "env": {},
        "cwd": "",
        "retry_on_restart": False,
        "allow_dash": False,
        "end_of_options": False,
    }


def test_example_delivery_target_block_is_a_valid_and_complete_target(tmp_path: Path) -> None:
    lines = EXAMPLE.read_text().splitlines()
    start = lines.index("# [[delivery.targets]]")
    block = []
    for line in lines[start:]:
        if not line.startswith("# "):
            break
        block.append(line.removeprefix("# "))
    assert set(tomllib.loads("\n".join(block))["delivery"]["targets"][0]) == set(
        DeliveryTarget.model_fields
    )
    cfg = load_config(write(tmp_path, "\n".join(block)), environ={})
    target = cfg.delivery.targets[0]
    assert target.name == "bridge" and target.events == ["answer", "notice"]
    assert target.timeout == 10.0


@pytest.mark.parametrize(
    ("body", "names"),
    [
        ('url = "ftp://x/y"', "delivery.targets[0].url"),
        ('url = "http://user:pw@127.0.0.1/"', "delivery.targets[0].url"),
        ('url = "http://127.0.0.1:99999/"', "delivery.targets[0].url"),
        ('url = "http://bücher..de/in"', "delivery.targets[0].url"),
        ('url = "http://127.0.0.1/"\nevents = ["model_response"]', "delivery.targets[0].events"),
        ('url = "http://127.0.0.1/"\nevents = []', "delivery.targets[0].events"),
        ('url = "http://127.0.0.1/"\nsecret_env = "A B"', "delivery.targets[0].secret_env"),
    ],
)
def test_a_bad_delivery_target_is_one_line_naming_its_key(
    tmp_path: Path, body: str, names: str
) -> None:
    text = '[[delivery.targets]]\nname = "t"\nsecret_env = "S"\n' + body + "\n"
    if "secret_env" in body:
        text = text.replace('secret_env = "S"\n', "", 1)
    with pytest.raises(ConfigError) as caught:
        load_config(write(tmp_path, text), environ={})
    assert names in str(caught.value) and "\n" not in str(caught.value)


def test_two_delivery_targets_of_one_name_and_a_cap_below_the_base_are_refused(
    tmp_path: Path,
) -> None:
    one = '[[delivery.targets]]\nname = "t"\nurl = "http://127.0.0.1/"\nsecret_env = "S"\n'
    with pytest.raises(ConfigError, match=r"delivery\.targets\[1\]\.name.*duplicate"):
        load_config(write(tmp_path, one + one), environ={})
    with pytest.raises(ConfigError, match=r"delivery\.backoff_cap"):
        load_config(write(tmp_path, "[delivery]\nbackoff = 10\nbackoff_cap = 5\n"), environ={})


def example_server_block() -> str:
    lines = EXAMPLE.read_text().splitlines()
    start = lines.index("# [[mcp.servers]]")
    block = []
    for line in lines[start:]:
        if not line.startswith("# "):
            break
        block.append(line.removeprefix("# "))
    return "\n".join(block)


def test_example_mcp_server_block_is_valid_and_complete(tmp_path: Path) -> None:
    block = example_server_block()
    server = tomllib.loads(block)["mcp"]["servers"][0]
    assert set(server) == set(McpServer.model_fields)
    cfg = load_config(write(tmp_path, block), environ={})
    assert cfg.mcp.servers[0].name == "files"


# Layering


def test_file_overrides_defaults_and_environment_overrides_file(tmp_path: Path) -> None:
    path = write(tmp_path, '[pool]\nworkers = 3\nspare = 0\n[log]\nlevel = "debug"\n')
    cfg = load_config(path, environ={})
    assert (cfg.pool.workers, cfg.pool.spare, cfg.log.level) == (3, 0, "DEBUG")
    cfg = load_config(path, environ={"TURNKEEPER_POOL__WORKERS": "4"})
    assert (cfg.pool.workers, cfg.pool.spare) == (4, 0)


def test_config_file_named_by_environment(tmp_path: Path) -> None:
    path = write(tmp_path, "[lease]\nstale_after = 12.5\n")
    assert load_config(environ={"TURNKEEPER_CONFIG": path}).lease.stale_after == 12.5
    assert load_config(environ={"TURNKEEPER_CONFIG": ""}) == Config()


def test_explicit_path_wins_over_environment(tmp_path: Path) -> None:
    named = write(tmp_path, "[pool]\nworkers = 7\n", "named.toml")
    other = write(tmp_path, "[pool]\nworkers = 9\n", "other.toml")
    assert load_config(named, environ={"TURNKEEPER_CONFIG": other}).pool.workers == 7


@pytest.mark.parametrize(
    ("variable", "text", "section", "key", "expected"),
    [
        ("TURNKEEPER_POOL__WORKERS", "4", "pool", "workers", 4),
        ("TURNKEEPER_Pool__Workers", "3", "pool", "workers", 3),
        ("TURNKEEPER_RECOVERY__AUTO_CONTINUE", "false", "recovery", "auto_continue", False),
        ("TURNKEEPER_AUTH__METRICS_PUBLIC", "true", "auth", "metrics_public", True),
        ("TURNKEEPER_POOL__HEARTBEAT_INTERVAL", "0.5", "pool", "heartbeat_interval", 0.5),
        ("TURNKEEPER_MODEL__MODEL", "llama3.1:8b", "model", "model", "llama3.1:8b"),
        ("TURNKEEPER_MODEL__MODEL", "7", "model", "model", "7"),
        ("TURNKEEPER_MODEL__MODEL", '"quoted"', "model", "model", "quoted"),
        ("TURNKEEPER_MODEL__PROVIDER", "OpenAI", "model", "provider", "openai"),
        ("TURNKEEPER_LOG__LEVEL", "debug", "log", "level", "DEBUG"),
        ("TURNKEEPER_STORE__SYNCHRONOUS", "NORMAL", "store", "synchronous", "normal"),
        ("TURNKEEPER_DAEMON__STATE_DIR", "/srv/tk", "daemon", "state_dir", "/srv/tk"),
        ("TURNKEEPER_AGENT__CLASS", "mypkg.agents:Mine", "agent", "class_", "mypkg.agents:Mine"),
        (
            "TURNKEEPER_HTTP__LISTEN",
            "unix:/run/tk/api.sock",
            "http",
            "listen",
            "unix:/run/tk/api.sock",
        ),
    ],
)
def test_environment_values_are_read_as_toml_or_text(
    variable: str, text: str, section: str, key: str, expected: object
) -> None:
    cfg = load_config(environ={variable: text})
    value = getattr(getattr(cfg, section), key)
    assert value == expected
    assert type(value) is type(expected)


def test_variables_without_a_section_separator_are_ignored() -> None:
    environ = {
        "TURNKEEPER_TEST_POSTGRES_URL": "postgresql://x",
        "TURNKEEPER_WORKERS": "9",
        "POOL__WORKERS": "9",
    }
    assert load_config(environ=environ) == Config()


# Errors: one line, naming the key and where it came from


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[pool]\nworkrs = 3\n", "pool.workrs: unknown key"),
        ("[poool]\nworkers = 3\n", "poool: unknown key"),
        (
            '[pool]\nworkers = "many"\n',
            "pool.workers: Input should be a valid integer",
        ),
        ("[pool]\nworkers = 0\n", "pool.workers: Input should be greater than or equal to 1"),
        ("[pool]\nspare = -1\n", "pool.spare"),
        ("pool = 3\n", "pool: Input should be a valid dictionary"),
        ("[shutdown]\nkill_grace = -1\n", "shutdown.kill_grace: Input should be greater than 0"),
        ("[shutdown]\nkill_grace = 0\n", "shutdown.kill_grace"),
        ("[shutdown]\ndrain_budget = -1\n", "shutdown.drain_budget"),
        ("[lease]\nstale_after = 0\n", "lease.stale_after"),
        ("[attach]\nshutdown_timeout = -5\n", "attach.shutdown_timeout"),
        ("[pool]\nheartbeat_interval = 0\n", "pool.heartbeat_interval"),
        ("[pool]\nhang_timeout = 1.0\n", "pool.hang_timeout: must be greater than"),
        ("[pool]\nheartbeat_interval = 2.0\nhang_timeout = 1.5\n", "pool.hang_timeout"),
        (
            "[restart]\nagent_may_request = true\nmin_interval = 0.5\n",
            "restart.min_interval: must be at least 1.0 s while restart.agent_may_request",
        ),
        ("[http]\nmax_body = 0\n", "http.max_body"),
        ('[http]\nlisten = "localhost"\n', "http.listen: expected HOST:PORT"),
        ('[http]\nlisten = "127.0.0.1:0"\n', "http.listen"),
        ('[http]\nlisten = "127.0.0.1:65536"\n', "http.listen"),
        ('[http]\nlisten = "::1:8765"\n', "http.listen"),
        ('[http]\nlisten = "[nonsense]:8765"\n', "http.listen"),
        (
            '[http]\nlisten = "unix:run/tk.sock"\n',
            "http.listen: a unix socket path must be absolute",
        ),
        (
            '[store]\nsynchronous = "fast"\n',
            "store.synchronous: Input should be 'full' or 'normal'",
        ),
        ('[log]\nlevel = "LOUD"\n', "log.level"),
        ('[log]\nformat = "xml"\n', "log.format"),
        ('[model]\nprovider = "magic"\n', "model.provider"),
        ("[model]\ndelay = -0.1\n", "model.delay"),
        ("[model]\nmax_tokens = 0\n", "model.max_tokens"),
        ('[agent]\nclass = "ToolLoopAgent"\n', "agent.class: expected 'package.module:Class'"),
        ("[recovery]\nfreshness = 0\n", "recovery.freshness"),
        ("[delivery]\nmax_age = 0\n", "delivery.max_age: Input should be greater than 0"),
        ("[delivery]\nmax_age = -86400\n", "delivery.max_age: Input should be greater than 0"),
        ('[delivery]\nmax_age = "a day"\n', "delivery.max_age: Input should be a valid number"),
        ("[delivery]\nmax_attempts = -1\n", "delivery.max_attempts"),
        ("[recovery]\nmax_per_pass = -1\n", "recovery.max_per_pass"),
        ("[recovery]\npass_interval = 0\n", "recovery.pass_interval"),
        (
            "[recovery]\nmax_per_boot = 10\n",
            "recovery.max_per_boot: unknown key; replaced by recovery.max_per_pass (the most "
            "one recovery pass continues; passes come every recovery.pass_interval while "
            "interrupted sessions are left)",
        ),
        ("[recovery]\nbreaker_threshold = 0\n", "recovery.breaker_threshold"),
        ('[recovery]\nauto_continue = "perhaps"\n', "recovery.auto_continue"),
        (
            '[[mcp.servers]]\nname = "a"\ncommand = ["x"]\n'
            '[[mcp.servers]]\nname = "b"\ncommand = ["y"]\n'
            '[[mcp.servers]]\nname = "a"\ncommand = ["z"]\n',
            "mcp.servers[2].name: duplicate server name 'a', already used by mcp.servers[0]",
        ),
        ('[[mcp.servers]]\nname = "a"\n', "mcp.servers[0].command: Field required"),
        ('[[mcp.servers]]\nname = "a"\ncommand = []\n', "mcp.servers[0].command"),
        ('[[mcp.servers]]\nname = ""\ncommand = ["x"]\n', "mcp.servers[0].name"),
        (
            '[[mcp.servers]]\nname = "a"\ncommand = ["x"]\nport = 1\n',
            "mcp.servers[0].port: unknown key",
        ),
        (
            '[[mcp.servers]]\nname = "a"\ncommand = ["x"]\ncall_timeout = -1\n',
            "mcp.servers[0].call_timeout",
        ),
    ],
)
def test_file_errors_name_the_key_and_the_file(tmp_path: Path, text: str, expected: str) -> None:
    path = write(tmp_path, text)
    message = error_of(path)
    assert message.startswith(expected)
    assert message.endswith(f"[file {path}]")


@pytest.mark.parametrize(
    ("variable", "text", "expected"),
    [
        (
            "TURNKEEPER_POOL__WORKERS",
            "-1",
            "pool.workers: Input should be greater than or equal to 1 (got -1)",
        ),
        (
            "TURNKEEPER_POOL__WORKERS",
            "many",
            "pool.workers: Input should be a valid integer",
        ),
        ("TURNKEEPER_SHUTDOWN__KILL_GRACE", "-1", "shutdown.kill_grace"),
        ("TURNKEEPER_HTTP__LISTEN", "8765", "http.listen"),
        ("TURNKEEPER_POOL__HEARTBEAT_INTERVAL", "10", "pool.hang_timeout: must be greater than"),
    ],
)
def test_environment_errors_name_the_key_and_the_variable(
    variable: str, text: str, expected: str
) -> None:
    message = error_of(environ={variable: text})
    assert message.endswith(f" [env {variable}]")
    assert message.count("[env ") == 1
    assert message.startswith(expected)


@pytest.mark.parametrize(
    ("variable", "expected"),
    [
        ("TURNKEEPER_POOL__WORKRS", "TURNKEEPER_POOL__WORKRS: unknown key pool.workrs"),
        ("TURNKEEPER_POLL__WORKERS", "TURNKEEPER_POLL__WORKERS: unknown section poll"),
        ("TURNKEEPER_MCP__SERVERS", "TURNKEEPER_MCP__SERVERS: mcp.servers cannot be set"),
        ("TURNKEEPER_POOL__WORKERS__MAX", "TURNKEEPER_POOL__WORKERS__MAX: expected"),
        ("TURNKEEPER___WORKERS", "TURNKEEPER___WORKERS: expected"),
    ],
)
def test_malformed_environment_variables_are_named(variable: str, expected: str) -> None:
    assert error_of(environ={variable: "1"}).startswith(expected)


def test_wrong_type_shows_the_value_given(tmp_path: Path) -> None:
    message = error_of(write(tmp_path, '[pool]\nworkers = "many"\n'))
    assert message.startswith("pool.workers: Input should be a valid integer")
    assert "(got 'many')" in message


def test_a_variable_overriding_a_file_error_is_blamed_not_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "[pool]\nworkers = 3\n")
    message = error_of(path, {"TURNKEEPER_POOL__WORKERS": "0"})
    assert message.endswith("[env TURNKEEPER_POOL__WORKERS]")


def test_errors_do_not_echo_secrets(tmp_path: Path) -> None:
    path = write(
        tmp_path, '[[mcp.servers]]\nname = "a"\ncommand = ["x"]\nenv = { TOKEN = 31337 }\n'
    )
    message = error_of(path)
    assert message.startswith("mcp.servers[0].env.TOKEN")
    assert "31337" not in message


def test_missing_file_is_an_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    assert error_of(str(missing)) == f"{missing}: no such file"
    assert error_of(environ={"TURNKEEPER_CONFIG": str(missing)}) == f"{missing}: no such file"


def test_directory_as_file_is_an_error(tmp_path: Path) -> None:
    assert error_of(str(tmp_path)) == f"{tmp_path}: is a directory, not a configuration file"


def test_invalid_toml_names_file_line_and_column(tmp_path: Path) -> None:
    path = write(tmp_path, "[pool]\nworkers = 2\nspare = = 1\n")
    message = error_of(path)
    assert message.startswith(f"{path}: invalid TOML: ")
    assert "line 3, column" in message


def test_non_utf8_file_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "latin1.toml"
    path.write_bytes('[model]\nmodel = "caf\xe9"\n'.encode("latin-1"))
    assert error_of(str(path)) == f"{path}: not UTF-8 text"


# http.listen


@pytest.mark.parametrize(
    ("listen", "expected"),
    [
        ("127.0.0.1:8765", ("127.0.0.1", 8765)),
        ("0.0.0.0:1", ("0.0.0.0", 1)),
        ("localhost:65535", ("localhost", 65535)),
        ("[::1]:8765", ("::1", 8765)),
        ("[fe80::1%eth0]:80", ("fe80::1%eth0", 80)),
        ("unix:/run/turnkeeper/api.sock", Path("/run/turnkeeper/api.sock")),
    ],
)
def test_listen_addresses(listen: str, expected: object) -> None:
    assert parse_listen(listen) == expected
    assert load_config(environ={"TURNKEEPER_HTTP__LISTEN": listen}).http.listen == listen


@given(st.integers(min_value=-10, max_value=99999))
def test_listen_port_range(port: int) -> None:
    if 1 <= port <= 65535:
        assert parse_listen(f"127.0.0.1:{port}") == ("127.0.0.1", port)
    else:
        with pytest.raises(ValueError):
            parse_listen(f"127.0.0.1:{port}")


# Rendering


def test_render_round_trips(tmp_path: Path) -> None:
    cfg = Config.model_validate(
        {
            "store": {
                "url": "postgresql://tk@db.internal:5432/turnkeeper",
                "synchronous": "normal",
            },
            "pool": {"workers": 6, "hang_timeout": 9.5},
            "agent": {"class": "mypkg.agents:Mine"},
            "model": {"provider": "openai", "model": "llama3", "api_key_env": "OPENAI_API_KEY"},
            "mcp": {
                "servers": [
                    {"name": "files", "command": ["mcp-files", "/srv"], "cwd": "/srv"},
                    {"name": "shell", "command": ["mcp-shell"], "call_timeout": 5.0},
                ]
            },
            "recovery": {"auto_continue": False},
            "log": {"format": "json", "level": "DEBUG"},
        }
    )
    loaded = load_config(write(tmp_path, render_config(cfg)), environ={})
    assert loaded.model_dump() == cfg.model_dump()
    defaults = load_config(write(tmp_path, render_config(Config())), environ={})
    assert defaults.model_dump() == Config().model_dump()


def test_render_keeps_section_order() -> None:
    rendered = tomllib.loads(render_config(Config()))
    assert list(rendered) == [name for name in Config.model_fields if name != "mcp"]


def test_render_masks_secrets(tmp_path: Path) -> None:
    cfg = Config.model_validate(
        {
            "store": {"url": "postgresql://tk:hunter2@db:5432/tk?sslmode=require&password=hunter3"},
            "model": {
                "api_key_env": "OPENAI_API_KEY",
                "base_url": "https://proxy:hunter4@llm.example/v1",
            },
            "auth": {"tokens_file": "/etc/turnkeeper/tokens"},
            "mcp": {
                "servers": [
                    {
                        "name": "gh",
                        "command": ["gh-mcp", "--db", "postgresql://gh:hunter5@db/gh"],
                        "env": {"GH": "ghp_abc"},
                    }
                ]
            },
        }
    )
    rendered = render_config(cfg)
    for secret in ("hunter2", "hunter3", "hunter4", "hunter5", "ghp_abc"):
        assert secret not in rendered
    parsed = tomllib.loads(rendered)
    assert parsed["store"]["url"] == "postgresql://tk:***@db:5432/tk?sslmode=require&password=***"
    assert parsed["model"]["base_url"] == "https://proxy:***@llm.example/v1"
    assert parsed["mcp"]["servers"][0]["command"][2] == "postgresql://gh:***@db/gh"
    assert parsed["mcp"]["servers"][0]["env"] == {"GH": "***"}
    assert parsed["model"]["api_key_env"] == "OPENAI_API_KEY"
    assert parsed["model"]["max_tokens"] == 1024
    assert parsed["auth"]["tokens_file"] == "/etc/turnkeeper/tokens"
    assert load_config(write(tmp_path, rendered), environ={}).mcp.servers[0].env == {"GH": "***"}


# Paths


def test_paths_default_to_home_state() -> None:
    paths = resolve_paths(Config(), {"HOME": "/home/op"})
    state = Path("/home/op/.local/state/turnkeeper")
    assert paths.state_dir == state
    assert paths.runtime_dir == state / "run"
    assert paths.db_url == "sqlite:////home/op/.local/state/turnkeeper/turnkeeper.db"
    assert paths.admin_token_file == state / "admin.token"


def test_paths_follow_systemd_directories() -> None:
    environ = {
        "HOME": "/home/op",
        "STATE_DIRECTORY": "/var/lib/turnkeeper:/var/lib/other",
        "RUNTIME_DIRECTORY": "/run/turnkeeper",
        "XDG_RUNTIME_DIR": "/run/user/1000",
    }
    paths = resolve_paths(Config(), environ)
    assert paths.state_dir == Path("/var/lib/turnkeeper")
    assert paths.runtime_dir == Path("/run/turnkeeper")
    assert paths.db_url == "sqlite:////var/lib/turnkeeper/turnkeeper.db"


def test_runtime_dir_falls_back_to_xdg() -> None:
    paths = resolve_paths(Config(), {"HOME": "/home/op", "XDG_RUNTIME_DIR": "/run/user/1000"})
    assert paths.runtime_dir == Path("/run/user/1000/turnkeeper")


def test_configured_paths_win_and_are_made_absolute() -> None:
    cfg = Config.model_validate(
        {
            "daemon": {"state_dir": "~/tk", "runtime_dir": "rel/run"},
            "store": {"url": "postgresql://tk@db/tk"},
        }
    )
    environ = {"HOME": "/home/op", "STATE_DIRECTORY": "/var/lib/x", "RUNTIME_DIRECTORY": "/run/x"}
    paths = resolve_paths(cfg, environ)
    assert paths.state_dir == Path("/home/op/tk")
    assert paths.runtime_dir == Path.cwd() / "rel" / "run"
    assert paths.db_url == "postgresql://tk@db/tk"
    assert paths.admin_token_file == Path("/home/op/tk/admin.token")


def test_make_private_dir_creates_0700(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b" / "state"
    make_private_dir(target)
    for directory in (target, target.parent, target.parent.parent):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    make_private_dir(target)
    assert stat.S_IMODE(target.stat().st_mode) == 0o700


def test_make_private_dir_never_changes_an_existing_dir(tmp_path: Path) -> None:
    target = tmp_path / "state"
    target.mkdir()
    target.chmod(0o755)
    make_private_dir(target)
    assert stat.S_IMODE(target.stat().st_mode) == 0o755


# The command line


def run_cli(
    *args: str, env: dict[str, str] | None = None, home: Path
) -> subprocess.CompletedProcess[str]:
    environ = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home)}
    environ.update(env or {})
    return run_turnkeeper(*args, env=environ)


def one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 78, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("turnkeeper: configuration error: ")
    return lines[0]


def test_cli_config_show(tmp_path: Path) -> None:
    result = run_cli("config", "show", env={"TURNKEEPER_CONFIG": str(EXAMPLE)}, home=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "[pool]" in result.stdout
    assert tomllib.loads(result.stdout)["pool"]["workers"] == 2


def test_cli_bad_file_via_option(tmp_path: Path) -> None:
    path = write(tmp_path, "[pool]\nworkers = -1\n")
    result = run_cli("--config", path, "config", "show", home=tmp_path)
    assert "pool.workers" in one_error_line(result)
    assert result.stdout == ""


def test_cli_bad_file_via_environment(tmp_path: Path) -> None:
    path = write(tmp_path, "[shutdown]\nkill_grace = -1\n")
    result = run_cli("config", "show", env={"TURNKEEPER_CONFIG": path}, home=tmp_path)
    assert "shutdown.kill_grace" in one_error_line(result)


def test_cli_bad_delivery_max_age(tmp_path: Path) -> None:
    path = write(tmp_path, "[delivery]\nmax_age = 0\n")
    line = one_error_line(run_cli("--config", path, "config", "show", home=tmp_path))
    assert "delivery.max_age: Input should be greater than 0" in line


def test_cli_bad_environment_variable(tmp_path: Path) -> None:
    env = {"TURNKEEPER_CONFIG": str(EXAMPLE), "TURNKEEPER_POOL__WORKERS": "-1"}
    line = one_error_line(run_cli("config", "show", env=env, home=tmp_path))
    assert "pool.workers" in line
    assert "TURNKEEPER_POOL__WORKERS" in line


def test_an_old_config_naming_recovery_max_per_boot_does_not_start(tmp_path: Path) -> None:
    """Its meaning changed (10 at the boot, the rest at the retry timer; now 10 a pass, a
    pass every 5 s): `run` refuses it in one line naming the key and what replaced it."""
    path = write(tmp_path, "[recovery]\nmax_per_boot = 10\n")
    line = one_error_line(run_cli("--config", path, "run", home=tmp_path))
    assert "recovery.max_per_boot: unknown key; replaced by recovery.max_per_pass" in line
    assert line.endswith(f"[file {path}]")
    env = {"TURNKEEPER_CONFIG": str(EXAMPLE), "TURNKEEPER_RECOVERY__MAX_PER_BOOT": "10"}
    line = one_error_line(run_cli("run", env=env, home=tmp_path))
    assert line.endswith(
        "TURNKEEPER_RECOVERY__MAX_PER_BOOT: recovery.max_per_boot was replaced by "
        "recovery.max_per_pass (the most one recovery pass continues; passes come every "
        "recovery.pass_interval while interrupted sessions are left)"
    )


def test_cli_missing_file(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.toml")
    line = one_error_line(run_cli("--config", missing, "config", "show", home=tmp_path))
    assert line.endswith(f"{missing}: no such file")


def test_cli_show_masks_secrets(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        '[store]\nurl = "postgresql://tk:s3cr3t-pw@db:5432/tk"\n'
        f'[[mcp.servers]]\nname = "gh"\ncommand = ["{sys.executable}"]\n'
        'env = { GITHUB_TOKEN = "ghp_hidden" }\n',
    )
    result = run_cli("--config", path, "config", "show", home=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "s3cr3t-pw" not in result.stdout
    assert "ghp_hidden" not in result.stdout
    assert "***" in result.stdout
    assert "postgresql://tk:***@db:5432/tk" in result.stdout
