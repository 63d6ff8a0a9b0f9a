"""Choose how the experts' heads train on top of their federated length start, on the **validation**
pairs only (issue 10; docs/prism.md "Residual over the length prior").

Every expert starts as exactly the federated length-only regression (``length_init='fedavg_lr'``: the
length path ``v`` at the FedAvg of the clients' local regressions, the content part ``w2 . tanh(...) +
b2`` at zero; :mod:`trainer.experts.length_init`). Variants of what training may then change, the same
head design for every method (FedPrism and FedBis here):

- ``trained``: everything (LoRA, content head, length path) at ``expert_lr = 1e-3`` (the previous default).
- ``residual``: the length path stays at the federated prior (``length_lr_scale = 0``); LoRA and the
  content head learn a residual over it.
- ``residual_lr1e-2``: ``residual`` with ``expert_lr = 1e-2`` for LoRA and the content head. The content
  part starts at zero (``w2 = 0``), so the first step moves only ``w2`` and LoRA gets a gradient only
  through it; with one local step per expert and client in most rounds (about 7 routed pairs, batches
  of 16) the residual stays near zero at 1e-3 (the prior barely moves: ``init`` vs ``trained``).
- ``residual_es_lr1e-2``: ``residual_lr1e-2`` + per-expert early stopping on the clients' local
  validation splits (``client_val_fraction = 0.2``: each client keeps 20 % of its pairs out of
  training; the server keeps per expert the state with the lowest federated validation loss, the
  initial prior included).
- ``domain_residual_lr1e-2``: ``residual_lr1e-2`` over a *per-domain* prior (``length_prior='domain'``):
  every expert adds the fixed offset ``w_d . f`` of the pair's domain (FedAvg of the clients' local
  per-domain length-only regressions) and its own length path starts at 0 and stays there. It reads the
  domain label at prediction time, the same input as the per-domain length-only baseline of the table.
- ``domain_residual_lr1e-2@s0.5``: the same trained run, its content residual (``w2``, ``b2``) served at
  half scale (``residual_scale = 0.5``, scored post hoc on the same experts: shrinkage towards the prior).
- ``domain_init`` (reference): the per-domain prior alone, before any training (the same for every seed
  up to the clients' FedAvg weights).
- ``init`` (reference, not a candidate; the preset's length start, which every variant shares except
  that ``residual_es_lr1e-2`` fits it on the clients' train parts only): the experts before round 1, i.e. the federated length prior
  under the initial routing, no training at all.

``PYTHONPATH=. HF_HUB_OFFLINE=1 python benchmarks/prism_residual_settings.py --seed S --out DIR`` runs one
seed (the seeds run as separate processes, so they can run side by side) and writes
``DIR/prism_residual_settings_seed<S>.json`` after every run; ``--choose`` then combines the seeds into
``DIR/prism_residual_settings.{json,md,png}``. ``--priors`` writes the length-prior diagnosis (no
selector training; :func:`prior_analysis`) to ``DIR/prism_residual_settings_priors.json``.

Rule: the variant with the highest FedPrism validation accuracy, averaged over the seeds (FedPrism is the
method being tuned; FedBis gets the same head variant, so the comparison stays fair); ties to the
simpler variant (order of :data:`VARIANTS`). The CPU preset's 450 validation pairs; the test pairs are
never read.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

# every field explicit: each variant means the same whatever PRESETS["cpu"] carries
_EXPERT = {"length_prior": "expert", "residual_scale": 1.0}
VARIANTS = {"trained": {"length_lr_scale": 1.0, "expert_lr": 1e-3, "client_val_fraction": 0.0, **_EXPERT},
            "residual": {"length_lr_scale": 0.0, "expert_lr": 1e-3, "client_val_fraction": 0.0, **_EXPERT},
            "residual_lr1e-2": {"length_lr_scale": 0.0, "expert_lr": 1e-2, "client_val_fraction": 0.0, **_EXPERT},
            "residual_es_lr1e-2": {"length_lr_scale": 0.0, "expert_lr": 1e-2, "client_val_fraction": 0.2, **_EXPERT},
            "domain_residual_lr1e-2": {"length_lr_scale": 0.0, "expert_lr": 1e-2, "client_val_fraction": 0.0,
                                       "length_prior": "domain", "residual_scale": 1.0}}
# residual shrinkage, scored post hoc on the same trained run (residual_scale acts only on the served experts)
SCALES = (0.5,)
for _v in ("domain_residual_lr1e-2",):
    for _s in SCALES:
        VARIANTS[f"{_v}@s{_s:g}"] = {**VARIANTS[_v], "residual_scale": _s}
METHODS = ("fedprism", "fedbis")
# methods of the table (FedPrism alone is tuned); random routing is scored under some variants to show what the
# routing adds over the same head
TABLE_METHODS = METHODS + ("random_routing",)


def run_seed(data_dir: Path, seed: int, out: Path, variants=tuple(VARIANTS), methods=METHODS) -> dict:
    import torch  # torch: optional heavy dependency

    from trainer.experts.experiment import PRESETS, _federated, prepare_data  # imports pandas, torch: on use only
    from trainer.experts.fedprism import FedPrismTrainer, method_config  # imports torch: on use only
    from trainer.report import write_json  # matplotlib neighbours: on use only

    torch.set_num_threads(1)
    preset, base = PRESETS["cpu"]
    base = replace(base, router_role_scale=0.0)  # the embedding-only router its recorded figures used
    from trainer.experts.selector import PairSelector  # imports torch: on use only

    model = PairSelector(base.selector, seed=0)
    prep = prepare_data(data_dir, preset, model, progress=False)
    data = _federated(prep, preset, seed, "val")
    path = out / f"prism_residual_settings_seed{seed}.json"
    res = json.loads(path.read_text()) if path.exists() else {"seed": seed, "split": "val", "n_val": len(prep.val),
                                                               "runs": {}}

    def record(name, trainer, t0):
        ev = getattr(trainer, "last_eval_", None) or trainer.evaluate()  # a trained run scored its last round
        res["runs"][name] = {"acc": ev["accuracy"]["overall"],
                             "domains": {str(k): v for k, v in ev["accuracy"].items() if k != "overall"},
                             "best_round": list(trainer.best_round_), "seconds": round(time.time() - t0, 1)}
        print(name, json.dumps(res["runs"][name]), flush=True)
        write_json(path, res)

    for m in methods:
        for name, prior in ((f"{m}/init", "expert"), (f"{m}/domain_init", "domain")):
            if name not in res["runs"]:
                t0 = time.time()
                cfg = replace(method_config(m, base), seed=seed, length_prior=prior)
                record(name, FedPrismTrainer(model, data, cfg).setup(), t0)
    for m in methods:
        for v in variants:
            name = f"{m}/{v}"
            if name in res["runs"] or "@" in v:
                continue
            t0 = time.time()
            cfg = replace(method_config(m, base), seed=seed, **VARIANTS[v])
            trainer = FedPrismTrainer(model, data, cfg, progress=False).train()
            record(name, trainer, t0)
            for sv in [w for w in VARIANTS if w.startswith(v + "@")]:  # post hoc: same experts, shrunk residual
                t0 = time.time()
                trainer.args = replace(cfg, residual_scale=VARIANTS[sv]["residual_scale"])
                trainer.last_eval_ = None
                record(f"{m}/{sv}", trainer, t0)
    return res


def choose(out: Path) -> dict:
    seeds = sorted(out.glob("prism_residual_settings_seed*.json"))
    runs = [json.loads(p.read_text()) for p in seeds]
    table = {}
    for m in TABLE_METHODS:
        for v in ("init", "domain_init") + tuple(VARIANTS):
            vals = [r["runs"][f"{m}/{v}"]["acc"] for r in runs if f"{m}/{v}" in r["runs"]]
            doms = {}
            for r in runs:
                for d, a in r["runs"].get(f"{m}/{v}", {}).get("domains", {}).items():
                    doms.setdefault(d, []).append(a)
            table[f"{m}/{v}"] = {"acc_mean": float(np.mean(vals)) if vals else None,
                                 "acc_std": float(np.std(vals, ddof=1)) if len(vals) > 1 else 0.0,
                                 "acc_per_seed": vals, "domains": {d: float(np.mean(a)) for d, a in doms.items()}}
    complete = [v for v in VARIANTS if runs and len(table[f"fedprism/{v}"]["acc_per_seed"]) == len(runs)]
    best = max(table[f"fedprism/{v}"]["acc_mean"] for v in complete)
    chosen = next(v for v in complete if table[f"fedprism/{v}"]["acc_mean"] == best)
    return {"split": "val", "seeds": [r["seed"] for r in runs], "table": table, "chosen_variant": chosen,
            "chosen_settings": VARIANTS[chosen],
            "rule": "argmax of FedPrism's mean validation accuracy over the seeds; ties to the simpler variant"}


def markdown(result: dict) -> str:
    doms = sorted({d for r in result["table"].values() for d in r["domains"]})
    lines = [f"Validation pairwise accuracy (450 pairs, seeds {result['seeds']}; mean +- std over seeds)", "",
             "| method / head variant | overall | per seed | " + " | ".join(doms) + " |",
             "|---|---|---|" + "---|" * len(doms)]
    for name, r in result["table"].items():
        if r["acc_mean"] is None:
            continue
        mark = " **(chosen)**" if name == "fedprism/" + result["chosen_variant"] else ""
        lines.append(f"| {name}{mark} | {r['acc_mean']:.3f} +- {r['acc_std']:.3f} | "
                     + " / ".join(f"{x:.3f}" for x in r["acc_per_seed"]) + " | "
                     + " | ".join(f"{r['domains'].get(d, float('nan')):.3f}" for d in doms) + " |")
    lines += ["", f"Chosen: `{result['chosen_variant']}` {result['chosen_settings']} ({result['rule']})."]
    return "\n".join(lines) + "\n"


def table_has(result: dict, v: str) -> bool:
    """True when FedPrism has at least one validation run of variant ``v``."""
    return bool(result["table"][f"fedprism/{v}"]["acc_per_seed"])


def plot(result: dict, path: Path) -> None:
    import matplotlib  # matplotlib: optional heavy dependency

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # matplotlib: optional heavy dependency

    from trainer.report import save_figure  # imports matplotlib: on use only

    names = ("init", "domain_init") + tuple(v for v in VARIANTS if table_has(result, v))
    fig, ax = plt.subplots(figsize=(8, 4.4))
    x = np.arange(len(names))
    width = 0.8 / len(TABLE_METHODS)
    for i, m in enumerate(TABLE_METHODS):
        rows = [result["table"][f"{m}/{v}"] for v in names]
        off = (i - (len(TABLE_METHODS) - 1) / 2) * width
        ax.bar(x + off, [r["acc_mean"] or 0 for r in rows], width, yerr=[r["acc_std"] for r in rows], label=m, capsize=3)
        for j, r in enumerate(rows):
            ax.scatter([x[j] + off] * len(r["acc_per_seed"]), r["acc_per_seed"], color="k", s=8, zorder=3)
    ax.set_xticks(x, [n.replace("_", " ").replace("@", "\n") for n in names], fontsize=7, rotation=20, ha="right")
    ref = Path(__file__).resolve().parents[1] / "docs" / "results" / "prism_experts_settings.json"
    if ref.exists():  # the centralised per-domain length-only regression on the same validation pairs
        ax.axhline(json.loads(ref.read_text())["centralised"]["domain_oracle_length"], color="k", ls="--", lw=1,
                   label="length-only (per domain, centralised)")
    ax.set_ylim(0.6, 0.84)
    ax.set_ylabel("validation pairwise accuracy (450 pairs)")
    ax.set_title(f"Head variants on the length prior; chosen: {result['chosen_variant']}")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    save_figure(fig, path)


def prior_analysis(data_dir: Path, seeds=(0, 1, 2)) -> dict:
    """Diagnosis, no selector training: validation accuracy of length priors alone (``--priors``).

    Per seed (the seed's clients): ``expert`` (the CPU preset's prior: per expert, the FedAvg of the
    clients' local regressions on the pairs the K-means-initialised router sends to it), ``global`` (one
    FedAvg regression), ``domain_federated`` (FedAvg per domain, the domain label read at prediction:
    the ``length_prior='domain'`` start), ``domain_predicted`` (the same weights picked by a federated
    3-class prompt classifier instead of the label: a :class:`PromptRouter` trained by 5 rounds of FedAvg
    of local ``fit_router`` on the clients' prompt embeddings and domain labels), ``domain_pooled`` (the
    length-only baseline: per-domain regression on the pooled client pairs).
    """
    import torch  # torch: optional heavy dependency

    from trainer.experts.experiment import PRESETS, _federated, prepare_data  # imports pandas, torch: on use only
    from trainer.experts.length_init import client_length_coefs, fedavg_length_coefs  # numpy + sklearn
    from trainer.experts.prompt_router import PromptRouter, fit_router, kmeans_init  # imports torch: on use only
    from trainer.experts.selector import PairSelector  # imports torch: on use only
    from trainer.length_baseline import LengthBaseline  # imports pandas: on use only
    from trainer.routers.fedavg import fedavg  # numpy only

    torch.set_num_threads(1)
    preset, base = PRESETS["cpu"]
    prep = prepare_data(data_dir, preset, PairSelector(base.selector, seed=0), progress=False)
    f, y = prep.store.features.numpy().astype(np.float64), prep.store.label.numpy().astype(np.int64)
    emb = prep.prompt_emb
    dom = np.concatenate([prep.train.domain, prep.val.domain, prep.test.domain]).astype(str)
    doms = np.unique(dom)
    di = np.searchsorted(doms, dom)
    va = np.arange(len(prep.train), len(prep.train) + len(prep.val))

    def acc(logit):
        r = {"overall": float(((logit[va] > 0) == y[va]).mean())}
        for k, name in enumerate(doms):
            s = va[di[va] == k]
            r[str(name)] = float(((logit[s] > 0) == y[s]).mean())
        return r

    out = {"split": "val", "n_val": int(len(va)), "seeds": {}}
    for seed in seeds:
        cl = _federated(prep, preset, seed, "val").clients
        router = PromptRouter(emb.shape[1], base.n_experts, base.router_hidden, seed=seed)
        kmeans_init(router, prep.public_emb, lr=base.init_lr, epochs=base.init_epochs, seed=seed)
        a = router.route(emb)
        w_exp = fedavg_length_coefs([client_length_coefs(f[c], y[c], a[c], base.n_experts) for c in cl], base.n_experts)
        w_dom = fedavg_length_coefs([client_length_coefs(f[c], y[c], di[c], len(doms)) for c in cl], len(doms))
        w_glo = fedavg_length_coefs([client_length_coefs(f[c], y[c], np.zeros(len(c), int), 1) for c in cl], 1)
        clf = PromptRouter(emb.shape[1], len(doms), base.router_hidden, seed=seed)
        for rnd in range(5):
            ups = []
            for c in cl:
                loc = PromptRouter(emb.shape[1], len(doms), base.router_hidden)
                loc.load_state(clf.state())
                fit_router(loc, emb[c], di[c], lr=1e-2, epochs=3, seed=rnd)
                ups.append((loc.state(), float(len(c))))
            clf.load_state({k: v.astype(np.float32) for k, v in fedavg(ups).items()})
        dhat = clf.route(emb)
        pooled = LengthBaseline(per_domain=True).fit(prep.train.iloc[np.concatenate(cl)])
        w_pool = np.stack([pooled.coef_[str(d)] for d in doms])
        out["seeds"][str(seed)] = {
            "expert": acc((f * w_exp[a]).sum(1)), "global": acc(f @ w_glo[0]),
            "domain_federated": acc((f * w_dom[di]).sum(1)), "domain_predicted": acc((f * w_dom[dhat]).sum(1)),
            "domain_pooled": acc((f * w_pool[di]).sum(1)),
            "domain_classifier_val_accuracy": float((dhat[va] == di[va]).mean()),
            "coefs": {"domain_federated": w_dom.tolist(), "domain_pooled": w_pool.tolist(), "domains": doms.tolist()}}
        print(seed, json.dumps({k: v for k, v in out["seeds"][str(seed)].items() if k != "coefs"}), flush=True)
    return out


PRIORS = ("global", "expert", "domain_predicted", "domain_federated", "domain_pooled")


def plot_priors(result: dict, path: Path) -> None:
    """Validation accuracy of each length prior alone (mean over seeds, dots per seed), overall and per domain."""
    import matplotlib  # matplotlib: optional heavy dependency

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # matplotlib: optional heavy dependency

    from trainer.report import save_figure  # imports matplotlib: on use only

    seeds = list(result["seeds"].values())
    parts = ("overall", "alpacaeval", "hh_harmless", "routerbench")
    fig, axes = plt.subplots(1, len(parts), figsize=(12, 3.6), sharey=False)
    for ax, part in zip(axes, parts):
        vals = np.array([[s[p][part] for s in seeds] for p in PRIORS])
        ax.bar(np.arange(len(PRIORS)), vals.mean(1), color=["C7", "C0", "C1", "C2", "k"])
        for i, row in enumerate(vals):
            ax.scatter([i] * len(row), row, color="r", s=8, zorder=3)
        ax.set_xticks(np.arange(len(PRIORS)), [p.replace("_", "\n") for p in PRIORS], fontsize=7)
        ax.set_ylim(vals.min() - 0.05, min(1.0, vals.max() + 0.03))
        ax.set_title(part, fontsize=9)
    axes[0].set_ylabel("validation accuracy, prior alone")
    fig.suptitle("Length priors without training (450 validation pairs, seeds 0-2): "
                 "the routed per-expert prior vs per-domain fits", fontsize=9)
    save_figure(fig, path)


def main() -> None:
    from trainer.report import write_json, write_text  # matplotlib neighbours: on use only

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=Path("../shared/data"))
    ap.add_argument("--out", type=Path, default=Path("docs/results/prism_residual_settings"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--choose", action="store_true", help="combine the per-seed JSONs already written")
    ap.add_argument("--priors", action="store_true", help="the length-prior diagnosis (no selector training)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, in the order to run")
    ap.add_argument("--methods", default=",".join(METHODS), help="comma-separated, in the order to run")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.priors:  # computed once (no selector training), then plotted
        path = args.out / "prism_residual_settings_priors.json"
        if not path.exists():
            write_json(path, prior_analysis(args.data))
        plot_priors(json.loads(path.read_text()), args.out / "prism_residual_settings_priors.png")
        return
    if args.choose:
        result = choose(args.out)
        write_json(args.out / "prism_residual_settings.json", result)
        write_text(args.out / "prism_residual_settings.md", markdown(result))
        plot(result, args.out / "prism_residual_settings.png")
        print(markdown(result))
        return
    run_seed(args.data, args.seed, args.out, variants=tuple(args.variants.split(",")), methods=tuple(args.methods.split(",")))


if __name__ == "__main__":
    main()
