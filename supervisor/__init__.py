"""turnkeeper's supervisor: the parent process of the daemon and its command line.

`supervisor.store` holds the contracts both processes share (schema and event log); the
worker process lives in the `workers` package.
"""

__version__ = "0.1.0"
