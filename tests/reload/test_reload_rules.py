"""What a reload changes and what each change needs, without I/O: the keys compared (named
lists by name), the effect of each, the configuration in force with the restart-only keys
left as they were, and what `turnkeeper reload` prints of a result."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from supervisor.cli.reload_command import result_lines, shown
from supervisor.contract.config import Config, masked_data
from supervisor.core import reload as rules
from supervisor.reloading import ReloadResult

SERVER = {"name": "files", "command": ["python3", "-m", "files"], "env": {"TOKEN": "s3cret"}}
TARGET = {"name": "hook", "url": "http://127.0.0.1:9/in", "secret_env": "HOOK_SECRET"}
KIND = {"name": "build", "command": ["make", "{n}"], "args": {"n": "^[0-9]+$"}, "env": {"K": "v"}}


def data(**sections: dict[str, Any]) -> dict[str, Any]:
    """A configuration's data (as a reload compares it): the defaults and `sections`."""
    config = Config.model_validate(sections)
    found: dict[str, Any] = config.model_dump(mode="json", by_alias=True)
    return found


def diff(old: dict[str, Any], new: dict[str, Any]) -> dict[str, tuple[Any, Any, str]]:
    return {c.key: (c.before, c.after, c.effect) for c in rules.changes(old, new)}


def test_the_same_configuration_changes_nothing() -> None:
    assert rules.changes(data(), data()) == []
    assert rules.in_force(data(), data()) == data()


@pytest.mark.parametrize(
    ("section", "key", "value", "effect"),
    [
        ("pool", "workers", 3, "live"),
        ("pool", "spare", 0, "live"),
        ("pool", "hang_timeout", 9.0, "live"),
        ("pool", "heartbeat_interval", 0.5, "workers"),
        ("pool", "history_cache_mb", 8, "workers"),
        ("http", "listen", "127.0.0.1:9999", "restart"),
        ("http", "max_body", 10, "restart"),
        ("daemon", "state_dir", "/srv/tk", "restart"),
        ("store", "url", "postgresql://db/tk", "restart"),
        ("attach", "shutdown_timeout", 9.0, "restart"),
        ("lease", "stale_after", 60.0, "restart"),
        ("shutdown", "kill_grace", 9.0, "restart"),
        ("shutdown", "drain_budget", 9.0, "live"),
        ("shutdown", "subagent_drain", 9.0, "live"),
        ("auth", "tokens_file", "/etc/tk/tokens", "live"),
        ("auth", "metrics_public", False, "live"),
        ("agent", "allowed", ["tests.agents:ChaosAgent"], "workers"),
        ("agent", "class", "tests.agents:ChaosAgent", "workers"),
        ("model", "delay", 1.0, "workers"),
        ("recovery", "attempt_delays", [0.0, 1.0], "workers"),  # a runner's, at its start
        ("recovery", "auto_continue", False, "workers"),
        ("recovery", "breaker_threshold", 9, "live"),
        ("recovery", "retry_interval", 9.0, "live"),
        ("recovery", "pass_interval", 1.0, "live"),
        ("http", "max_streams_per_principal", 2, "live"),
        ("http", "read_timeout", 9.0, "restart"),  # the listener's head timeout too
        ("subagents", "freshness", 60.0, "live"),
        ("subagents", "reconcile_interval", 5.0, "live"),
        ("subagents", "max_depth", 0, "workers"),
        ("subagents", "max_children", 1, "workers"),
        ("tasks", "keep", 60.0, "live"),
        ("tasks", "max_running", 1, "workers"),
        ("schedules", "min_interval", 1.0, "live"),
        ("delivery", "max_attempts", 2, "live"),
        ("delivery", "max_age", 3600.0, "live"),
        ("delivery", "concurrency", 2, "live"),
        ("restart", "turn_wait", 5.0, "live"),
        ("restart", "min_interval", 5.0, "workers"),
        ("log", "level", "DEBUG", "workers"),
        ("log", "format", "json", "workers"),
    ],
)
def test_each_key_has_the_effect_of_who_reads_it(
    section: str, key: str, value: Any, effect: str
) -> None:
    found = diff(data(), data(**{section: {key: value}}))
    assert list(found) == [f"{section}.{key}"]
    assert found[f"{section}.{key}"][2] == effect


