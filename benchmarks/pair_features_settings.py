"""Choose the pair features of :mod:`sdk.pair_features` on the **validation** pairs (issue 29).

Data: every pair of :func:`trainer.data.preferences.load_preference_pairs` (defaults, seed 0), split by
prompt 0.6 / 0.2 / 0.2 as the FedPrism presets split them (:func:`trainer.data.preferences.split_by_prompt`).
Model: the per-domain logistic regression of :class:`trainer.length_baseline.LengthBaseline` (no
intercept, antisymmetric features), fitted on all training pairs.

Rule: forward selection starting from the three length features. Each step adds the feature that lowers
the validation log-loss (mean over pairs, per-domain models) most; selection stops when no feature lowers
it by at least ``--min-gain`` (default 0.0005 nats per pair). Then ``C`` is chosen from (0.1, 1, 10) on
the same validation log-loss. The test pairs are scored once, for the report only (paired standard
errors against the per-domain length-only baseline), never for a choice.

``PYTHONPATH=. HF_HUB_OFFLINE=1 python benchmarks/pair_features_settings.py --out docs`` writes
``docs/pair_features_settings.{json,png}``; copy the chosen names into
:data:`sdk.pair_features.DEFAULT_FEATURES`.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np


def _fit_predict(x_tr, y_tr, d_tr, x_ev, d_ev, C: float, per_domain: bool = True) -> np.ndarray:
    from sklearn.linear_model import LogisticRegression

    keys_tr = d_tr if per_domain else np.full(len(d_tr), "*")
    keys_ev = d_ev if per_domain else np.full(len(d_ev), "*")
    p = np.zeros(len(x_ev))
    for k in np.unique(keys_tr):
        lr = LogisticRegression(C=C, fit_intercept=False, max_iter=1000).fit(x_tr[keys_tr == k], y_tr[keys_tr == k])
        sel = keys_ev == k
        p[sel] = 1.0 / (1.0 + np.exp(-x_ev[sel] @ lr.coef_[0]))
    return p


def _log_loss(p: np.ndarray, y: np.ndarray) -> float:
    p = np.clip(p, 1e-7, 1 - 1e-7)
    return float(-(y * np.log(p) + (1 - y) * np.log(1 - p)).mean())


def _acc(p: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Per-pair correctness (a tie counts 1/2), float64."""
    return np.where(p == 0.5, 0.5, ((p > 0.5) == (y == 1)).astype(np.float64))


def paired(c_new: np.ndarray, c_base: np.ndarray) -> dict:
    """Accuracy gain of ``c_new`` over ``c_base`` (per-pair correctness) with its paired standard error."""
    d = c_new - c_base
    return {"gain": float(d.mean()), "se": float(d.std(ddof=1) / np.sqrt(len(d)))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default="../shared/data")
    ap.add_argument("--out", type=Path, default=Path("docs"))
    ap.add_argument("--min-gain", type=float, default=0.0005)
    args = ap.parse_args()

    from sdk.pair_encoding import LENGTH_FEATURE_NAMES
    from sdk.pair_features import FEATURE_NAMES, pair_features_many
    from trainer.data.preferences import load_preference_pairs, split_by_prompt
    from trainer.report import save_figure, write_json

    t0 = time.time()
    pairs = load_preference_pairs(args.data, seed=0)
    parts = split_by_prompt(pairs, (0.6, 0.2, 0.2), seed=0)
    xs = [pair_features_many(list(p.prompt), list(p.response_a), list(p.response_b), FEATURE_NAMES).astype(np.float64)
          for p in parts]
    ys = [p.label.to_numpy(dtype=np.float64) for p in parts]
    ds = [p.domain.to_numpy().astype(str) for p in parts]
    col = {n: i for i, n in enumerate(FEATURE_NAMES)}

    def val_loss(names, C=1.0) -> float:
        c = [col[n] for n in names]
        return _log_loss(_fit_predict(xs[0][:, c], ys[0], ds[0], xs[1][:, c], ds[1], C), ys[1])

    chosen = list(LENGTH_FEATURE_NAMES)
    steps = [{"added": None, "val_log_loss": val_loss(chosen)}]
    while True:
        rest = [n for n in FEATURE_NAMES if n not in chosen]
        if not rest:
            break
        losses = {n: val_loss(chosen + [n]) for n in rest}
        best = min(losses, key=losses.get)
        if steps[-1]["val_log_loss"] - losses[best] < args.min_gain:
            break
        chosen.append(best)
        steps.append({"added": best, "val_log_loss": losses[best]})
        print(f"+ {best}: val log-loss {losses[best]:.4f}", flush=True)
    c_losses = {C: val_loss(chosen, C) for C in (0.1, 1.0, 10.0)}
    C = min(c_losses, key=c_losses.get)

    def scores(names, split: int, per_domain=True, c=C) -> np.ndarray:
        idx = [col[n] for n in names]
        return _fit_predict(xs[0][:, idx], ys[0], ds[0], xs[split][:, idx], ds[split], c, per_domain)

    report = {}
    for split, name in ((1, "val"), (2, "test")):
        base = _acc(scores(LENGTH_FEATURE_NAMES, split, c=1.0), ys[split])
        rows = {"length_only": base,
                "length_only_global": _acc(scores(LENGTH_FEATURE_NAMES, split, False, 1.0), ys[split]),
                "structure_only": _acc(scores(chosen, split), ys[split]),
                "structure_only_global": _acc(scores(chosen, split, False), ys[split]),
                "all_features": _acc(scores(FEATURE_NAMES, split), ys[split])}
        report[name] = {"n_pairs": int(len(base)), "methods": {}}
        for m, c in rows.items():
            per = {d: float(c[ds[split] == d].mean()) for d in sorted(set(ds[split]))}
            report[name]["methods"][m] = {"overall": float(c.mean()), **per,
                                          "vs_length_only": paired(c, base)}
    result = {"rule": f"forward selection on validation log-loss (per-domain LR), min gain {args.min_gain}; "
                      "C from (0.1, 1, 10) on validation log-loss",
              "n_pairs": {"train": len(parts[0]), "val": len(parts[1]), "test": len(parts[2])},
              "steps": steps, "chosen": chosen, "C": C, "C_val_log_loss": {str(k): v for k, v in c_losses.items()},
              "results": report, "seconds": round(time.time() - t0, 1)}
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "pair_features_settings.json", result)

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(range(len(steps)), [s["val_log_loss"] for s in steps], marker="o")
    ax.set_xticks(range(len(steps)), ["length"] + [f"+{s['added']}" for s in steps[1:]], rotation=45, ha="right")
    ax.set_ylabel("validation log-loss (per-domain LR)")
    ax.set_title("Pair features chosen by forward selection")
    save_figure(fig, args.out / "pair_features_settings.png")
    print(f"chosen {chosen}, C={C}")
    for name, r in report.items():
        print(name, {m: (round(v["overall"], 4), round(v["vs_length_only"]["gain"], 4), round(v["vs_length_only"]["se"], 4))
                     for m, v in r["methods"].items()})


if __name__ == "__main__":
    main()
