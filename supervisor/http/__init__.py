"""The HTTP API: the aiohttp application, its listener's limits, attach streams, tokens,
the OpenAPI document and the Prometheus metrics. It never imports the pool's internals:
what it needs of the pool is the narrow `PoolView` protocol in `app.py`.
"""
