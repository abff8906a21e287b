"""The pure core: decisions as data, no I/O.

Modules here import the standard library only: no other part of turnkeeper, no logging,
no clock of their own (time is passed in). The daemon looks facts up, asks these rules,
and carries out what they return; tests drive them directly, with tables and Hypothesis.
"""
