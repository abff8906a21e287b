"""The daemon's frame, which knows no feature: the service protocol (`service`), the
reconcile loop every service runs (`loops`), the in-process event bus (`bus`) and the
lifecycle of a tree of services (`root`). `supervisor.composition` builds turnkeeper's
tree with it; docs/architecture.md draws it.
"""
