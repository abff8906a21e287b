"""The worker pool: worker processes and the control plane (`pool.py`), who owns which
session (`ownership.py`), and recovery carried out (`recoverer.py`).
"""
