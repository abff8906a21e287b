"""What `turnkeeper run` checks before it starts anything, shared with `turnkeeper doctor`.

Each check judges one configuration key the way the process that uses it would: the agent
classes (`agent.class` and each of `agent.allowed`) are imported by the worker's own loader,
in a child process, since an agent module is user code and whatever its import does (exit,
crash, hang) it must do there; the model is built as a worker builds it; each MCP server's
command is resolved on the PATH the worker would give it, never started; the tokens file
is read as the HTTP API reads it. `run` stops at the first verdict that is not ok with a
configuration error (exit 78) whose one line is the verdict's `detail`, which starts with
the key (a tokens file `supervisor.trust` refuses is described as the daemon's other files
are); `doctor` shows every verdict as a finding.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
from collections.abc import Generator, Mapping
from dataclasses import dataclass
from pathlib import Path

from supervisor import trust
from supervisor.agent_probe import Probe, load_agents
from supervisor.contract.config import Config, McpServer, parse_listen, resolve_paths
from supervisor.contract.delivery_targets import DeliveryTarget
from supervisor.contract.mcp_env import child_environment
from supervisor.contract.paths import inside, task_work_dir
from supervisor.contract.task_kinds import TaskKind


@dataclass(frozen=True)
class Verdict:
    """One key judged: ok or not, one line that starts with the key, and how to fix it.

    `untrusted` marks a file `supervisor.trust` refuses: that line is the file's problem
    and fix, word for word as the daemon's other files' (doctor reports it under `files`).
    """

    key: str
    ok: bool
    detail: str
    fix: str = ""
    untrusted: bool = False


def verdicts(
    config: Config, user: int | None = None, environ: Mapping[str, str] | None = None
) -> Generator[Verdict, None, None]:
    """Every check `run` makes of the configuration, the cheap ones first.

    `user` is whose files the daemon trusts (default: this process's user); `environ` the
    environment the daemon, its workers and their MCP servers start from (default: ours).
    """
    environ = os.environ if environ is None else environ
    keys = agent_keys(config)
    probe = Probe(list(keys), environ)  # loads the agents while the checks below run
    try:
        yield model_verdict(config, environ)
        for server in config.mcp.servers:
            yield from mcp_verdicts(server, environ)
        yield event_size_verdict(config)
        yield from work_dir_verdicts(config, environ)
        for kind in config.tasks.kinds:
            yield from task_verdicts(kind, environ)
        for target in config.delivery.targets:
            yield target_verdict(target, environ)
        if config.auth.tokens_file:
            who = trust.effective_user() if user is None else user
            yield tokens_verdict(Path(config.auth.tokens_file), who)
        yield from agent_verdicts(keys, load_agents(probe, environ))
    finally:
        probe.stop()  # `run` stops at the first problem: the child goes too


def model_verdict(config: Config, environ: Mapping[str, str]) -> Verdict:
    """The `[model]` settings, built into a model as each worker builds it."""
    from workers.models import ModelError, make_model

    try:
        make_model(config.model, environ)
    except ModelError as exc:
        message = str(exc)
        named = re.match(r"model\.\w+", message)
        detail, _, fix = message.partition("; ")
        key = named[0] if named else "model"
        return Verdict(key, False, detail if named else f"model: {detail}", fix)
    return Verdict("model", True, f"model: provider {config.model.provider}")


def mcp_verdicts(server: McpServer, environ: Mapping[str, str]) -> Generator[Verdict, None, None]:
    """An MCP server's working directory and command, as its worker would start it."""
    key = f"mcp.servers.{server.name}"
    if server.cwd and not Path(server.cwd).is_dir():
        yield Verdict(
            f"{key}.cwd",
            False,
            f"{key}.cwd: {server.cwd} is not a directory",
            "create it, or correct the path",
        )
        return
    env = child_environment(server.env, environ)
    found, problem = resolve_command(server.command[0], env, server.cwd)
    if problem:
        fix = (
            f"chmod +x {found}"
            if problem.endswith("is not executable")
            else "install it, or give its absolute path"
        )
        yield Verdict(f"{key}.command", False, f"{key}.command: {problem}", fix)
    else:
        yield Verdict(f"{key}.command", True, f"{key}.command: {found}")


def event_size_verdict(config: Config) -> Verdict:
    """`store.max_event_bytes` holds what the other limits admit: a message of
    `http.max_body`, a model answer of `model.max_response_bytes`, a tool result of
    `tools.max_result_bytes`."""
    limit = config.store.max_event_bytes
    for key, value in (
        ("http.max_body", config.http.max_body),
        ("model.max_response_bytes", config.model.max_response_bytes),
        ("tools.max_result_bytes", config.tools.max_result_bytes),
    ):
        if limit <= value:
            return Verdict(
                "store.max_event_bytes",
                False,
                f"store.max_event_bytes: {limit} is not above {key} ({value}): what it admits "
                "could not be stored",
                f"raise store.max_event_bytes above {value}, or lower {key}",
            )
    return Verdict("store.max_event_bytes", True, f"store.max_event_bytes: {limit}")


def work_dir_verdicts(config: Config, environ: Mapping[str, str]) -> Generator[Verdict, None, None]:
    """Tasks run outside the state directory: `tasks.work_dir` and every kind's `cwd` are
    neither the state directory nor inside it (a command there would be `../` away from
    `admin.token` and the database)."""
    state_dir = resolve_paths(config, environ).state_dir
    work_dir = task_work_dir(config.tasks.work_dir, state_dir, environ)
    fix = "choose a directory outside the state directory"
    if inside(work_dir, state_dir):
        yield Verdict(
            "tasks.work_dir",
            False,
            f"tasks.work_dir: {work_dir} is inside the state directory {state_dir}",
            fix,
        )
        return
    for kind in config.tasks.kinds:
        if kind.cwd and inside(Path(kind.cwd), state_dir):
            key = f"tasks.kinds.{kind.name}.cwd"
            detail = f"{key}: {kind.cwd} is inside the state directory {state_dir}"
            yield Verdict(key, False, detail, fix)
            return
    if config.tasks.kinds:
        yield Verdict("tasks.work_dir", True, f"tasks.work_dir: {work_dir}")


def task_verdicts(kind: TaskKind, environ: Mapping[str, str]) -> Generator[Verdict, None, None]:
    """A task kind's working directory and program, as its runner would start it (a
    program named by a placeholder is only known at the start of a task)."""
    key = f"tasks.kinds.{kind.name}"
    if kind.cwd and not Path(kind.cwd).is_dir():
        yield Verdict(f"{key}.cwd", False, f"{key}.cwd: {kind.cwd} is not a directory", "create it")
        return
    program = kind.command[0]
    if "{" in program:
        return
    found, problem = resolve_command(program, child_environment(kind.env, environ), kind.cwd)
    if problem:
        problem = problem.replace("the server gets", "the task gets")
        fix = "chmod +x it" if problem.endswith("is not executable") else "install it"
        yield Verdict(f"{key}.command", False, f"{key}.command: {problem}", fix)
    else:
        yield Verdict(f"{key}.command", True, f"{key}.command: {found}")


def target_verdict(target: DeliveryTarget, environ: Mapping[str, str]) -> Verdict:
    """A delivery target's secret: its variable is set, and not empty (its value is never
    shown)."""
    key = f"delivery.targets.{target.name}.secret_env"
    if not environ.get(target.secret_env):
        problem = "is not set" if target.secret_env not in environ else "is empty"
        return Verdict(
            key,
            False,
            f"{key}: the variable {target.secret_env} {problem} (the HMAC key of {target.url})",
            f"set {target.secret_env} in the daemon's environment (the unit's EnvironmentFile)",
        )
    return Verdict(key, True, f"{key}: {target.secret_env} is set")


def resolve_command(program: str, env: Mapping[str, str], cwd: str) -> tuple[str, str]:
    """(the file the worker would execute, "") or (the file if any, why it cannot be run).

    As `subprocess` does: a name with a slash is a path (relative to the server's `cwd`),
    a bare name is looked up on the child environment's PATH (the system default if unset).
    """
    if "/" not in program:
        path = env.get("PATH", os.defpath)
        found = shutil.which(program, path=path)
        if found is None:
            return "", f"{program!r} is not found on the PATH the server gets ({path})"
        return found, ""
    file = Path(cwd or ".", program)
    if not file.exists():
        return "", f"{file} does not exist"
    if file.is_dir():
        return str(file), f"{file} is a directory"
    if not os.access(file, os.X_OK):
        return str(file), f"{file} is not executable"
    return str(file), ""


def tokens_verdict(path: Path, user: int) -> Verdict:
    """The tokens file, judged and read as the HTTP API reads it at start."""
    from supervisor.http.auth import TokensFileError, read_tokens_file

    key = "auth.tokens_file"
    try:
        principals = read_tokens_file(path, user)
    except trust.Untrusted as exc:
        return Verdict(key, False, str(exc), exc.problem.fix, untrusted=True)
    except TokensFileError as exc:
        fix = "fix or remove the line" if " line " in str(exc) else "correct auth.tokens_file"
        return Verdict(key, False, str(exc), fix)
    return Verdict(key, True, f"{key}: {path}: {len(principals)} principals")


def agent_keys(config: Config) -> dict[str, str]:
    """Each agent class a worker may load -> the key that names it."""
    keys = {config.agent.class_: "agent.class"}
    for index, spec in enumerate(config.agent.allowed):
        keys.setdefault(spec, f"agent.allowed[{index}]")
    return keys


def agent_verdicts(keys: dict[str, str], errors: dict[str, str]) -> list[Verdict]:
    """The verdicts on the agent classes `keys` names, from what loading them found."""
    found = []
    for spec, key in keys.items():
        error = errors[spec]
        if not error:
            found.append(Verdict(key, True, f"{key} {spec!r}: loads in a child process"))
            continue
        fix = (
            "install the package that provides it in the daemon's Python, or correct the name"
            if error.startswith("cannot import")
            else "name a class with an async run_turn(turn) whose module imports cleanly"
        )
        found.append(Verdict(key, False, f"{key} {spec!r}: {error}", fix))
    return found


def listen_verdict(listen: str, daemon_pid: int | None) -> Verdict:
    """Whether `http.listen` can be bound now, as the daemon binds it at start."""
    key = "http.listen"
    if daemon_pid is not None:
        return Verdict(key, True, f"{key} {listen}: the running daemon (pid {daemon_pid}) has it")
    where = parse_listen(listen)
    try:
        if isinstance(where, Path):
            _bind_unix(where)
        else:
            _bind_tcp(*where)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        return Verdict(
            key,
            False,
            f"{key} {listen}: {reason}",
            "stop what listens there, or choose another address",
        )
    return Verdict(key, True, f"{key} {listen}: free")


def _bind_tcp(host: str, port: int) -> None:
    """Bind every address `host` resolves to, as asyncio's create_server does; raises OSError."""
    for family, kind, proto, _, address in socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    ):
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(address)


def _bind_unix(path: Path) -> None:
    """The socket's directory must take a socket; an old socket file is replaced at start."""
    if not path.parent.is_dir():
        raise OSError(0, f"{path.parent} is not a directory")
    if not os.access(path.parent, os.W_OK | os.X_OK):
        raise OSError(0, f"{path.parent} is not writable")
