"""The workers' side of the supervisor: three services, the worker processes and their
slots (`pool.py`), the control plane they talk to (`plane.py`) and who owns which session
(`ownership.py`); recovery carried out (`recoverer.py`), and this daemon among the others
on the database (`membership.py`, `signals.py`).
"""
