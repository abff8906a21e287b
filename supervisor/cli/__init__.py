"""The `turnkeeper` command line: the group and its shared helpers (`common.py`), the
commands that talk to the daemon (`daemon_commands.py`, over `client.py`), those that work
on the database directly (`store_commands.py`), and `doctor`.
"""
