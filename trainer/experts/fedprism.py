"""FedPrism: federated preference experts with instance-wise routing (paper 000; ARCHITECTURE.md §7).

:class:`FedPrismConfig` (data, validated, savable without a model) + :class:`FedPrismTrainer`
(behaviour). One round ``t = 1..rounds`` (paper 000, Algorithm 1):

1. A seeded ``clients_per_round`` of the clients take part; each draws up to ``local_pairs`` of its
   pairs for the round (one local pass).
2. **Route**: each sample goes to ``argmax`` of the router on its frozen prompt embedding.
3. **Sparse retrieval**: the client downloads the router and only the experts its samples were routed
   to (:meth:`FedPrismTrainer.retrieve`, which records the indices and counts the bytes: float32
   tensors, 4 bytes per value).
4. **Local training**: each retrieved expert is trained (AdamW, ``expert_lr``, batches of
   ``batch_size``, BCE on pairs and their position-swapped copies) on the samples routed to it.
5. **PGPD** at rounds ``t > warmup_rounds`` with ``(t - warmup_rounds) % router_every == 0`` (the
   router is frozen otherwise): the CE of every retrieved (locally updated) expert on every round
   sample, argmin -> pseudo-label, ``router_epochs`` of KL-to-one-hot into a local router copy.
6. **Aggregation**: each expert is averaged over the clients that updated it, weighted by the samples
   it used (:func:`trainer.experts.aggregation.aggregate_components`); routers updated by PGPD are
   FedAvg-ed weighted by their sample counts. That count is the pairs the client drew for the round
   (``min(local_pairs, |D_i|)``, the samples the distillation used), not the paper's full ``|D_i|``
   (paper 000, Eq. of Step 4): a deliberate deviation, since with one local pass over a per-round draw
   the router never saw the rest of ``D_i``; the two agree whenever ``|D_i| <= local_pairs``.

Before round 1 (``length_init='fedavg_lr'``, the default), every expert's length path starts at the
FedAvg of client-local length-only logistic regressions on the pairs initially routed to it
(:mod:`trainer.experts.length_init`; 16 bytes per client and expert up, counted in
``length_init_upload_bytes_``), so training starts from what length alone predicts.

Routing kinds (``FedPrismConfig.routing``) give the baselines and ablations on the same clients:
``'router'`` (FedPrism; with ``pgpd=False`` the *frozen router* ablation, with ``warmup_rounds=0``
*no warm-up*), ``'random'`` (each sample to a uniformly random expert, redrawn each round; test pairs
too), ``'single'`` (FedBis: one expert, FedAvg), ``'client_cluster'`` (FedBiscuit-style: clients
clustered into ``n_experts`` groups by K-means on their mean prompt embedding, one selector per
group trained by its clients; a test pair is scored by the mean probability of the group selectors).
``'domain_oracle'`` (each pair to the expert of its *domain*, which no client's router knows: an
upper reference for what routing can reach, used by ``benchmarks/prism_experts_settings.py``, not a
method of the table). See :func:`method_config`.

With ``length_prior='domain'`` the start is instead one FedAvg length-only regression per *domain*
(clients fit one per domain they hold), added to every expert's logit as a fixed offset chosen by the
pair's domain label (the per-domain length-only baseline's input); the experts' own length paths
start and stay at 0, so each expert is that prior plus its learned content residual.

Presets: the CPU default (``trainer.experts.experiment.PRESETS['cpu']``) is scaled down (6 experts, the
federated per-expert length start and a content residual over it (``length_lr_scale=0``,
``expert_lr=1e-2``), all chosen on validation; label-free, as ``sdk.Selector`` needs: the per-domain
prior, ranked higher on validation, reads the domain label and is opt-in, docs/prism.md),
8 rounds, warm-up 3, PGPD every 2 rounds, 4 clients x 40 pairs per round, MiniLM with LoRA in the
top layer on cached lower layers); :meth:`FedPrismConfig.gpu_preset` is the
paper's 5 experts, 400 rounds, warm-up 150, router update every 20 rounds at lr 1e-3, experts at
lr 1e-5 on a Qwen2-0.5B-class backbone with LoRA on every layer.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from sdk.errors import InvalidInputError
from trainer.config_fields import check_bool, check_config, check_int, check_real
from trainer.experts.aggregation import aggregate_components
from trainer.experts.prompt_router import PromptRouter, centroid_distillation, fit_router, kmeans_init, pgpd_pseudo_labels
from trainer.experts.selector import PairSelector, SegmentStore, SelectorConfig
from trainer.routers.fedavg import fedavg
from trainer.preference_metrics import expert_utilisation, pairwise_accuracy
from trainer.generator_prior import aggregate_win_counts, client_win_counts, fit_bradley_terry, generator_logit
from trainer.experts.length_init import client_length_coefs, fedavg_length_coefs, pooled_expert_coefs, upload_bytes
from trainer.report import write_text

ROUTINGS = ("router", "random", "single", "client_cluster", "domain_oracle")
LENGTH_INITS = ("fedavg_lr", "pooled", "zero")
LENGTH_PRIORS = ("expert", "domain")
METHODS = ("fedprism", "fedprism_generator_prior", "fedbis", "fedbiscuit", "random_routing", "frozen_router", "no_warmup")


@dataclass
class FedPrismConfig:
    """Settings of one FedPrism (or baseline) run.

    n_experts : M, number of experts (paper 5).
    rounds : communication rounds (paper 400).
    warmup_rounds : T_warm, rounds before the first router update (paper 150).
    router_every : F_freq, rounds between router updates after warm-up (paper 20).
    clients_per_round : clients sampled per round.
    local_pairs : pairs per participating client per round (one pass).
    batch_size : pairs per optimiser step.
    expert_lr : AdamW learning rate of LoRA + head (paper 1e-5 on a 0.5B LM).
    router_lr : AdamW learning rate of PGPD (paper 1e-3).
    router_epochs : local epochs of PGPD distillation.
    router_hidden : router width (paper 128).
    init_lr, init_epochs : router fit to the K-means pseudo-labels of public prompts.
    routing : one of :data:`ROUTINGS`; pgpd : bool, update the router by PGPD.
    length_init : ``'fedavg_lr'`` (each expert's length path starts at the FedAvg of the clients'
        local length-only logistic regressions on the pairs initially routed to it, and the head's
        output layer at zero: :mod:`trainer.experts.length_init`) or ``'zero'`` (length path 0, head
        at PyTorch's default initialisation), or ``'pooled'`` (the exact federated fits of
        :func:`trainer.experts.length_init.pooled_expert_coefs`: one fit on every client pair (``length_C``),
        then per expert the fit on the pairs initially routed to it pulled towards it (``length_pool_C``);
        clients send loss and gradient per L-BFGS evaluation; chosen on validation by
        ``benchmarks/prism_prior_fit_settings.py``).
    length_C : inverse L2 strength of those local regressions (``'pooled'``: of the global fit).
    length_pool_C : float > 0, ``'pooled'`` only: inverse strength of each expert's pull towards the global fit.
    router_init_rounds : int >= 0, rounds of federated distillation of the K-means-initialised router onto its
        public centroids over the clients' own prompts (:func:`trainer.experts.prompt_router.centroid_distillation`;
        0 = the router fitted to the public prompts alone).
    length_prior : ``'expert'`` (each expert's own length path ``v_k`` is its prior: the federated fit on
        the pairs initially routed to it) or ``'domain'`` (every expert adds the fixed offset
        ``w_d . f`` of the pair's *domain* ``d``, the FedAvg of the clients' local per-domain length-only
        regressions, to its own output, whose length path ``v_k`` starts at 0: expert logit = the
        length-only baseline's logit + a learned content residual). ``'domain'`` reads the pair's domain
        label at training *and* prediction time, the same input as the per-domain length-only
        baseline; it needs ``length_init='fedavg_lr'``.
    residual_scale : float >= 0, the served experts' head output layer (``w2``, ``b2``: the content
        residual over the length path/prior) is multiplied by it (1 = as trained, 0 = the prior alone);
        applied to :attr:`FedPrismTrainer.served_experts` (evaluation and saved experts), not in training.
    length_lr_scale : float >= 0, the length path's learning rate is ``expert_lr * length_lr_scale``
        (0 = the length path stays at its start: the expert is the length prior plus a learned content
        residual ``w2 . tanh(...) + b2``, which starts at zero).
    generator_prior : bool, a Bradley-Terry prior over the responses' generators as one more antisymmetric
        feature of the exact federated start (``length_init='pooled'`` only; issue 29, item 3): every client
        uploads its win/loss counts per (winner, loser) generator pair
        (:func:`trainer.generator_prior.client_win_counts`), the server sums them and fits the strengths
        ``beta`` (:func:`trainer.generator_prior.fit_bradley_terry`); a client's training pairs get
        ``g = beta_A - beta_B`` from the strengths of the *other* clients' counts (cross-fitting: its own labels
        never build its feature), every other pair from all counts, 0 where a generator is unknown or the
        domain has none. Each expert's feature path is fitted on ``[f, g]``: its last weight ``gamma_k`` is
        saved beside the strengths (``generator_prior.json``) and adds ``gamma_k g`` to the expert's logit
        (fixed, like ``v_k``). Chosen on validation by ``benchmarks/prism_start_gap.py --part prior``.
    router_role_scale : float >= 0, > 0 appends ``router_role_scale * log(1 + count)`` of each role tag of
        :data:`sdk.routed_selector.ROLE_TAGS` in the prompt to the router's input (K-means start, distillation,
        routing, PGPD), which tells chat transcripts from instructions; 0 = the embedding alone. Chosen on
        validation by ``benchmarks/prism_start_gap.py --part roles`` (0.5).
    client_val_fraction : float in [0, 0.5), share of each client's pairs kept as its local validation
        split (never trained on); 0 = off. When > 0, before round 1 and after every round every client
        scores each expert on its validation pairs routed to it and sends (loss sum, count) per expert;
        the server keeps, per expert, the state with the lowest federated validation loss (per-expert
        early stopping; the initial state is a candidate), and the run ends with those states.
    eval_every : rounds between test evaluations (the last round is always evaluated).
    seed : int, client sampling, expert initialisation, routing draws.
    selector : SelectorConfig of the experts.
    device : torch device string of the experts' training and scoring (``'cpu'``; ``'cuda'`` in
        :meth:`gpu_preset`); the prompt router, the length fits and the segment cache stay on the CPU.
    """

    n_experts: int = 3
    rounds: int = 10
    warmup_rounds: int = 4
    router_every: int = 2
    clients_per_round: int = 5
    local_pairs: int = 48
    batch_size: int = 16
    expert_lr: float = 1e-3  # chosen on validation pairs by trainer.experts.tune (1e-3 vs 3e-3)
    router_lr: float = 1e-3
    router_epochs: int = 5
    router_hidden: int = 128
    init_lr: float = 1e-2
    init_epochs: int = 30
    routing: str = "router"
    pgpd: bool = True
    length_init: str = "fedavg_lr"
    length_C: float = 1.0
    length_pool_C: float = 5.0
    router_init_rounds: int = 0
    length_lr_scale: float = 1.0
    length_prior: str = "expert"
    residual_scale: float = 1.0
    generator_prior: bool = False
    router_role_scale: float = 0.0
    client_val_fraction: float = 0.0
    eval_every: int = 2
    seed: int = 0
    selector: SelectorConfig = field(default_factory=SelectorConfig)
    device: str = "cpu"

    def __post_init__(self) -> None:
        if isinstance(self.selector, dict):
            from trainer.experts.selector import PairEncodingConfig  # trainer.experts.selector imports torch: on use only

            sel = dict(self.selector)
            sel["encoding"] = PairEncodingConfig(**sel["encoding"])
            self.selector = SelectorConfig(**sel)
        check_config(self, "selector", SelectorConfig)
        if self.length_init not in LENGTH_INITS:
            raise InvalidInputError(f"length_init must be one of {LENGTH_INITS}, got {self.length_init!r}")
        if self.length_prior not in LENGTH_PRIORS:
            raise InvalidInputError(f"length_prior must be one of {LENGTH_PRIORS}, got {self.length_prior!r}")
        if self.length_prior == "domain" and self.length_init != "fedavg_lr":
            raise InvalidInputError("length_prior='domain' needs length_init='fedavg_lr' (the prior is a federated fit)")
        check_real(self, "residual_scale", 0)
        check_real(self, "router_role_scale", 0)
        check_real(self, "length_C", 0, low_open=True)
        check_real(self, "length_pool_C", 0, low_open=True)
        check_int(self, "router_init_rounds", 0)
        check_real(self, "length_lr_scale", 0)
        check_real(self, "client_val_fraction", 0, 0.5, high_open=True)
        for name in ("expert_lr", "router_lr", "init_lr"):
            check_real(self, name, 0, low_open=True)
        check_bool(self, "pgpd")
        check_bool(self, "generator_prior")
        if self.generator_prior and self.length_init != "pooled":
            raise InvalidInputError("generator_prior=True needs length_init='pooled' (the prior is a feature of its exact fit)")
        if self.routing not in ROUTINGS:
            raise InvalidInputError(f"routing must be one of {ROUTINGS}, got {self.routing!r}")
        for name in ("n_experts", "rounds", "router_every", "clients_per_round", "local_pairs", "batch_size",
                     "router_epochs", "router_hidden", "eval_every"):
            check_int(self, name, 1)
        check_int(self, "init_epochs", 0)
        check_int(self, "seed", 0)
        check_int(self, "warmup_rounds", 0)
        if not isinstance(self.device, str):
            raise InvalidInputError(f"device must be a torch device string ('cpu', 'cuda', 'cuda:1'), got {self.device!r}")
        try:
            torch.device(self.device)
        except (RuntimeError, ValueError) as exc:
            raise InvalidInputError(f"device {self.device!r} is not a torch device ('cpu', 'cuda', 'cuda:1')") from exc
        if not self.warmup_rounds <= self.rounds:
            raise InvalidInputError(f"warmup_rounds={self.warmup_rounds!r} must be in [0, rounds={self.rounds}]")
        if self.routing == "single" and self.n_experts != 1:
            raise InvalidInputError(f"routing='single' (FedBis) needs n_experts=1, got {self.n_experts}")
        if self.pgpd and self.routing != "router":
            raise InvalidInputError(f"pgpd=True needs routing='router', got routing={self.routing!r}")

    @classmethod
    def gpu_preset(cls, backbone: str = "Qwen/Qwen2-0.5B") -> FedPrismConfig:
        """The paper's settings (M = 5, 400 rounds, warm-up 150, F_freq 20, lr 1e-3 / 1e-5)."""
        return cls(n_experts=5, rounds=400, warmup_rounds=150, router_every=20, expert_lr=1e-5, router_lr=1e-3,
                   local_pairs=64, batch_size=8, eval_every=20, selector=SelectorConfig.gpu_preset(backbone),
                   device="cuda")

    def pgpd_round(self, t: int) -> bool:
        """True when round ``t`` (1-based) updates the router by PGPD."""
        return self.pgpd and t > self.warmup_rounds and (t - self.warmup_rounds) % self.router_every == 0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["selector"] = self.selector.to_dict()
        return d


