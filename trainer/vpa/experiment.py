"""``fedroute vpa train``: every method on the same clients and pairs, settings chosen on validation (issue 28).

Per seed (:func:`run_seed`): draw the users (:func:`trainer.data.conflicting_users.make_users`), choose the
features (with or without ``s(y)``: the oracle's validation accuracy decides, unless the config fixes it), train
the monolithic and per-type Bradley-Terry rewards, VPL (N(0, I) prior) and FedVPA-GP for every beta of the config,
keep per prior the beta (and, for FedVPA-GP, the z mode) with the best validation accuracy averaged over the
context sizes (FedVPA-GP, trained under each client's own ``pi`` by default, ``VPAConfig.client_prior``, is then read
under each user's client's own ``pi``, ``VPAConfig.client_scale``; the
global read-out is scored too, as ``fedvpa_gp_global_pi``), train local-only VPL with VPL's beta, and score every method on the test users for every C.
:func:`run_experiment` repeats over seeds and reports mean and standard deviation over seeds.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from trainer.data.conflicting_users import TYPES, make_users
from trainer.data.preferences import load_hh_harmless_pairs
from trainer.rewards.pair_features import PairEncoder
from trainer.vpa import evaluation as ev
from trainer.vpa.artefact import PersonalRewardArtefact
from trainer.vpa.features import STRUCTURES, fit_projection, pair_feature_scales, pair_features, select_structure
from trainer.vpa.trainer import VPAConfig, VPATrainer

METHODS = ("fedvpa_gp", "vpl_gaussian", "monolithic_bt", "length_per_user", "two_stage", "local_vpl", "oracle_type",
           "fedvpa_gp_global_pi")
Z_METHODS = ("fedvpa_gp", "vpl_gaussian", "local_vpl")


def load_features(cfg: VPAConfig) -> tuple[pd.DataFrame, np.ndarray]:
    """The HH pairs and ``phi`` with ``s(y)`` and ``p(y)`` (its last columns; :func:`trainer.vpa.features.pair_features`)."""
    pairs = load_hh_harmless_pairs(cfg.data_dir, seed=0)
    encoder = PairEncoder(cache_dir=None if cfg.cache_dir is None else Path(cfg.cache_dir), show_progress=True)
    return pairs, pair_features(pairs, encoder)


def _val_score(tr: VPATrainer, model, protos, z_mode: str) -> float:
    ids = tr.users.users("val")
    accs = [ev.vpa_correct(tr, model, ids, ev.choose_z(tr, model, ids, c, protos, z_mode)).mean()
            for c in tr.cfg.contexts]
    return float(np.mean(accs))


def choose_readout(tr: VPATrainer, model, protos, z_mode: str, options: list[tuple[str, float]], choices: dict
                   ) -> dict[int, tuple[str, float]]:
    """Per C, FedVPA-GP's read-out of ``z`` with the best validation accuracy: ``(z_mode, 1.0)`` (the global ``pi``,
    chosen over all C) or one of ``options``, ``(mode, alpha)`` (e.g. ``('client', 0.1)``: the client's own ``pi``,
    evidence scaled by 0.1; :func:`trainer.vpa.evaluation.choose_z`); the first wins ties. Records every score in
    ``choices`` (``benchmarks/vpa_readout_settings.py``)."""
    ids = tr.users.users("val")
    readout = {}
    options = [(z_mode, 1.0)] + list(options)
    for c in tr.cfg.contexts:
        accs = [float(ev.vpa_correct(tr, model, ids, ev.choose_z(tr, model, ids, c, protos, m, a)).mean())
                for m, a in options]
        choices.setdefault("fedvpa_gp_readout_val_acc", {})[str(c)] = {f"{m}@{a}": v for (m, a), v in zip(options, accs)}
        readout[c] = options[int(np.argmax(accs))]
    choices["fedvpa_gp"]["readout"] = {str(c): list(r) for c, r in readout.items()}
    return readout


def run_seed(cfg: VPAConfig, pairs: pd.DataFrame, phi_full: np.ndarray, seed: int,
             log: Callable[[str], None] = print) -> dict:
    """All methods on one seed; returns per-method, per-C test scores, collapse and switching figures, choices made."""
    users = make_users(pairs, cfg.users, seed=seed)
    projection = None
    if cfg.pca_components:
        projection = fit_projection(phi_full, np.flatnonzero(users.part == "train"), cfg.pca_components)
        phi_full = projection.apply(phi_full)
    val_ids, test_ids = users.users("val"), users.users("test")
    t_val, t_test = users.type[val_ids], users.type[test_ids]
    choices: dict = {}

    # features: which of s(y) and p(y), by the oracle's validation accuracy
    options = [cfg.structure] if cfg.structure is not None else list(STRUCTURES)
    best = None
    for structure in options:
        tr = VPATrainer(users, select_structure(phi_full, structure), cfg)
        oracle = tr.train_bt(per_type=True, seed=seed)
        acc = ev.bt_correct(tr, oracle, val_ids, t_val).mean()
        choices[f"oracle_val_acc_structure_{structure}"] = float(acc)
        if best is None or acc > best[0]:
            best = (acc, structure, tr, oracle)
    _, choices["structure"], tr, oracle = best
    log(f"seed {seed}: features {choices['structure']}; oracle val acc {best[0]:.3f}")

    mono = tr.train_bt(per_type=False, seed=seed)
    fitted = {}
    for prior, name in (("mixture", "fedvpa_gp"), ("gaussian", "vpl_gaussian")):
        cands = []
        for beta in cfg.betas_for(prior):
            model, protos = tr.train_vpa(prior, beta, seed)
            for z_mode in (cfg.z_modes if prior == "mixture" else ("mean",)):
                score = _val_score(tr, model, protos, z_mode)
                choices[f"{name}_val_acc_beta_{beta}_{z_mode}"] = score
                cands.append((score, beta, z_mode, model, protos))
        score, beta, z_mode, model, protos = max(cands, key=lambda t: t[0])
        choices[name] = {"beta": beta, "z_mode": z_mode, "val_acc": score}
        fitted[name] = (model, protos, z_mode)
        log(f"seed {seed}: {name} beta {beta}, z {z_mode}, val acc {score:.3f}")
    scale = cfg.client_scale
    readout = {c: ("client", scale) if scale is not None else (fitted["fedvpa_gp"][2], 1.0) for c in cfg.contexts}
    choices["fedvpa_gp"]["readout"] = {str(c): list(r) for c, r in readout.items()}
    local = {i: tr.train_vpa("gaussian", choices["vpl_gaussian"]["beta"], seed, clients=[i])
             for i in range(cfg.users.n_clients)}

    shares = np.bincount(users.type[users.users("train")], minlength=len(TYPES)) + 1.0
    log_prior = np.log(shares / shares.sum())
    rng = np.random.default_rng(seed + 7)
    partner = ev.partners(t_test, rng)
    out: dict = {m: {} for m in METHODS}
    collapse: dict = {m: {} for m in METHODS}
    switch: dict = {m: {} for m in ("fedvpa_gp", "vpl_gaussian", "two_stage", "oracle_type", "monolithic_bt")}
    latent: dict = {}
    oracle_ok = ev.bt_correct(tr, oracle, test_ids, t_test)
    mono_ok = ev.bt_correct(tr, mono, test_ids, np.zeros(len(test_ids), dtype=np.int64))
    for c in cfg.contexts:
        key = str(c)
        out["oracle_type"][key] = ev.summarise(oracle_ok, t_test)
        out["monolithic_bt"][key] = ev.summarise(mono_ok, t_test)
        out["length_per_user"][key] = ev.summarise(ev.length_correct(tr, test_ids, c), t_test)
        guess = ev.two_stage_types(tr, oracle, test_ids, c, log_prior)
        two_ok = ev.bt_correct(tr, oracle, test_ids, guess)
        out["two_stage"][key] = ev.summarise(two_ok, t_test)
        collapse["two_stage"][key] = {"kl_mean": None, "type_acc_from_z": float((guess == t_test).mean())}
        switch["two_stage"][key] = ev.switching(two_ok, ev.bt_correct(tr, oracle, test_ids, guess[partner]))
        switch["oracle_type"][key] = ev.switching(oracle_ok, ev.bt_correct(tr, oracle, test_ids, t_test[partner]))
        switch["monolithic_bt"][key] = ev.switching(mono_ok, mono_ok)
        for name, source in (("fedvpa_gp", "fedvpa_gp"), ("vpl_gaussian", "vpl_gaussian"),
                             ("fedvpa_gp_global_pi", "fedvpa_gp")):
            model, protos, z_mode = fitted[source]
            z_mode, scale = readout[c] if name == "fedvpa_gp" else (z_mode, 1.0)
            z = ev.choose_z(tr, model, test_ids, c, protos, z_mode, scale)
            ok = ev.vpa_correct(tr, model, test_ids, z)
            out[name][key] = ev.summarise(ok, t_test)
            if z_mode == "client":  # the posterior mean under the client's prior is the z scored with
                mu, mu_val = z, ev.choose_z(tr, model, val_ids, c, protos, z_mode, scale)
            else:
                mu, mu_val = ev.posterior(tr, model, test_ids, c, protos)[0], ev.posterior(tr, model, val_ids, c, protos)[0]
            collapse[name][key] = {"kl_mean": float(ev.kl_to_prior(tr, model, test_ids, c, protos).mean()),
                                   "type_acc_from_z": ev.type_probe(mu_val.numpy(), t_val, mu.numpy(), t_test)}
            if name == "fedvpa_gp_global_pi":
                continue
            switch[name][key] = ev.switching(ok, ev.vpa_correct(tr, model, test_ids, z[partner]))
            latent.setdefault(name, {})[key] = mu.numpy().round(4).tolist()
            if protos is not None:
                latent["prototypes"] = protos.mu.round(4).tolist()
        ok_rows, kls = [], []
        for i, (model, _) in local.items():
            ids = users.users("test", i)
            mu, _ = ev.posterior(tr, model, ids, c)
            ok_rows.append(ev.vpa_correct(tr, model, ids, mu))
            kls.append(ev.kl_to_prior(tr, model, ids, c, None))
        order = np.concatenate([users.users("test", i) for i in local])
        t_local = users.type[order]
        out["local_vpl"][key] = ev.summarise(np.concatenate(ok_rows), t_local)
        collapse["local_vpl"][key] = {"kl_mean": float(np.concatenate(kls).mean()), "type_acc_from_z": None}
    latent["types"] = t_test.tolist()
    log(f"seed {seed}: C={cfg.contexts[-1]} " + ", ".join(f"{m} {out[m][str(cfg.contexts[-1])]['acc']:.3f}" for m in METHODS))
    model, protos, z_mode = fitted["fedvpa_gp"]
    artefact = {"model": model, "prototypes": protos, "z_mode": z_mode, "readout": readout, "structure": choices["structure"],
                "projection": projection, "beta": choices["fedvpa_gp"]["beta"]}
    return {"seed": seed, "methods": out, "collapse": collapse, "switching": switch, "choices": choices,
            "latent": latent, "artefact": artefact, "n_test_users": int(len(test_ids)),
            "n_test_users_per_type": {name: int((t_test == t).sum()) for t, name in enumerate(TYPES)}}


def _mean_std(values: list) -> tuple[float | None, float | None]:
    vals = [v for v in values if v is not None and np.isfinite(v)]
    if not vals:
        return None, None
    return float(np.mean(vals)), float(np.std(vals, ddof=1)) if len(vals) > 1 else 0.0


def combine(runs: list[dict], contexts: tuple[int, ...]) -> dict:
    """Mean and standard deviation over seeds (ddof 1) of every figure of :func:`run_seed`."""
    methods, collapse, switching = {}, {}, {}
    for m in METHODS:
        methods[m], collapse[m] = {}, {}
        for c in map(str, contexts):
            mean, std = _mean_std([r["methods"][m][c]["acc"] for r in runs])
            per_type = {t: _mean_std([r["methods"][m][c]["per_type"].get(t) for r in runs])[0] for t in TYPES}
            methods[m][c] = {"acc_mean": mean, "acc_std": std, "per_type": per_type}
            collapse[m][c] = {k: _mean_std([r["collapse"][m].get(c, {}).get(k) for r in runs])[0]
                              for k in ("kl_mean", "type_acc_from_z")}
    for m in runs[0]["switching"]:
        switching[m] = {c: {k: _mean_std([r["switching"][m][c][k] for r in runs])[0] for k in ("flip", "both_right")}
                        for c in map(str, contexts)}
    headroom = {}
    for c in map(str, contexts):
        h = methods["oracle_type"][c]["acc_mean"] - methods["monolithic_bt"][c]["acc_mean"]
        gp = methods["fedvpa_gp"][c]["acc_mean"] - methods["monolithic_bt"][c]["acc_mean"]
        headroom[c] = {"H": h, "fedvpa_gp_recovered": gp / h if h > 0 else None}
    return {"methods": methods, "collapse": collapse, "switching_rate": switching, "headroom": headroom}


def _seed_job(args: tuple) -> dict:
    cfg, pairs, phi, seed, threads = args
    torch.set_num_threads(threads)
    return run_seed(cfg, pairs, phi, seed, lambda line: print(line, flush=True))


def run_experiment(cfg: VPAConfig, log: Callable[[str], None] = print, jobs: int = 1, save_to: Path | None = None) -> dict:
    """Every seed of ``cfg`` and their combination (JSON-ready); ``jobs`` > 1 runs seeds in that many processes
    (one torch thread each). ``save_to``: a folder to save seed 0's FedVPA-GP in
    (:class:`trainer.vpa.artefact.PersonalRewardArtefact`, what ``fedroute vpa export`` reads)."""
    pairs, phi = load_features(cfg)
    if jobs > 1 and cfg.seeds > 1:
        with ProcessPoolExecutor(max_workers=min(jobs, cfg.seeds)) as pool:
            runs = list(pool.map(_seed_job, [(cfg, pairs, phi, seed, 1) for seed in range(cfg.seeds)]))
    else:
        runs = [run_seed(cfg, pairs, phi, seed, log) for seed in range(cfg.seeds)]
    if save_to is not None:
        PersonalRewardArtefact.from_run(runs[0]["artefact"], cfg, pair_feature_scales(pairs)).save(save_to)
    res = combine(runs, cfg.contexts)
    res["seeds"] = [{k: v for k, v in r.items() if k not in ("latent", "artefact")} for r in runs]
    res["latent_seed0"] = runs[0]["latent"]
    res["config"] = cfg.to_json()
    return res
