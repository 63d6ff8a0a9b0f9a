"""Closing federated rounds, whatever their kind (ARCHITECTURE.md §6); each kind's open, validate
and aggregate live in its round kind (:mod:`trainer.server.round_kinds`).

A round closes when ``quorum`` clients have uploaded or at its deadline, whichever comes first:
:func:`close_round` claims it (:meth:`Store.claim_close`: one closer at a time, with a snapshot of
the updates it may count) and hands it to its kind's ``close``, which aggregates, stores the
aggregate and publishes through the ``publisher`` the server was handed.

- A round where no update arrived closes as a **no-op** (no aggregate, no bundle).
- A crash while closing leaves the round ``closing``; the server finishes it on restart with the same
  snapshot of updates, so the outcome does not depend on the crash.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections.abc import Collection

from trainer.server import round_kinds
from trainer.server.round_kind import Publisher, RoundOutcome
from trainer.server.store import Store


#: Failed close attempts after which a round is closed as "failed" (its updates stay stored), and
#: the first wait before retrying (doubled after each failure): 30 s, 60 s, then failed.
MAX_CLOSE_ATTEMPTS = 3
CLOSE_RETRY_S = 30.0


def close_round(store: Store, round_id: int, progress=lambda msg: None, owner: str | None = None,
                force: bool = False, publisher: Publisher | None = None) -> RoundOutcome | None:
    """Close ``round_id``: aggregate, store the aggregate, publish (through ``publisher``, when the
    round was opened to publish; without one the outcome says publishing was skipped). Returns the
    outcome, or None if the round is closed already or another closer holds it (see
    :meth:`Store.claim_close`). A close that raises gives its claim up first
    (:meth:`Store.release_close`), so the next closer takes the round over at once.

    The outcome is a :class:`~trainer.server.round_kind.RoundOutcome` (stored with the round as JSON).
    """
    owner = owner or f"closer-{os.getpid()}-{secrets.token_hex(4)}"
    snapshot = store.claim_close(round_id, owner, force=force)
    if snapshot is None:
        return None
    try:
        r = store.get_round(round_id)
        return round_kinds.get(r.kind).close(store, r, snapshot, owner, progress, publisher)
    except BaseException:
        # A closer that failed (or was interrupted) holds nothing: the next one, e.g. a rerun of
        # `fedroute rounds close` once the cause is fixed, takes the round over at once with the
        # same snapshot, rather than after the lease (10 minutes).
        try:
            store.release_close(round_id, owner)
        except Exception:  # noqa: BLE001 - the close's own error is the one to report
            logging.getLogger("fedroute.server").exception("releasing the close of round %s failed", round_id)
        raise


def close_due_rounds(store: Store, now: float | None = None, progress=lambda msg: None,
                     owner: str | None = None, takeover: Collection[int] = (),
                     publisher: Publisher | None = None) -> list[tuple[int, RoundOutcome]]:
    """Close every round that is due (deadline passed, quorum reached, or left closing), as ``owner``;
    rounds in ``takeover`` (left closing by a crashed server) are taken over even if their lease
    has not run out. A close that raises is retried after ``CLOSE_RETRY_S * 2**(failures - 1)``
    seconds; after :data:`MAX_CLOSE_ATTEMPTS` failures the round is closed as ``"failed"`` (with the error; its
    updates stay stored) so a new round can open."""
    done = []
    now = time.time() if now is None else now
    for rid in store.rounds_to_close(now):
        failures, last_failure = store.close_failures(rid)
        if failures and now < last_failure + CLOSE_RETRY_S * 2 ** (failures - 1):
            continue  # back off: a transient error (a locked database, a full disk) gets time to clear
        try:
            outcome = close_round(store, rid, progress, owner=owner, force=rid in takeover, publisher=publisher)
        except Exception as exc:
            failures = store.record_close_failure(rid, now)
            logging.getLogger("fedroute.server").exception("closing round %s failed (attempt %s)", rid, failures)
            if failures < MAX_CLOSE_ATTEMPTS or owner is None:
                continue
            outcome = RoundOutcome("failed", error=f"{type(exc).__name__}: {exc}"[:500])
            if not store.finish_close(rid, outcome, None, [], [], owner):
                continue
        if outcome is not None:
            done.append((rid, outcome))
    return done
