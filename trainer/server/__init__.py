"""The federated aggregation server (ARCHITECTURE.md §6): FastAPI over uvicorn with TLS, a
SQLAlchemy store (SQLite WAL by default), round open/close with aggregation, bundle publishing
through a publisher handed in from the top (``export.publish``; the server never imports export).

Modules: :mod:`.store` (durable state), :mod:`.validation` (upload checks), :mod:`.round_kind` (what
a round kind supplies), :mod:`.round_kinds` (the registry), :mod:`.kmeans_rounds` and
:mod:`.mlp_rounds` (the two kinds), :mod:`.rounds` (closing due rounds), :mod:`.errors`,
:mod:`.app` (HTTP API), :mod:`.upload_state` (the upload path's caches and quota),
:mod:`.group_commit` (the writer thread), :mod:`.cli` (``fedroute serve``, ``clients``, ``rounds``, ``publish``).
"""