def method_config(method: str, base: FedPrismConfig) -> FedPrismConfig:
    """The config of a named method of the results table on top of ``base`` (FedPrism's settings).

    Raises
    ------
    InvalidInputError
        Unknown method (the message lists :data:`METHODS`).
    """
    if method == "fedprism":
        return replace(base, routing="router", pgpd=True)
    if method == "fedprism_generator_prior":
        return replace(base, routing="router", pgpd=True, generator_prior=True)
    if method == "fedbis":
        return replace(base, routing="single", pgpd=False, n_experts=1)
    if method == "fedbiscuit":
        return replace(base, routing="client_cluster", pgpd=False)
    if method == "random_routing":
        return replace(base, routing="random", pgpd=False)
    if method == "frozen_router":
        return replace(base, routing="router", pgpd=False)
    if method == "no_warmup":
        return replace(base, routing="router", pgpd=True, warmup_rounds=0)
    raise InvalidInputError(f"unknown method {method!r}; valid: {', '.join(METHODS)}")


def state_bytes(state: dict[str, np.ndarray]) -> int:
    """Bytes of a parameter dict sent as float32 (4 bytes per value)."""
    return int(sum(np.asarray(v).size for v in state.values()) * 4)


@dataclass
class FederatedPairs:
    """The pairs a run sees, all in one :class:`SegmentStore`.

    store : SegmentStore of every pair (train, public-free).
    prompt_emb : ndarray of shape (n_pairs, d_emb), float32, frozen embedding of each pair's prompt.
    domain : ndarray of shape (n_pairs,), str.
    clients : list of ndarrays of pair indices (train pairs of each client).
    public_emb : ndarray of shape (n_public, d_emb), float32, prompts held by no client (router init).
    eval_pairs : ndarray of pair indices scored each evaluation (test or validation).
    generators : None, or a DataFrame indexed like the pairs with ``domain``, ``source_a``, ``source_b``
        (the responses' generators, as in the pairs frames), needed by ``FedPrismConfig.generator_prior``.
    prompt_roles, public_roles : None, or the role-tag counts of each pair's / public prompt
        (:func:`sdk.routed_selector.role_counts`, (n, T) float32), needed by ``FedPrismConfig.router_role_scale``.
    """

    store: SegmentStore
    prompt_emb: np.ndarray
    domain: np.ndarray
    clients: list[np.ndarray]
    public_emb: np.ndarray
    eval_pairs: np.ndarray
    generators: pd.DataFrame | None = None
    prompt_roles: np.ndarray | None = None
    public_roles: np.ndarray | None = None


