"""The worker process: runs agent turns and talks to MCP tool servers."""
