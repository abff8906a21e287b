"""What the supervisor and its workers share: control messages, the spawn spec, the
configuration, where files live, logging, and the process tools both sides use.

`workers/` imports from here (and from `supervisor.store` and `supervisor.core`), never
from the parent's runtime (`pool`, `http`, `cli`, the daemon); nothing here imports those.
"""
