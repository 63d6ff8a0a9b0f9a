"""Why FedPrism's federated start trails the centralised structure-feature baseline, and what was tried (issue 29).

The start of every FedPrism expert is ``v_k . f`` (11 pair features, :data:`sdk.pair_features.DEFAULT_FEATURES`),
``v_k`` the exact federated logistic fit on the pairs the distilled router sends to expert ``k``, pulled towards the
global fit (:func:`trainer.experts.length_init.pooled_expert_coefs`; the presets' ``pooled_C1@r3``, chosen by
``benchmarks/prism_prior_fit_settings.py``). On the validation pairs it is 0.790 against 0.798 for the structure
baseline (the same features, one scikit-learn fit per domain, the domain label read). ``--part gap`` splits that
gap on every **validation** pair (10,939 training pairs, 4,293 validation pairs, seeds 0-2, the preset's clients):

- oracle rows (read the domain label; diagnosis only): the same exact federated fits with the domain as the
  expert (with and without the pull), per (expert, domain) cell, and each expert given its majority domain's
  structure fit (routing errors alone);
- the accuracy of the start and of the baseline on the pairs routed to an expert of another domain's majority
  (``misrouted``) and on the others;
- label-free remedies: M = 8 / 10, K-means on the clients' prompts instead of the public ones (a federated Lloyd
  iteration computes the same), loss-based re-assignment of each client prompt to its best expert before the
  router's distillation (IFCA, Ghosh et al. 2020; all prompts, or only prompts with >= 8 pairs and a gain > 0.1
  nats per pair), soft routing (router-probability mixture of the experts' logits), and the global fit for pairs
  the router is unsure of (max probability < 0.5); and one supervised router (a federated domain classifier on
  the prompt embedding, trained on the clients' own domain labels, 12 rounds).

``--part quick_size``: the quick preset's start on the validation pairs for 600 / 1,200 / 2,400 / 4,800 training
pairs (stratified like the preset; the per-domain baselines fitted on the same pairs); rule: the fewest training
pairs whose start is not below per-domain length-only overall (``not_below_in_every_domain`` lists the sizes that
are not below it in any domain).

``--part prior``: the generator prior on the start. (a) ``lambda`` chosen on FedPrism's own validation start
(grid of :mod:`benchmarks.prism_generator_prior`) instead of on the structure baseline's; (b) the prior as a 12th
feature of the exact federated fit, each client's ``beta_A - beta_B`` from the Bradley-Terry strengths fitted on
the other clients' counts (cross-fitting: its own labels never build its feature), so each expert fits its own
weight. Chosen on validation, then scored once on every test pair (per-seed test rows, paired SE over pairs).

``--part roles``: the router input that separates chat transcripts from instructions: the prompt embedding with
``scale * log(1 + count)`` of each role tag of :data:`ROLE_TAGS` appended (K-means start, centroid distillation
and routing all on that input; the same exact federated fits), per ``scale`` of :data:`ROLE_SCALES` (0 = the
start), on every validation pair; rule: the scale with the highest validation accuracy, wired only if it beats the
start by more than its paired SE. The chosen scale and the start are then scored once on every test pair, each
without and with the generator prior as the cross-fitted feature of ``--part prior`` (``test_rows``).
``--part roles_quick``: the same grid and rule on the quick preset's training and public prompts (2,400 pairs),
validation only (the quick preset's test figures come from ``fedroute prism train --quick``).

``PYTHONPATH=. HF_HUB_OFFLINE=1 python benchmarks/prism_start_gap.py --part gap --out docs/results`` writes
``DIR/prism_start_gap_<part>.{json,md}`` (and, for ``gap``, a PNG of each row's gain over structure_only). Needs the prompt embeddings only (no segment cache); minutes on CPU.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from sdk.routed_selector import ROLE_TAGS, role_counts

SEEDS = (0, 1, 2)
QUICK_SIZES = ((600, 120), (1200, 120), (2400, 300), (4800, 300))
LAMBDAS = (0.0, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0)
ROLE_SCALES = (0.0, 0.1, 0.25, 0.35, 0.5, 0.7, 1.0)


def _frames(data_dir: Path, n_train=None, n_public=300):
    """(train, val, test, public) of the ``cpu`` preset's split; ``n_train`` subsamples train like the quick preset."""
    from dataclasses import replace

    from trainer.experts.experiment import PRESETS, split_frames  # imports torch: on use only

    preset = PRESETS["cpu"][0]
    train, val, test, public = split_frames(data_dir, preset, 0)
    if n_train is not None:
        train, _, _, public = split_frames(data_dir, replace(preset, n_train=n_train, n_public=n_public), 0)
    return train, val, test, public


