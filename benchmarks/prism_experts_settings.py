"""Choose FedPrism's number of experts M on the **validation** pairs, and measure what a length model
can reach at all (issue 10, docs/prism.md "What the data allow").

``PYTHONPATH=. HF_HUB_OFFLINE=1 python benchmarks/prism_experts_settings.py --data ../shared/data --out docs/results``
writes ``prism_experts_settings.json`` and ``prism_experts_settings.png``.

Everything here scores the CPU preset's 450 validation pairs; the test pairs are never read.

1. **Centralised references** (all 2,399 train pairs pooled, scikit-learn logistic regression without
   intercept on each pair and its position-swapped copy, C = 1): the length features ``f`` alone
   (global); ``f`` per *domain* (the oracle that is told the domain: the length-only baseline of the
   tables); ``f`` per *subset* (9 finer groups); ``f`` per K-means cluster of the frozen prompt
   embedding (the clusters FedPrism's router starts from, K-means fitted on the public prompts) for
   each M of the grid; a prompt-conditioned length model ``f + f (x) e`` (``e`` the 384-d prompt
   embedding: the length direction as a linear function of the prompt); and the domain oracle plus the
   response content (``h_A - h_B``, the selector's pooled top-layer vectors at initialisation). These
   bound what any model on length + prompt group (+ frozen content, linearly) can do on these pairs.
2. **Federated** (seed 0, the CPU preset's clients and schedule, federated length start): FedPrism for
   each M of :data:`M_GRID`, FedBis, random routing at M = 5, and FedPrism with the *domain oracle*
   routing (``routing='domain_oracle'``, M = 3: every pair to its domain's expert; an upper reference,
   not a method).

Rule: M = the FedPrism validation accuracy's argmax among the M whose utilisation max share is
<= 0.6 (the issue's target); ties to the smaller M.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

M_GRID = (3, 4, 5, 6, 8)
MAX_SHARE = 0.6


def _lr_accuracy(x_tr, y_tr, x_ev, y_ev, C: float = 1.0) -> float:
    from sklearn.linear_model import LogisticRegression  # sklearn: optional heavy dependency

    m = LogisticRegression(C=C, fit_intercept=False, max_iter=3000).fit(
        np.concatenate([x_tr, -x_tr]), np.concatenate([y_tr, 1 - y_tr]))
    return float(((m.predict_proba(x_ev)[:, 1] > 0.5) == y_ev).mean())


def _by_group(f: np.ndarray, group: np.ndarray) -> np.ndarray:
    """(n, 3 * n_groups): the length features in the column block of each pair's group (per-group model)."""
    keys = np.unique(group)
    onehot = (group[:, None] == keys[None, :]).astype(np.float64)
    return (f[:, :, None] * onehot[:, None, :]).reshape(len(f), -1)


def centralised(prep, model, seeds=(0, 1, 2)) -> dict:
    import torch  # torch: optional heavy dependency
    from sklearn.cluster import KMeans  # sklearn: optional heavy dependency

    n_tr, n_va = len(prep.train), len(prep.val)
    tr, va = np.arange(n_tr), np.arange(n_tr, n_tr + n_va)
    f = prep.store.features.numpy().astype(np.float64)
    y = prep.store.label.numpy().astype(np.int64)
    emb = prep.prompt_emb.astype(np.float64)
    dom = np.concatenate([prep.train.domain, prep.val.domain]).astype(str)
    sub = np.concatenate([prep.train.subset, prep.val.subset]).astype(str)
    idx = np.arange(n_tr + n_va)
    model.train(False)
    with torch.no_grad():
        h = np.concatenate([prep.store.batch(model, idx[s:s + 256])[0].numpy() - prep.store.batch(model, idx[s:s + 256])[1].numpy()
                            for s in range(0, len(idx), 256)])

    def acc(x, C=1.0):
        return _lr_accuracy(x[tr], y[tr], x[va], y[va], C)

    out = {"global_length": acc(f[idx]), "domain_oracle_length": acc(_by_group(f[idx], dom)),
           "subset_oracle_length": acc(_by_group(f[idx], sub)),
           "prompt_conditioned_length": acc(np.concatenate([f[idx], (f[idx, :, None] * emb[idx, None, :]).reshape(len(idx), -1)], 1)),
           "domain_oracle_length_plus_content": acc(np.concatenate([_by_group(f[idx], dom), h], 1), C=0.1),
           "kmeans_cluster_length": {}}
    for m in M_GRID:
        vals, shares = [], []
        for s in seeds:
            lab = KMeans(m, n_init=10, random_state=s).fit(prep.public_emb).predict(prep.prompt_emb[idx])
            vals.append(acc(_by_group(f[idx], lab)))
            shares.append(float(np.bincount(lab[va], minlength=m).max() / len(va)))
        out["kmeans_cluster_length"][str(m)] = {"acc_mean": float(np.mean(vals)), "acc_per_seed": vals,
                                               "max_share": float(np.mean(shares))}
    return out


def federated(prep, model, preset, base) -> dict:
    from trainer.experts.experiment import _federated  # trainer.experts.experiment imports pandas, torch: on use only
    from trainer.experts.fedprism import FedPrismTrainer, method_config  # imports torch: on use only
    from trainer.preference_metrics import expert_utilisation  # numpy only, kept beside its users

    data = _federated(prep, preset, 0, "val")
    runs = {}

    def run(name, cfg):
        t = time.time()
        tr = FedPrismTrainer(model, data, replace(cfg, seed=0), progress=True).train()
        ev = tr.evaluate()
        entry = {"acc": ev["accuracy"]["overall"], "domains": {k: v for k, v in ev["accuracy"].items() if k != "overall"},
                 "seconds": round(time.time() - t, 1)}
        if ev["assignment"] is not None and cfg.n_experts > 1:
            entry["max_share"] = float(expert_utilisation(ev["assignment"], cfg.n_experts)[1])
        runs[name] = entry
        print(name, entry, flush=True)

    for m in M_GRID:
        run(f"fedprism_M{m}", method_config("fedprism", replace(base, n_experts=m)))
    run("fedbis", method_config("fedbis", base))
    run("random_routing_M5", method_config("random_routing", replace(base, n_experts=5)))
    run("domain_oracle_routing_M3", replace(base, routing="domain_oracle", pgpd=False, n_experts=3))
    return runs


