"""Small MCP servers for the tests, written with the official SDK.

Each runs over stdio as `python -m tests.mcp_servers.NAME` (from the repository root).
"""