def _arrays(frame, names):
    from sdk.pair_features import pair_features_many
    from trainer.embeddings import embed_texts

    f = pair_features_many(list(frame.prompt), list(frame.response_a), list(frame.response_b), names, exact=True)
    return f, frame.label.to_numpy().astype(np.float64), embed_texts(list(frame.prompt), show_progress=False)


def _clients(train, seed):
    from trainer.data.preferences import dirichlet_clients
    from trainer.experts.experiment import PRESETS

    preset = PRESETS["cpu"][0]
    client = dirichlet_clients(train, preset.n_clients, preset.alpha, seed=seed)
    return [c for c in (np.flatnonzero(client == i) for i in range(preset.n_clients)) if len(c)]


def _router(e_tr, e_pub, clients, seed, n_experts, rounds=3):
    """The presets' router start: K-means on the public prompts, then ``rounds`` of federated distillation."""
    from trainer.experts.experiment import PRESETS
    from trainer.experts.prompt_router import PromptRouter, centroid_distillation, kmeans_init

    base = PRESETS["cpu"][1]
    router = PromptRouter(e_tr.shape[1], n_experts, base.router_hidden, seed=seed)
    kmeans_init(router, e_pub, lr=base.init_lr, epochs=base.init_epochs, seed=seed)
    if rounds:
        centroid_distillation(router, e_pub, [e_tr[c] for c in clients], rounds=rounds, lr=base.init_lr, seed=seed)
    return router


def _fed_fit_router(router, e_tr, clients, labels, seed, epochs, rounds=1, tag=0):
    """``rounds`` of FedAvg of client copies of ``router`` fitted to per-pair ``labels`` (what each client knows)."""
    from trainer.experts.experiment import PRESETS
    from trainer.experts.prompt_router import PromptRouter, fit_router
    from trainer.routers.fedavg import fedavg

    lr = PRESETS["cpu"][1].init_lr
    for r in range(rounds):
        ups = []
        for i, c in enumerate(clients):
            local = PromptRouter(e_tr.shape[1], router.n_experts, router.net[0].out_features)
            local.load_state(router.state())
            fit_router(local, e_tr[c], labels[c], lr=lr, epochs=epochs, seed=seed * 1000 + (r + tag) * 100 + i)
            ups.append((local.state(), float(len(c))))
        router.load_state({k: v.astype(np.float32) for k, v in fedavg(ups).items()})


def _ifca_labels(f_tr, y_tr, prompt_of, assign, coefs, clients, n_min, gain_min):
    """Per client prompt: the expert with the lowest summed logistic loss over its pairs if it has >= ``n_min``
    pairs and beats the current expert by > ``gain_min`` nats per pair, else the current expert (per pair)."""
    z = f_tr @ coefs.T
    ce = np.logaddexp(0.0, z) - y_tr[:, None] * z
    out = assign.copy()
    for c in clients:
        _, inv = np.unique(prompt_of[c], return_inverse=True)
        tot = np.zeros((inv.max() + 1, len(coefs)))
        np.add.at(tot, inv, ce[c])
        n = np.bincount(inv).astype(np.float64)
        cur = np.zeros(len(n), np.int64)
        cur[inv] = assign[c]
        best = tot.argmin(1)
        gain = (tot[np.arange(len(n)), cur] - tot[np.arange(len(n)), best]) / n
        out[c] = np.where((n >= n_min) & (gain > gain_min), best, cur)[inv]
    return out


