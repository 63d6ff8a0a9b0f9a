"""Client partition and sparse logging of the federated simulation protocol (METRICS.md).

- :func:`dirichlet_partition`: for each task, the share of its queries that goes to each of the N
  clients is drawn from ``Dir(alpha * 1_N)``; every query goes to exactly one client.
- :func:`sparse_logging`: client i draws a model-preference vector ``pi_i ~ Dir(0.5 * 1_M)``; each of
  its queries is logged with exactly one model ``m ~ pi_i`` (restricted to the models labelled for
  that query, renormalised), revealing only ``acc(x, m)`` and ``cost(x, m)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sdk.errors import InvalidInputError


@dataclass(frozen=True)
class Partition:
    """Assignment of queries to clients.

    Attributes
    ----------
    client : ndarray of shape (n_queries,), int64, client of each query in ``[0, n_clients)``.
    shares : dict task -> ndarray of shape (n_clients,), float64, the Dirichlet draw per task.
    n_clients : int
    """

    client: np.ndarray
    shares: dict[str, np.ndarray]
    n_clients: int

    def indices(self, i: int) -> np.ndarray:
        """Query indices of client ``i``, shape (n_i,), int64, ascending."""
        return np.flatnonzero(self.client == i)


def dirichlet_partition(
    tasks: np.ndarray, n_clients: int, alpha: float, rng: np.random.Generator
) -> Partition:
    """Split queries among clients with a Dirichlet(alpha) share per task.

    For each task the queries are shuffled and cut at the cumulative shares (rounded down), so each
    client's count differs from ``share * n_task`` by less than one query.

    Parameters
    ----------
    tasks : ndarray of shape (n_queries,), task label of each query.
    n_clients : int >= 1.
    alpha : float > 0, Dirichlet concentration (small = heterogeneous).
    rng : numpy Generator (all randomness comes from it).

    Inputs validated by the caller (``SimulationConfig``, ``OnlineConfig``).
    """
    tasks = np.asarray(tasks)
    client = np.full(tasks.shape[0], -1, dtype=np.int64)
    shares: dict[str, np.ndarray] = {}
    for task in sorted(set(tasks.tolist())):
        idx = rng.permutation(np.flatnonzero(tasks == task))
        p = rng.dirichlet(np.full(n_clients, float(alpha)))
        cuts = np.floor(np.cumsum(p)[:-1] * idx.shape[0]).astype(np.int64)
        for i, part in enumerate(np.split(idx, cuts)):
            client[part] = i
        shares[str(task)] = p
    return Partition(client=client, shares=shares, n_clients=int(n_clients))


@dataclass(frozen=True)
class SparseLog:
    """Which single model each query was logged with, and what that revealed.

    Attributes
    ----------
    model : ndarray of shape (n_queries,), int64, the one logged model of each query.
    accuracy : ndarray of shape (n_queries,), float64 in [0, 1], ``acc(x, model)``.
    cost : ndarray of shape (n_queries,), float64, USD, ``cost(x, model)``.
    preference : ndarray of shape (n_clients, n_models), float64, each client's ``pi_i``.
    """

    model: np.ndarray
    accuracy: np.ndarray
    cost: np.ndarray
    preference: np.ndarray


def sparse_logging(
    accuracy: np.ndarray,
    cost: np.ndarray,
    client: np.ndarray,
    n_clients: int,
    rng: np.random.Generator,
    concentration: float = 0.5,
) -> SparseLog:
    """Reveal exactly one model's outcome per query, drawn from the client's skewed preference.

    Parameters
    ----------
    accuracy : ndarray of shape (n_queries, n_models), float, NaN = not labelled (never drawn).
    cost : ndarray of shape (n_queries, n_models), float, USD.
    client : ndarray of shape (n_queries,), int, client of each query.
    n_clients : int.
    rng : numpy Generator.
    concentration : float > 0, the Dirichlet concentration of ``pi_i`` (METRICS.md: 0.5).

    Raises
    ------
    InvalidInputError
        A query has no labelled model (drop such rows first), or shapes differ.
    """
    accuracy = np.asarray(accuracy, dtype=np.float64)
    cost = np.asarray(cost, dtype=np.float64)
    client = np.asarray(client, dtype=np.int64)
    if accuracy.shape != cost.shape or accuracy.ndim != 2 or client.shape != (accuracy.shape[0],):
        raise InvalidInputError(
            f"expected accuracy/cost (n_queries, n_models) and client (n_queries,), got "
            f"{accuracy.shape}, {cost.shape}, {client.shape}"
        )
    labelled = ~np.isnan(accuracy)
    if not labelled.any(axis=1).all():
        row = int(np.flatnonzero(~labelled.any(axis=1))[0])
        raise InvalidInputError(f"query {row} has no labelled model; drop unlabelled rows before logging")
    n_models = accuracy.shape[1]
    preference = rng.dirichlet(np.full(n_models, float(concentration)), size=n_clients)
    p = preference[client] * labelled
    zero = p.sum(axis=1) == 0  # the client's preference puts ~0 mass on every labelled model
    p[zero] = labelled[zero]
    p /= p.sum(axis=1, keepdims=True)
    u = rng.random(accuracy.shape[0])[:, None]
    model = np.minimum((np.cumsum(p, axis=1) < u).sum(axis=1), n_models - 1)
    # Guard against float round-off landing on an unlabelled trailing model.
    bad = ~labelled[np.arange(model.shape[0]), model]
    if bad.any():
        model[bad] = np.argmax(p[bad], axis=1)
    rows = np.arange(accuracy.shape[0])
    return SparseLog(
        model=model.astype(np.int64),
        accuracy=accuracy[rows, model],
        cost=cost[rows, model],
        preference=preference,
    )
