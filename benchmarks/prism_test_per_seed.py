"""The CPU preset's held-out test run, one seed per process, then merged into one results folder.

``fedroute prism train`` runs its seeds one after another; on a shared machine the seeds of the test run
can instead run side by side, each in its own process on the same data, clients and test pairs:

    PYTHONPATH=. HF_HUB_OFFLINE=1 python benchmarks/prism_test_per_seed.py --seed S --variant V --out DIR
    PYTHONPATH=. python benchmarks/prism_test_per_seed.py --merge --out DIR

Each seed writes ``DIR/seed<S>/`` (:func:`trainer.experts.experiment.run_experiment` with one seed; the
seed-0 folder also holds ``fedprism_seed0/`` and ``fedbis_seed0/``); ``--merge`` combines them into
``DIR/results.{json,md}``, ``DIR/history.json`` and the PNGs, the same format as ``fedroute prism train``
(mean and sample std over the seeds). ``--variant`` is a head variant of
``benchmarks/prism_residual_settings.py`` (chosen there on validation), applied to every method.
``--compare DIR1 DIR2 ... --out PNG`` plots the methods of several merged folders side by side.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
from prism_residual_settings import VARIANTS  # benchmarks/ is on sys.path: this script's folder


def run(data: Path, seed: int, variant: str, methods: tuple[str, ...], out: Path) -> None:
    import torch  # torch: optional heavy dependency

    from trainer.experts.experiment import PRESETS, prepare_data, run_experiment  # imports pandas, torch: on use only
    from trainer.experts.selector import PairSelector  # imports torch: on use only

    torch.set_num_threads(1)
    preset, base = PRESETS["cpu"]
    base = replace(base, **VARIANTS[variant])
    model = PairSelector(base.selector)
    prep = prepare_data(data, preset, model, progress=False)
    run_experiment(prep, model, preset, base, [seed], out / f"seed{seed}", methods=methods, progress=True)


def merge(out: Path, extra: tuple[Path, ...] = ()) -> dict:
    """Merge ``out/seed*/`` (and the methods of ``extra/seed*/``, other methods on the same seeds) into
    ``out``."""
    from trainer.experts.experiment import write_results  # imports pandas, torch: on use only

    parts = sorted(out.glob("seed*/results.json"), key=lambda p: int(p.parent.name[4:]))
    res = [json.loads(p.read_text()) for p in parts]
    hist = [json.loads((p.parent / "history.json").read_text()) for p in parts]
    for folder in extra:
        for r, h, p in zip(res, hist, parts):
            other = folder / p.parent.name
            more = json.loads((other / "results.json").read_text())
            if more["seeds"] != r["seeds"]:
                raise ValueError(f"{other}: seeds {more['seeds']} != {r['seeds']}")
            r["methods"].update({m: v for m, v in more["methods"].items() if m not in r["methods"]})
            r.setdefault("bytes", {}).setdefault("per_method", {}).update(more.get("bytes", {}).get("per_method", {}))
            h.update({m: v for m, v in json.loads((other / "history.json").read_text()).items() if m not in h or not h[m]})

    def summary(values):
        v = np.asarray(values, dtype=np.float64)
        return {"acc_mean": float(v.mean()), "acc_std": float(v.std(ddof=1)) if len(v) > 1 else 0.0,
                "acc_per_seed": [float(x) for x in v]}

    merged = dict(res[0])
    merged["seeds"] = [s for r in res for s in r["seeds"]]
    merged["seconds"] = round(sum(r["seconds"] for r in res), 1)
    from trainer.experts.experiment import ALL_METHODS  # imports pandas, torch: on use only

    merged["methods"] = {}
    for m in [m for m in ALL_METHODS if m in res[0]["methods"]]:
        entry = summary([x for r in res for x in r["methods"][m]["acc_per_seed"]])
        entry["domains"] = {d: summary([x for r in res for x in r["methods"][m]["domains"][d]["acc_per_seed"]])
                            for d in res[0]["methods"][m]["domains"]}
        merged["methods"][m] = entry
    if "utilisation" in res[0]:
        per = [x for r in res for x in r["utilisation"]["max_share_per_seed"]]
        merged["utilisation"] = {"max_share": float(np.mean(per)), "max_share_per_seed": per,
                                 "entropy": float(np.mean([r["utilisation"]["entropy"] for r in res])),
                                 "share": [s for r in res for s in r["utilisation"]["share"]]}
        merged["bytes"] = {k: float(np.mean([r["bytes"][k] for r in res]))
                           for k in ("downlink_per_round", "dense_downlink_per_round", "length_init_upload_total")}
        merged["bytes"]["per_method"] = {m: float(np.mean([r["bytes"]["per_method"][m] for r in res]))
                                         for m in res[0]["bytes"]["per_method"]}
    history = {m: {int(s): h for hs in hist for s, h in hs.get(m, {}).items()} for m in res[0]["methods"]}
    write_results(out, merged, history)
    return merged


def compare(folders: list[Path], labels: list[str], path: Path) -> None:
    """Bar chart of the methods' test accuracy (mean +- std over seeds, dots per seed) of several merged
    results folders side by side (e.g. two head variants), with both length-only baselines as lines."""
    import matplotlib  # matplotlib: optional heavy dependency

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # matplotlib: optional heavy dependency

    from trainer.report import save_figure  # imports matplotlib: on use only

    res = [json.loads((f / "results.json").read_text()) for f in folders]
    methods = [m for m in ("fedprism", "fedbis", "fedbiscuit", "random_routing", "frozen_router", "no_warmup")
               if any(m in r["methods"] for r in res)]
    fig, ax = plt.subplots(figsize=(9, 4.2))
    width = 0.8 / len(res)
    x = np.arange(len(methods))
    for i, (r, lab) in enumerate(zip(res, labels)):
        off = (i - (len(res) - 1) / 2) * width
        rows = [r["methods"].get(m) for m in methods]
        ax.bar(x + off, [e["acc_mean"] if e else 0 for e in rows], width, yerr=[e["acc_std"] if e else 0 for e in rows],
               capsize=3, label=lab)
        for j, e in enumerate(rows):
            if e:
                ax.scatter([x[j] + off] * len(e["acc_per_seed"]), e["acc_per_seed"], color="k", s=8, zorder=3)
    for m, ls in (("length_only", "--"), ("length_only_global", ":")):
        vals = [r["methods"][m]["acc_mean"] for r in res if m in r["methods"]]
        if vals:
            ax.axhline(vals[0], color="k", ls=ls, lw=1, label=f"{m} {vals[0]:.3f}")
    ax.set_xticks(x, methods, fontsize=8)
    ax.set_ylim(0.6, 0.82)
    ax.set_ylabel("test pairwise accuracy (600 pairs)")
    ax.set_title("Same clients, seeds and test pairs under different expert heads (one bar colour per results folder)", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    save_figure(fig, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=Path("../shared/data"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--variant", default="trained", choices=sorted(VARIANTS))
    ap.add_argument("--methods", default="fedprism,fedbis,random_routing,length_only,length_only_global")
    ap.add_argument("--merge", action="store_true")
    ap.add_argument("--extra", type=Path, action="append", default=[],
                    help="with --merge: a folder of the same seeds with other methods (repeatable)")
    ap.add_argument("--compare", type=Path, nargs="+", default=None,
                    help="merged results folders to plot side by side into --out (a PNG path); labels = folder names")
    args = ap.parse_args()
    if args.compare:
        compare(args.compare, [f.name for f in args.compare], args.out)
        return
    if args.merge:
        from trainer.experts.experiment import markdown  # imports pandas, torch: on use only

        print(markdown(merge(args.out, tuple(args.extra))))
        return
    run(args.data, args.seed, args.variant, tuple(args.methods.split(",")), args.out)


if __name__ == "__main__":
    main()
