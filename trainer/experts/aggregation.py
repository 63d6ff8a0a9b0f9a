"""Per-component aggregation of FedPrism (paper 000, Sec. 3.3; ARCHITECTURE.md §7).

Each client trains only the experts it retrieved and reports, per expert ``k`` it updated, the new
parameters and the number of samples it used. The server averages each expert over the clients that
updated *it*, weighted by those sample counts; an expert nobody updated keeps its parameters:

    theta_k <- sum_{i in U_k} n_ik theta_ik / sum_{i in U_k} n_ik   if U_k is non-empty, else theta_k.

An update with ``n_ik = 0`` (a client that sent expert k back without using any sample for it) has
weight 0 in that formula, so it is left out; an expert whose every update has count 0 keeps its
parameters (no 0/0).

Pure functions in the style of Flower's strategies (no I/O, clock or sampling): a reply is checked by
:func:`validate_component_update`, then merged by :func:`aggregate_components` (per-expert
:func:`trainer.routers.fedavg.fedavg`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from sdk.errors import InvalidInputError, ShapeError
from trainer.routers.fedavg import Parameters, fedavg, validate_updates

#: One client's reply: expert index -> (parameters, n_samples used for that expert).
ComponentUpdate = Mapping[int, tuple[Parameters, float]]


def validate_component_update(current: Sequence[Parameters], update: ComponentUpdate, who: str = "client") -> None:
    """Check one client's reply against the current experts (the Flower strategy runs it per reply,
    to drop a bad one instead of the round). Pure.

    Parameters
    ----------
    current : sequence of n_experts parameter dicts, the global experts before the round.
    update : {expert index: (parameters, n_samples)}, one client's reply.
    who : how the messages name the client.

    Raises
    ------
    InvalidInputError
        ``update`` is not a mapping, an expert index outside ``[0, n_experts)``, or a count that is
        negative or not finite.
    ShapeError
        An expert's names or shapes differ from the current expert's (an empty array included), or
        it holds NaN/inf (zero-count experts too).
    """
    n = len(current)
    if not isinstance(update, Mapping):
        raise InvalidInputError(f"{who}: update must be a mapping expert index -> (parameters, n_samples), "
                                f"got {type(update).__name__}")
    for k, (params, count) in update.items():
        if isinstance(k, bool) or not (isinstance(k, (int, np.integer)) and 0 <= k < n):
            raise InvalidInputError(f"{who}: expert index {k!r} outside [0, {n})")
        if not (np.isfinite(count) and count >= 0):
            raise InvalidInputError(f"{who}, expert {k}: sample count must be finite and >= 0, got {count!r}")
        try:
            validate_updates([(current[k], 1.0), (params, 1.0)])
        except ShapeError as exc:  # its message names "update 1" (this one) and "update 0" (the current expert)
            detail = str(exc).removeprefix("update 1: ").replace("update 0", "the current expert")
            raise ShapeError(f"{who}, expert {k}: {detail}") from exc


def aggregate_components(
    current: Sequence[Parameters], updates: Sequence[ComponentUpdate]
) -> list[dict[str, np.ndarray]]:
    """Average each expert over the clients that updated it, weighted by their sample counts.

    Parameters
    ----------
    current : sequence of n_experts parameter dicts, the global experts before the round.
    updates : sequence over clients of {expert index: (parameters, n_samples)}, each passed by
        :func:`validate_component_update` (or made by our own local step).

    Returns
    -------
    list of n_experts dicts name -> ndarray float32; experts without updates are copies of ``current``.
    """
    n = len(current)
    per: list[list[tuple[Parameters, float]]] = [[] for _ in range(n)]
    for upd in updates:
        for k, (params, count) in upd.items():
            per[k].append((params, float(count)))
    out = []
    for k in range(n):
        used = [(p, w) for p, w in per[k] if w > 0]  # weight 0 in the paper's mean: left out, so no 0/0
        if not used:
            out.append({name: np.array(v, dtype=np.float32, copy=True) for name, v in current[k].items()})
            continue
        mean = fedavg(used)
        out.append({name: v.astype(np.float32) for name, v in mean.items()})
    return out
