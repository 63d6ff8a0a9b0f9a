"""Hostile arguments to the trainer's Python API (configs, data entry points, aggregation).

Each case must fail with our exception tree (a ``ValueError`` subclass) naming the field, when the
config or the data object is built: before any model or data is loaded, so no case trains anything.
The CLI and the SDK have their own tables (tests/test_cli_hostile.py, tests/test_hostile_inputs.py).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from sdk.errors import InvalidInputError, ShapeError
from trainer.alignment.dpo import DPORunConfig
from trainer.alignment.errors import AlignmentConfigError
from trainer.alignment.grpo import RoutedGRPOConfig
from trainer.alignment.thompson_routing import ThompsonConfig
from trainer.data.preferences import dirichlet_clients, split_by_prompt
from trainer.experts.aggregation import aggregate_components, validate_component_update
from trainer.experts.fedprism import FedPrismConfig
from trainer.experts.selector import SelectorConfig
from trainer.federated.kmeans_aggregation import AggregationConfig
from trainer.federated.mlp_aggregation import MLPAggregationConfig
from trainer.rewards.client_router import RouterConfig
from trainer.rewards.mor_trainer import MoRConfig
from trainer.rewards.pair_features import PairEncoder
from trainer.rewards.reward_models import PreferencePairs, RewardModelConfig, RewardModelTrainer, ScoreNormaliser
from trainer.routers.fedavg import fedavg
from trainer.routers.kmeans_router import KMeansRouterConfig
from trainer.routers.mlp_router import MLPRouterConfig
from trainer.simulation import SimulationConfig

NAN, INF = float("nan"), float("inf")


def pairs_frame(**columns) -> pd.DataFrame:
    """4 pairs over 3 prompts in the trainer.data.preferences schema; ``columns`` replace columns."""
    data = dict(prompt_id=["p1", "p1", "p2", "p3"], prompt=["a", "a", "b", "c"], response_a=["x", "y", "z", "w"],
                response_b=["u", "v", "s", "t"], label=[1, 0, 1, 0], domain=["alpacaeval"] * 4,
                subset=["koala", "koala", "oasst", "vicuna"])
    return pd.DataFrame(data | columns)


ONE = {"w": np.ones((2, 2), np.float32)}

# (id, call, exception class, regex the message must match). Each was accepted (or failed with a
# raw numpy/Python error, or only later inside training) before trainer/config_fields.py.
CONFIG_CASES = [
    ("rm-lr-nan", lambda: RewardModelConfig(lr=NAN), InvalidInputError, r"RewardModelConfig\.lr=nan should be a finite number > 0"),
    ("rm-lr-inf", lambda: RewardModelConfig(lr=INF), InvalidInputError, r"lr=inf"),
    ("rm-weight-decay-nan", lambda: RewardModelConfig(weight_decay=NAN), InvalidInputError, r"weight_decay=nan"),
    ("rm-epochs-float", lambda: RewardModelConfig(epochs=1.5), InvalidInputError, r"epochs=1\.5 should be an integer >= 1"),
    ("rm-epochs-str", lambda: RewardModelConfig(epochs="3"), InvalidInputError, r"epochs='3' should be an integer"),
    ("rm-batch-bool", lambda: RewardModelConfig(batch_size=True), InvalidInputError, r"batch_size=True"),
    ("rm-lora-alpha-0", lambda: RewardModelConfig(lora_alpha=0), InvalidInputError, r"lora_alpha=0 should be a finite number > 0"),
    ("rm-lora-dropout-1", lambda: RewardModelConfig(lora_dropout=1.0), InvalidInputError, r"lora_dropout=1\.0 should be .*< 1"),
    ("rm-eps-neg", lambda: RewardModelConfig(eps=-1.0), InvalidInputError, r"eps=-1\.0"),
    ("rm-clip-nan", lambda: RewardModelConfig(clip=NAN), InvalidInputError, r"clip=nan should be .* or None"),
    ("rm-dp-delta-2", lambda: RewardModelConfig(dp_noise_multiplier=1.0, dp_delta=2.0), InvalidInputError, r"dp_delta=2\.0"),
    ("rm-dp-noise-nan", lambda: RewardModelConfig(dp_noise_multiplier=NAN), InvalidInputError, r"dp_noise_multiplier=nan"),
    ("rm-flag-str", lambda: RewardModelConfig(early_stopping="False"), InvalidInputError, r"early_stopping='False' should be True or False"),
    ("rm-seed-neg", lambda: RewardModelConfig(seed=-1), InvalidInputError, r"seed=-1 should be an integer >= 0"),
    ("router-lr-neg", lambda: RouterConfig(lr=-1.0), InvalidInputError, r"RouterConfig\.lr=-1\.0"),
    ("router-dropout-nan", lambda: RouterConfig(dropout=NAN), InvalidInputError, r"dropout=nan"),
    ("router-weight-decay-str", lambda: RouterConfig(weight_decay="0.1"), InvalidInputError, r"weight_decay='0\.1'"),
    ("router-local-steps-nan", lambda: RouterConfig(local_steps=NAN), InvalidInputError, r"local_steps=nan"),
    ("mlp-lr-0", lambda: MLPRouterConfig(lr=0.0), InvalidInputError, r"MLPRouterConfig\.lr=0\.0"),
    ("mlp-epochs-0", lambda: MLPRouterConfig(epochs=0), InvalidInputError, r"epochs=0 should be an integer >= 1"),
    ("mlp-grad-clip-nan", lambda: MLPRouterConfig(grad_clip=NAN), InvalidInputError, r"grad_clip=nan"),
    ("mlp-hidden-nan", lambda: MLPRouterConfig(hidden=NAN), InvalidInputError, r"hidden=nan"),
    ("kmeans-clusters-nan", lambda: KMeansRouterConfig(n_clusters=NAN), InvalidInputError, r"n_clusters=nan"),
    ("kmeans-prior-nan", lambda: KMeansRouterConfig(prior_strength=NAN), InvalidInputError, r"prior_strength=nan"),
    ("kmeans-prior-kind", lambda: KMeansRouterConfig(prior="bayes"), InvalidInputError, r"prior must be 'model' or 'additive'"),
    ("sim-no-clients", lambda: SimulationConfig(n_clients=0), InvalidInputError, r"n_clients=0"),
    ("sim-participation-2", lambda: SimulationConfig(participation=2.0), InvalidInputError, r"participation=2\.0"),
    ("sim-alpha-0", lambda: SimulationConfig(alpha=0.0), InvalidInputError, r"alpha"),
    ("fedprism-experts-0", lambda: FedPrismConfig(n_experts=0), InvalidInputError, r"n_experts=0"),
    ("fedprism-rounds-bool", lambda: FedPrismConfig(rounds=True), InvalidInputError, r"rounds=True"),
    ("fedprism-init-epochs-neg", lambda: FedPrismConfig(init_epochs=-1), InvalidInputError, r"init_epochs=-1 should be an integer >= 0"),
    ("fedprism-lr-str", lambda: FedPrismConfig(expert_lr="1e-3"), InvalidInputError, r"expert_lr='1e-3'"),
    ("fedprism-device-bogus", lambda: FedPrismConfig(device="gpu0"), InvalidInputError, r"device 'gpu0' is not a torch device"),
    ("fedprism-device-int", lambda: FedPrismConfig(device=0), InvalidInputError, r"device must be a torch device string"),
    ("fedprism-fraction-none", lambda: FedPrismConfig(client_val_fraction=None), InvalidInputError, r"client_val_fraction=None"),
    ("fedprism-pgpd-str", lambda: FedPrismConfig(pgpd="yes"), InvalidInputError, r"pgpd='yes'"),
    ("selector-head-0", lambda: SelectorConfig(head_hidden=0), InvalidInputError, r"head_hidden=0"),
    ("selector-modules-str", lambda: SelectorConfig(target_modules="query"), InvalidInputError, r"target_modules must be a tuple"),
    ("mor-split-sum", lambda: MoRConfig(split_fractions=(0.5, 0.5, 0.5)), InvalidInputError, r"split_fractions"),
    ("mor-split-zero-val", lambda: MoRConfig(split_fractions=(0.8, 0.0, 0.2)), InvalidInputError, r"split_fractions"),
    ("mor-lora-pairs-0", lambda: MoRConfig(lora_train_pairs=0), InvalidInputError, r"lora_train_pairs=0"),
    ("mor-prior-c-nan", lambda: MoRConfig(length_prior_C=NAN), InvalidInputError, r"length_prior_C=nan"),
    ("mor-margin-inf", lambda: MoRConfig(routing_margin_se=INF), InvalidInputError, r"routing_margin_se=inf"),
    ("mor-names-none", lambda: MoRConfig(client_names=None), InvalidInputError, r"client_names must be a tuple"),
    ("mor-pool-str", lambda: MoRConfig(pool_pairs=("900", 300, 900)), InvalidInputError, r"pool_pairs"),
    ("mor-router-dict", lambda: MoRConfig(router={"lr": 1e-3}), InvalidInputError, r"MoRConfig\.router should be a RouterConfig"),
    ("mor-rm-none", lambda: MoRConfig(mlp_rm=None), InvalidInputError, r"mlp_rm should be a RewardModelConfig"),
    ("sim-mlp-dict", lambda: SimulationConfig(mlp={"lr": 1e-3}), InvalidInputError, r"mlp should be a MLPRouterConfig"),
    ("sim-routers-str", lambda: SimulationConfig(routers="mlp"), InvalidInputError, r"routers must be a tuple"),
    ("fedprism-selector-none", lambda: FedPrismConfig(selector=None), InvalidInputError, r"selector should be a SelectorConfig"),
    ("grpo-thompson-none", lambda: RoutedGRPOConfig(model="m", thompson=None), AlignmentConfigError, r"thompson should be a ThompsonConfig"),
    ("dpo-steps-float", lambda: DPORunConfig(model="m", max_steps=1.5), AlignmentConfigError, r"max_steps=1\.5"),
    ("dpo-steps-inf", lambda: DPORunConfig(model="m", max_steps=INF), AlignmentConfigError, r"max_steps=inf"),
    ("dpo-beta-str", lambda: DPORunConfig(model="m", beta="0.1"), AlignmentConfigError, r"beta='0\.1'"),
    ("dpo-warmup-none", lambda: DPORunConfig(model="m", warmup_ratio=None), AlignmentConfigError, r"warmup_ratio=None"),
    ("thompson-enabled-str", lambda: ThompsonConfig(enabled="no"), InvalidInputError, r"enabled='no'"),
    ("dp-fedavg-clients-nan", lambda: MLPAggregationConfig(clip_norm=1.0, noise_multiplier=1.0, expected_clients=NAN),
     InvalidInputError, r"MLPAggregationConfig\.expected_clients=nan should be an integer >= 1 or None"),
    ("dp-fedavg-clip-bool", lambda: MLPAggregationConfig(clip_norm=True), InvalidInputError, r"clip_norm=True"),
    ("kmeans-agg-trim-str", lambda: AggregationConfig(trim_fraction="0.1"), InvalidInputError, r"trim_fraction='0\.1'"),
    ("kmeans-agg-clip-str", lambda: AggregationConfig(clip_count="5"), InvalidInputError, r"clip_count='5'"),
]

DATA_CASES = [
    ("pairs-nan-response", lambda: PreferencePairs.from_frame(pairs_frame(response_a=[NAN, "y", "z", "w"])),
     InvalidInputError, r"PreferencePairs\.chosen\[0\] must be a str, got nan"),
    ("pairs-none-prompt", lambda: PreferencePairs.from_frame(pairs_frame(prompt=[None, "a", "b", "c"])),
     InvalidInputError, r"prompts\[0\] must be a str"),
    ("pairs-int-response", lambda: PreferencePairs.from_frame(pairs_frame(response_b=[1, 2, 3, 4])),
     InvalidInputError, r"chosen\[1\] must be a str, got 2"),
    ("pairs-not-a-frame", lambda: PreferencePairs.from_frame([1, 2]), InvalidInputError, r"needs a pandas DataFrame, got list"),
    ("pairs-str-fields", lambda: PreferencePairs("ab", "cd", "ef", "gh"), InvalidInputError, r"prompts must be a tuple, got str"),
    ("pairs-none-id", lambda: PreferencePairs(("a",), ("b",), ("c",), (None,)), InvalidInputError, r"prompt_ids\[0\]"),
    ("pairs-nan-label", lambda: PreferencePairs.from_frame(pairs_frame(label=[1.0, NAN, 0.0, 1.0])),
     InvalidInputError, r"label must be 0 or 1"),
    ("pairs-label-2", lambda: PreferencePairs.from_frame(pairs_frame(label=[1, 2, 0, 1])), InvalidInputError, r"label must be 0 or 1"),
    ("pairs-missing-column", lambda: PreferencePairs.from_frame(pairs_frame().drop(columns="prompt")),
     InvalidInputError, r"lacks columns \['prompt'\]"),
    ("train-on-frame", lambda: RewardModelTrainer().train(pairs_frame()), InvalidInputError, r"train needs PreferencePairs"),
    ("train-on-empty", lambda: RewardModelTrainer().train(PreferencePairs.from_frame(pairs_frame().iloc[:0])),
     InvalidInputError, r">= 4 training pairs, got 0"),
    ("encode-empty", lambda: PairEncoder().encode([], []), InvalidInputError, r"at least one \(prompt, response\) pair, got 0"),
    ("encode-lengths", lambda: PairEncoder().encode(["a", "b"], ["x"]), InvalidInputError, r"2 prompts but 1 responses"),
    ("encode-none-response", lambda: PairEncoder().encode(["a"], [None]), InvalidInputError, r"responses\[0\] must be a str, got None"),
    ("split-fractions-str", lambda: split_by_prompt(pairs_frame(), "abc"), InvalidInputError, r"fractions must be 3"),
    ("split-seed-neg", lambda: split_by_prompt(pairs_frame(), seed=-1), InvalidInputError, r"seed must be an int >= 0"),
    ("dirichlet-alpha-0", lambda: dirichlet_clients(pairs_frame(), 3, 0.0), InvalidInputError, r"alpha must be finite and > 0"),
    ("dirichlet-alpha-str", lambda: dirichlet_clients(pairs_frame(), 3, "0.5"), InvalidInputError, r"alpha must be finite and > 0, got '0\.5'"),
    ("dirichlet-alpha-bool", lambda: dirichlet_clients(pairs_frame(), 3, True), InvalidInputError, r"alpha"),
    ("dirichlet-clients-bool", lambda: dirichlet_clients(pairs_frame(), True, 0.5), InvalidInputError, r"n_clients must be an int"),
    ("normaliser-eps-neg", lambda: ScoreNormaliser(0.0, 1.0, eps=-1.0), InvalidInputError, r"eps=-1\.0"),
    ("normaliser-str-mean", lambda: ScoreNormaliser("0", 1.0), InvalidInputError, r"mean='0'"),
    ("normaliser-nan-std", lambda: ScoreNormaliser(0.0, float("nan")), InvalidInputError, r"std=nan"),
    ("normaliser-str-clip", lambda: ScoreNormaliser(0.0, 1.0, clip="2"), InvalidInputError, r"clip must be a finite number > 0 or None, got '2'"),
    ("normaliser-inf-clip", lambda: ScoreNormaliser(0.0, 1.0, clip=float("inf")), InvalidInputError, r"got inf"),
    ("normaliser-constant-eps-0", lambda: ScoreNormaliser.fit(np.ones(3), eps=0.0), InvalidInputError, r"std=0 .* eps=0"),
    ("fedavg-str-count", lambda: fedavg([(ONE, "3")]), InvalidInputError, r"n_examples must be finite and > 0, got '3'"),
    ("fedavg-bool-count", lambda: fedavg([(ONE, True)]), InvalidInputError, r"got True"),
    ("fedavg-zero-counts", lambda: fedavg([(ONE, 0), (ONE, 0)]), InvalidInputError, r"got 0"),
    # a zero count has weight 0 (paper 000 Step 4; tests/test_fedprism.py), a negative one is refused
    ("components-negative-count", lambda: validate_component_update([ONE], {0: (ONE, -1.0)}), InvalidInputError, r"got -1\.0"),
    ("components-shape", lambda: validate_component_update([ONE], {0: ({"w": np.ones(3)}, 1.0)}), ShapeError, r"'w' has shape \(3,\)"),
    ("components-not-mapping", lambda: validate_component_update([ONE], [ONE]), InvalidInputError, r"update must be a mapping"),
    ("components-bool-index", lambda: validate_component_update([ONE], {True: (ONE, 1.0)}), InvalidInputError, r"expert index True"),
]


@pytest.mark.parametrize("call, error, match", [c[1:] for c in CONFIG_CASES + DATA_CASES],
                         ids=[c[0] for c in CONFIG_CASES + DATA_CASES])
def test_hostile_argument_is_refused_with_a_named_error(call, error, match):
    with pytest.raises(error, match=match) as info:
        call()
    assert isinstance(info.value, ValueError)  # our tree: every input error is also a ValueError


def test_valid_settings_still_accepted():
    """Edge values that are valid stay valid: numpy scalars, 0 where 0 is allowed, lists for tuples."""
    rm = RewardModelConfig(lr=np.float32(1e-3), epochs=np.int64(3), weight_decay=0, dropout=0.0, eps=0.0, clip=None)
    assert (rm.epochs, rm.weight_decay) == (3, 0)  # stored verbatim
    assert FedPrismConfig(warmup_rounds=0, init_epochs=0, residual_scale=0, length_lr_scale=0.0).init_epochs == 0
    assert (FedPrismConfig().device, FedPrismConfig(device="cuda:1").device, FedPrismConfig.gpu_preset().device) == \
        ("cpu", "cuda:1", "cuda")  # parsed, not checked against this machine (the CLI does that)
    assert MoRConfig(split_fractions=[0.5, 0.25, 0.25], lora_train_pairs=None, pool_pairs=(np.int64(50), 40, 30)).seeds == 3
    assert RouterConfig(local_steps=None, input_columns=np.int64(4), label_smoothing=0).local_steps is None
    assert KMeansRouterConfig(prior="model", prior_strength=0).prior == "model"
    assert ThompsonConfig(enabled=np.bool_(False)).enabled == np.bool_(False)
    assert DPORunConfig(model="m", num_threads=None, warmup_ratio=0).num_threads is None


def test_valid_data_still_accepted():
    pairs = PreferencePairs.from_frame(pairs_frame(prompt_id=[1, 1, 2, 3]))  # int ids are hashable ids
    assert pairs.chosen == ("x", "v", "z", "t") and pairs.rejected == ("u", "y", "s", "w")
    assert PreferencePairs.from_frame(pairs_frame().iloc[:0]).n_pairs == 0  # empty is a valid (empty) split
    norm = ScoreNormaliser.fit(np.array([1.0, 3.0]), eps=0.0)  # eps 0 is fine when std > 0
    assert norm(np.array([3.0])).tolist() == [1.0]
    two = {"w": np.full((2, 2), 4.0, np.float32)}
    mean = fedavg([(ONE, np.int64(3)), (two, 1)])  # (3 * 1 + 1 * 4) / 4
    assert np.allclose(mean["w"], 1.75)
    assert math.isclose(float(aggregate_components([ONE], [{np.int64(0): (two, 2.0)}])[0]["w"][0, 0]), 4.0)