def _cross_fitted_g(train, clients) -> np.ndarray:
    """``beta_A - beta_B`` of each client's pairs from the Bradley-Terry strengths of the *other* clients' summed win
    counts (cross-fitting: a client's labels never build its own feature): (len(train),) float64."""
    from trainer.generator_prior import aggregate_win_counts, client_win_counts, fit_bradley_terry, generator_logit

    ups = [client_win_counts(train.iloc[c]) for c in clients]
    total = aggregate_win_counts(ups)
    g = np.zeros(len(train))
    for c, u in zip(clients, ups):
        g[c] = generator_logit(train.iloc[c], fit_bradley_terry(+(total - u)))
    return g


def _row(correct: list, ref: list, dom: np.ndarray, extra=None) -> dict:
    """Mean over seeds, per domain, per seed, and the paired gain over ``ref`` (SE over pairs)."""
    from trainer.experts.experiment import paired_gain

    m = np.mean(correct, axis=0)
    out = {"overall": float(m.mean()), "per_seed": [float(c.mean()) for c in correct],
           "domains": {d: float(m[dom == d].mean()) for d in sorted(set(dom))}, "vs_length_only": paired_gain(correct, ref)}
    return {**out, **(extra or {})}


def _validation_setup(data_dir: Path, preset: str = "cpu"):
    """(``preset``'s FedPrismConfig, train, val, public frames, (f, y, e) of train and val, public embeddings); the
    training and public prompts subsampled as ``preset`` does, the validation pairs always the CPU preset's (all)."""
    from trainer.experts.experiment import PRESETS

    data, base = PRESETS[preset]
    train, val, _, public = _frames(data_dir, data.n_train, data.n_public)
    names = base.selector.pair_features
    return base, train, val, public, _arrays(train, names), _arrays(val, names), _arrays(public, names)[2]


