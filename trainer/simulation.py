"""The federated simulation protocol of METRICS.md on an evaluation table.

One seed: Dirichlet(alpha) task split of the train queries over N clients, one logged model per
query from each client's skewed preference ``pi_i ~ Dir(0.5)``, then for each router kind the
settings **local** (each client alone), **federated** and **centralised** (all sparse logs pooled)
trained on the *same* sparse logs, plus **federated + personalised** (paper 002 interpolation per
client, errors measured on held-out rows of the client's log, shrunk by the rows behind each
estimate: :mod:`sdk.personalisation`), all evaluated on the shared test split with the METRICS.md curve metrics. Local, federated
and personalised routers are also scored on each client's own task mix (test rows drawn to match
the client's tasks), where personalisation is meant to help.
"""

from __future__ import annotations


from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from sdk.errors import InvalidInputError
from sdk.personalisation import holdout_split, personalisation_weights, personalise
from trainer import kinds, metrics
from trainer.config_fields import check_config, check_int, check_real, check_sequence
from trainer.data.client_data import ClientData
from trainer.data.routerbench import EvalTable
from trainer.federated.partition import dirichlet_partition, sparse_logging
from trainer.routers.base import Router
from trainer.routers.kmeans_router import KMeansRouterConfig
from trainer.routers.mlp_router import MLPRouterConfig

SETTINGS = ("local", "federated", "centralised", "personalised")


@dataclass
class SimulationConfig:
    """Protocol settings (defaults: METRICS.md).

    n_clients : N. alpha : Dirichlet concentration of the task split.
    preference_concentration : Dirichlet concentration of each client's model preference.
    participation : share of clients per round. routers : kinds to train.
    Raises InvalidInputError for a concentration that is not a finite number > 0 or an unknown router kind.
    """

    n_clients: int = 10
    alpha: float = 0.6
    preference_concentration: float = 0.5
    participation: float = 0.6
    routers: tuple[str, ...] = field(default_factory=kinds.in_order)
    mlp: MLPRouterConfig = field(default_factory=MLPRouterConfig)
    kmeans: KMeansRouterConfig = field(default_factory=KMeansRouterConfig)

    def __post_init__(self) -> None:
        # numpy's Dirichlet draws NaN shares for a NaN concentration (a silent wrong split) and fails on inf
        for name in ("alpha", "preference_concentration"):
            check_real(self, name, 0, low_open=True)
        check_config(self, "mlp", MLPRouterConfig)
        check_config(self, "kmeans", KMeansRouterConfig)
        check_sequence(self, "routers")
        check_int(self, "n_clients", 1)
        check_real(self, "participation", 0, 1, low_open=True)
        valid = kinds.in_order()  # registration order: mlp, kmeans (the CLI has always listed them so)
        unknown = set(self.routers) - set(valid)
        if not self.routers:
            raise InvalidInputError(f"no router kind given; valid: {list(valid)}")
        if unknown:
            raise InvalidInputError(f"unknown router kind(s) {sorted(unknown)}; valid: {list(valid)}")
        if len(set(self.routers)) != len(self.routers):  # the second copy retrained on another RNG state, silently
            raise InvalidInputError(f"routers={tuple(self.routers)}: give each kind once")
        self.mlp.participation = self.participation
        self.kmeans.participation = self.participation


CLIENT_VIEW = ("local", "federated", "personalised", "zero", "oracle")


@dataclass
class SeedResult:
    """Metrics of one seed.

    reports[kind][setting] : CurveReports on the shared test split (one per client for
        local/personalised, one otherwise).
    client_reports[kind][setting] : CurveReports on each client's own task mix (one per client), for
        the settings of ``CLIENT_VIEW`` (``zero``/``oracle`` are the references on that client's set).
    federated_routers[kind] : the trained federated router.
    """

    seed: int
    reports: dict[str, dict[str, list[metrics.CurveReport]]]
    client_reports: dict[str, dict[str, list[metrics.CurveReport]]]
    federated_routers: dict[str, Router]
    n_samples_per_client: list[int]


def client_test_indices(
    test_tasks: np.ndarray, client_tasks: np.ndarray, rng: np.random.Generator, size: int = 300
) -> np.ndarray:
    """Test rows drawn to match one client's task mix: about ``size * share_t`` rows of each task t
    (capped by what the test split holds), without replacement.

    Returns
    -------
    ndarray of shape (n_rows,), int64, sorted indices into the test split.
    """
    tasks, counts = np.unique(client_tasks, return_counts=True)
    picks = []
    for task, count in zip(tasks, counts):
        pool = np.flatnonzero(test_tasks == task)
        n = min(int(round(size * count / counts.sum())), pool.shape[0])
        picks.append(rng.choice(pool, size=n, replace=False))
    return np.sort(np.concatenate(picks)).astype(np.int64)