def _name_of(model: torch.nn.Module, param: torch.nn.Parameter) -> str:
    for n, p in model.named_parameters():
        if p is param:
            return n
    raise KeyError("parameter not in model")


class FedPrismTrainer:
    """Runs FedPrism (or one of its baselines) on simulated clients (module docstring).

    Parameters
    ----------
    model : PairSelector, the shared frozen backbone (its current expert state is overwritten).
    data : FederatedPairs
    args : FedPrismConfig or None (defaults).

    Attributes (after :meth:`train`)
    ----------
    experts_ : list of n_experts expert states; router_ : PromptRouter; history_ : list of dicts per
    round (``round``, ``retrieved`` per client, ``downlink_bytes``, ``router_updated``,
    ``utilisation`` (share per expert of the eval pairs), and at evaluated rounds ``accuracy``);
    last_eval_ : the :meth:`evaluate` result of the last evaluated round (the final round's, after
    :meth:`train`), so callers need not score the eval pairs again. With ``generator_prior``:
    ``generator_strengths_`` ({generator: beta}, all clients' counts), ``generator_weights_`` (ndarray (M,), each
    expert's ``gamma_k``) and ``generator_upload_bytes_`` (the clients' count uploads); else None, None, 0.
    """

    def __init__(self, model: PairSelector, data: FederatedPairs, args: FedPrismConfig | None = None,
                 progress: bool = False) -> None:
        self.args = args or FedPrismConfig()
        self.model = model.to(torch.device(self.args.device))  # the experts train there; the router stays on the CPU
        self.data = data
        self.progress = progress
        if not data.clients or any(len(c) == 0 for c in data.clients):
            raise InvalidInputError("every client needs at least one train pair")
        if self.args.generator_prior and data.generators is None:
            raise InvalidInputError("generator_prior=True needs FederatedPairs.generators (the pairs' source_a / source_b)")
        if self.args.router_role_scale > 0 and (data.prompt_roles is None or data.public_roles is None):
            raise InvalidInputError("router_role_scale > 0 needs FederatedPairs.prompt_roles and public_roles")
        scale = self.args.router_role_scale
        self._emb, self._public = ((data.prompt_emb, data.public_emb) if scale == 0 else
                                   (np.c_[data.prompt_emb, scale * data.prompt_roles].astype(np.float32),
                                    np.c_[data.public_emb, scale * data.public_roles].astype(np.float32)))
        self.rng = np.random.default_rng(self.args.seed)
        self.retrievals_: list[tuple[int, list[int]]] = []

    # ------------------------------------------------------------------ pieces

    def _init_experts(self) -> list[dict[str, np.ndarray]]:
        states = []
        for k in range(self.args.n_experts):
            torch.manual_seed(self.args.seed * 1000 + k)
            for m in self.model.modules():
                if hasattr(m, "reset_lora_parameters"):
                    m.reset_lora_parameters("default", True)
            for m in list(self.model.head) + [self.model.length_skip]:
                if isinstance(m, torch.nn.Linear):
                    m.reset_parameters()
            torch.nn.init.zeros_(self.model.length_skip.weight)
            states.append(self.model.expert_state())
        return states

    def retrieve(self, client: int, needed: np.ndarray) -> list[dict[str, np.ndarray]]:
        """Sparse retrieval: the client downloads exactly the experts in ``needed`` (recorded with the bytes)."""
        needed = sorted(int(k) for k in np.unique(needed))
        self.retrievals_.append((client, needed))
        return [self.experts_[k] for k in needed]

    def _route(self, pairs: np.ndarray, client_group: int | None = None) -> np.ndarray:
        a = self.args
        if a.routing == "single":
            return np.zeros(len(pairs), dtype=np.int64)
        if a.routing == "random":
            return self.rng.integers(0, a.n_experts, size=len(pairs))
        if a.routing == "client_cluster":
            return np.full(len(pairs), client_group, dtype=np.int64)
        if a.routing == "domain_oracle":
            return np.searchsorted(self._domains, self.data.domain[pairs]).astype(np.int64)
        return self.router_.route(self._emb[pairs])

    def _train_expert(self, state: dict[str, np.ndarray], pairs: np.ndarray, k: int) -> dict[str, np.ndarray]:
        a = self.args
        self.model.load_expert_state(state)
        self.model.train()
        skip = self.model.length_skip.weight
        groups = [{"params": [p for p in self.model.parameters() if p.requires_grad and p is not skip]}]
        if a.length_lr_scale > 0:
            groups.append({"params": [skip], "lr": a.expert_lr * a.length_lr_scale})
        opt = torch.optim.AdamW(groups, lr=a.expert_lr)
        order = self.rng.permutation(pairs)
        for s in range(0, len(order), a.batch_size):
            batch = order[s:s + a.batch_size]
            ha, hb, f, y = self.data.store.batch(self.model, batch)
            loss = self.model.pair_loss(ha, hb, f, y, prior=self._prior(batch), offset=self._offset(batch, k))
            opt.zero_grad()
            loss.backward()
            opt.step()
        self.model.train(False)
        return self.model.expert_state()

    def _prior(self, pairs: np.ndarray) -> torch.Tensor | None:
        """The per-pair feature-prior weights (len(pairs), F) of ``length_prior='domain'``, else None."""
        if getattr(self, "_prior_w", None) is None:
            return None
        return self._prior_w[torch.from_numpy(np.asarray(pairs, dtype=np.int64))].to(self.model.device)

    def _offset(self, pairs: np.ndarray, k: int) -> torch.Tensor | None:
        """Expert ``k``'s generator-prior logit ``gamma_k g`` of the pairs (len(pairs),), else None."""
        if self.generator_weights_ is None:
            return None
        g = self._generator_g[np.asarray(pairs, dtype=np.int64)] * self.generator_weights_[k]
        return torch.from_numpy(g.astype(np.float32)).to(self.model.device)

    @torch.no_grad()
    def _per_sample(self, state: dict[str, np.ndarray], pairs: np.ndarray, what: str, k: int) -> np.ndarray:
        self.model.load_expert_state(state)
        self.model.train(False)
        out = []
        for s in range(0, len(pairs), 128):
            batch = pairs[s:s + 128]
            ha, hb, f, y = self.data.store.batch(self.model, batch)
            prior, offset = self._prior(batch), self._offset(batch, k)
            v = (self.model.pair_loss(ha, hb, f, y, reduction="none", prior=prior, offset=offset) if what == "ce"
                 else self.model.pair_proba(ha, hb, f, prior, offset))
            out.append(v.detach().cpu().numpy())
        return np.concatenate(out) if out else np.zeros(0)

    def predict_proba(self, pairs: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """P(A better) of pairs under the current experts and routing; also the expert of each pair
        (None for the FedBiscuit-style ensemble)."""
        a = self.args
        served = self.served_experts
        if a.routing == "client_cluster":
            return np.mean([self._per_sample(s, pairs, "proba", k) for k, s in enumerate(served)], axis=0), None
        assign = self._route(pairs) if a.routing != "single" else np.zeros(len(pairs), dtype=np.int64)
        proba = np.zeros(len(pairs))
        for k in np.unique(assign):
            sel = assign == k
            proba[sel] = self._per_sample(served[k], pairs[sel], "proba", int(k))
        return proba, assign

    def evaluate(self, pairs: np.ndarray | None = None) -> dict:
        """Pairwise accuracy overall and per domain on ``pairs`` (default: the eval pairs)."""
        pairs = self.data.eval_pairs if pairs is None else pairs
        proba, assign = self.predict_proba(pairs)
        label = self.data.store.label[pairs].numpy().astype(np.int64)
        dom = self.data.domain[pairs]
        acc = {"overall": pairwise_accuracy(proba, label)}
        for d in sorted(set(dom)):
            acc[d] = pairwise_accuracy(proba[dom == d], label[dom == d])
        return {"accuracy": acc, "assignment": assign, "proba": proba}

    @property
    def served_experts(self) -> list[dict[str, np.ndarray]]:
        """The experts the server would ship now: the per-expert best on the clients' validation splits
        when ``client_val_fraction > 0``, else the current aggregated experts."""
        served = self.best_experts_ if self.args.client_val_fraction > 0 else self.experts_
        if self.args.residual_scale == 1.0:
            return served
        last = self.model.head[-1]
        names = (_name_of(self.model, last.weight), _name_of(self.model, last.bias))
        return [{n: (v * np.float32(self.args.residual_scale) if n in names else v) for n, v in s.items()}
                for s in served]

    def _split_clients(self) -> None:
        """Each client's pairs -> (train part, local validation part); the validation part is a seeded
        ``client_val_fraction`` of them (at least one train pair kept), drawn with its own generator so
        that ``client_val_fraction = 0`` leaves every other draw of a run unchanged."""
        a, d = self.args, self.data
        if a.client_val_fraction == 0:
            self._train_parts, self._val_parts = list(d.clients), [np.zeros(0, np.int64) for _ in d.clients]
            return
        rng = np.random.default_rng([a.seed, 7919])
        self._train_parts, self._val_parts = [], []
        for own in d.clients:
            n_val = min(int(round(a.client_val_fraction * len(own))), len(own) - 1)
            perm = rng.permutation(own)
            self._val_parts.append(np.sort(perm[:n_val]))
            self._train_parts.append(np.sort(perm[n_val:]))

    def _route_val(self) -> None:
        """Route every client's validation pairs (its own routing: the router, its group, a draw)."""
        parts = [(v, self._route(v, None if self._groups is None else int(self._groups[c])))
                 for c, v in enumerate(self._val_parts) if len(v)]
        self._val_experts = [set(np.unique(k).tolist()) for _, k in parts]
        self._val_pairs = np.concatenate([v for v, _ in parts]) if parts else np.zeros(0, np.int64)
        self._val_assign = np.concatenate([k for _, k in parts]) if parts else np.zeros(0, np.int64)

    def _val_ce(self, state: dict[str, np.ndarray], k: int) -> np.ndarray:
        """Per-pair CE of ``state`` on the validation pairs routed to expert ``k`` (what the clients
        holding them compute locally; they send the sum and the count, 8 bytes per expert)."""
        return self._per_sample(state, self._val_pairs[self._val_assign == k], "ce", k)

    def _select_on_client_val(self, updated: set[int], rerouted: bool) -> None:
        """Per-expert early stopping (``client_val_fraction > 0``): an updated expert replaces its best
        copy when its federated validation loss (mean CE over the clients' validation pairs routed to
        it) is lower than the best copy's on the same pairs; an expert no validation pair is routed to
        follows its training. After a router update the pairs are re-routed and the best copies
        rescored."""
        if rerouted:
            self._route_val()
            self._best_ce = {k: self._val_ce(self.best_experts_[k], k) for k in range(self.args.n_experts)}
        scored = [(ks & updated) | (ks if rerouted else set()) for ks in self._val_experts]
        self.val_upload_bytes_ += 8 * sum(len(ks) for ks in scored)
        self.val_downlink_bytes_ += sum(state_bytes(self.experts_[k]) for ks in scored for k in ks)
        for k in sorted(updated):
            n = int((self._val_assign == k).sum())
            if n == 0:
                self.best_experts_[k] = self.experts_[k]
                continue
            cur = self._val_ce(self.experts_[k], k)
            if cur.mean() < self._best_ce[k].mean():
                self.best_experts_[k], self._best_ce[k] = self.experts_[k], cur
                self.best_round_[k] = self._round

    def _client_groups(self) -> np.ndarray:
        from sklearn.cluster import KMeans  # sklearn: optional heavy dependency, imported on use

        means = np.stack([self.data.prompt_emb[c].mean(0) for c in self.data.clients])
        k = min(self.args.n_experts, len(means))
        return KMeans(k, n_init=10, random_state=self.args.seed).fit_predict(means).astype(np.int64)

    def _length_start(self) -> None:
        """Federated length-only start (:mod:`trainer.experts.length_init`): every client routes its
        train pairs with the initial routing, fits one local regression per expert it routed to and
        sends (F coefficients, count); the FedAvg per expert becomes that expert's length path, and
        the head's output layer is zeroed so the expert starts as exactly that regression."""

        a, d = self.args, self.data
        feats, labels = d.store.features.numpy(), d.store.label.numpy()
        sent = []
        if a.length_prior == "domain":
            # per-domain prior (same inputs as the per-domain length-only baseline): clients fit one local
            # regression per domain they hold; the FedAvg per domain is every expert's fixed offset
            dom = np.searchsorted(self._domains, d.domain).astype(np.int64)
            for own in self._train_parts:
                sent.append(client_length_coefs(feats[own], labels[own], dom[own], len(self._domains), C=a.length_C))
            self.domain_length_coefs_ = fedavg_length_coefs(sent, len(self._domains), feats.shape[1])
            self._prior_w = torch.from_numpy(self.domain_length_coefs_[dom].astype(np.float32))
            self.length_coefs_ = np.zeros((a.n_experts, feats.shape[1]))
        elif a.length_init == "pooled":
            # exact federated fits (L-BFGS on the clients' summed loss and gradient); each evaluation is one
            # upload of F + 1 floats per client and expert
            assign = np.zeros(len(labels), np.int64)
            for c, own in enumerate(self._train_parts):
                assign[own] = self._route(own, None if self._groups is None else int(self._groups[c]))
            pool_C = None if a.routing == "single" else a.length_pool_C
            x = feats.astype(np.float64)
            if a.generator_prior:
                x = np.c_[x, self._generator_feature()]
            coefs, n_eval = pooled_expert_coefs(x, labels.astype(np.float64), assign, self._train_parts, a.n_experts,
                                                a.length_C, pool_C)
            self.length_coefs_ = coefs[:, :feats.shape[1]]
            if a.generator_prior:
                self.generator_weights_ = coefs[:, -1]
            self.length_init_upload_bytes_ = 4 * (x.shape[1] + 1) * n_eval * len(self._train_parts)  # at most
            return self._set_length_paths()
        else:
            for c, own in enumerate(self._train_parts):
                assign = self._route(own, None if self._groups is None else int(self._groups[c]))
                sent.append(client_length_coefs(feats[own], labels[own], assign, a.n_experts, C=a.length_C))
            self.length_coefs_ = fedavg_length_coefs(sent, a.n_experts, feats.shape[1])
        self.length_init_upload_bytes_ = upload_bytes(sent)
        self._set_length_paths()

    def _generator_feature(self) -> np.ndarray:
        """``g`` of every pair (n_pairs,) float64 (``FedPrismConfig.generator_prior``): the clients upload their win
        counts (3 values per (winner, loser, count) row, counted in ``generator_upload_bytes_``), the server sums
        them; a client's pairs get the strengths fitted on the other clients' counts, every other pair
        ``generator_strengths_`` (all counts)."""
        frame = self.data.generators.assign(label=self.data.store.label.numpy().astype(np.int64))
        ups = [client_win_counts(frame.iloc[own]) for own in self._train_parts]
        total = aggregate_win_counts(ups)
        self.generator_upload_bytes_ = 12 * sum(len(u) for u in ups)
        self.generator_strengths_ = fit_bradley_terry(total)
        g = generator_logit(frame, self.generator_strengths_)
        for c, u in enumerate(ups):
            rest = +(total - u)  # cross-fitting: the strengths of the other clients' counts
            own = self.data.clients[c]
            g[own] = generator_logit(frame.iloc[own], fit_bradley_terry(rest)) if rest else 0.0
        self._generator_g = g
        return g

    def _set_length_paths(self) -> None:
        """Each expert's feature path ``v`` <- ``length_coefs_[k]``, its head's output layer <- 0."""
        last = self.model.head[-1]
        for k, state in enumerate(self.experts_):
            state[_name_of(self.model, self.model.length_skip.weight)] = self.length_coefs_[k][None, :].astype(np.float32)
            state[_name_of(self.model, last.weight)] = np.zeros(tuple(last.weight.shape), np.float32)
            state[_name_of(self.model, last.bias)] = np.zeros(tuple(last.bias.shape), np.float32)

    # ------------------------------------------------------------------ the loop

    def setup(self) -> FedPrismTrainer:
        """Initial experts (one seed each), the router (K-means initialised for ``routing='router'``),
        and the client groups of ``'client_cluster'``; empties ``history_``."""
        a, d = self.args, self.data
        self.experts_ = self._init_experts()
        self.router_ = PromptRouter(self._emb.shape[1], a.n_experts, a.router_hidden, seed=a.seed)
        if a.routing == "router":
            kmeans_init(self.router_, self._public, lr=a.init_lr, epochs=a.init_epochs, seed=a.seed)
            if a.router_init_rounds:
                centroid_distillation(self.router_, self._public, [self._emb[c] for c in d.clients],
                                      rounds=a.router_init_rounds, lr=a.init_lr, seed=a.seed)
        self._groups = self._client_groups() if a.routing == "client_cluster" else None
        self._domains = np.unique(self.data.domain)
        if a.routing == "domain_oracle" and len(self._domains) != a.n_experts:
            raise InvalidInputError(f"routing='domain_oracle' needs n_experts = {len(self._domains)} domains, got {a.n_experts}")
        self._router_bytes = state_bytes(self.router_.state()) if a.routing == "router" else 0
        self._split_clients()
        self.length_coefs_, self.length_init_upload_bytes_ = None, 0
        self.domain_length_coefs_, self._prior_w = None, None
        self.generator_weights_, self.generator_strengths_, self.generator_upload_bytes_ = None, None, 0
        if a.length_init != "zero":
            self._length_start()
        self.best_experts_, self.best_round_, self._round = list(self.experts_), [0] * a.n_experts, 0
        self.val_upload_bytes_, self.val_downlink_bytes_ = 0, 0
        if a.client_val_fraction > 0:
            self._select_on_client_val(set(), rerouted=True)
        self.history_ = []
        return self

    def run_round(self, t: int) -> dict:
        """Round ``t`` (1-based) of the module docstring; appends and returns its history entry."""
        a, d = self.args, self.data
        n_clients = len(d.clients)
        chosen = np.sort(self.rng.choice(n_clients, size=min(a.clients_per_round, n_clients), replace=False))
        updates, router_updates, downlink, retrieved = [], [], 0, {}
        do_pgpd = a.pgpd_round(t)
        for c in chosen:
            own = self._train_parts[c]
            pairs = self.rng.choice(own, size=min(a.local_pairs, len(own)), replace=False)
            assign = self._route(pairs, None if self._groups is None else int(self._groups[c]))
            experts = self.retrieve(int(c), assign)
            needed = sorted(int(k) for k in np.unique(assign))
            retrieved[int(c)] = needed
            downlink += self._router_bytes + sum(state_bytes(e) for e in experts)
            local = {}
            for k, state in zip(needed, experts):
                sub = pairs[assign == k]
                local[k] = (self._train_expert(state, sub, k), float(len(sub)))
            updates.append(local)
            if do_pgpd:
                ce = np.stack([self._per_sample(local[k][0], pairs, "ce", k) for k in needed], axis=1)
                target = pgpd_pseudo_labels(ce, np.array(needed))
                router = PromptRouter(self._emb.shape[1], a.n_experts, a.router_hidden)
                router.load_state(self.router_.state())
                fit_router(router, self._emb[pairs], target, lr=a.router_lr, epochs=a.router_epochs,
                           seed=int(self.rng.integers(1 << 31)))
                router_updates.append((router.state(), float(len(pairs))))
        self.experts_ = aggregate_components(self.experts_, updates)
        if router_updates:
            self.router_.load_state({k: v.astype(np.float32) for k, v in fedavg(router_updates).items()})
        if a.client_val_fraction > 0:
            self._round = t
            self._select_on_client_val({k for u in updates for k in u}, rerouted=bool(router_updates))
        entry = {"round": t, "clients": chosen.tolist(), "retrieved": retrieved, "downlink_bytes": downlink,
                 "router_updated": bool(router_updates)}
        if a.routing == "router":
            share, _, _ = expert_utilisation(self._route(d.eval_pairs), a.n_experts)
            entry["utilisation"] = share.tolist()
        if t % a.eval_every == 0 or t == a.rounds:
            ev = self.last_eval_ = self.evaluate()
            entry["accuracy"] = ev["accuracy"]
            if ev["assignment"] is not None:
                entry["utilisation"] = expert_utilisation(ev["assignment"], a.n_experts)[0].tolist()
        self.history_.append(entry)
        return entry

    def train(self) -> FedPrismTrainer:
        """:meth:`setup`, then ``rounds`` rounds; fills ``experts_``, ``router_``, ``history_``."""
        self.setup()
        rounds = range(1, self.args.rounds + 1)
        if self.progress:
            from tqdm.auto import tqdm  # tqdm: optional heavy dependency, imported on use

            a = self.args
            rounds = tqdm(rounds, desc=f"{a.routing}{'+pgpd' if a.pgpd else ''} seed {a.seed}", unit="round")
        for t in rounds:
            self.run_round(t)
        return self

    # ------------------------------------------------------------------ saving

    def save(self, out: Path) -> None:
        """Write the trained experts and router (layout in :mod:`trainer.experts.experiment`)."""
        from safetensors.numpy import save_file  # safetensors: optional heavy dependency, imported on use

        from trainer.experts.selector import save_selector_config  # trainer.experts.selector imports torch: on use only

        out.mkdir(parents=True, exist_ok=True)
        for k, state in enumerate(self.served_experts):
            self.model.save_expert(state, out / f"expert_{k}")
        save_file(self.router_.state(), str(out / "router.safetensors"))
        save_selector_config(self.args.selector, out / "selector_config.json")
        write_text(out / "fedprism_config.json", json.dumps(self.args.to_dict(), indent=2))
        if self.generator_weights_ is not None:  # generator_prior: the strengths and each expert's weight gamma_k
            write_text(out / "generator_prior.json", json.dumps({"strengths": self.generator_strengths_,
                                                                 "weights": self.generator_weights_.tolist()}, indent=2))
        if self.domain_length_coefs_ is not None:  # length_prior='domain': the fixed per-domain offsets
            write_text(out / "length_prior.json", json.dumps({"domains": self._domains.tolist(),
                                                              "coefs": self.domain_length_coefs_.tolist()}, indent=2))