def part_gap(data_dir: Path) -> dict:
    import torch

    from sklearn.cluster import KMeans

    from trainer.experts.length_init import federated_logistic_fit, pooled_expert_coefs
    from trainer.length_baseline import LengthBaseline

    base, train, val, public, (f_tr, y_tr, e_tr), (f_va, y_va, e_va), e_pub = _validation_setup(data_dir)
    names, C, M = base.selector.pair_features, base.length_C, base.n_experts
    doms = sorted(set(train.domain))
    dt = train.domain.map(doms.index).to_numpy()
    dv = val.domain.map(doms.index).to_numpy()
    dom_va = val.domain.to_numpy().astype(str)
    prompt_of = np.unique(train.prompt_id.to_numpy(), return_inverse=True)[1]
    structure = LengthBaseline(per_domain=True, C=2 * C, features=names).fit(train)
    w_dom = np.stack([structure.coef_[d] for d in doms])
    p_lo = LengthBaseline(per_domain=True).fit(train).predict_proba(val)

    def correct(logit):
        return ((logit > 0) == y_va).astype(np.float64)

    def experts(assign, n, pool_C=1.0):
        return pooled_expert_coefs(f_tr, y_tr, assign, clients, n, C, pool_C)[0]

    rows, notes = {}, {}
    for seed in SEEDS:
        clients = _clients(train, seed)
        router = _router(e_tr, e_pub, clients, seed, M)
        a_tr, a_va = router.route(e_tr), router.route(e_va)
        w = experts(a_tr, M)
        z = (f_va[:, None, :] * w[None]).sum(2)
        add = lambda k, logit: rows.setdefault(k, []).append(correct(logit))  # noqa: E731
        add("length_only (domain label)", np.log(p_lo) - np.log1p(-p_lo))
        add("structure_only (domain label)", (f_va * w_dom[dv]).sum(1))
        add("FedPrism start (pooled_C1@r3)", z[np.arange(len(z)), a_va])
        # oracle diagnosis: the domain as the expert, per (expert, domain) cell, majority-domain coefficients
        for pool in (1.0, 1e4):
            add(f"oracle: domain as expert, exact fits, pull C {pool:g}", (f_va * experts(dt, 3, pool)[dv]).sum(1))
        glob_dom = w_dom
        cell_tr, cell_va = a_tr * 3 + dt, a_va * 3 + dv
        w_cell = np.repeat(glob_dom[None], M, 0).reshape(3 * M, -1).copy()
        for k in range(3 * M):
            if (cell_tr == k).sum() > 20:
                w_cell[k] = federated_logistic_fit([(f_tr[c[cell_tr[c] == k]], y_tr[c[cell_tr[c] == k]]) for c in clients],
                                                   1.0, center=glob_dom[k % 3])[0]
        add("oracle: (expert, domain) cells pulled to the domain fit", (f_va * w_cell[cell_va]).sum(1))
        majority = np.array([np.bincount(dt[a_tr == k], minlength=3).argmax() if (a_tr == k).any() else 0 for k in range(M)])
        add("oracle: each expert = its majority domain's structure fit", (f_va * w_dom[majority[a_va]]).sum(1))
        mis = majority[a_va] != dv
        notes.setdefault("misrouted", []).append({
            "share": float(mis.mean()), "n": int(mis.sum()), "by_domain": {d: int((mis & (dv == i)).sum()) for i, d in enumerate(doms)},
            "start_acc_misrouted": float(rows["FedPrism start (pooled_C1@r3)"][-1][mis].mean()),
            "structure_acc_misrouted": float(rows["structure_only (domain label)"][-1][mis].mean()),
            "start_acc_others": float(rows["FedPrism start (pooled_C1@r3)"][-1][~mis].mean()),
            "structure_acc_others": float(rows["structure_only (domain label)"][-1][~mis].mean())})
        # label-free remedies
        with torch.no_grad():
            prob = torch.softmax(router(torch.as_tensor(e_va)), 1).numpy()
        add("soft routing: router-probability mixture of the experts' logits", (z * prob).sum(1))
        z_glob = f_va @ experts(a_tr, M, None)[0]
        add("global fit where the router's max probability < 0.5", np.where(prob.max(1) < 0.5, z_glob, z[np.arange(len(z)), a_va]))
        for m in (8, 10):
            r = _router(e_tr, e_pub, clients, seed, m)
            add(f"M = {m}", (f_va * experts(r.route(e_tr), m)[r.route(e_va)]).sum(1))
        km = KMeans(M, n_init=10, random_state=seed).fit(e_tr[np.unique(prompt_of, return_index=True)[1]])
        b_tr, b_va = km.predict(e_tr), km.predict(e_va)
        add("K-means on the clients' prompts (nearest centroid)", (f_va * experts(b_tr, M)[b_va]).sum(1))
        for n_min, gain in ((1, 0.0), (8, 0.1)):
            r = _router(e_tr, e_pub, clients, seed, M)
            _fed_fit_router(r, e_tr, clients, _ifca_labels(f_tr, y_tr, prompt_of, a_tr, w, clients, n_min, gain), seed, 2)
            add(f"IFCA re-assignment (prompts with >= {n_min} pairs, gain > {gain:g})",
                (f_va * experts(r.route(e_tr), M)[r.route(e_va)]).sum(1))
        from trainer.experts.prompt_router import PromptRouter

        r = PromptRouter(e_tr.shape[1], 3, base.router_hidden, seed=seed)
        _fed_fit_router(r, e_tr, clients, dt, seed, 5, rounds=12)
        notes.setdefault("domain_router_accuracy", []).append(float((r.route(e_va) == dv).mean()))
        add("supervised: federated domain classifier as router (clients' domain labels), pull C 50",
            (f_va * experts(r.route(e_tr), 3, 50.0)[r.route(e_va)]).sum(1))
        print("seed", seed, "done", flush=True)
    ref = rows["length_only (domain label)"]
    out = {k: _row(v, ref, dom_va) for k, v in rows.items()}
    st = rows["structure_only (domain label)"]
    for k, v in out.items():
        from trainer.experts.experiment import paired_gain

        v["vs_structure_only"] = paired_gain(rows[k], st)
    return {"part": "gap", "n_train": len(train), "n_val": len(val), "seeds": list(SEEDS), "rows": out, **notes}