# Every key, by what its change needs: who reads it, and when (a named entry's name is *).
EXPECTED: dict[str, str] = {
    "restart": """daemon.state_dir daemon.runtime_dir daemon.host_id store.url store.synchronous
        store.max_event_bytes store.connect_timeout
        http.listen http.max_body http.read_timeout http.max_connections http.write_timeout
        http.console
        lease.stale_after
        shutdown.kill_grace attach.shutdown_timeout tasks.work_dir
        telemetry.otlp_endpoint telemetry.capture_content telemetry.service_name
        telemetry.queue_size""",
    "live": """http.max_streams_per_principal auth.tokens_file auth.metrics_public
        auth.max_open_sessions_per_principal pool.workers
        pool.spare pool.hang_timeout shutdown.drain_budget shutdown.subagent_drain
        recovery.freshness recovery.max_per_pass recovery.pass_interval
        recovery.retry_interval
        recovery.breaker_threshold recovery.breaker_window subagents.freshness
        subagents.max_recoveries subagents.max_per_boot subagents.reconcile_interval
        tasks.keep tasks.max_output tasks.kill_grace tasks.reconcile_interval tasks.lost_grace
        schedules.misfire_grace schedules.max_schedules schedules.max_per_owner
        schedules.min_interval delivery.max_age delivery.max_attempts delivery.backoff
        delivery.backoff_cap delivery.poll_interval delivery.concurrency delivery.keep
        delivery.targets.*.url
        delivery.targets.*.timeout delivery.targets.*.events delivery.targets.*.principals
        restart.turn_wait restart.drain_budget""",
    "workers": """pool.heartbeat_interval pool.history_cache_mb agent.class agent.allowed
        model.provider model.delay model.base_url model.model model.api_key_env model.timeout
        model.max_tokens model.max_response_bytes model.stream model.outage_budget
        model.context_window
        model.context_margin budget.turn_tokens budget.session_tokens
        model.compaction_prompt tools.max_result_bytes
        mcp.servers.*.command mcp.servers.*.env.TOKEN mcp.servers.*.cwd
        mcp.servers.*.start_timeout mcp.servers.*.call_timeout recovery.auto_continue
        recovery.attempt_delays subagents.max_depth subagents.max_children
        subagents.max_total_per_root restart.agent_principals
        tasks.kinds.*.command tasks.kinds.*.args.n tasks.kinds.*.timeout tasks.kinds.*.env.K
        tasks.kinds.*.cwd tasks.kinds.*.retry_on_restart tasks.kinds.*.allow_dash
        tasks.kinds.*.end_of_options tasks.max_running tasks.max_running_total
        tasks.max_running_per_principal
        delivery.targets.*.secret_env restart.agent_may_request restart.min_interval
        log.format log.level""",
}


def test_every_key_of_the_configuration_has_the_effect_decided_for_it() -> None:
    """Each key's effect is the one decided for it here (who reads it, and when); a key
    added to a section fails until it is decided. A key nobody classified would need a
    restart: safe, but it should be a decision."""
    expected = {key: effect for effect, keys in EXPECTED.items() for key in keys.split()}
    everything = data(
        mcp={"servers": [SERVER]}, delivery={"targets": [TARGET]}, tasks={"kinds": [KIND]}
    )
    found = {
        rules.shape(path): rules.effect_of(path)
        for path, _, _ in rules.differences(blank(everything), everything)
    }
    assert found == expected
    assert rules.effect_of(("section_of_tomorrow", "key")) == "restart"


def blank(value: Any, path: tuple[str, ...] = ()) -> Any:
    """`value` with every leaf replaced (a named entry keeps its name): unlike any value."""
    if isinstance(value, dict):
        return {k: v if k == "name" else blank(v, (*path, k)) for k, v in value.items()}
    if isinstance(value, list) and path in rules.NAMED:
        return [blank(entry, path) for entry in value]
    return object()


def test_a_named_list_is_compared_entry_by_entry() -> None:
    old = data(mcp={"servers": [SERVER, {"name": "web", "command": ["web"]}]})
    changed = copy.deepcopy(SERVER) | {"command": ["python3", "-X", "utf8", "-m", "files"]}
    new = data(mcp={"servers": [changed, {"name": "mail", "command": ["mail"]}]})
    found = diff(old, new)
    assert found["mcp.servers.files.command"] == (
        ["python3", "-m", "files"],
        ["python3", "-X", "utf8", "-m", "files"],
        "workers",
    )
    before, after, effect = found["mcp.servers.web"]
    assert before["command"] == ["web"] and after is None and effect == "workers"
    before, after, _ = found["mcp.servers.mail"]
    assert before is None and after["command"] == ["mail"]
    assert set(found) == {"mcp.servers.files.command", "mcp.servers.web", "mcp.servers.mail"}


def test_the_same_entries_in_another_order_are_the_lists_own_change() -> None:
    web = {"name": "web", "command": ["web"]}
    found = diff(data(mcp={"servers": [SERVER, web]}), data(mcp={"servers": [web, SERVER]}))
    assert found == {"mcp.servers": (["files", "web"], ["web", "files"], "workers")}


def test_secrets_are_shown_masked_and_still_compared() -> None:
    old_config = Config.model_validate({"mcp": {"servers": [SERVER]}})
    rotated = copy.deepcopy(SERVER) | {"env": {"TOKEN": "n3w"}}
    new_config = Config.model_validate({"mcp": {"servers": [rotated]}})
    old, new = (c.model_dump(mode="json", by_alias=True) for c in (old_config, new_config))
    found = rules.changes(old, new, masked_data(old_config), masked_data(new_config))
    assert [(c.key, c.before, c.after) for c in found] == [
        ("mcp.servers.files.env.TOKEN", "***", "***")
    ]
    assert "n3w" not in repr(found) and "s3cret" not in repr(found)


