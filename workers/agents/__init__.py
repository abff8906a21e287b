"""Agents that ship with turnkeeper."""