def part_quick_size(data_dir: Path) -> dict:
    from trainer.experts.experiment import LENGTH_ONLY, PRESETS
    from trainer.experts.length_init import pooled_expert_coefs
    from trainer.length_baseline import LengthBaseline

    base = PRESETS["quick"][1]
    names = base.selector.pair_features
    _, val, _, _ = _frames(data_dir)
    f_va, y_va, e_va = _arrays(val, names)
    dom = val.domain.to_numpy().astype(str)
    out = {}
    for n_train, n_public in QUICK_SIZES:
        train, _, _, public = _frames(data_dir, n_train, n_public)
        f_tr, y_tr, e_tr = _arrays(train, names)
        _, _, e_pub = _arrays(public, names)
        rows = {}
        for seed in SEEDS:
            clients = _clients(train, seed)
            router = _router(e_tr, e_pub, clients, seed, base.n_experts, base.router_init_rounds)
            w = pooled_expert_coefs(f_tr, y_tr, router.route(e_tr), clients, base.n_experts, base.length_C,
                                    base.length_pool_C)[0]
            rows.setdefault("fedprism_start", []).append((((f_va * w[router.route(e_va)]).sum(1) > 0) == y_va).astype(float))
            tr = train.iloc[np.concatenate(clients)]
            for m in LENGTH_ONLY:
                rows.setdefault(m, []).append(((LengthBaseline(**LENGTH_ONLY[m]).fit(tr).predict_proba(val) > 0.5) == y_va)
                                              .astype(float))
        out[str(n_train)] = {k: _row(v, rows["length_only"], dom) for k, v in rows.items()}
        print(n_train, "done", flush=True)
    level = [n for n in out if out[n]["fedprism_start"]["vs_length_only"]["gain"] >= 0]
    every = [n for n in out if all(out[n]["fedprism_start"]["domains"][d] >= out[n]["length_only"]["domains"][d]
                                   for d in out[n]["length_only"]["domains"])]
    return {"part": "quick_size", "n_val": len(val), "seeds": list(SEEDS), "sizes": out,
            "chosen": min(level, key=int) if level else None, "not_below_in_every_domain": every}


def part_prior(data_dir: Path) -> dict:
    from trainer.experts.experiment import PRESETS
    from trainer.experts.length_init import pooled_expert_coefs
    from trainer.generator_prior import client_win_counts, fit_bradley_terry, generator_logit
    from trainer.length_baseline import LengthBaseline

    base = PRESETS["cpu"][1]
    names, C, M = base.selector.pair_features, base.length_C, base.n_experts
    train, val, test, public = _frames(data_dir)
    f_tr, y_tr, e_tr = _arrays(train, names)
    _, _, e_pub = _arrays(public, names)
    beta = fit_bradley_terry(client_win_counts(train))
    split = {}
    for name, frame in (("val", val), ("test", test)):
        f, y, e = _arrays(frame, names)
        p = LengthBaseline(per_domain=True).fit(train).predict_proba(frame)
        split[name] = {"f": f, "y": y, "e": e, "g": generator_logit(frame, beta), "dom": frame.domain.to_numpy().astype(str),
                       "lo": ((p > 0.5) == y).astype(float)}
    logits = {"val": {}, "test": {}}
    for seed in SEEDS:
        clients = _clients(train, seed)
        router = _router(e_tr, e_pub, clients, seed, M)
        a_tr = router.route(e_tr)
        w = pooled_expert_coefs(f_tr, y_tr, a_tr, clients, M, C, base.length_pool_C)[0]
        g_tr = _cross_fitted_g(train, clients)
        w_g = pooled_expert_coefs(np.c_[f_tr, g_tr], y_tr, a_tr, clients, M, C, base.length_pool_C)[0]
        for name, s in split.items():
            a = router.route(s["e"])
            logits[name].setdefault("start", []).append((s["f"] * w[a]).sum(1))
            logits[name].setdefault("feature", []).append((np.c_[s["f"], s["g"]] * w_g[a]).sum(1))
        print("seed", seed, "done", flush=True)
    val_acc = {lam: float(np.mean([((z + lam * split["val"]["g"] > 0) == split["val"]["y"]).mean() for z in logits["val"]["start"]]))
               for lam in LAMBDAS}
    lam = max(LAMBDAS, key=lambda v: (val_acc[v], -v))
    out = {"part": "prior", "seeds": list(SEEDS), "lambda_by_val_accuracy": {str(k): v for k, v in val_acc.items()},
           "lambda": lam, "n": {k: len(s["y"]) for k, s in split.items()}, "rows": {}}
    for name, s in split.items():
        ref = [s["lo"]] * len(SEEDS)
        for key, zs in (("FedPrism start", logits[name]["start"]),
                        ("FedPrism start + prior (lambda 0.75, the structure baseline's)", [z + 0.75 * s["g"] for z in logits[name]["start"]]),
                        (f"FedPrism start + prior (lambda {lam:g}, chosen on its validation)", [z + lam * s["g"] for z in logits[name]["start"]]),
                        ("FedPrism start, prior as a cross-fitted feature", logits[name]["feature"])):
            out["rows"].setdefault(key, {})[name] = _row([((z > 0) == s["y"]).astype(float) for z in zs], ref, s["dom"])
    return out