def simulate_clients(
    train: EvalTable, train_embeddings: np.ndarray, config: SimulationConfig, rng: np.random.Generator
) -> tuple[list[ClientData], list[np.ndarray]]:
    """Partition the train table over clients and reveal one model per query (METRICS.md).

    Rows with no labelled model are dropped first (they cannot be logged).

    Returns
    -------
    (clients, tasks) : each client's log, and the task label of each of its queries (for the
    client-distribution evaluation only; routers never see it)."""
    keep = train.labelled().any(axis=1)
    acc, cost, emb, tasks = train.accuracy[keep], train.cost[keep], train_embeddings[keep], train.tasks[keep]
    part = dirichlet_partition(tasks, config.n_clients, config.alpha, rng)
    log = sparse_logging(acc, cost, part.client, config.n_clients, rng, config.preference_concentration)
    clients, client_tasks = [], []
    for i in range(config.n_clients):
        idx = part.indices(i)
        clients.append(ClientData(emb[idx], log.model[idx], log.accuracy[idx], log.cost[idx]))
        client_tasks.append(tasks[idx])
    return clients, client_tasks


def _personalised_predictions(
    global_router: Router,
    trainer_kind,
    data: ClientData,
    models: Sequence[str],
    config: SimulationConfig,
    rng: np.random.Generator,
    global_test: tuple[np.ndarray, np.ndarray],
    test_embeddings: np.ndarray,
    n_global: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Personalised test predictions ``(accuracy, cost)`` (:mod:`sdk.personalisation`): the local
    estimator fitted on 80% of the client's log (:func:`sdk.personalisation.holdout_split`), both
    errors measured on the other 20%, weights shrunk by the rows behind each estimate (``n_global``:
    (n_models,) rows of each model over every client's log)."""
    fit_rows, held_rows = holdout_split(data.model, rng)
    local = trainer_kind.fit_local(data.subset(fit_rows), models, config, rng)
    held = data.embeddings[held_rows]
    weights = personalisation_weights(
        global_router.predict(held), local.predict(held), data.model[held_rows], data.accuracy[held_rows],
        data.cost[held_rows], np.bincount(data.model[fit_rows], minlength=len(models)), n_global,
    )
    local_test = local.predict(test_embeddings)
    return (personalise(global_test[0], local_test[0], weights.accuracy),
            personalise(global_test[1], local_test[1], weights.cost))


def run_seed(
    train: EvalTable,
    train_embeddings: np.ndarray,
    test: EvalTable,
    test_embeddings: np.ndarray,
    config: SimulationConfig,
    seed: int,
    progress: Callable[[str], None] | None = None,
    show_rounds: bool = False,
) -> SeedResult:
    """One seed of the protocol; ``test`` must be fully labelled (see ``EvalTable.complete_rows``).

    ``progress`` receives one line per phase; ``show_rounds`` adds a progress bar over MLP rounds."""
    rng = np.random.default_rng(seed)
    clients, client_tasks = simulate_clients(train, train_embeddings, config, rng)
    active = [c for c in clients if c.n_samples > 0]
    active_tasks = [t for c, t in zip(clients, client_tasks) if c.n_samples > 0]
    client_sets = [client_test_indices(test.tasks, t, rng) for t in active_tasks]
    models = train.models
    n_global = np.bincount(np.concatenate([c.model for c in clients]), minlength=len(models))
    true_acc, true_cost = test.accuracy, test.cost
    say = progress or (lambda _msg: None)

    def evaluate_on(rows: np.ndarray, acc: np.ndarray, cost: np.ndarray) -> metrics.CurveReport:
        return metrics.evaluate_router(acc[rows], cost[rows], true_acc[rows], true_cost[rows])

    all_rows = np.arange(test.n_queries)
    references = {
        "zero": [metrics.zero_router_report(true_acc[r], true_cost[r]) for r in client_sets],
        "oracle": [metrics.oracle_report(true_acc[r], true_cost[r]) for r in client_sets],
    }
    reports: dict[str, dict[str, list[metrics.CurveReport]]] = {}
    client_reports: dict[str, dict[str, list[metrics.CurveReport]]] = {}
    federated_routers: dict[str, Router] = {}
    for kind in config.routers:
        trainer_kind = kinds.get(kind)
        say(f"seed {seed}: {kind} local ({len(active)} clients)")
        local_routers = [trainer_kind.fit_local(c, models, config, rng) for c in active]
        say(f"seed {seed}: {kind} federated")
        fed = trainer_kind.fit_federated(clients, models, config, rng, progress=show_rounds)
        say(f"seed {seed}: {kind} centralised")
        central = trainer_kind.fit_local(ClientData.pool(active), models, config, rng)
        local_pred = [r.predict(test_embeddings) for r in local_routers]
        fed_pred = fed.predict(test_embeddings)
        say(f"seed {seed}: {kind} personalised (local estimators on 80% of each log, errors on the held-out 20%)")
        # Its own generator, so the held-out splits and refits leave every other setting's draws as they were.
        pers_rng = np.random.default_rng([seed, 1 + list(config.routers).index(kind)])
        pers_pred = [
            _personalised_predictions(fed, trainer_kind, c, models, config, pers_rng, fed_pred, test_embeddings,
                                      n_global)
            for c in active
        ]
        reports[kind] = {
            "local": [evaluate_on(all_rows, *p) for p in local_pred],
            "federated": [evaluate_on(all_rows, *fed_pred)],
            "centralised": [evaluate_on(all_rows, *central.predict(test_embeddings))],
            "personalised": [evaluate_on(all_rows, *p) for p in pers_pred],
        }
        client_reports[kind] = {
            "local": [evaluate_on(r, *p) for r, p in zip(client_sets, local_pred)],
            "federated": [evaluate_on(r, *fed_pred) for r in client_sets],
            "personalised": [evaluate_on(r, *p) for r, p in zip(client_sets, pers_pred)],
            **references,
        }
        federated_routers[kind] = fed
    return SeedResult(seed, reports, client_reports, federated_routers, [c.n_samples for c in clients])


def reference_reports(test: EvalTable) -> dict[str, metrics.CurveReport]:
    """Oracle, zero-router and random references on the (fully labelled) test table."""
    return {
        "oracle": metrics.oracle_report(test.accuracy, test.cost),
        "zero": metrics.zero_router_report(test.accuracy, test.cost),
        "random": metrics.random_router_report(test.accuracy, test.cost),
    }


def summarise(seed_results: Sequence[SeedResult], references: dict[str, metrics.CurveReport]) -> dict:
    """Mean and std over seeds (and over clients for local/personalised) of each metric.

    ``cost_at_best_acc`` is the median over routers (inf where most never reach the best accuracy).
    For federated and centralised, ``auc_std`` is the std over seeds; for local and personalised it
    is the std over all (seed, client) routers, and ``auc_mean`` their mean.
    """
    auc_zero, auc_oracle = references["zero"].auc, references["oracle"].auc
    out: dict = {
        "references": {
            name: {"auc": r.auc, "acc_at_best_cost": r.acc_at_best_cost, "cost_at_best_acc": r.cost_at_best_acc}
            for name, r in references.items()
        },
        "routers": {},
    }
    for name in out["references"]:
        out["references"][name]["gain"] = metrics.gain(references[name].auc, auc_zero, auc_oracle)
    kinds = seed_results[0].reports.keys()
    for kind in kinds:
        out["routers"][kind] = {}
        for setting in SETTINGS:
            reps = [r for s in seed_results for r in s.reports[kind][setting]]
            aucs = np.array([r.auc for r in reps])
            per_seed = np.array([np.mean([r.auc for r in s.reports[kind][setting]]) for s in seed_results])
            auc_mean = float(aucs.mean())
            out["routers"][kind][setting] = {
                "auc_mean": auc_mean,
                "auc_std": float(aucs.std(ddof=0)),
                "auc_per_seed": per_seed.tolist(),
                "gain": metrics.gain(auc_mean, auc_zero, auc_oracle),
                "acc_at_best_cost": float(np.mean([r.acc_at_best_cost for r in reps])),
                "cost_at_best_acc": float(np.median([r.cost_at_best_acc for r in reps])),
                "n_routers": len(reps),
            }
    out["client_distribution"] = {}
    for kind in kinds:
        per_client = {
            setting: np.array([r.auc for s in seed_results for r in s.client_reports[kind][setting]])
            for setting in CLIENT_VIEW
        }
        headroom = per_client["oracle"] - per_client["zero"]
        out["client_distribution"][kind] = {
            setting: {
                "auc_mean": float(aucs.mean()),
                "auc_std": float(aucs.std(ddof=0)),
                "gain_mean": float(np.mean((aucs - per_client["zero"]) / headroom)),
            }
            for setting, aucs in per_client.items()
        }
    return out
