"""An agent plug-in that imports in the supervisor but not in a worker: a broken install."""

import multiprocess

from workers.agents.tool_loop import ToolLoopAgent

if multiprocess.current_process().name.startswith("turnkeeper-w"):
    raise ImportError("this plug-in is broken inside worker processes")

BrokenAgent = ToolLoopAgent
