"""The `turnkeeper` command line: the group (`main.py`) and its shared helpers
(`common.py`: exit codes, `--json`, colour, tables), the commands that talk to the daemon
(`daemon_commands.py`, over `client.py`), the `sessions` group (`session_commands.py`),
those that work on the database directly (`store_commands.py`: boots, breaker,
autonomous), `config` (`config_commands.py`), `doctor` (`doctor_command.py` over the
checks in `doctor.py`), and the service manager's detection for `stop` (`service.py`).
"""