def test_the_environments_of_task_kinds_are_secrets_too() -> None:
    old_config = Config.model_validate({"tasks": {"kinds": [KIND | {"env": {"K": "s3cret"}}]}})
    new_config = Config.model_validate({"tasks": {"kinds": [KIND | {"env": {"K": "n3w"}}]}})
    shown = masked_data(new_config)
    assert shown["tasks"]["kinds"][0]["env"] == {"K": "***"}
    old, new = (c.model_dump(mode="json", by_alias=True) for c in (old_config, new_config))
    found = rules.changes(old, new, masked_data(old_config), masked_data(new_config))
    assert [(c.key, c.before, c.after) for c in found] == [
        ("tasks.kinds.build.env.K", "***", "***")
    ]
    added = rules.changes(data(), new, masked_data(Config()), shown)
    assert [c.key for c in added] == ["tasks.kinds.build"] and "n3w" not in repr(added)


def test_a_delivery_target_added_replaces_the_workers_a_new_url_does_not() -> None:
    added = diff(data(), data(delivery={"targets": [TARGET]}))
    assert added["delivery.targets.hook"][2] == "workers"  # its secret leaves their environment
    moved = TARGET | {"url": "http://127.0.0.1:10/in", "events": ["answer"]}
    found = diff(data(delivery={"targets": [TARGET]}), data(delivery={"targets": [moved]}))
    assert {key: effect for key, (_, _, effect) in found.items()} == {
        "delivery.targets.hook.url": "live",
        "delivery.targets.hook.events": "live",
    }
    secret = TARGET | {"secret_env": "OTHER_SECRET"}
    found = diff(data(delivery={"targets": [TARGET]}), data(delivery={"targets": [secret]}))
    assert found["delivery.targets.hook.secret_env"][2] == "workers"


def test_what_needs_a_restart_stays_as_it_was_in_force() -> None:
    old = data(http={"listen": "127.0.0.1:8765"}, pool={"workers": 2})
    new = data(http={"listen": "127.0.0.1:9999", "max_body": 10}, pool={"workers": 3})
    in_force = rules.in_force(old, new)
    assert in_force["http"] == old["http"]
    assert in_force["pool"]["workers"] == 3
    assert Config.model_validate(in_force).pool.workers == 3
    assert rules.in_force(old, old) == old


# Keys and a value each can take; a reload may change any subset of them.
EDITS: list[tuple[tuple[str, str], Any]] = [
    (("pool", "workers"), 5),
    (("pool", "spare"), 0),
    (("http", "listen"), "unix:/run/tk.sock"),
    (("daemon", "state_dir"), "/srv/tk"),
    (("store", "synchronous"), "normal"),
    (("lease", "stale_after"), 90.0),
    (("log", "level"), "DEBUG"),
    (("recovery", "max_per_pass"), 3),
    (("shutdown", "kill_grace"), 1.0),
    (("agent", "allowed"), ["tests.agents:ChaosAgent"]),
]


@given(st.sets(st.sampled_from(range(len(EDITS)))))
def test_in_force_takes_every_change_but_those_that_need_a_restart(chosen: set[int]) -> None:
    old = data()
    new = copy.deepcopy(old)
    for index in chosen:
        (section, key), value = EDITS[index]
        new[section][key] = value
    found = {c.key: c for c in rules.changes(old, new)}
    assert set(found) == {".".join(EDITS[i][0]) for i in chosen}
    in_force = rules.in_force(old, new)
    for (section, key), _ in EDITS:
        change = found.get(f"{section}.{key}")
        expected = old if change is None or change.effect == "restart" else new
        assert in_force[section][key] == expected[section][key]
    Config.model_validate(in_force)  # still a configuration


def test_what_the_command_line_prints_of_a_result() -> None:
    result = ReloadResult(
        ok=True,
        error=None,
        version_before="95311db4df12",
        version="1a2b3c4d5e6f",
        loaded_at=1.0,
        changes=[
            rules.Change("pool.workers", 2, 3, "live"),
            rules.Change("mcp.servers.files", None, {"name": "files"}, "workers"),
            rules.Change("http.listen", "127.0.0.1:1", "127.0.0.1:2", "restart"),
        ],
        needs_restart=["http.listen"],
        workers_replaced=True,
    )
    assert result_lines(result.as_dict()) == [
        "pool.workers: 2 -> 3",
        'mcp.servers.files: (none) -> {"name": "files"}',
        "needs a restart: http.listen (left as it was)",
        "configuration 95311db4df12 -> 1a2b3c4d5e6f",
        "workers replaced",
    ]
    unchanged = ReloadResult(True, None, "95311db4df12", "95311db4df12", 1.0).as_dict()
    assert result_lines(unchanged, waited=False)[-2:] == [
        "configuration 95311db4df12 unchanged",
        "workers kept",
    ]
    stopped = ReloadResult(True, None, "95311db4df12", "1a2b3c4d5e6f", 1.0)
    stopped.incomplete = "worker w0.2, replacing w0.1, died before it was ready: ..."
    assert result_lines(stopped.as_dict())[-1] == f"not done: {stopped.incomplete}"
    assert shown("INFO") == '"INFO"' and shown([0.0, 5.0]) == "[0.0, 5.0]"
