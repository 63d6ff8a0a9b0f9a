"""Writing MoR results: ``results.json``, ``results.md`` and PNG figures (atomic writes of
:mod:`trainer.report`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from trainer.report import save_figure, write_json, write_text

LABELS = {"router_rm_sparse": "router + RM (sparse)", "router_rm_soft": "router + RM (soft)", "avg_rm": "AvgRM",
          "random_rm": "random RM", "fedavg_rm": "FedAvg RM", "best_single_rm": "best single RM",
          "oracle_client": "oracle client", "length_only": "length only", "length_only_global": "length only, label-free",
          "structure_only": "structure features", "router_rm_sparse_generator_prior": "router + RM (sparse) + generator prior",
          "router_rm_soft_generator_prior": "router + RM (soft) + generator prior"}


def _row(name: str, m: dict, paired: dict | None = None) -> str:
    held = f"{m['heldout_acc_mean']:.3f} ± {m['heldout_acc_std']:.3f}" if "heldout_acc_mean" in m else "n/a"
    row = f"| {name} | {m['id_acc_mean']:.3f} ± {m['id_acc_std']:.3f} | {held} |"
    if paired is None:
        return row
    gain = lambda k: f"{paired[k]['gain']:+.3f} ± {paired[k]['se']:.3f}" if k in paired else "-"  # noqa: E731
    return row + f" {gain('id')} | {gain('heldout')} |"


def eval_markdown(res: dict) -> str:
    """The Table 4 analogue, then single RMs, router weightings and the no-normalisation ablation."""
    n = len(res["seeds"])
    lines = [f"Pairwise ranking accuracy, mean ± std over {n} seeds (ID = mean of the clients' test accuracies); "
             "gain over length only on the same pairs ± its paired standard error.", "",
             "| method | ID accuracy | held-out category | ID vs length only | held-out vs length only |",
             "|---|---|---|---|---|"]
    paired = res.get("paired_vs_length_only", {})
    lines += [_row(LABELS.get(k, k), m, paired.get(k, {})) for k, m in res["methods"].items()]
    lines += ["", "Single client reward models and router weightings:", "",
              "| scorer | ID accuracy | held-out category |", "|---|---|---|"]
    lines += [_row(k, m) for k, m in {**res["single_rms"], **res["router_weighting"]}.items()]
    if res.get("routing_variants"):
        lines += ["", "Routing variants (the validation-chosen weighting of each seed; `sparse|prompt` routes the responses "
                  "of one prompt together, `sparse<f|...` gives rows whose largest weight is below f the soft reward, "
                  "`soft|...|T=t` uses softmax(z / t)):", "",
                  "| variant | ID accuracy | held-out category |", "|---|---|---|"]
        lines += [_row(k.removeprefix("routing_"), m) for k, m in res["routing_variants"].items()]
    lines += ["", "Without normalisation (raw client rewards):", "", "| method | ID accuracy | held-out category |", "|---|---|---|"]
    lines += [_row(k, m) for k, m in res["ablation_no_norm"].items()]
    clients = list(res["seeds"][0]["per_client"])
    lines += ["", "Per client (test accuracy, mean over seeds):", "",
              "| method | " + " | ".join(clients) + " |", "|---|" + "---|" * len(clients)]
    for k, m in {**res["methods"], **res["single_rms"]}.items():
        lines.append(f"| {LABELS.get(k, k)} | " + " | ".join(f"{m['per_client_mean'][c]:.3f}" for c in clients) + " |")
    if res.get("routing_errors"):
        e = res["routing_errors"]
        held = "heldout_acc_mean" in e["pairs_away"]
        lines += ["", "Routing errors vs reward-model errors (the validation-chosen weighting and rules): share of test pairs "
                  "with a response whose largest routing weight is another client than its own, and the accuracy that "
                  "costs (own client's RM minus routed reward on those pairs, per pair of the set); the rest of the gap to 1 "
                  "is the reward models':", "",
                  "| | " + " | ".join(clients) + (" | held-out |" if held else " |"), "|---|" + "---|" * (len(clients) + held)]
        for k in ("pairs_away", "routing_cost", "soft_pairs_away", "soft_routing_cost"):
            if k in e:
                label = ("soft: " if k.startswith("soft_") else "sparse: ") + k.removeprefix("soft_").replace("_", " ")
                lines.append(f"| {label} | " + " | ".join(f"{e[k]['per_client_mean'][c]:.3f}" for c in clients)
                             + (f" | {e[k]['heldout_acc_mean']:.3f} |" if held else " |"))
    if res["seeds"][0].get("heldout_routing_errors"):
        lines += ["", "Held-out category, every routing variant (mean over seeds; diagnosis only, nothing is chosen here): "
                  "accuracy, pairs away from the helpfulness client, accuracy of the routed reward and of the "
                  "helpfulness RM on those pairs:", "",
                  "| variant | held-out accuracy | pairs away | routed on away pairs | helpfulness RM on away pairs |",
                  "|---|---|---|---|---|"]
        for v, row in heldout_diagnosis(res).items():
            lines.append(f"| {v} | {row['acc']:.3f} | {row['pairs_away']:.3f} | {row['acc_away_routed']:.3f} | "
                         f"{row['acc_away_own']:.3f} |")
        diag = heldout_diagnosis(res)
        if "buckets" in next(iter(diag.values())):
            names = ("home_sure", "home_mixed", "away_sure", "away_mixed")
            lines += ["", "Held-out category, where the gap to the helpfulness RM goes (mean over seeds; diagnosis only): "
                      "pairs split by routed away or home and by scored by one client (sure) or by the mixture (mixed: "
                      "soft routing, or a sparse fallback); per bucket the share of pairs / the accuracy it costs against the "
                      "helpfulness RM, per pair of the category (the costs add up to the gap):", "",
                      "| variant | gap | " + " | ".join(n.replace("_", " ") for n in names) + " |", "|---|---|" + "---|" * len(names)]
            for v, row in diag.items():
                b = row["buckets"]
                lines.append(f"| {v} | {sum(b[n]['cost'] for n in names):.3f} | "
                             + " | ".join(f"{b[n]['share']:.3f} / {b[n]['cost']:+.3f}" for n in names) + " |")
    if res.get("routing_chosen_on_validation"):
        lines += ["", f"Routing chosen on validation per seed: {res['routing_chosen_on_validation']}."]
    lines += ["", f"Weighting chosen on validation per seed: {res['weighting_chosen_on_validation']}; "
              f"best single RM chosen on validation: {res['best_single_chosen_on_validation']}.",
              f"Wall time: {res['seconds']:.0f} s."]
    return "\n".join(lines) + "\n"


def heldout_diagnosis(res: dict) -> dict:
    """Per routing variant, means over seeds on the held-out category: ``acc`` (routed accuracy), ``pairs_away``,
    ``acc_away_routed``, ``acc_away_own`` (:func:`trainer.rewards.evaluation.routing_errors`; NaN when no seed had
    pairs away) and, when the seeds have them, ``buckets`` (mean ``share`` / ``cost`` per bucket)."""
    seeds = res["seeds"]
    out = {}
    for v in seeds[0]["heldout_routing_errors"]:
        errs = [s["heldout_routing_errors"][v] for s in seeds]
        mean = lambda k: float(np.mean([x[k] for x in errs if x[k] is not None] or [np.nan]))  # noqa: E731
        out[v] = {"acc": float(np.mean([s["heldout"][f"routing_{v}"] for s in seeds])), "pairs_away": mean("pairs_away"),
                  "acc_away_routed": mean("acc_away_routed"), "acc_away_own": mean("acc_away_own")}
        if all("buckets" in x for x in errs):  # results written before the buckets existed have none
            out[v]["buckets"] = {b: {m: float(np.mean([x["buckets"][b][m] for x in errs])) for m in ("share", "cost")}
                                 for b in errs[0]["buckets"]}
    return out


def eval_figure(res: dict, path: Path) -> None:
    import matplotlib  # matplotlib: optional heavy dependency, imported on use

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # matplotlib: optional heavy dependency, imported on use

    methods = res["methods"]
    keys = list(methods)
    x = np.arange(len(keys))
    diag = heldout_diagnosis(res) if res["seeds"][0].get("heldout_routing_errors") else None
    fig, ax = plt.subplots(1, 3 if diag else 2, figsize=(18 if diag else 12, 4.2))
    ax[0].bar(x - 0.2, [methods[k]["id_acc_mean"] for k in keys], 0.4, yerr=[methods[k]["id_acc_std"] for k in keys],
              label="in-distribution (mean of clients)", capsize=3)
    if "heldout_acc_mean" in methods[keys[0]]:
        ax[0].bar(x + 0.2, [methods[k]["heldout_acc_mean"] for k in keys], 0.4,
                  yerr=[methods[k]["heldout_acc_std"] for k in keys], label="held-out category", capsize=3)
    ax[0].set_xticks(x, [LABELS.get(k, k) for k in keys], rotation=35, ha="right")
    ax[0].set_ylim(0.3, 1.0)
    ax[0].axhline(0.5, color="grey", lw=0.8, ls=":")
    ax[0].set_ylabel("pairwise ranking accuracy")
    ax[0].legend(fontsize=8)
    ax[0].set_title(f"MoR on 3 clients ({len(res['seeds'])} seeds)")
    clients = list(res["seeds"][0]["per_client"])
    share = {w: [np.mean([s["per_client"][c][f"own_share_{w}"] for s in res["seeds"]]) for c in clients]
             for w in ("samples", "equal")}
    xc = np.arange(len(clients))
    ax[1].bar(xc - 0.2, share["samples"], 0.4, label="FedAvg weighted by samples")
    ax[1].bar(xc + 0.2, share["equal"], 0.4, label="equal weights")
    ax[1].set_xticks(xc, clients)
    ax[1].set_ylim(0, 1.05)
    ax[1].set_ylabel("share of test responses routed to own client")
    ax[1].legend(fontsize=8)
    ax[1].set_title("router aggregation")
    if diag:
        chosen = {c[m] for c in res.get("routing_chosen_on_validation", []) for m in ("sparse", "soft")}
        keys = list(diag)
        xv = np.arange(len(keys))
        ax[2].bar(xv, [diag[k]["acc"] for k in keys], 0.6, color=["C3" if k in chosen else "C0" for k in keys])
        own = methods["oracle_client"]["heldout_acc_mean"]
        ax[2].axhline(own, color="k", ls="--", lw=0.9, label=f"helpfulness RM alone ({own:.3f})")
        ax2 = ax[2].twinx()
        ax2.plot(xv, [diag[k]["pairs_away"] for k in keys], "o", color="C1", label="pairs routed away")
        ax2.set_ylabel("share of held-out pairs routed away", color="C1")
        ax2.set_ylim(0, max(0.4, max(diag[k]["pairs_away"] for k in keys) * 1.2))
        ax[2].set_xticks(xv, keys, rotation=45, ha="right", fontsize=7)
        ax[2].set_ylim(0.7, 0.9)
        ax[2].set_ylabel("held-out accuracy (red: chosen on validation)")
        ax[2].legend(fontsize=8, loc="upper left")
        ax2.legend(fontsize=8, loc="upper right")
        ax[2].set_title("held-out category: every routing variant (diagnosis)")
    save_figure(fig, path, dpi=120)


def write_eval(res: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "results.json", res)
    write_text(out / "results.md", eval_markdown(res))
    eval_figure(res, out / "results.png")


def audit_markdown(res: dict) -> str:
    lines = [f"Membership inference on reward margins (members : non-members = 1 : 1, mean over {res['seeds']} seed(s) "
             f"± the standard error of that mean (Hanley-McNeil per seed); clip = {res['clip']}). Members = the pairs "
             "each model trained on; settings: shipped = `mor train`'s reward models, shipped_dp = `mor train --dp`'s "
             "(DP-SGD), naive = a 200-epoch MLP (worst case).", "",
             "| setting | client | members | AUC raw | AUC normalised ± SE | AUC per seed (normalised) | AUC norm. + clip | "
             "TPR@1% | TPR@5% | TPR@10% | test accuracy | DP epsilon (delta) |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s, cl in res["per_client"].items():
        for c, e in cl.items():
            a = e["normalised"]
            eps = "-" if e.get("epsilon") is None else f"{e['epsilon']:.1f} ({e['delta']:.1e})"
            lines.append(f"| {s} | {c} | {a['n_members']} | {e['raw']['auc']:.3f} | {a['auc']:.3f} ± {a['auc_se']:.3f} | "
                         f"{', '.join(f'{x:.3f}' for x in a['auc_per_seed'])} | {e['normalised_clipped']['auc']:.3f} | "
                         f"{a['tpr_at_1pct_fpr']:.3f} | {a['tpr_at_5pct_fpr']:.3f} | {a['tpr_at_10pct_fpr']:.3f} | "
                         f"{e['test_acc']:.3f} | {eps} |")
    lines += ["", "Pooled over clients (the server sees every client's answers):", "",
              "| setting | scores | AUC ± SE | TPR@1% | TPR@5% | TPR@10% |", "|---|---|---|---|---|---|"]
    for s, d in res["pooled"].items():
        for v, a in d.items():
            lines.append(f"| {s} | {v} | {a['auc']:.3f} ± {a['auc_se']:.3f} | {a['tpr_at_1pct_fpr']:.3f} | "
                         f"{a['tpr_at_5pct_fpr']:.3f} | {a['tpr_at_10pct_fpr']:.3f} |")
    c = res["communication"]
    lines += ["", "Communication per round:", "", "| item | bytes |", "|---|---|",
              f"| router updates (K clients, download + upload, {c['router_parameters']} float32 parameters) | {c['router_update_bytes']:,} |",
              f"| reward queries ({c['queries_per_round']} sparse queries: prompt + response text) | {c['reward_query_bytes']:,} |",
              f"| reward answers (4 bytes each) | {c['reward_answer_bytes']:,} |",
              f"| for comparison: FedAvg of reward MLPs ({c['reward_mlp_parameters']} parameters) | {c['fedavg_of_reward_mlps_bytes']:,} |"]
    return "\n".join(lines) + "\n"


def audit_figure(res: dict, path: Path) -> None:
    import matplotlib  # matplotlib: optional heavy dependency, imported on use

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # matplotlib: optional heavy dependency, imported on use

    clients = list(dict.fromkeys(c for cl in res["per_client"].values() for c in cl))
    x = np.arange(len(clients))
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.8))
    width = 0.8 / len(res["per_client"])
    for i, (s, cl) in enumerate(res["per_client"].items()):
        pos = x + (i - (len(res["per_client"]) - 1) / 2) * width
        auc = [cl[c]["normalised"]["auc"] if c in cl else np.nan for c in clients]
        se = [cl[c]["normalised"]["auc_se"] if c in cl else np.nan for c in clients]
        ax[0].bar(pos, auc, width, yerr=se, label=s)
        ax[1].bar(pos, [cl[c]["test_acc"] if c in cl else np.nan for c in clients], width, label=s)
    ax[0].axhline(0.6, color="red", ls="--", lw=0.8, label="target 0.60")
    ax[0].axhline(0.5, color="grey", ls=":", lw=0.8)
    ax[0].set_ylabel("membership-inference AUC")
    ax[1].set_ylabel("test pairwise accuracy")
    for a in ax:
        a.set_xticks(x, clients)
        a.legend(fontsize=8)
    ax[0].set_ylim(0.4, 1.0)
    ax[1].set_ylim(0.4, 1.0)
    save_figure(fig, path, dpi=120)


def write_audit(res: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "audit.json", res)
    write_text(out / "audit.md", audit_markdown(res))
    audit_figure(res, out / "audit.png")