def part_roles(data_dir: Path, preset: str = "cpu") -> dict:
    from trainer.experts.length_init import pooled_expert_coefs
    from trainer.length_baseline import LengthBaseline

    base, train, val, public, (f_tr, y_tr, e_tr), (f_va, y_va, e_va), e_pub = _validation_setup(data_dir, preset)
    C, M, rounds = base.length_C, base.n_experts, base.router_init_rounds
    r_tr, r_va, r_pub = (role_counts(list(x.prompt)) for x in (train, val, public))
    doms = sorted(set(train.domain))
    dt, dv = (x.domain.map(doms.index).to_numpy() for x in (train, val))
    p_lo = LengthBaseline(per_domain=True).fit(train).predict_proba(val)
    rows, misrouted = {}, {}
    for seed in SEEDS:
        clients = _clients(train, seed)
        rows.setdefault("length_only (domain label)", []).append(((p_lo > 0.5) == y_va).astype(np.float64))
        for scale in ROLE_SCALES:
            tr, va, pub = (np.c_[e, scale * r].astype(np.float32) for e, r in ((e_tr, r_tr), (e_va, r_va), (e_pub, r_pub)))
            router = _router(tr, pub, clients, seed, M, rounds)
            a_tr, a_va = router.route(tr), router.route(va)
            w = pooled_expert_coefs(f_tr, y_tr, a_tr, clients, M, C, base.length_pool_C)[0]
            key = "FedPrism start" + ("" if scale == 0 else f", role tags x {scale:g}")
            rows.setdefault(key, []).append((((f_va * w[a_va]).sum(1) > 0) == y_va).astype(np.float64))
            majority = np.array([np.bincount(dt[a_tr == k], minlength=3).argmax() if (a_tr == k).any() else -1
                                 for k in range(M)])
            misrouted.setdefault(key, []).append(float((majority[a_va] != dv).mean()))
        print("seed", seed, "done", flush=True)
    ref = rows["length_only (domain label)"]
    out = {k: _row(v, ref, val.domain.to_numpy().astype(str), {"misrouted_share": misrouted.get(k)}) for k, v in rows.items()}
    from trainer.experts.experiment import paired_gain

    for k in out:
        out[k]["vs_start"] = paired_gain(rows[k], rows["FedPrism start"])
    keys = [k for k in rows if k.startswith("FedPrism start")]
    best = max(keys, key=lambda k: out[k]["overall"])
    gain = out[best]["vs_start"]
    scale = ROLE_SCALES[keys.index(best)]
    res = {"part": "roles", "preset": preset, "n_train": len(train), "n_val": len(val), "seeds": list(SEEDS),
           "tags": list(ROLE_TAGS), "rows": out, "chosen": best, "scale": scale,
           "wire": bool(best != "FedPrism start" and gain["gain"] > gain["se"])}
    return res if preset != "cpu" else {**res, "test_rows": _roles_test(data_dir, scale)}


