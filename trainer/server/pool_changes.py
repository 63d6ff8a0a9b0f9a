"""Federated K-means rounds over a changed model pool (``fedroute add-model``; ARCHITECTURE.md §4
"Model pool changes"): the explicit migration of stored uploads.

Design notes: docs/sync-protocol-and-operations.md (Module notes).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from sdk.cell_statistics import CellStatistics
from sdk.protocol import KMeansUpdate
from trainer.server.store import Store

__all__ = ["align_to_pool", "widen_update"]


def widen_update(update: KMeansUpdate, models: Sequence[str], pool: Sequence[str]) -> KMeansUpdate:
    """``update`` (statistics columns in ``models`` order) with its columns placed in ``pool`` order,
    zeros for the models of ``pool`` it lacks; cell means, weights and ``log_size`` unchanged.

    Raises
    ------
    ValueError
        ``models`` names a model that ``pool`` lacks, or its length is not the statistics' width.
    """
    models, pool = list(models), list(pool)
    s = update.statistics
    if len(models) != s.n_models:
        raise ValueError(f"{len(models)} model ids for statistics of {s.n_models} columns")
    missing = [m for m in models if m not in pool]
    if missing:
        raise ValueError(f"models {missing} are not in the pool {pool}")
    where = np.array([pool.index(m) for m in models], dtype=np.int64)
    arrays = []
    for a in (s.count, s.sum_accuracy, s.sum_cost):
        wide = np.zeros((s.n_cells, len(pool)))
        wide[:, where] = a
        arrays.append(wide)
    return dataclasses.replace(update, statistics=CellStatistics(*arrays))


def align_to_pool(store: Store, latest: dict[str, tuple[int, KMeansUpdate]], pool: Sequence[str]
                  ) -> tuple[dict[str, tuple[int, KMeansUpdate]], list[str]]:
    """The clients' latest uploads (``Store.latest_updates``) migrated to ``pool`` (see the design notes).

    Returns
    -------
    (aligned, not_merged) : the uploads to merge, each in ``pool`` column order; the client ids whose
    latest upload names a model ``pool`` lacks (kept in the store, not merged).
    """
    pool = tuple(pool)
    if not latest:
        return latest, []
    sent = {uid: sent_round for uid, _, sent_round, _ in store.update_payloads(sorted(i for i, _ in latest.values()))}
    pools: dict[int, tuple[str, ...]] = {}
    aligned, not_merged = {}, []
    for client, (uid, update) in latest.items():
        round_id = sent.get(uid)
        models = pool if round_id is None else pools.setdefault(round_id, tuple(store.get_round(round_id).models))
        if models == pool:
            aligned[client] = (uid, update)
        elif set(models) <= set(pool):
            aligned[client] = (uid, widen_update(update, models, pool))
        else:
            not_merged.append(client)
    return aligned, sorted(not_merged)
