"""An agent module that SIGKILLs the process importing it, when that is a worker: a plug-in
whose import takes its worker down every time (a native crash, an OOM kill at import).
"""

import os
import signal

import multiprocess

from workers.agents.tool_loop import ToolLoopAgent

if multiprocess.current_process().name.startswith("turnkeeper-w"):
    os.kill(os.getpid(), signal.SIGKILL)

Agent = ToolLoopAgent
