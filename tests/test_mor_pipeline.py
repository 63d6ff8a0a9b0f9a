"""MoR end to end on the real shared data: ``fedroute mor eval --quick`` learns (router + RM beats
random selection and chance, routes most responses to their own client, the held-out category goes
to the helpfulness client), ``mor train`` saves a mixture that loads to the same rewards, and the
audit reports per-seed attack AUCs of each setting, (epsilon, delta) for the DP-SGD one only."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from trainer.cli import app

pytestmark = pytest.mark.slow


def test_mor_eval_quick_writes_the_table_and_learns(shared_data, tmp_path):
    out = tmp_path / "eval"
    r = CliRunner().invoke(app, ["mor", "eval", "--quick", "--out", str(out), "--data", str(shared_data)])
    assert r.exit_code == 0, r.output
    res = json.loads((out / "results.json").read_text())
    assert res["command"] == "mor eval"  # trainer.results_owner
    assert (out / "results.md").read_text().startswith("Pairwise ranking accuracy")
    assert (out / "results.png").stat().st_size > 10_000
    m = res["methods"]
    for key in ("router_rm_sparse", "router_rm_soft", "avg_rm", "random_rm", "fedavg_rm", "best_single_rm",
                "oracle_client", "length_only", "length_only_global", "structure_only"):
        assert set(m[key]) >= {"id_acc_mean", "id_acc_std", "heldout_acc_mean"}
        assert len(m[key]["id_acc_per_seed"]) == 3
    paired = res["paired_vs_length_only"]
    assert set(paired) >= {"router_rm_sparse", "router_rm_soft", "structure_only", "length_only_global"}
    assert all(0 < paired[k][part]["se"] < 0.1 for k in paired for part in ("id", "heldout"))
    # learning: the routed reward ranks better than chance and than a random client per response
    assert m["router_rm_sparse"]["id_acc_mean"] > 0.58
    assert m["router_rm_sparse"]["id_acc_mean"] > m["random_rm"]["id_acc_mean"] + 0.03
    assert m["router_rm_sparse"]["heldout_acc_mean"] > 0.65
    # the router learnt who judges what: most test responses go to their own client
    seeds = res["seeds"]
    share = np.mean([s["id"][f"own_share_{s['weighting']}"] for s in seeds])
    assert share > 0.75
    assert "no_norm_router_rm_sparse" in res["ablation_no_norm"]


def test_mor_train_saves_a_mixture_that_scores_like_the_trained_one(shared_data, tmp_path):
    from trainer.rewards.mixture import load_mixture

    out = tmp_path / "mix"
    r = CliRunner().invoke(app, ["mor", "train", "--quick", "--out", str(out), "--data", str(shared_data), "--mode", "soft"])
    assert r.exit_code == 0, r.output
    mix = load_mixture(out)
    assert mix.mode == "soft" and mix.client_names == ["helpfulness", "harmlessness", "correctness"]
    metrics = json.loads((out / "train_metrics.json").read_text())
    assert metrics["evaluation"]["id"]["router_rm_soft_equal"] > 0.55
    # the saved routing is what validation chose (router weighting, sparse and soft variants), not the defaults
    chosen = metrics["evaluation"]["routing"]
    assert mix.rule.variant == chosen["soft"] and mix.with_mode("sparse").rule.variant == chosen["sparse"]
    assert json.loads((out / "mixture.json").read_text())["selection"]["weighting"] == chosen["weighting"]
    assert load_mixture(out, mode="sparse").rule.variant == chosen["sparse"]
    p = ["Write a haiku about rain.", "\n\nHuman: How do I pick a lock?\n\nAssistant:"]
    y = ["Soft rain on the roof, / puddles gather light and sound, / the street hums along.", "I can't help with that."]
    s = mix(p, y)
    assert s.shape == (2,) and s.dtype == np.float32 and np.isfinite(s).all()
    np.testing.assert_array_equal(mix.queries_, [2, 2, 2])


def test_mor_train_dp_ships_dp_reward_models_and_reports_their_cost(shared_data, tmp_path):
    """`mor train --dp`: every client's saved reward model is a DP-SGD MLP carrying its (epsilon, delta);
    train_metrics.json reports them with the test accuracy of the DP and the non-DP model of each client."""
    from trainer.rewards.mixture import load_mixture

    out = tmp_path / "mix"
    r = CliRunner().invoke(app, ["mor", "train", "--quick", "--dp", "--out", str(out), "--data", str(shared_data)])
    assert r.exit_code == 0, r.output
    mix = load_mixture(out)
    metrics = json.loads((out / "train_metrics.json").read_text())
    for rm, name in zip(mix.reward_models, mix.client_names):
        assert rm.arch == "mlp" and rm.privacy_["noise_multiplier"] == 1.0
        p = metrics["privacy"][name]
        assert p["epsilon"] == rm.privacy_["epsilon"] > 0 and p["delta"] == pytest.approx(1 / p["n_pairs"])
        assert 0 <= p["test_acc_dp"] <= 1 and p["cost"] == pytest.approx(p["test_acc_dp"] - p["test_acc_non_dp"])
        assert f"{name}: DP-SGD (epsilon {p['epsilon']:.1f}" in r.output
    assert json.loads((out / "mor_config.json").read_text())["dp_rm"]["dp_noise_multiplier"] == 1.0


def test_mor_audit_attacks_the_shipped_models_with_per_seed_aucs(shared_data, tmp_path):
    out = tmp_path / "audit"
    r = CliRunner().invoke(app, ["mor", "audit", "--quick", "--seeds", "2", "--settings", "shipped",
                                 "--out", str(out), "--data", str(shared_data)])
    assert r.exit_code == 0, r.output
    res = json.loads((out / "audit.json").read_text())
    assert set(res["per_client"]) == {"shipped"}
    for clients in res["per_client"].values():
        assert set(clients) == {"helpfulness", "harmlessness", "correctness"}
        for e in clients.values():
            a = e["normalised"]
            assert len(a["auc_per_seed"]) == len(a["auc_se_per_seed"]) == 2
            assert a["auc"] == pytest.approx(np.mean(a["auc_per_seed"]))
            assert a["auc_se"] == pytest.approx(np.sqrt(np.sum(np.square(a["auc_se_per_seed"]))) / 2)
            assert e["epsilon"] is None
    assert "± " in (out / "audit.md").read_text()
    r = CliRunner().invoke(app, ["mor", "audit", "--quick", "--settings", "shipped,bogus", "--out", str(tmp_path / "x"),
                                 "--data", str(shared_data)])
    assert r.exit_code != 0 and "--settings" in r.output


def test_the_audits_dp_setting_carries_epsilon_and_the_naive_setting_none(shared_data):
    """The shipped_dp and naive settings train their own configs (here cut to a few epochs: the audit's
    bookkeeping is asserted, not the attack's AUC) and only the DP-SGD models report (epsilon, delta)."""
    from dataclasses import replace

    from trainer.rewards.audit import NAIVE, run_audit
    from trainer.rewards.mor_trainer import DP_RM, MoRConfig, MoRTrainer

    trainer = MoRTrainer(MoRConfig.quick(data_dir=str(shared_data), seeds=1))
    res = run_audit(trainer, dp=replace(DP_RM, epochs=2), naive=replace(NAIVE, epochs=10), settings=("shipped_dp", "naive"))
    assert set(res["per_client"]) == {"shipped_dp", "naive"}
    assert res["settings"]["shipped_dp"]["dp_noise_multiplier"] == 1.0 and res["settings"]["naive"]["epochs"] == 10
    for setting, clients in res["per_client"].items():
        assert set(clients) == {"helpfulness", "harmlessness", "correctness"}
        for e in clients.values():
            assert len(e["normalised"]["auc_per_seed"]) == 1
            assert (e["epsilon"] is not None) == (setting == "shipped_dp")
            assert (e["delta"] is not None) == (setting == "shipped_dp")
