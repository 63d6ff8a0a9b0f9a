"""``MoRConfig`` + ``MoRTrainer``: the MoR pipeline on the shared preference data (paper 001, Fig. 2 A-B).

Clients with different criteria (one domain each, :mod:`trainer.data.preferences`):

================ ============= ==================================================== =============
client           domain        criterion                                            default arch
================ ============= ==================================================== =============
helpfulness      alpacaeval    GPT-4 judge of AlpacaEval (model vs model)           mlp
harmlessness     hh_harmless   HH-RLHF harmless chosen vs rejected                  lora
correctness      routerbench   a correct vs an incorrect answer to one prompt       mlp
================ ============= ==================================================== =============

One AlpacaEval source subset (``heldout_subset``, default ``koala``) is removed from the helpfulness
client: no reward model and no router ever sees it; it is the cross-category test.

Data flow of one seed (:meth:`MoRTrainer.prepare` then :meth:`MoRTrainer.train`):

1. A fixed pool per client (data seed ``pool_seed``): prompts shuffled, at most ``pairs_per_prompt``
   pairs per prompt, at most ``pool_pairs`` pairs (``heldout_pairs`` for the held-out subset). The
   pool is the same for every seed, so its texts are embedded once (the SQLite cache).
2. Each client's pool is split by prompt into train / validation / test (``split_fractions``,
   :func:`trainer.data.preferences.split_by_prompt`, the seed).
3. Each client trains its reward model on its train pairs (:class:`RewardModelTrainer`; early stopping
   on a split of its own train prompts) and fits its normaliser on them.
4. The router is trained federatedly on the clients' train pairs, once per aggregation weighting
   (``"samples"`` and ``"equal"``, :class:`FederatedRouterTrainer`).
5. The generator prior (evaluation only: :func:`generator_strengths`, issue 29 item 3), then baselines: one MLP
   reward model trained by FedAvg over all clients' train pairs (:func:`train_fedavg_reward_model`), the length-only logistic baseline
   (:class:`trainer.length_baseline.LengthBaseline`, one model per domain, and one global model), and
   the structure-feature baseline (the same regression on :data:`sdk.pair_features.DEFAULT_FEATURES`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from torch import nn
from tqdm.auto import tqdm

from sdk.errors import InvalidInputError
from sdk.pair_features import DEFAULT_FEATURES
from trainer.config_fields import check_bool, check_config, check_int, check_real, check_sequence
from trainer.data.preferences import DOMAINS, check_split_fractions, load_preference_pairs, split_by_prompt
from trainer.embeddings import EmbedderConfig
from trainer.routers.fedavg import fedavg
from trainer.rewards.client_router import (
    WEIGHTINGS,
    ClientRouter,
    ClientRouterData,
    FederatedRouterTrainer,
    RouterConfig,
)
from trainer.rewards.mixture import RoutedReward, save_mixture
from trainer.rewards.pair_features import PairEncoder
from trainer.rewards.routing_rule import RoutingRule
from trainer.rewards.reward_models import (
    ClientRewardModel,
    MLPRewardModel,
    PreferencePairs,
    RewardModelConfig,
    RewardModelTrainer,
    ScoreNormaliser,
    bradley_terry_loss,
)


#: The DP-SGD reward model of ``fedroute mor train --dp`` (``MoRConfig.dp_rm``): per-pair gradients clipped
#: to 1.0, Gaussian noise multiplier 1.0, 30 epochs of Poisson-sampled batches of 64, AdamW lr 3e-3, no weight
#: decay or dropout; chosen on validation pairs by ``benchmarks/mor_defence_settings.py`` (docs/mor.md).
DP_RM = RewardModelConfig(arch="mlp", epochs=30, lr=3e-3, weight_decay=0.0, dropout=0.0, dp_noise_multiplier=1.0,
                          dp_max_grad_norm=1.0)


#: A pool / evaluation cap above every source's pair count: :meth:`MoRConfig.full` keeps every pair.
EVERY_PAIR = 10 ** 9
#: The embedder of :meth:`MoRConfig.full`: model2vec distilled from all-MiniLM-L6-v2 (:mod:`trainer.static_embedder`).
STATIC_MINILM = "static:all-MiniLM-L6-v2"
#: The full preset's client settings, chosen on validation by ``benchmarks/mor_pair_features_settings.py --full``
#: (``docs/results/mor_pair_features_settings_full.json``: router + RM sparse 0.7373 with the length columns vs 0.7372
#: with pair-feature clients, every client's prior, and 0.7369 with ``keep_start`` too; 3 seeds).
FULL_CHOICE: dict = {"pair_features": None, "length_prior": (True, False, True), "keep_start": False}


@dataclass
class MoRConfig:
    """Settings of the MoR pipeline (module docstring).

    data_dir : the shared data folder (``../shared/data``).
    client_names, client_domains, client_archs : one entry per client (equal lengths, >= 2 clients,
        distinct domains of :data:`trainer.data.preferences.DOMAINS`, archs ``mlp`` | ``lora``).
    heldout_subset : AlpacaEval subset no client sees (None: no held-out category).
    pool_pairs, heldout_pairs, pairs_per_prompt, pool_seed : the fixed data pool (step 1);
        ``pool_pairs`` gives one size per client (unequal by default, as the sources are: HH-RLHF
        harmless holds a quarter of the others' pairs, which is what makes sample-weighted FedAvg
        lean away from it).
    max_eval_pairs : cap on each client's validation and test pairs (CPU cost of the LoRA client).
    split_fractions : (train, val, test) shares of each client's prompts.
    lora_train_pairs : cap on the LoRA client's training pairs (CPU cost; None = all).
    mlp_rm, lora_rm : :class:`RewardModelConfig` of each architecture (``arch`` is set per client).
    router : :class:`RouterConfig`; its ``weighting`` is the default of :meth:`MoRTrainer.mixture`. Default: dropout 0.5
        and weight decay 1 (RouterConfig's 0.1 / 1e-4 otherwise), chosen with the routing rules below on a validation
        category (``benchmarks/mor_router_inputs_settings.py --loco``, ``docs/mor_router_loco_settings.json``; within
        0.001 of the unregularised router there). One router (``ensemble=1``): an ensemble of 3 FedAvg runs
        (``RouterConfig.ensemble``) won the accuracy-only rule on the same validation folds by one standard error
        for sparse routing and lost for soft (``benchmarks/mor_router_generalisation_settings.py``,
        ``docs/mor_router_generalisation_settings.json``: +0.0007 +- 0.0007 / -0.0007 +- 0.0008), at 3x the router
        communication (7.14 MB per round instead of 2.38 MB, more than FedAvg of the reward MLPs); label smoothing,
        15 rounds, early stopping and 5 members did not win (docs/mor.md).
    fedavg_rm_rounds : rounds of the FedAvg reward-model baseline (1 local epoch each).
    embedder : EmbedderConfig of the frozen pair encoder (128 tokens: half the CPU time of 256).
    length_features : append the response length to the pair features.
    pair_features : None, or names of :data:`sdk.pair_features.FEATURE_NAMES`: the appended columns are the
        response's pair features ``phi(x, y) / 8`` instead of its 3 length columns (``PairEncoder.pair_features``),
        and an MLP client's length prior becomes the client's local Bradley-Terry fit on them (the
        structure-feature baseline of its own pairs) with the MLP as a residual over it. LoRA clients keep the
        3 length columns.
    length_prior : each client's reward model gets a linear length term started from its OWN local
        length-only Bradley-Terry fit (``RewardModelConfig.length_prior``; MLP and LoRA clients alike;
        not the FedAvg-RM baseline). Overrides ``mlp_rm.length_prior`` / ``lora_rm.length_prior`` for
        the clients. A tuple gives one bool per client (in ``client_names`` order): each client's own
        choice. Default ``(True, False, True)``: each client's choice on its own validation pairs
        (``benchmarks/mor_client_settings.py --mlp-only``, ``docs/mor_client_settings_mlp.json``, seeds 0-2:
        helpfulness 0.889 with / 0.860 without, harmlessness 0.578 / **0.617**, correctness 0.691 / 0.629).
        ``length_prior_C`` is the fit's inverse L2 strength. Both chosen on validation
        pairs by ``benchmarks/mor_length_prior_settings.py`` (``docs/mor_length_prior_settings.json``:
        mean client validation accuracy 0.702 without, 0.708 / 0.716 / 0.719 with C = 1 / 0.1 / 10).
    keep_start : early stopping may keep a client's untrained start (with the length prior: its local
        length-only model) when training does not lower its validation loss (``RewardModelConfig.keep_start``;
        overrides ``mlp_rm.keep_start`` / ``lora_rm.keep_start`` for the clients).
    clip : clip normalised client scores to [-clip, clip] (None: no clipping).
    router_inputs : ``"pair"`` (the router reads ``Enc(x, y)``, the paper), ``"text"`` (``[e(x), e(y)]`` without the
        response's length columns: the reward models keep them) or ``"prompt"`` (only ``e(x)``:
        ``RouterConfig.input_columns`` = the embedder width; the criterion is a property of the prompt's task, so the
        responses of one prompt go to one client and a response's length or style cannot send it elsewhere).
        Chosen on validation by ``benchmarks/mor_router_inputs_settings.py`` (docs/mor.md): ``"pair"`` (best variant
        0.725 vs text 0.719, prompt 0.722; the router's length columns help it keep AlpacaEval responses home).
    mode : ``"sparse"`` or ``"soft"``, the routed reward saved by :meth:`MoRTrainer.save`.
    route_by, sparse_fallback : the sparse routing's ``route_by`` and ``fallback`` (rows whose largest routing weight is
        below it get the soft reward); soft_route_by, temperature : the soft routing's
        (:class:`trainer.rewards.routing_rule.RoutingRule`). These and ``router.weighting`` are the defaults the
        evaluation keeps per seed unless that seed's validation pairs show a variant better by more than
        ``routing_margin_se`` standard errors (:func:`trainer.rewards.evaluation.choose_routing`); ``fedroute mor
        train`` saves that per-seed choice. Equal weighting chosen on validation pairs by
        ``benchmarks/mor_router_inputs_settings.py`` (``docs/mor_router_inputs_settings.json``); the rules (sparse per
        prompt with fallback 0.8, soft per prompt at T = 1) on the in-distribution validation pairs and a validation
        category (each AlpacaEval subset but the held-out one, left out in turn) by ``--loco`` of the same script
        (``docs/mor_router_loco_settings.json``: validation-category accuracy 0.871 / 0.872 vs 0.854 for sparse per
        response, own RM 0.892). ``sparse_fallback_top`` (the fallback mixes only the 2 clients with the largest
        weights) and ``soft_probabilities`` (``"ovr"``: normalised sigmoids of the BCE-trained logits instead of the
        softmax) on the same validation folds by ``benchmarks/mor_heldout_gap_settings.py``
        (``docs/mor_heldout_gap_settings.json``: score +0.0009 +- 0.0005 and +0.0014 +- 0.0010 over the previous
        defaults, paired over 12 seed x fold cells; :class:`RoutingRule`).
    dp_rm : None (default: reward models as above, not differentially private), or the DP-SGD
        :class:`RewardModelConfig` (``arch='mlp'``, ``dp_noise_multiplier`` set) every client then trains its
        reward model with: the models that are saved, evaluated and exported are DP-trained (Abadi et al.
        2016, through Opacus; :data:`DP_RM`, ``fedroute mor train --dp``). Every client is then an MLP
        (DP-SGD of the LoRA client is not implemented: ``client_archs`` is overridden) and the length prior
        is off (its fit on the client's pairs would not be private); the MLP still reads the length columns.
    seeds : seeds 0..seeds-1 of the evaluation.
    cache_dir : embedding cache folder (None: ``$FEDROUTE_CACHE`` or ``~/.cache/fedroute``).
    """

    data_dir: str = "../shared/data"
    client_names: tuple = ("helpfulness", "harmlessness", "correctness")
    client_domains: tuple = ("alpacaeval", "hh_harmless", "routerbench")
    client_archs: tuple = ("mlp", "lora", "mlp")
    heldout_subset: str | None = "koala"
    pool_pairs: tuple = (900, 300, 900)
    heldout_pairs: int = 250
    pairs_per_prompt: int = 2
    pool_seed: int = 0
    split_fractions: tuple = (0.6, 0.2, 0.2)
    max_eval_pairs: int = 150
    lora_train_pairs: int | None = 150
    mlp_rm: RewardModelConfig = field(default_factory=lambda: RewardModelConfig(arch="mlp"))
    lora_rm: RewardModelConfig = field(default_factory=lambda: RewardModelConfig(
        arch="lora", epochs=2, batch_size=16, lr=5e-4, weight_decay=0.0, max_tokens=64, patience=1))
    router: RouterConfig = field(default_factory=lambda: RouterConfig(dropout=0.5, weight_decay=1.0))
    fedavg_rm_rounds: int = 30
    embedder: EmbedderConfig = field(default_factory=lambda: EmbedderConfig(max_tokens=128))
    length_features: bool = True
    pair_features: tuple | None = None
    length_prior: bool | tuple = (True, False, True)
    length_prior_C: float = 10.0
    keep_start: bool = False
    clip: float | None = None
    router_inputs: str = "pair"
    mode: str = "sparse"
    route_by: str = "prompt"
    sparse_fallback: float = 0.8
    sparse_fallback_top: int = 2
    soft_route_by: str = "prompt"
    temperature: float = 1.0
    soft_probabilities: str = "ovr"
    routing_margin_se: float = 1.0
    dp_rm: RewardModelConfig | None = None
    seeds: int = 3
    cache_dir: str | None = None

    def __post_init__(self) -> None:
        if self.dp_rm is not None:
            check_config(self, "dp_rm", RewardModelConfig)
            if self.dp_rm.dp_noise_multiplier is None:
                raise InvalidInputError("dp_rm must set dp_noise_multiplier (a DP-SGD config, e.g. mor_trainer.DP_RM)")
        for name, kind in (("mlp_rm", RewardModelConfig), ("lora_rm", RewardModelConfig), ("router", RouterConfig),
                           ("embedder", EmbedderConfig)):
            check_config(self, name, kind)
        for name in ("client_names", "client_domains", "client_archs", "pool_pairs", "split_fractions"):
            check_sequence(self, name)
        n = len(self.client_names)
        if n < 2 or len(self.client_domains) != n or len(self.client_archs) != n:
            raise InvalidInputError(f"need >= 2 clients with one name, domain and arch each, got names={self.client_names}, "
                                    f"domains={self.client_domains}, archs={self.client_archs}")
        if len(set(self.client_domains)) != n or not set(self.client_domains) <= set(DOMAINS):
            raise InvalidInputError(f"client_domains must be distinct values of {DOMAINS}, got {self.client_domains}")
        bad = [a for a in self.client_archs if a not in ("mlp", "lora")]
        if bad:
            raise InvalidInputError(f"client_archs must be 'mlp' or 'lora', got {bad}")
        if self.heldout_subset is not None and "alpacaeval" not in self.client_domains:
            raise InvalidInputError(f"heldout_subset={self.heldout_subset!r} is an AlpacaEval subset but no client holds alpacaeval")
        if self.router_inputs not in ("pair", "text", "prompt"):
            raise InvalidInputError(f"router_inputs must be 'pair', 'text' or 'prompt', got {self.router_inputs!r}")
        self.sparse_rule(), self.soft_rule()  # validate
        if self.mode not in ("sparse", "soft"):
            raise InvalidInputError(f"mode must be 'sparse' or 'soft', got {self.mode!r}")
        if len(self.pool_pairs) != n or not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= 10
                                                for v in self.pool_pairs):
            raise InvalidInputError(f"pool_pairs must give >= 10 pairs for each of the {n} clients, got {self.pool_pairs}")
        if not isinstance(self.length_prior, bool) and (len(self.length_prior) != n
                                                        or not all(isinstance(v, bool) for v in self.length_prior)):
            raise InvalidInputError(f"length_prior must be a bool or one bool per client ({n}), got {self.length_prior!r}")
        for name in ("heldout_pairs", "pairs_per_prompt", "seeds", "fedavg_rm_rounds", "max_eval_pairs"):
            check_int(self, name, 1)
        check_int(self, "lora_train_pairs", 1, optional=True)
        check_int(self, "pool_seed", 0)
        check_real(self, "length_prior_C", 0, low_open=True)
        check_real(self, "clip", 0, low_open=True, optional=True)
        check_real(self, "routing_margin_se", 0)
        check_bool(self, "length_features")
        check_bool(self, "keep_start")
        check_split_fractions(self.split_fractions, positive=True, name="MoRConfig.split_fractions")

    def sparse_rule(self) -> RoutingRule:
        """The default sparse routing rule (``route_by``, ``sparse_fallback``, ``sparse_fallback_top``)."""
        return RoutingRule("sparse", 1.0, self.route_by, self.sparse_fallback, self.sparse_fallback_top)

    def soft_rule(self) -> RoutingRule:
        """The default soft routing rule (``soft_route_by``, ``temperature``, ``soft_probabilities``)."""
        return RoutingRule("soft", self.temperature, self.soft_route_by, probabilities=self.soft_probabilities)

    @classmethod
    def quick(cls, **overrides) -> MoRConfig:
        """The ``--quick`` preset: smaller pools, every client an MLP (a LoRA encoder step costs ~1 s
        per pair on a loaded 2-core CPU), fewer FedAvg-RM rounds, 60 eval pairs per client; still 3 seeds."""
        base = dict(pool_pairs=(300, 100, 300), heldout_pairs=120, max_eval_pairs=60, client_archs=("mlp", "mlp", "mlp"), fedavg_rm_rounds=15)
        return cls(**(base | overrides))

    @classmethod
    def full(cls, **overrides) -> MoRConfig:
        """The ``--full`` preset (issue 29, item 2): every pair of each client's domain (no pool cap, every pair of
        a prompt, no cap on validation and test pairs; all 1,768 koala pairs held out), every client an MLP (the LoRA
        client's ~1 s per CPU step does not scale to ~1.4k harmlessness training pairs per seed) and the static
        (model2vec) table distilled from MiniLM as ``e(.)`` (:mod:`trainer.static_embedder`, 256 dimensions, the whole
        text): the 22,728 texts of the three domains embed in 42 s (after a one-off 134 s distillation) where MiniLM at
        128 tokens embedded 1,500 in 197 s and not the next 1,500 in 7 min (2-core CPU at load 6-12: hours). Pair-feature clients or the length columns and the length priors chosen on validation by
        ``benchmarks/mor_pair_features_settings.py --full`` (docs/mor.md)."""
        base = dict(pool_pairs=(EVERY_PAIR,) * 3, heldout_pairs=EVERY_PAIR, pairs_per_prompt=EVERY_PAIR,
                    max_eval_pairs=EVERY_PAIR, client_archs=("mlp", "mlp", "mlp"), lora_train_pairs=None,
                    embedder=EmbedderConfig(model=STATIC_MINILM))
        return cls(**(base | FULL_CHOICE | overrides))

    def with_members(self, n: int) -> MoRConfig:
        """This config with every client's pool grown to ``ceil(n / min(train share, val + test share) * 1.1)``
        pairs, up to 4 pairs per prompt (AlpacaEval without the held-out subset has ~490 instructions) and no
        cap on the validation and test pairs, so that the privacy audit has at least ``n`` members (training
        pairs) and ``n`` non-members (validation + test pairs) per client (the 10 % margin covers the split by
        prompt's rounding). At n = 500, 1 : 1, the AUC's standard error is <= 0.0183."""
        tr, va, te = self.split_fractions
        pool = int(np.ceil(n / min(tr, va + te) * 1.1))
        return replace(self, pool_pairs=(pool,) * len(self.client_names), max_eval_pairs=pool,
                       pairs_per_prompt=max(self.pairs_per_prompt, 4))

    def to_json(self) -> dict:
        return json.loads(json.dumps(asdict(self), default=str))


@dataclass
class ClientSplit:
    """One client's pairs of one seed: frames (pairs schema) and PreferencePairs of each part."""

    name: str
    domain: str
    train: pd.DataFrame
    val: pd.DataFrame
    test: pd.DataFrame

    def pairs(self, part: str) -> PreferencePairs:
        return PreferencePairs.from_frame(getattr(self, part))


@dataclass
class MoRSplit:
    seed: int
    clients: list[ClientSplit]
    heldout: pd.DataFrame | None


@dataclass
class MoRModels:
    """What one seed trains: client reward models (client order), routers per weighting, baselines."""

    reward_models: list[ClientRewardModel]
    routers: dict[str, ClientRouter]
    fedavg_rm: MLPRewardModel
    length_baseline: object
    router_bytes_per_round: int = 0
    history: dict = field(default_factory=dict)
    baselines: dict = field(default_factory=dict)
    generator_beta: dict | None = None


def train_fedavg_reward_model(features: list[tuple[np.ndarray, np.ndarray]], config: RewardModelConfig, encoder: PairEncoder,
                              rounds: int, seed: int) -> MLPRewardModel:
    """The FedAvg baseline: one MLP reward model whose parameters are averaged (sample-weighted,
    :func:`trainer.routers.fedavg.fedavg`) over all clients after one local Bradley-Terry epoch each.

    features : per client (chosen, rejected) pair features, each (n_k, d_in) float32.
    Returns an MLPRewardModel whose normaliser is fitted on the pooled training scores.
    """
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    d_in = features[0][0].shape[1]
    model = MLPRewardModel(encoder, d_in, config.hidden, config.dropout)
    params = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
    for _ in range(rounds):
        updates = []
        for fc, fr in features:
            model.module.load_state_dict(params)
            opt = torch.optim.AdamW(model.module.parameters(), lr=config.lr, weight_decay=config.weight_decay)
            model.module.train()
            tc, tr = torch.from_numpy(fc), torch.from_numpy(fr)
            order = rng.permutation(len(fc))
            for s in range(0, len(fc), config.batch_size):
                idx = order[s : s + config.batch_size]
                loss = bradley_terry_loss(model.module(tc[idx]), model.module(tr[idx]))
                opt.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(model.module.parameters(), 1.0)
                opt.step()
            updates.append(({k: v.detach().numpy() for k, v in model.module.state_dict().items()}, len(fc)))
        params = {k: torch.from_numpy(v.astype(np.float32)) for k, v in fedavg(updates).items()}
    model.module.load_state_dict(params)
    model.module.eval()
    raw = np.concatenate([model.raw_scores_from_features(np.concatenate([fc, fr])) for fc, fr in features])
    model.normaliser_ = ScoreNormaliser.fit(raw, config.eps, config.clip)
    return model


def generator_strengths(split: MoRSplit) -> dict[str, float] | None:
    """Bradley-Terry strengths of the generators (:func:`trainer.generator_prior.fit_bradley_terry`, C = 1) from the
    win/loss counts each client uploads of its train pairs (:func:`~trainer.generator_prior.client_win_counts`,
    summed by the server); None when no client's pairs name their generators (HH-RLHF's do not)."""
    from trainer.generator_prior import aggregate_win_counts, client_win_counts, fit_bradley_terry  # pandas, sklearn: on use

    counts = aggregate_win_counts(client_win_counts(c.train) for c in split.clients)
    return fit_bradley_terry(counts) if counts else None


class MoRTrainer:
    """Runs the MoR pipeline of :class:`MoRConfig` (module docstring).

    ``prepare(seed) -> MoRSplit``, ``train(split) -> MoRModels``, ``mixture(models, ...) -> RoutedReward``,
    ``save(models, directory)``. ``pool_`` holds the fixed pairs pool (a pairs frame with a ``client``
    column; held-out rows have client ``"heldout"``).
    """

    def __init__(self, args: MoRConfig | None = None, show_progress: bool = True) -> None:
        self.args = args or MoRConfig()
        self.show_progress = show_progress
        a = self.args
        self.encoder = PairEncoder(a.embedder, Path(a.cache_dir) if a.cache_dir else None, show_progress,
                                   length_features=a.length_features,
                                   pair_features=None if a.pair_features is None else tuple(a.pair_features))
        self.pool_: pd.DataFrame | None = None

    # ------------------------------------------------------------------ data

    def load_pool(self) -> pd.DataFrame:
        """The fixed pairs pool (step 1); cached on the trainer."""
        if self.pool_ is not None:
            return self.pool_
        a = self.args
        df = load_preference_pairs(a.data_dir, a.client_domains, seed=a.pool_seed)
        rng = np.random.default_rng(a.pool_seed)
        parts = []
        for name, domain, size in zip(a.client_names, a.client_domains, a.pool_pairs):
            d = df[df["domain"] == domain]
            if domain == "alpacaeval" and a.heldout_subset is not None:
                if a.heldout_subset not in set(d["subset"]):
                    raise InvalidInputError(f"heldout_subset {a.heldout_subset!r} is not an AlpacaEval subset: "
                                            f"{sorted(set(d['subset']))}")
                parts.append(self._sample(d[d["subset"] == a.heldout_subset], a.heldout_pairs, rng).assign(client="heldout"))
                d = d[d["subset"] != a.heldout_subset]
            parts.append(self._sample(d, size, rng).assign(client=name))
        self.pool_ = pd.concat(parts, ignore_index=True)
        return self.pool_

    def _sample(self, d: pd.DataFrame, n: int, rng: np.random.Generator) -> pd.DataFrame:
        ids = np.array(sorted(d["prompt_id"].unique()))
        ids = ids[rng.permutation(len(ids))]
        groups = {k: g for k, g in d.groupby("prompt_id")}
        rows, total = [], 0
        for pid in ids:
            g = groups[pid]
            g = g.iloc[rng.permutation(len(g))[: self.args.pairs_per_prompt]]
            rows.append(g)
            total += len(g)
            if total >= n:
                break
        return pd.concat(rows).iloc[:n].reset_index(drop=True)

    def prepare(self, seed: int) -> MoRSplit:
        """Split each client's pool by prompt for ``seed`` (step 2)."""
        pool = self.load_pool()
        clients = []
        for name, domain in zip(self.args.client_names, self.args.client_domains):
            tr, va, te = split_by_prompt(pool[pool["client"] == name], self.args.split_fractions, seed)
            cap = self.args.max_eval_pairs
            clients.append(ClientSplit(name, domain, tr, va.iloc[:cap].reset_index(drop=True), te.iloc[:cap].reset_index(drop=True)))
        held = pool[pool["client"] == "heldout"].reset_index(drop=True)
        return MoRSplit(seed, clients, held if len(held) else None)

    # ------------------------------------------------------------------ training

    def features(self, pairs: PreferencePairs) -> tuple[np.ndarray, np.ndarray]:
        """(chosen, rejected) pair features, each (n, d_in) float32."""
        return (self.encoder.encode(pairs.prompts, pairs.chosen), self.encoder.encode(pairs.prompts, pairs.rejected))

    def router_input_columns(self, d_in: int) -> int | None:
        """``RouterConfig.input_columns`` of ``router_inputs`` for pair features of width ``d_in``: None (pair, or
        text without length features), ``2 d_emb`` (text: no length columns) or ``d_emb`` (prompt);
        ``d_in = 2 d_emb (+ 3 length columns)``."""
        if self.args.router_inputs == "pair" or (self.args.router_inputs == "text" and not self.args.length_features):
            return None
        d_emb = (d_in - self.encoder.n_feature_columns) // 2
        return d_emb if self.args.router_inputs == "prompt" else 2 * d_emb

    def client_length_prior(self, name: str) -> bool:
        """Whether client ``name`` uses the length prior (``MoRConfig.length_prior``, one bool or one per client)."""
        lp = self.args.length_prior
        return bool(lp) if isinstance(lp, bool) else bool(lp[list(self.args.client_names).index(name)])

    def train_reward_model(self, client: ClientSplit, arch: str, seed: int, config: RewardModelConfig | None = None) -> tuple[ClientRewardModel, list]:
        a = self.args
        if config is None and a.dp_rm is not None:
            config, arch = replace(a.dp_rm, clip=a.clip), "mlp"
        base = config or (a.mlp_rm if arch == "mlp" else a.lora_rm)
        cfg = replace(base, arch=arch, seed=seed, clip=a.clip if config is None else base.clip,
                      length_prior=self.client_length_prior(client.name) if config is None else base.length_prior,
                      length_prior_C=a.length_prior_C if config is None else base.length_prior_C,
                      keep_start=a.keep_start if config is None else base.keep_start)
        trainer = RewardModelTrainer(cfg, self.encoder, self.show_progress)
        return trainer.train(self.training_pairs(client, arch, seed)), trainer.history_

    def training_pairs(self, client: ClientSplit, arch: str, seed: int) -> PreferencePairs:
        """The pairs a client's reward model of ``arch`` trains on: its train pairs, at most ``lora_train_pairs``
        of them (seeded draw) for the LoRA architecture (the members of the privacy audit)."""
        pairs, cap = client.pairs("train"), self.args.lora_train_pairs
        if arch == "lora" and cap is not None and pairs.n_pairs > cap:
            pairs = pairs.subset(np.sort(np.random.default_rng(seed).permutation(pairs.n_pairs)[:cap]))
        return pairs

    def train(self, split: MoRSplit) -> MoRModels:
        """Steps 3-5 for one seed."""
        from trainer.length_baseline import STRUCTURE_C, LengthBaseline  # trainer.length_baseline imports pandas: on use only

        a, seed = self.args, split.seed
        rms, history = [], {}
        for c, arch in zip(tqdm(split.clients, desc=f"seed {seed}: client reward models", disable=not self.show_progress),
                           a.client_archs):
            rm, hist = self.train_reward_model(c, arch, seed)
            rms.append(rm)
            history[c.name] = hist
        feats = [self.features(c.pairs("train")) for c in split.clients]
        data = [ClientRouterData(fc, fr, k) for k, (fc, fr) in enumerate(feats)]
        routers, nbytes = {}, 0
        for w in WEIGHTINGS:
            rt = FederatedRouterTrainer(replace(a.router, weighting=w, seed=seed, input_columns=self.router_input_columns(feats[0][0].shape[1])),
                                        self.show_progress)
            routers[w] = rt.train(data, list(a.client_names))
            nbytes = rt.bytes_per_round_
        fed = train_fedavg_reward_model(feats, replace(a.mlp_rm, seed=seed, clip=a.clip), self.encoder, a.fedavg_rm_rounds, seed)
        pooled = pd.concat([c.train for c in split.clients], ignore_index=True)
        length = LengthBaseline(per_domain=True).fit(pooled)
        baselines = {"length_only_global": LengthBaseline(per_domain=False).fit(pooled),
                     "structure_only": LengthBaseline(per_domain=True, C=STRUCTURE_C, features=DEFAULT_FEATURES).fit(pooled)}
        return MoRModels(rms, routers, fed, length, nbytes, history, baselines, generator_strengths(split))

    def mixture(self, models: MoRModels, mode: str | None = None, weighting: str | None = None,
                normalise: bool = True, routing: dict | None = None) -> RoutedReward:
        """The routed reward over the clients' reward models.

        routing : the validation choice of :func:`trainer.rewards.evaluation.choose_routing` (``weighting``,
            ``sparse`` and ``soft`` variant keys): its router and one RoutingRule per mode. None: the config's
            ``router.weighting``, ``route_by`` (sparse), ``soft_route_by`` and ``temperature`` (soft). ``weighting`` overrides the router either way;
            ``mode`` (default the config's) picks the active variant.
        """
        a = self.args
        keys = (routing["sparse"], routing["soft"]) if routing is not None else (
            a.sparse_rule().variant, a.soft_rule().variant)
        variants = {r.mode: r for r in map(RoutingRule.from_variant, keys)}
        w = weighting or (routing or {}).get("weighting") or self.args.router.weighting
        return RoutedReward(models.routers[w], models.reward_models, self.encoder, mode or self.args.mode, normalise,
                            variants=variants)

    def save(self, models: MoRModels, directory: Path, weighting: str | None = None, routing: dict | None = None,
             mode: str | None = None, records: dict | None = None) -> Path:
        """:func:`trainer.rewards.mixture.save_mixture` of :meth:`mixture` (``routing``: the validation choice,
        recorded in ``mixture.json["selection"]``), plus ``mor_config.json`` and ``records`` ({file name:
        JSON object}, e.g. ``train_metrics.json``), written before ``mixture.json``."""
        mix = self.mixture(models, mode=mode, weighting=weighting, routing=routing)
        selection = None
        if routing is not None:
            selection = {"chosen_on": "validation", "weighting": weighting or routing["weighting"],
                         "sparse": routing["sparse"], "soft": routing["soft"], "val": routing.get("val", {})}
        return save_mixture(mix, Path(directory), selection, records={"mor_config.json": self.args.to_json(), **(records or {})})