def _roles_test(data_dir: Path, scale: float) -> dict:
    """The start and the start with role tags x ``scale`` on every test pair, without and with the generator
    prior as the cross-fitted feature (:func:`part_prior` (b)); gains over per-domain length-only, paired SE."""
    from trainer.experts.experiment import PRESETS
    from trainer.experts.length_init import pooled_expert_coefs
    from trainer.generator_prior import client_win_counts, fit_bradley_terry, generator_logit
    from trainer.length_baseline import LengthBaseline

    base = PRESETS["cpu"][1]
    names, C, M = base.selector.pair_features, base.length_C, base.n_experts
    train, _, test, public = _frames(data_dir)
    f_tr, y_tr, e_tr = _arrays(train, names)
    f_te, y_te, e_te = _arrays(test, names)
    _, _, e_pub = _arrays(public, names)
    g_te = generator_logit(test, fit_bradley_terry(client_win_counts(train)))
    ref = [((LengthBaseline(per_domain=True).fit(train).predict_proba(test) > 0.5) == y_te).astype(np.float64)] * len(SEEDS)
    rows = {}
    for seed in SEEDS:
        clients = _clients(train, seed)
        g_tr = _cross_fitted_g(train, clients)
        for sc in (0.0, scale):
            tr, te, pub = (np.c_[e, sc * role_counts(list(x.prompt))].astype(np.float32)
                           for e, x in ((e_tr, train), (e_te, test), (e_pub, public)))
            router = _router(tr, pub, clients, seed, M)
            a_tr, a_te = router.route(tr), router.route(te)
            name = "start" + ("" if sc == 0 else f" + role tags x {sc:g}")
            for tag, x_tr, x_te in (("", f_tr, f_te), (" + prior feature", np.c_[f_tr, g_tr], np.c_[f_te, g_te])):
                w = pooled_expert_coefs(x_tr, y_tr, a_tr, clients, M, C, base.length_pool_C)[0]
                rows.setdefault(name + tag, []).append((((x_te * w[a_te]).sum(1) > 0) == y_te).astype(np.float64))
        print("test seed", seed, "done", flush=True)
    return {k: _row(v, ref, test.domain.to_numpy().astype(str)) for k, v in rows.items()}


def markdown(out: dict) -> str:
    if out["part"] == "gap":
        rows = out["rows"]
        doms = list(next(iter(rows.values()))["domains"])
        lines = [f"Validation ({out['n_val']} pairs), {out['n_train']} training pairs, seeds {out['seeds']}", "",
                 "| start | overall | " + " | ".join(doms) + " | vs length-only (paired SE) | vs structure_only (paired SE) |",
                 "|---" * (4 + len(doms)) + "|"]
        for k, r in rows.items():
            lines.append(f"| {k} | {r['overall']:.4f} | " + " | ".join(f"{r['domains'][d]:.3f}" for d in doms)
                         + f" | {r['vs_length_only']['gain']:+.4f} ± {r['vs_length_only']['se']:.4f}"
                         + f" | {r['vs_structure_only']['gain']:+.4f} ± {r['vs_structure_only']['se']:.4f} |")
        lines += ["", "Misrouted pairs (routed to an expert whose training pairs are mostly another domain), per seed:", ""]
        lines += [f"- {m}" for m in out["misrouted"]]
        lines += [f"- federated domain classifier accuracy (validation): {out['domain_router_accuracy']}"]
        return "\n".join(lines) + "\n"
    if out["part"] == "roles":
        lines = [f"{out.get('preset', 'cpu')} preset ({out.get('n_train', 10939)} training pairs), "
                 f"router input with role-tag counts ({out['tags']}), validation ({out['n_val']} pairs), seeds "
                 f"{out['seeds']}; best: **{out['chosen']}**; wire it (beats the start by > 1 paired SE): {out['wire']}", "",
                 "| router input | overall | domains | misrouted share per seed | vs length-only | vs the start |",
                 "|---|---|---|---|---|---|"]
        for k, r in out["rows"].items():
            lines.append(f"| {k} | {r['overall']:.4f} | " + " / ".join(f"{d} {v:.3f}" for d, v in r["domains"].items())
                         + f" | {r['misrouted_share']} | {r['vs_length_only']['gain']:+.4f} ± {r['vs_length_only']['se']:.4f}"
                         + f" | {r['vs_start']['gain']:+.4f} ± {r['vs_start']['se']:.4f} |")
        if "test_rows" not in out:
            return "\n".join(lines) + "\n"
        lines += ["", "Scored once on every test pair (the start and the chosen scale, without / with the prior feature):", "",
                  "| router input (test) | overall | per seed | domains | vs length-only |", "|---|---|---|---|---|"]
        for k, r in out["test_rows"].items():
            lines.append(f"| {k} | {r['overall']:.4f} | " + " / ".join(f"{x:.4f}" for x in r["per_seed"]) + " | "
                         + " / ".join(f"{d} {v:.3f}" for d, v in r["domains"].items())
                         + f" | {r['vs_length_only']['gain']:+.4f} ± {r['vs_length_only']['se']:.4f} |")
        return "\n".join(lines) + "\n"
    if out["part"] == "quick_size":
        lines = [f"Quick preset's start on the validation pairs ({out['n_val']}), seeds {out['seeds']}; chosen: "
                 f"**{out['chosen']}** training pairs; not below length-only in every domain: "
                 f"{out['not_below_in_every_domain'] or 'none'}", "", "| training pairs | method | overall | domains | vs length-only |",
                 "|---|---|---|---|---|"]
        for n, rows in out["sizes"].items():
            for k, r in rows.items():
                lines.append(f"| {n} | {k} | {r['overall']:.4f} | "
                             + " / ".join(f"{d} {v:.3f}" for d, v in r["domains"].items())
                             + f" | {r['vs_length_only']['gain']:+.4f} ± {r['vs_length_only']['se']:.4f} |")
        return "\n".join(lines) + "\n"
    lines = [f"Generator prior on FedPrism's start; lambda chosen on validation: {out['lambda']} "
             f"(grid {out['lambda_by_val_accuracy']}); pairs {out['n']}, seeds {out['seeds']}", "",
             "| method | split | overall | per seed | domains | vs length-only (paired SE) |", "|---|---|---|---|---|---|"]
    for k, by in out["rows"].items():
        for name, r in by.items():
            lines.append(f"| {k} | {name} | {r['overall']:.4f} | " + " / ".join(f"{x:.4f}" for x in r["per_seed"]) + " | "
                         + " / ".join(f"{d} {v:.3f}" for d, v in r["domains"].items())
                         + f" | {r['vs_length_only']['gain']:+.4f} ± {r['vs_length_only']['se']:.4f} |")
    return "\n".join(lines) + "\n"


