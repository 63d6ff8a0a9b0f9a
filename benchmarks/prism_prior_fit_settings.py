"""How the FedPrism experts' feature path ``v_k`` starts, chosen on the **validation** pairs (issue 29).

Why FedPrism (quick preset, -0.010 +- 0.005 vs per-domain length-only) lost to the central structure-feature
baseline (+0.012) on the same 11 features: every expert is ``v_k . f`` + a content residual, and ``v_k`` was the
**FedAvg of local fits** (:func:`trainer.experts.length_init.fedavg_length_coefs`): each client fits the 11-weight
regression on the few pairs it routes to expert ``k`` (600 training pairs / 20 clients / 6 experts = about 5 on
the quick preset, about 90 on every pair) and the server averages those noisy fits. This script scores, with no
selector training and the K-means-initialised router of each seed (what round 1 starts from):

- ``fedavg_local``: that start (C = ``length_C`` of the preset).
- ``global``: one exact federated fit on every client pair for all experts (``pool_C = None`` of
  :func:`trainer.experts.length_init.pooled_expert_coefs`: L-BFGS over the clients' summed loss and gradient,
  equal to the central fit); label-free.
- ``pooled_C<c>``: per expert, the exact federated fit on the pairs routed to it, pulled towards ``global``
  with inverse strength ``c`` (hierarchical prior; small ``c`` = ``global``).
- ``@r<n>``: the router's start, ``n`` rounds of federated distillation onto the public K-means centroids over
  the clients' prompts (:func:`trainer.experts.prompt_router.centroid_distillation`; 0 = fitted to the public
  prompts alone, the previous start); ``routing_purity`` is the share of validation pairs in their expert's
  majority domain.
- the logistic baselines of every table, fitted on the same client pairs: ``length_only`` (per domain),
  ``length_only_global`` (label-free) and ``structure_only`` (per domain, the 11 features, C = 10).

Rule: the start with the highest mean validation accuracy over the seeds (ties to the earlier entry of
:data:`STARTS`). The test pairs are never read. Every pair of the split (the ``cpu`` preset: 10,939 train /
4,293 validation pairs) or the quick preset's training pairs (``--preset quick``, scored on the full
validation split, which that preset never trains on; 2,400 now, 600 when ``prism_prior_fit_settings_quick`` was
written).

``PYTHONPATH=. HF_HUB_OFFLINE=1 python benchmarks/prism_prior_fit_settings.py --data ../shared/data --out docs/results``
writes ``prism_prior_fit_settings_<preset>.{json,md}``. Needs the prompt embeddings only (no segment cache).

``--test DIR`` then scores the start chosen on validation (the saved json's ``chosen``) on every **test** pair,
per seed, as the experts of round 0 (no backbone training): ``fedprism_start`` (the chosen start, routed by the
router it fitted), ``fedbis_start`` (the global fit: one expert) and ``random_routing_start`` (per-expert fits on
a uniform random assignment, test pairs drawn too), and writes ``DIR/results.json`` (``seeds``) and
``DIR/eval_proba.npz`` in the layout of ``fedroute prism train``, so that ``benchmarks/prism_generator_prior.py
--preset cpu --run DIR`` reports them with and without the generator prior beside the three baselines.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

POOL_CS = (0.1, 1.0, 5.0, 50.0)
ROUTER_INIT_ROUNDS = (0, 1, 3)
STARTS = ("global",) + tuple(f"pooled_C{c:g}@r{r}" for r in ROUTER_INIT_ROUNDS for c in POOL_CS) + tuple(
    f"fedavg_local@r{r}" for r in ROUTER_INIT_ROUNDS)
BASELINES = ("length_only", "length_only_global", "structure_only")


def _scores(logit: np.ndarray, y: np.ndarray, dom: np.ndarray) -> dict:
    correct = ((logit > 0) == y).astype(np.float64)
    out = {"overall": float(correct.mean())}
    for d in np.unique(dom):
        out[str(d)] = float(correct[dom == d].mean())
    return out, correct


def run(data_dir: Path, preset_name: str, seeds) -> dict:
    import pandas as pd  # pandas: optional heavy dependency
    import torch  # torch: optional heavy dependency

    from sdk.pair_features import pair_features_many
    from trainer.data.preferences import dirichlet_clients
    from trainer.embeddings import embed_texts
    from trainer.experts.experiment import LENGTH_ONLY, PRESETS, split_frames  # imports torch: on use only
    from trainer.experts.length_init import client_length_coefs, fedavg_length_coefs, pooled_expert_coefs
    from trainer.experts.prompt_router import PromptRouter, centroid_distillation, kmeans_init  # imports torch
    from trainer.length_baseline import LengthBaseline

    torch.set_num_threads(1)
    preset, base = PRESETS[preset_name]
    full, _ = PRESETS["cpu"]
    train, _, _, public = split_frames(data_dir, preset, 0)
    _, val, _, _ = split_frames(data_dir, full, 0)  # the full validation split (the quick preset has none)
    names = base.selector.pair_features
    f_tr = pair_features_many(list(train.prompt), list(train.response_a), list(train.response_b), names, exact=True)
    f_va = pair_features_many(list(val.prompt), list(val.response_a), list(val.response_b), names, exact=True)
    y_tr, y_va = train.label.to_numpy().astype(np.float64), val.label.to_numpy()
    dom_va = val.domain.to_numpy().astype(str)
    emb = embed_texts(list(train.prompt) + list(val.prompt) + list(public.prompt), show_progress=False)
    e_tr, e_va, e_pub = emb[: len(train)], emb[len(train): len(train) + len(val)], emb[len(train) + len(val):]
    out = {"preset": preset_name, "split": "val", "n_train": len(train), "n_val": len(val), "features": list(names),
           "length_C": base.length_C, "pool_Cs": list(POOL_CS), "seeds": {}}
    for seed in seeds:
        client = dirichlet_clients(train, preset.n_clients, preset.alpha, seed=seed)
        clients = [np.flatnonzero(client == i) for i in range(preset.n_clients)]
        clients = [c for c in clients if len(c)]
        res, correct, evals, purity = {}, {}, {}, {}
        router = PromptRouter(emb.shape[1], base.n_experts, base.router_hidden, seed=seed)
        kmeans_init(router, e_pub, lr=base.init_lr, epochs=base.init_epochs, seed=seed)
        done = 0
        for rounds in ROUTER_INIT_ROUNDS:
            if rounds > done:
                centroid_distillation(router, e_pub, [e_tr[c] for c in clients], rounds=rounds - done,
                                      lr=base.init_lr, seed=seed)
                done = rounds
            a_tr, a_va = router.route(e_tr), router.route(e_va)
            purity[f"r{rounds}"] = float(sum(np.unique(dom_va[a_va == k], return_counts=True)[1].max()
                                             for k in np.unique(a_va)) / len(a_va))
            w = fedavg_length_coefs([client_length_coefs(f_tr[c], y_tr[c], a_tr[c], base.n_experts, C=base.length_C)
                                     for c in clients], base.n_experts, len(names))
            key = f"fedavg_local@r{rounds}"
            res[key], correct[key] = _scores((f_va * w[a_va]).sum(1), y_va, dom_va)
            for c_pool in ((None,) if rounds == 0 else ()) + POOL_CS:
                key = "global" if c_pool is None else f"pooled_C{c_pool:g}@r{rounds}"
                w, evals[key] = pooled_expert_coefs(f_tr, y_tr, a_tr, clients, base.n_experts, base.length_C, c_pool)
                res[key], correct[key] = _scores((f_va * w[a_va]).sum(1), y_va, dom_va)
        tr = train.iloc[np.concatenate(clients)]
        for m in BASELINES:
            p = LengthBaseline(**LENGTH_ONLY[m]).fit(tr).predict_proba(val)
            res[m], correct[m] = _scores(np.log(p) - np.log1p(-p), y_va, dom_va)
        for k in res:
            d = correct[k] - correct["length_only"]
            res[k]["vs_length_only"] = float(d.mean())
            res[k]["paired_se"] = float(d.std(ddof=1) / np.sqrt(len(d)))
        res["lbfgs_rounds"] = evals
        res["routing_purity"] = purity
        out["seeds"][str(seed)] = res
        print(seed, json.dumps({k: round(v["overall"], 4) for k, v in res.items() if isinstance(v, dict) and "overall" in v}),
              flush=True)
    mean = {k: float(np.mean([out["seeds"][s][k]["overall"] for s in out["seeds"]])) for k in STARTS + BASELINES}
    out["mean_overall"] = mean
    out["chosen"] = max(STARTS, key=lambda k: (mean[k], -STARTS.index(k)))
    return out


def run_test(data_dir: Path, preset_name: str, seeds, chosen: str, out_dir: Path) -> dict:
    """The chosen start (and the FedBis / random-routing starts) on the test split (module docstring)."""
    import torch  # torch: optional heavy dependency

    from sdk.pair_features import pair_features_many
    from trainer.data.preferences import dirichlet_clients
    from trainer.embeddings import embed_texts
    from trainer.experts.experiment import PRESETS, split_frames, write_eval_proba  # imports torch: on use only
    from trainer.experts.length_init import pooled_expert_coefs
    from trainer.experts.prompt_router import PromptRouter, centroid_distillation, kmeans_init  # imports torch
    from trainer.report import write_json

    torch.set_num_threads(1)
    pool_C, rounds = float(chosen.split("@r")[0].removeprefix("pooled_C")), int(chosen.split("@r")[1])
    preset, base = PRESETS[preset_name]
    train, _, test, public = split_frames(data_dir, preset, 0)
    names = base.selector.pair_features
    f_tr = pair_features_many(list(train.prompt), list(train.response_a), list(train.response_b), names, exact=True)
    f_te = pair_features_many(list(test.prompt), list(test.response_a), list(test.response_b), names, exact=True)
    y_tr = train.label.to_numpy().astype(np.float64)
    emb = embed_texts(list(train.prompt) + list(test.prompt) + list(public.prompt), show_progress=False)
    e_tr, e_te, e_pub = emb[: len(train)], emb[len(train): len(train) + len(test)], emb[len(train) + len(test):]
    probas, shares = {}, []
    for seed in seeds:
        client = dirichlet_clients(train, preset.n_clients, preset.alpha, seed=seed)
        clients = [c for c in (np.flatnonzero(client == i) for i in range(preset.n_clients)) if len(c)]
        router = PromptRouter(emb.shape[1], base.n_experts, base.router_hidden, seed=seed)
        kmeans_init(router, e_pub, lr=base.init_lr, epochs=base.init_epochs, seed=seed)
        if rounds:
            centroid_distillation(router, e_pub, [e_tr[c] for c in clients], rounds=rounds, lr=base.init_lr, seed=seed)
        a_tr, a_te = router.route(e_tr), router.route(e_te)
        shares.append(np.bincount(a_te, minlength=base.n_experts) / len(a_te))
        rng = np.random.default_rng(seed)
        r_tr, r_te = rng.integers(0, base.n_experts, len(train)), rng.integers(0, base.n_experts, len(test))
        for m, (at, ae, c_pool) in {"fedprism_start": (a_tr, a_te, pool_C), "fedbis_start": (a_tr, a_te, None),
                                    "random_routing_start": (r_tr, r_te, pool_C)}.items():
            w, _ = pooled_expert_coefs(f_tr, y_tr, at, clients, base.n_experts, base.length_C, c_pool)
            probas[f"{m}_seed{seed}"] = 1.0 / (1.0 + np.exp(-(f_te * w[ae]).sum(1)))
        print(seed, flush=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_eval_proba(out_dir / "eval_proba.npz", test.pair_id.to_numpy().astype(str), probas)
    result = {"seeds": list(seeds), "preset": preset_name, "chosen": chosen, "n_test": len(test),
              "utilisation_max_share": [float(s.max()) for s in shares]}
    write_json(out_dir / "results.json", result)
    return result


def markdown(out: dict) -> str:
    seeds = list(out["seeds"])
    doms = [k for k in out["seeds"][seeds[0]]["global"] if k not in ("overall", "vs_length_only", "paired_se")]
    lines = [f"Validation ({out['n_val']} pairs), preset {out['preset']} ({out['n_train']} training pairs), "
             f"seeds {', '.join(seeds)}; chosen: **{out['chosen']}**", "",
             "| start | overall (mean over seeds) | " + " | ".join(doms) + " | vs length-only (paired SE, seed "
             f"{seeds[0]}) |", "|---" * (3 + len(doms)) + "|"]
    for k in STARTS + BASELINES:
        r = [out["seeds"][s][k] for s in seeds]
        per = " | ".join(f"{np.mean([x[d] for x in r]):.3f}" for d in doms)
        lines.append(f"| {k} | {np.mean([x['overall'] for x in r]):.4f} | {per} | "
                     f"{r[0]['vs_length_only']:+.3f} +- {r[0]['paired_se']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    from trainer.report import write_json, write_text  # matplotlib neighbours: on use only

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", type=Path, default=Path("../shared/data"))
    ap.add_argument("--out", type=Path, default=Path("docs/results"))
    ap.add_argument("--preset", choices=("cpu", "quick"), default="cpu")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--test", type=Path, default=None, help="score the chosen start on the test pairs into this folder")
    ap.add_argument("--start", default=None, help="with --test: this start (e.g. pooled_C1@r3, the presets') instead of "
                                                   "the one chosen for --preset")
    args = ap.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    if args.test is not None:
        chosen = args.start or json.loads((args.out / f"prism_prior_fit_settings_{args.preset}.json").read_text())["chosen"]
        print(run_test(args.data, args.preset, seeds, chosen, args.test))
        return
    out = run(args.data, args.preset, seeds)
    write_json(args.out / f"prism_prior_fit_settings_{args.preset}.json", out)
    write_text(args.out / f"prism_prior_fit_settings_{args.preset}.md", markdown(out))
    print(markdown(out))


if __name__ == "__main__":
    main()
