"""An agent module whose import has a side effect: it creates the file named by
$TURNKEEPER_TEST_IMPORT_MARKER. Used to show that a session cannot make a worker import it.
"""

import os
from pathlib import Path

from workers.agents.tool_loop import ToolLoopAgent

if os.environ.get("TURNKEEPER_TEST_IMPORT_MARKER"):
    Path(os.environ["TURNKEEPER_TEST_IMPORT_MARKER"]).touch()

Agent = ToolLoopAgent
