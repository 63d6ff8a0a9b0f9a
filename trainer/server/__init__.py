"""The federated aggregation server (ARCHITECTURE.md §6): FastAPI over uvicorn with TLS, a
SQLAlchemy store (SQLite WAL by default), round open/close with aggregation, bundle publishing.

Modules: :mod:`.store` (durable state), :mod:`.validation` (upload checks), :mod:`.rounds` (open,
close, aggregate), :mod:`.publish` (new signed bundle from an aggregate), :mod:`.app` (HTTP API),
:mod:`.cli` (``fedroute serve``, ``clients``, ``rounds``, ``publish``).
"""