def choose(runs: dict) -> int:
    ok = [m for m in M_GRID if runs[f"fedprism_M{m}"].get("max_share", 1.0) <= MAX_SHARE] or list(M_GRID)
    best = max(runs[f"fedprism_M{m}"]["acc"] for m in ok)
    return min(m for m in ok if runs[f"fedprism_M{m}"]["acc"] == best)


def plot(result: dict, path: Path) -> None:
    import matplotlib  # matplotlib: optional heavy dependency

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # matplotlib: optional heavy dependency

    from trainer.report import save_figure  # imports matplotlib: on use only

    c, r = result["centralised"], result["federated"]
    names = ["global length", "domain oracle length", "subset oracle length", "prompt-cond. length",
             "domain oracle + content"] + [f"K-means M={m} length" for m in M_GRID]
    vals = [c["global_length"], c["domain_oracle_length"], c["subset_oracle_length"], c["prompt_conditioned_length"],
            c["domain_oracle_length_plus_content"]] + [c["kmeans_cluster_length"][str(m)]["acc_mean"] for m in M_GRID]
    fed_names = [f"FedPrism M={m}" for m in M_GRID] + ["FedBis", "random routing M=5", "domain-oracle routing"]
    fed_vals = [r[f"fedprism_M{m}"]["acc"] for m in M_GRID] + [r["fedbis"]["acc"], r["random_routing_M5"]["acc"],
                                                               r["domain_oracle_routing_M3"]["acc"]]
    fig, ax = plt.subplots(figsize=(8, 6))
    ys = np.arange(len(names) + len(fed_names))
    ax.barh(ys[: len(names)], vals, color="tab:gray", label="centralised logistic regression")
    ax.barh(ys[len(names):], fed_vals, color="tab:blue", label="federated (seed 0)")
    ax.axvline(c["domain_oracle_length"], color="k", ls="--", lw=1, label="length-only (domain oracle)")
    ax.set_yticks(ys, names + fed_names, fontsize=8)
    ax.set_xlim(0.6, 0.97)
    ax.set_xlabel("validation pairwise accuracy (450 pairs)")
    ax.set_title(f"What length + prompt group can reach; chosen M = {result['chosen_n_experts']}")
    ax.legend(fontsize=8, loc="lower right")
    ax.invert_yaxis()
    save_figure(fig, path)


def rebuild(log: Path, out: Path) -> dict:
    """The JSON and PNG from a run's printed output: the centralised JSON block, one ``name {dict}``
    line per federated run (``np.str_`` keys as printed), then the same rule of :func:`choose`."""
    import ast
    import re

    text = log.read_text()
    start = text.index("{\n")
    block, depth = "", 0
    for i, ch in enumerate(text[start:], start):
        depth += ch == "{"
        depth -= ch == "}"
        if depth == 0:
            block = text[start:i + 1]
            break
    runs = {}
    for line in text.splitlines():
        m = re.match(r"^(\w+) (\{.*\})$", line)
        if m:
            runs[m.group(1)] = ast.literal_eval(re.sub(r"np\.str_\(('[^']*')\)", r"\1", m.group(2)))
    result = {"split": "val", "centralised": json.loads(block), "federated": runs, "chosen_n_experts": choose(runs),
              "rule": f"argmax FedPrism val accuracy among M with max share <= {MAX_SHARE}; ties to the smaller M",
              "rebuilt_from_log": log.name}
    from trainer.report import write_json  # imports matplotlib's neighbours: on use only

    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "prism_experts_settings.json", result)
    plot(result, out / "prism_experts_settings.png")
    return result


def main() -> None:
    import torch  # torch: optional heavy dependency

    from trainer.experts.experiment import PRESETS, prepare_data  # imports pandas, torch: on use only
    from trainer.experts.selector import PairSelector  # imports torch: on use only
    from trainer.report import write_json

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=Path("../shared/data"))
    ap.add_argument("--out", type=Path, default=Path("docs/results"))
    ap.add_argument("--skip-federated", action="store_true")
    ap.add_argument("--from-log", type=Path, default=None,
                    help="rebuild the JSON and PNG from the printed output of an earlier run (no training)")
    args = ap.parse_args()
    if args.from_log is not None:
        rebuild(args.from_log, args.out)
        return
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    preset, base = PRESETS["cpu"]
    base = replace(base, router_role_scale=0.0)  # the embedding-only router its recorded figures used
    model = PairSelector(base.selector, seed=0)
    prep = prepare_data(args.data, preset, model, progress=False)
    result = {"split": "val", "n_val": len(prep.val), "centralised": centralised(prep, model)}
    print(json.dumps(result["centralised"], indent=1), flush=True)
    if not args.skip_federated:
        result["federated"] = federated(prep, model, preset, base)
        result["chosen_n_experts"] = choose(result["federated"])
        result["rule"] = f"argmax FedPrism val accuracy among M with max share <= {MAX_SHARE}; ties to the smaller M"
        plot(result, args.out / "prism_experts_settings.png")
    write_json(args.out / "prism_experts_settings.json", result)
    print("chosen n_experts:", result.get("chosen_n_experts"))


if __name__ == "__main__":
    main()