def plot(out: dict, path: Path) -> None:
    """``--part gap``: each start's gain over structure_only on validation, ± paired SE (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from trainer.report import save_figure

    rows = out["rows"]
    names = list(rows)[::-1]
    gain = [rows[k]["vs_structure_only"]["gain"] for k in names]
    se = [rows[k]["vs_structure_only"]["se"] for k in names]
    fig, ax = plt.subplots(figsize=(9, 0.38 * len(names) + 1.2))
    ax.barh(range(len(names)), gain, xerr=se, color=["tab:orange" if "oracle" in k else "tab:blue" for k in names])
    ax.set_yticks(range(len(names)), [k if len(k) < 60 else k[:57] + "..." for k in names], fontsize=7)
    ax.axvline(0, color="k", lw=0.8)
    ax.set_xlabel("validation accuracy minus structure_only (paired SE; orange: reads the domain label)")
    ax.set_title(f"FedPrism's start vs the structure baseline ({out['n_val']} validation pairs, seeds {out['seeds']})",
                 fontsize=9)
    save_figure(fig, path)


def main(argv=None) -> None:
    import torch

    from trainer.report import write_json, write_text

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", type=Path, default=Path("../shared/data"))
    ap.add_argument("--out", type=Path, default=Path("docs/results"))
    ap.add_argument("--part", choices=("gap", "quick_size", "prior", "roles", "roles_quick"), required=True,
                    help="roles_quick: --part roles on the quick preset's training pairs (validation only)")
    ap.add_argument("--plot-only", action="store_true", help="--part gap: redraw the PNG from the saved JSON")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    stem = args.out / f"prism_start_gap_{args.part}"
    if args.plot_only:
        plot(json.loads(stem.with_suffix(".json").read_text()), stem.with_suffix(".png"))
        return
    out = {"gap": part_gap, "quick_size": part_quick_size, "prior": part_prior, "roles": part_roles,
           "roles_quick": lambda d: part_roles(d, "quick")}[args.part](args.data)
    write_json(stem.with_suffix(".json"), out)
    write_text(stem.with_suffix(".md"), markdown(out))
    if args.part == "gap":
        plot(out, stem.with_suffix(".png"))
    print(markdown(out))


if __name__ == "__main__":
    main()
