"""Evaluation of MoR (paper 001, Table 4 analogue): pairwise ranking accuracy (METRICS.md) of each way
of scoring a (prompt, response) pair, on each client's held-out test pairs (in-distribution, "ID")
and on the held-out category no client and no router has seen.

Design notes: docs/mor.md (Module notes).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import pandas as pd

from trainer.preference_metrics import pairwise_accuracy as _metric
from trainer.rewards.client_router import WEIGHTINGS
from trainer.rewards.routing_rule import ROUTE_BY, RoutingRule
from trainer.rewards.mor_trainer import MoRModels, MoRSplit, MoRTrainer
from trainer.rewards.reward_models import PreferencePairs, pairwise_accuracy

METHODS = ("router_rm_sparse", "router_rm_soft", "avg_rm", "random_rm", "fedavg_rm", "best_single_rm",
           "oracle_client", "length_only", "length_only_global", "structure_only", "router_rm_sparse_generator_prior",
           "router_rm_soft_generator_prior")
#: Weights ``lam`` of the generator prior added to the routed reward (:func:`prior_correct`), chosen per seed on
#: validation (0: no prior).
PRIOR_WEIGHTS = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0)
#: The logistic baselines beside length_only (MoRModels.baselines).
BASELINES = ("length_only_global", "structure_only")
N_RANDOM_DRAWS = 20
#: Soft-routing temperatures compared on validation (:func:`choose_routing`), with per-response (the paper) or
#: per-prompt routing (:data:`trainer.rewards.routing_rule.ROUTE_BY`).
TEMPERATURES = (0.5, 1.0, 2.0)
#: Sparse routing's uncertain-routing fallbacks compared on validation (``RoutingRule.fallback``; 0 = plain sparse).
FALLBACKS = (0.0, 0.8)
#: Also compared: the fallback 0.8 mixing only the two clients with the largest weights (``RoutingRule.fallback_top``)
#: and soft routing at T = 1 on normalised one-vs-rest probabilities (``probabilities="ovr"``), each per route_by.
FALLBACK_TOP = 2


@dataclass
class EvalSet:
    """Scores of every scorer on one set of pairs.

    norm, raw : (2, n, K) float64, client reward models' normalised / raw scores on (chosen, rejected).
    logits : weighting -> (2, n, K) router logits. fedavg : (2, n). length_proba : (n,) P(chosen wins).
    own : index of the client the pairs belong to (the oracle's choice).
    groups : (n,) int, the pair's prompt (pairs of one prompt share it; routing by prompt).
    prior : (n,) float64, ``beta_g(chosen) - beta_g(rejected)`` of the generator prior (0 where a generator is
        unknown; None: no prior, :attr:`MoRModels.generator_beta`).
    """

    name: str
    own: int
    norm: np.ndarray
    raw: np.ndarray
    logits: dict
    fedavg: np.ndarray
    length_proba: np.ndarray
    groups: np.ndarray | None = None
    baseline_proba: dict | None = None
    prior: np.ndarray | None = None

    @property
    def n(self) -> int:
        return self.norm.shape[1]


def score_set(trainer: MoRTrainer, models: MoRModels, frame: pd.DataFrame, name: str, own: int) -> EvalSet:
    """Every scorer on the pairs of ``frame`` (each reward model asked about every pair once)."""
    pairs = PreferencePairs.from_frame(frame)
    fc, fr = trainer.features(pairs)
    norm, raw = [], []
    for rm in models.reward_models:
        if hasattr(rm, "raw_scores_from_features"):
            rc, rr = rm.raw_scores_from_features(fc), rm.raw_scores_from_features(fr)
        else:
            rc, rr = rm.raw_scores(pairs.prompts, pairs.chosen), rm.raw_scores(pairs.prompts, pairs.rejected)
        raw.append(np.stack([rc, rr]))
        norm.append(np.stack([rm.normaliser_(rc), rm.normaliser_(rr)]))
    logits = {w: np.stack([r.logits(fc), r.logits(fr)]) for w, r in models.routers.items()}
    fed = np.stack([models.fedavg_rm.raw_scores_from_features(fc), models.fedavg_rm.raw_scores_from_features(fr)])
    # P(response_a wins) -> P(chosen wins): the frame's label says which side is the chosen one
    lab = frame["label"].to_numpy()

    def chosen(m) -> np.ndarray:
        q = m.predict_proba(frame)  # once: the structure baseline's features cost ~1 ms per response
        return np.where(lab == 1, q, 1 - q)

    prior = None
    if models.generator_beta is not None:
        from trainer.generator_prior import generator_logit  # pandas: on use

        gl = generator_logit(frame, models.generator_beta)
        prior = np.where(lab == 1, gl, -gl)
    return EvalSet(name, own, np.stack(norm, -1).astype(np.float64), np.stack(raw, -1).astype(np.float64),
                   logits, fed.astype(np.float64), chosen(models.length_baseline),
                   pd.factorize(frame["prompt"])[0], {b: chosen(models.baselines[b]) for b in BASELINES}, prior)


def _acc(s: np.ndarray) -> float:
    return pairwise_accuracy(s[0], s[1])


def _flat(z: np.ndarray, groups: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """(2, n, K) -> (2n, K) rows [chosen..., rejected...] and the (2n,) prompt group of each row (default:
    each pair its own group, so its two responses are routed together under ``route_by="prompt"``)."""
    g = np.arange(z.shape[1]) if groups is None else np.asarray(groups)
    return np.asarray(z).reshape(-1, z.shape[-1]), np.concatenate([g, g])


def routing_weights(z: np.ndarray, temperature: float = 1.0, route_by: str = "response",
                    groups: np.ndarray | None = None) -> np.ndarray:
    """Routing probabilities of a set of pairs: z (2, n, K) router logits of (chosen, rejected) -> (2, n, K),
    :meth:`RoutingRule.weights` (the code path of RoutedReward and GRPO) with every response of the pairs
    of one prompt (``groups`` (n,) ids, default: each pair its own prompt) in one group."""
    flat, g = _flat(z, groups)
    return RoutingRule("soft", temperature, route_by).weights(flat, g).reshape(z.shape)


def routed_reward(s: np.ndarray, z: np.ndarray, rule: RoutingRule, groups: np.ndarray | None = None) -> np.ndarray:
    """The routed reward of ``rule`` on scores s (2, n, K) with router logits z (2, n, K): (2, n) float64,
    computed by :meth:`RoutingRule.reward` exactly as RoutedReward and GRPO's reward function do."""
    flat, g = _flat(z, groups)
    return rule.reward(flat, np.asarray(s).reshape(flat.shape), g).reshape(z.shape[:2])


def routing_variants() -> list[RoutingRule]:
    """The routing variants compared on validation: sparse x :data:`ROUTE_BY` x :data:`FALLBACKS`, sparse with fallback
    0.8 and ``fallback_top`` :data:`FALLBACK_TOP` x ROUTE_BY, soft x ROUTE_BY x :data:`TEMPERATURES`, soft at T = 1 with
    ``probabilities="ovr"`` x ROUTE_BY."""
    return [RoutingRule("sparse", 1.0, by, f) for f in FALLBACKS for by in ROUTE_BY] + \
        [RoutingRule("sparse", 1.0, by, 0.8, FALLBACK_TOP) for by in ROUTE_BY] + \
        [RoutingRule("soft", t, by) for by in ROUTE_BY for t in TEMPERATURES] + \
        [RoutingRule("soft", 1.0, by, probabilities="ovr") for by in ROUTE_BY]


def routed_accuracies(s: np.ndarray, z: np.ndarray, groups: np.ndarray | None = None) -> dict:
    """Accuracy of every routing variant on scores s (2, n, K) with router logits z (2, n, K):
    ``{"sparse|<route_by>": acc, "sparse<<f>|<route_by>": acc, "soft|<route_by>|T=<t>": acc}``
    (:func:`routing_variants`, keys :attr:`RoutingRule.variant`)."""
    return {rule.variant: _acc(routed_reward(s, z, rule, groups)) for rule in routing_variants()}


def routing_errors(e: EvalSet, z: np.ndarray) -> dict:
    """Routing errors vs reward-model errors of every routing variant on one EvalSet with router logits z (2, n, K).

    Per variant key (:func:`routing_variants`): ``pairs_away`` (share of pairs with a response whose largest routing
    weight is another client than its own), ``routing_cost`` (the own client's RM accuracy minus the routed reward's
    on those pairs, per pair of the set: what routing errors cost against the oracle), ``acc_home`` (routed
    accuracy on the other pairs), ``acc_away_routed`` / ``acc_away_own`` (routed / own-RM accuracy on the pairs
    away; None when there are none), ``buckets``: {``home_sure``, ``home_mixed``, ``away_sure``, ``away_mixed``} ->
    {``share``, ``cost``}, the pairs split by away or not and by whether a response of the pair got the mixture
    (soft routing: every pair; sparse: a largest weight below ``fallback``), with the share of pairs and the cost
    against the own RM per pair of the set (the four costs add up to ``routing_cost`` plus the home pairs' cost)."""
    won = lambda sc: (sc[0] > sc[1]) + 0.5 * (sc[0] == sc[1])  # noqa: E731 (per-pair pairwise accuracy)
    own = won(e.norm[..., e.own])
    out = {}
    flat, g = _flat(z, e.groups)
    for rule in routing_variants():
        w = rule.weights(flat, g)
        away = (w.argmax(1).reshape(z.shape[:2]) != e.own).any(0)
        mixed = np.ones(e.n, dtype=bool) if rule.mode == "soft" else (w.max(1) < rule.fallback).reshape(z.shape[:2]).any(0)
        routed = won(routed_reward(e.norm, z, rule, e.groups))
        buckets = {f"{a}_{b}": {"share": float(m.mean()), "cost": float((own[m].sum() - routed[m].sum()) / e.n)}
                   for a, am in (("home", ~away), ("away", away)) for b, bm in (("sure", ~mixed), ("mixed", mixed))
                   for m in [am & bm]}
        out[rule.variant] = {"pairs_away": float(away.mean()), "routing_cost": float((own[away].sum() - routed[away].sum()) / e.n),
                             "acc_home": float(routed[~away].mean()) if (~away).any() else None,
                             "acc_away_routed": float(routed[away].mean()) if away.any() else None,
                             "acc_away_own": float(own[away].mean()) if away.any() else None, "buckets": buckets}
    return out


def set_accuracies(e: EvalSet, rng: np.random.Generator) -> dict:
    """Accuracy of every scorer on one EvalSet: {"single": [K], "router_sparse": {w: acc}, ...};
    ``routing[tag][w]`` holds every routing variant (:func:`routed_accuracies`)."""
    k = e.norm.shape[-1]
    out: dict = {"n": e.n, "single": [_acc(e.norm[..., j]) for j in range(k)], "oracle_client": _acc(e.norm[..., e.own]),
                 "fedavg_rm": _acc(e.fedavg),
                 "length_only": _metric(e.length_proba, np.ones(e.n, dtype=np.int64)), "routing": {},
                 **{b: _metric(e.baseline_proba[b], np.ones(e.n, dtype=np.int64)) for b in BASELINES}}
    for tag, s in (("", e.norm), ("_no_norm", e.raw)):
        out["avg_rm" + tag] = _acc(s.mean(-1))
        draws = [_acc(np.take_along_axis(s, rng.integers(0, k, size=(2, e.n, 1)), -1)[..., 0]) for _ in range(N_RANDOM_DRAWS)]
        out["random_rm" + tag] = float(np.mean(draws))
        for w, z in e.logits.items():
            variants = routed_accuracies(s, z, e.groups)
            out["routing"].setdefault(tag, {})[w] = variants
            out.setdefault("router_sparse" + tag, {})[w] = variants["sparse|response"]
            out.setdefault("router_soft" + tag, {})[w] = variants["soft|response|T=1"]
    out["own_share"] = {w: float((z.argmax(-1) == e.own).mean()) for w, z in e.logits.items()}
    out["routing_errors"] = {w: routing_errors(e, z) for w, z in e.logits.items()}
    out["choice_share"] = {w: (np.bincount(z.argmax(-1).ravel(), minlength=k) / (2 * e.n)).tolist()
                           for w, z in e.logits.items()}
    return out


def choose_routing(val: dict, names: list[str], default_weighting: str, default_sparse: str = "sparse|response",
                   default_soft: str = "soft|response|T=1", margin_se: float = 0.0) -> dict:
    """The routing settings of one seed, chosen on VALIDATION accuracy (mean over clients):

    - ``weighting`` and the sparse ``route_by`` and ``fallback``: the best sparse variant of :func:`routing_variants`
      over weightings; the soft ``route_by`` and ``temperature``: the best ``soft|...`` variant for that weighting;
    - a candidate replaces the default (``default_weighting`` / ``default_sparse``, then ``default_soft``: the
      settings chosen over seeds by ``benchmarks/mor_router_inputs_settings.py``) only when it beats the
      default's validation accuracy by more than ``margin_se`` binomial standard errors of the default,
      ``sqrt(a (1 - a) / n_val)`` with ``n_val`` the validation pairs of all clients (0: the plain argmax, ties
      to the default). One seed's validation set cannot tell variants apart that differ by less than its noise.

    val : client name -> :func:`set_accuracies` of its validation pairs (``n_pairs`` read from ``val[name]["n"]``
        when present, else 0, i.e. no margin).
    Returns ``{"weighting", "sparse", "soft", "val": {"<weighting>/<variant>": acc}}`` (variant keys of :class:`RoutingRule`).
    """
    def mean(w: str, key: str) -> float:
        return round(float(np.mean([val[n]["routing"][""][w][key] for n in names])), 6)

    n_val = sum(int(val[n].get("n", 0)) for n in names)

    def pick(cands: list, default) -> tuple:
        a = mean(*default)
        margin = margin_se * np.sqrt(a * (1 - a) / n_val) if n_val and margin_se > 0 else 0.0
        best = max(cands, key=lambda c: (mean(*c), c == default))
        return best if mean(*best) > a + margin else default

    rules = routing_variants()
    w, sk = pick([(w, r.variant) for w in WEIGHTINGS for r in rules if r.mode == "sparse"], (default_weighting, default_sparse))
    _, ok = pick([(w, r.variant) for r in rules if r.mode == "soft"], (w, default_soft))
    return {"weighting": w, "sparse": sk, "soft": ok,
            "val": {f"{ww}/{v}": mean(ww, v) for ww in WEIGHTINGS for v in val[names[0]]["routing"][""][ww]}}


def evaluate_seed(trainer: MoRTrainer, split: MoRSplit, models: MoRModels) -> dict:
    """Accuracies of one seed: validation (choices), test per client, held-out; the router's weighting and
    routing variant (:func:`choose_routing`) and the best single client, all chosen on validation only."""
    rng = np.random.default_rng(split.seed)
    names = [c.name for c in split.clients]
    heldout_own = trainer.args.client_domains.index("alpacaeval") if split.heldout is not None else None
    val_sets = {c.name: score_set(trainer, models, c.val, c.name, k) for k, c in enumerate(split.clients)}
    val = {n: set_accuracies(e, rng) for n, e in val_sets.items()}
    test_sets = {c.name: score_set(trainer, models, c.test, c.name, k) for k, c in enumerate(split.clients)}
    test = {n: set_accuracies(e, rng) for n, e in test_sets.items()}
    held, held_set = None, None
    if split.heldout is not None:
        held_set = score_set(trainer, models, split.heldout, "heldout", heldout_own)
        held = set_accuracies(held_set, rng)
    val_router = {w: float(np.mean([val[n]["router_sparse"][w] for n in names])) for w in WEIGHTINGS}
    val_share = {w: float(np.mean([val[n]["own_share"][w] for n in names])) for w in WEIGHTINGS}
    a = trainer.args
    routing = choose_routing(val, names, a.router.weighting, a.sparse_rule().variant, a.soft_rule().variant, a.routing_margin_se)
    weighting = routing["weighting"]
    routing["prior_weight"] = choose_prior_weight(list(val_sets.values()), routing)
    val_single = [float(np.mean([val[n]["single"][j] for n in names])) for j in range(len(names))]
    best = int(np.argmax(val_single))

    def pick(acc: dict) -> dict:
        r, rr = acc["routing"][""][weighting], acc["routing"]["_no_norm"][weighting]
        return {"router_rm_sparse": r[routing["sparse"]], "router_rm_soft": r[routing["soft"]],
                "avg_rm": acc["avg_rm"], "random_rm": acc["random_rm"], "fedavg_rm": acc["fedavg_rm"],
                "best_single_rm": acc["single"][best], "oracle_client": acc["oracle_client"],
                "length_only": acc["length_only"], **{b: acc[b] for b in BASELINES},
                **{f"single_{names[j]}": acc["single"][j] for j in range(len(names))},
                **{f"router_rm_sparse_{w}": acc["router_sparse"][w] for w in WEIGHTINGS},
                **{f"router_rm_soft_{w}": acc["router_soft"][w] for w in WEIGHTINGS},
                **{f"routing_{v}": r[v] for v in r},
                "no_norm_router_rm_sparse": rr[routing["sparse"]],
                "no_norm_router_rm_soft": rr[routing["soft"]],
                "no_norm_avg_rm": acc["avg_rm_no_norm"], "no_norm_random_rm": acc["random_rm_no_norm"],
                **{f"own_share_{w}": acc["own_share"][w] for w in WEIGHTINGS},
                "pairs_away": acc["routing_errors"][weighting][routing["sparse"]]["pairs_away"],
                "routing_cost": acc["routing_errors"][weighting][routing["sparse"]]["routing_cost"],
                "soft_pairs_away": acc["routing_errors"][weighting][routing["soft"]]["pairs_away"],
                "soft_routing_cost": acc["routing_errors"][weighting][routing["soft"]]["routing_cost"]}

    def with_prior(e: EvalSet, acc: dict) -> dict:
        return pick(acc) | {k: float(v.mean()) for k, v in prior_correct(e, routing, routing["prior_weight"]).items()}

    per_client = {n: with_prior(test_sets[n], test[n]) for n in names}
    keys = list(per_client[names[0]])
    return {"seed": split.seed, "weighting": weighting, "routing": routing, "val_router_sparse": val_router,
            "val_own_share": val_share,
            "best_single": names[best], "val_single": dict(zip(names, val_single)),
            "id": {k: float(np.mean([per_client[n][k] for n in names])) for k in keys},
            "per_client": per_client, "heldout": with_prior(held_set, held) if held is not None else None,
            "heldout_routing_errors": held["routing_errors"][weighting] if held is not None else None,
            "choice_share": {n: test[n]["choice_share"] for n in names} | ({"heldout": held["choice_share"]} if held else {}),
            "n_pairs": {n: {"train": len(c.train), "val": len(c.val), "test": len(c.test)} for n, c in zip(names, split.clients)}
            | ({"heldout": len(split.heldout)} if split.heldout is not None else {}),
            "router_bytes_per_round": models.router_bytes_per_round,
            "pair_correct": {n: pair_correct(e, routing) for n, e in test_sets.items()}
            | ({"heldout": pair_correct(held_set, routing)} if held_set is not None else {})}


def _won(sc: np.ndarray) -> np.ndarray:
    """Per-pair correctness of (2, n) scores of (chosen, rejected): 1, 0, or 1/2 for a tie."""
    return (sc[0] > sc[1]) + 0.5 * (sc[0] == sc[1])


def pair_correct(e: EvalSet, routing: dict) -> dict:
    """Per-pair correctness (n,) float64 on one EvalSet of the routed rewards (the weighting and variants chosen
    on validation), length_only and the :data:`BASELINES`: what the paired standard errors are computed from."""
    z = e.logits[routing["weighting"]]
    p = lambda q: np.where(q == 0.5, 0.5, (q > 0.5).astype(np.float64))  # noqa: E731  (P(chosen wins))
    return {"router_rm_sparse": _won(routed_reward(e.norm, z, RoutingRule.from_variant(routing["sparse"]), e.groups)),
            "router_rm_soft": _won(routed_reward(e.norm, z, RoutingRule.from_variant(routing["soft"]), e.groups)),
            "avg_rm": _won(e.norm.mean(-1)), "fedavg_rm": _won(e.fedavg), "length_only": p(e.length_proba),
            **{b: p(e.baseline_proba[b]) for b in BASELINES}, **prior_correct(e, routing, routing["prior_weight"])}


def prior_correct(e: EvalSet, routing: dict, lam: float) -> dict:
    """Per-pair correctness (n,) float64 of the routed rewards of ``routing`` (its weighting, sparse and soft variants)
    with the generator prior beside them: the chosen response's routed reward plus ``lam * (beta_g(chosen) -
    beta_g(rejected))`` against the rejected one's (a Bradley-Terry prior over generators, as FedPrism's
    ``generator_prior``; ``e.prior`` 0 where a generator is unknown, None: no prior). Keys
    ``router_rm_{sparse,soft}_generator_prior``."""
    z = e.logits[routing["weighting"]]
    d = np.zeros(e.n) if e.prior is None else e.prior
    out = {}
    for mode in ("sparse", "soft"):
        r = routed_reward(e.norm, z, RoutingRule.from_variant(routing[mode]), e.groups)
        out[f"router_rm_{mode}_generator_prior"] = _won(np.stack([r[0] + lam * d, r[1]]))
    return out


def choose_prior_weight(val_sets: list[EvalSet], routing: dict) -> float:
    """The weight of :data:`PRIOR_WEIGHTS` whose sparse routed reward + prior (:func:`prior_correct`) has the highest
    mean validation accuracy over the clients' validation sets (ties to the smaller weight; 0 = no prior)."""
    def score(lam: float) -> float:
        return round(float(np.mean([prior_correct(e, routing, lam)["router_rm_sparse_generator_prior"].mean()
                                    for e in val_sets])), 9)

    return max(PRIOR_WEIGHTS, key=lambda lam: (score(lam), -lam))


def paired_vs_length_only(seeds: list[dict]) -> dict:
    """``{method: {"id"|"heldout": {gain, se, per_seed}}}`` from the seeds' ``pair_correct``.

    Each seed splits the pool anew, so the gain over length_only and its paired standard error are computed per seed
    (ID: mean over the K clients' test sets, se ``sqrt(sum_c se_c^2) / K``) and then averaged over the S seeds
    (se ``sqrt(sum_s se_s^2) / S``)."""
    def one(seed: dict, sets: list[str], m: str) -> tuple[float, float]:
        g, v = [], []
        for n in sets:
            d = seed["pair_correct"][n][m] - seed["pair_correct"][n]["length_only"]
            g.append(d.mean())
            v.append(d.var(ddof=1) / len(d) if len(d) > 1 else 0.0)
        return float(np.mean(g)), float(np.sqrt(np.sum(v)) / len(sets))

    out = {}
    clients = [n for n in seeds[0]["pair_correct"] if n != "heldout"]
    for m in seeds[0]["pair_correct"][clients[0]]:
        if m == "length_only":
            continue
        out[m] = {}
        for key, sets in (("id", clients), ("heldout", ["heldout"])):
            if not all(n in seeds[0]["pair_correct"] for n in sets):
                continue
            per = [one(s, sets, m) for s in seeds]
            out[m][key] = {"gain": float(np.mean([g for g, _ in per])),
                           "se": float(np.sqrt(np.sum([se ** 2 for _, se in per])) / len(per)),
                           "per_seed": [g for g, _ in per]}
    return out


def summarise(seeds: list[dict]) -> dict:
    """Mean/std over seeds: ``methods.<m>.{id_acc_mean, id_acc_std, heldout_acc_mean, heldout_acc_std}``
    for every key of a seed's ``id`` block (the table's methods, single RMs, weightings, ablation)."""
    keys = list(seeds[0]["id"])
    out = {}
    for k in keys:
        ids = np.array([s["id"][k] for s in seeds])
        entry = {"id_acc_mean": float(ids.mean()), "id_acc_std": float(ids.std(ddof=1)) if len(ids) > 1 else 0.0,
                 "id_acc_per_seed": ids.tolist()}
        if seeds[0]["heldout"] is not None:
            h = np.array([s["heldout"][k] for s in seeds])
            entry |= {"heldout_acc_mean": float(h.mean()), "heldout_acc_std": float(h.std(ddof=1)) if len(h) > 1 else 0.0,
                      "heldout_acc_per_seed": h.tolist()}
        names = list(seeds[0]["per_client"])
        entry["per_client_mean"] = {n: float(np.mean([s["per_client"][n][k] for s in seeds])) for n in names}
        out[k] = entry
    return out


def run_evaluation(trainer: MoRTrainer, progress=None) -> dict:
    """All seeds: prepare, train, evaluate; returns the results.json payload (without file I/O)."""
    t0 = time.perf_counter()
    seeds = []
    for seed in range(trainer.args.seeds):
        split = trainer.prepare(seed)
        models = trainer.train(split)
        seeds.append(evaluate_seed(trainer, split, models))
        if progress is not None:
            progress(seed, seeds[-1])
    methods = summarise(seeds)
    paired = paired_vs_length_only(seeds)
    for s in seeds:
        s.pop("pair_correct")  # arrays, not JSON; summarised in paired_vs_length_only
    return {"methods": {m: methods[m] for m in METHODS}, "paired_vs_length_only": paired,
            "single_rms": {k: v for k, v in methods.items() if k.startswith("single_")},
            "router_weighting": {k: v for k, v in methods.items() if k.startswith(("router_rm_sparse_", "router_rm_soft_", "own_share_"))},
            "routing_errors": {k: v for k, v in methods.items() if k in ("pairs_away", "routing_cost", "soft_pairs_away",
                                                                         "soft_routing_cost")},
            "routing_variants": {k: v for k, v in methods.items() if k.startswith(("routing_sparse|", "routing_sparse<", "routing_soft|"))},
            "routing_chosen_on_validation": [{k: s["routing"][k] for k in ("weighting", "sparse", "soft", "prior_weight")}
                                             for s in seeds],
            "ablation_no_norm": {k: v for k, v in methods.items() if k.startswith("no_norm_")},
            "weighting_chosen_on_validation": [s["weighting"] for s in seeds],
            "best_single_chosen_on_validation": [s["best_single"] for s in seeds],
            "seeds": seeds, "seconds": time.perf_counter() - t0}
