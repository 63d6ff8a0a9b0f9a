"""Federated K-means rounds over a changed model pool (``fedroute add-model``; ARCHITECTURE.md §4
"Model pool changes"): the explicit migration of stored uploads.

A K-means round merges each client's *latest* upload for the round's partition (centroids), also
uploads sent to earlier rounds over the same centroids (paper 002). After ``add-model`` the pool of
a new round can be wider than the pool those earlier uploads were made for. Their statistics are
migrated column by column, by model id:

- a model of the round that the upload's round lacked gets a column of zeros: exact, since the
  device counted only the models of the round it uploaded for (:func:`sdk.local_update.kmeans_update`
  skips rows of other models), so it reported no evaluation of that model;
- an upload whose round had a model that this round lacks (a model removed from the pool) is not
  merged: its statistics of that model cannot be dropped without changing what the client agreed to
  send in aggregate. It stays in the store (nothing is lost) and the close says so; the client's next
  upload, for this pool, replaces it.

The device applies the same rule to its record of the last sent update
(:func:`sdk.protocol.decode_sent_record` aligns it by model id), so its privacy hold
(:func:`sdk.local_update.hold_small_changes`) keeps working across the change.
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
    """The clients' latest uploads (``Store.latest_updates``) migrated to ``pool`` (see the module docstring).

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
