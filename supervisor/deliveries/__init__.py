"""Deliveries: one feature, one package (see docs/architecture.md).

`rules` is pure (the standard library only); `service` is the daemon's running part;
`routes` its HTTP API; `cli` its commands. Its tables are the store's
(`supervisor.store`): one schema, one migration path, shared with the workers.
"""
