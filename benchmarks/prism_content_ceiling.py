"""How much does the *whole* response's frozen MiniLM embedding add to the per-domain length model?
(issue 10, docs/prism.md "What the data allow"; validation pairs only, the test pairs are never read.)

``PYTHONPATH=. HF_HUB_OFFLINE=1 python benchmarks/prism_content_ceiling.py --data ../shared/data --out docs/results``
writes ``prism_content_ceiling.json`` and ``prism_content_ceiling.png`` (about 15 min on 2 cores the first
time: 4 x 2,850 texts through all-MiniLM-L6-v2 at 256 tokens; the embeddings are cached, later runs take
seconds).

``prism_experts_settings.py`` measured the per-domain length model plus the *selector's* content (its
pooled vectors of ``[CLS] prompt[-24:] [SEP] response[:40] [SEP]``): 0.796 against 0.800 for length alone.
This asks the wider question, centrally (every train pair pooled, no federation, the domain label
given): the CPU preset's 2,399 train pairs, each pair and its position-swapped copy, a scikit-learn
logistic regression without intercept on

- ``length_per_domain``: the length features ``f`` (3 log-length differences) in one block per domain
  (the length-only baseline of the tables; C = 1 as there);
- ``+ response``: ``e(y_A) - e(y_B)``, the sentence embeddings of the whole responses (first 256
  tokens, mean pooled, L2-normalised), shared by the domains or one block per domain;
- ``+ prompt and response``: ``e(x + y_A) - e(x + y_B)`` per domain (the MoR client models' input);
- both, per domain.

C is chosen per row by 5-fold cross-validation on the train pairs grouped by prompt, from :data:`C_GRID`;
the row's validation accuracy (450 pairs) is then measured once. The binomial standard deviation of one
accuracy on 450 pairs is about 0.019.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

C_GRID = (0.003, 0.01, 0.03, 0.1, 0.3, 1.0)
DOMAINS = ("alpacaeval", "hh_harmless", "routerbench")


def _block(x: np.ndarray, group: np.ndarray) -> np.ndarray:
    """(n, d * n_groups): ``x`` in the column block of each row's group (one model per group)."""
    keys = np.unique(group)
    onehot = (group[:, None] == keys[None, :]).astype(np.float64)
    return (x[:, :, None] * onehot[:, None, :]).reshape(len(x), -1)


def _fit_predict(x: np.ndarray, y: np.ndarray, train: np.ndarray, evaluate: np.ndarray, C: float) -> np.ndarray:
    """P(A preferred) for ``evaluate`` from a no-intercept regression on ``train`` and its swapped copies."""
    from sklearn.linear_model import LogisticRegression  # sklearn: optional heavy dependency

    m = LogisticRegression(C=C, fit_intercept=False, max_iter=5000).fit(
        np.concatenate([x[train], -x[train]]), np.concatenate([y[train], 1 - y[train]]))
    return m.predict_proba(x[evaluate])[:, 1]


def choose_c(x: np.ndarray, y: np.ndarray, train: np.ndarray, groups: np.ndarray, grid=C_GRID) -> tuple[float, float]:
    """(C, mean 5-fold accuracy): the grid's best C by cross-validation grouped by prompt, train pairs only."""
    from sklearn.model_selection import GroupKFold  # sklearn: optional heavy dependency

    folds = list(GroupKFold(5).split(train, groups=groups[train]))
    scores = [np.mean([((_fit_predict(x, y, train[a], train[b], C) > 0.5) == y[train[b]]).mean() for a, b in folds])
              for C in grid]
    best = int(np.argmax(scores))
    return float(grid[best]), float(scores[best])


def main() -> None:
    import torch  # torch: optional heavy dependency

    from trainer.embeddings import EmbedderConfig, embed_texts
    from trainer.experts.experiment import PRESETS, prepare_data  # imports pandas, torch: on use only
    from trainer.experts.selector import PairSelector  # imports torch: on use only
    from trainer.report import write_json

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=Path("../shared/data"))
    ap.add_argument("--out", type=Path, default=Path("docs/results"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    preset, base = PRESETS["cpu"]
    prep = prepare_data(args.data, preset, PairSelector(base.selector, seed=0), progress=False)
    n_tr, n_va = len(prep.train), len(prep.val)
    pairs = [prep.train, prep.val]
    prompt = [p for d in pairs for p in d.prompt]
    resp_a = [r for d in pairs for r in d.response_a]
    resp_b = [r for d in pairs for r in d.response_b]
    domain = np.array([str(v) for d in pairs for v in d.domain])
    groups = np.array([str(v) for d in pairs for v in d.prompt_id])
    f = prep.store.features.numpy()[: n_tr + n_va].astype(np.float64)
    y = prep.store.label.numpy()[: n_tr + n_va].astype(np.int64)
    responses = EmbedderConfig(truncation_side="right")  # keep a response's beginning
    e_a, e_b = (embed_texts(t, responses, None, show_progress=True) for t in (resp_a, resp_b))
    q_a, q_b = (embed_texts([p + "\n\n" + r for p, r in zip(prompt, t)], responses, None, show_progress=True)
                for t in (resp_a, resp_b))
    length = _block(f, domain)
    rows = {
        "length_per_domain": length,
        "length_per_domain + response (shared)": np.concatenate([length, e_a - e_b], 1),
        "length_per_domain + response (per domain)": np.concatenate([length, _block(e_a - e_b, domain)], 1),
        "length_per_domain + prompt and response (per domain)": np.concatenate([length, _block(q_a - q_b, domain)], 1),
        "length_per_domain + both (per domain)": np.concatenate(
            [length, _block(e_a - e_b, domain), _block(q_a - q_b, domain)], 1),
    }
    train, val = np.arange(n_tr), np.arange(n_tr, n_tr + n_va)
    result = {"split": "val", "n_train": n_tr, "n_val": n_va, "rows": {},
              "rule": "C by 5-fold CV grouped by prompt on the train pairs; validation scored once"}
    for name, x in rows.items():
        C, cv = choose_c(x, y, train, groups, (1.0,) if name == "length_per_domain" else C_GRID)
        right = (_fit_predict(x, y, train, val, C) > 0.5) == y[val]
        entry = {"C": C, "cv_acc": cv, "val_acc": float(right.mean()),
                 **{d: float(right[domain[val] == d].mean()) for d in DOMAINS}}
        result["rows"][name] = entry
        print(name, json.dumps(entry), flush=True)
    write_json(args.out / "prism_content_ceiling.json", result)
    plot(result, args.out / "prism_content_ceiling.png")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from trainer.report import save_figure

    names = list(result["rows"])
    vals = [result["rows"][n]["val_acc"] for n in names]
    fig, ax = plt.subplots(figsize=(8, 3.2))
    ax.barh(range(len(names)), vals, xerr=[0.019] * len(names), color=["tab:gray"] + ["tab:blue"] * (len(names) - 1))
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.invert_yaxis()
    ax.axvline(vals[0], color="k", lw=0.8, ls="--")
    ax.set_xlim(0.7, 0.85)
    ax.set_xlabel("validation pairwise accuracy (450 pairs; bar: +- one binomial std)")
    ax.set_title("Frozen MiniLM content over the per-domain length model (centralised)", fontsize=9)
    save_figure(fig, path, dpi=120)  # lays out, writes atomically, closes


if __name__ == "__main__":
    main()
