"""The federated router of MoR over client reward models (paper 001, Sec. "Routing Network Federated
Learning").

Design notes: docs/mor.md (Module notes).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from sdk.errors import InvalidInputError, ShapeError
from trainer.config_fields import check_int, check_real
from trainer.routers.fedavg import fedavg, validate_updates

WEIGHTINGS = ("samples", "equal")
FORMAT_VERSION = 1


class ClientRouter(nn.Module):
    """``forward(h) -> logits``: h (n, d_in) float32 -> (n, n_clients) float32."""

    def __init__(self, d_in: int, n_clients: int, hidden: int = 128, dropout: float = 0.1,
                 client_names: Sequence[str] | None = None) -> None:
        super().__init__()
        if n_clients < 2:
            raise InvalidInputError(f"a router needs >= 2 clients, got {n_clients}")
        self.d_in, self.n_clients, self.hidden, self.dropout = int(d_in), int(n_clients), int(hidden), float(dropout)
        self.client_names = list(client_names) if client_names is not None else [f"client{k}" for k in range(n_clients)]
        if len(self.client_names) != n_clients:
            raise InvalidInputError(f"{len(self.client_names)} client names for {n_clients} clients")
        self.trunk = nn.Sequential(nn.Linear(self.d_in, self.hidden), nn.GELU(), nn.Dropout(self.dropout))
        self.head = nn.Linear(self.hidden, self.n_clients)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(self.trunk(h))

    def logits(self, features: np.ndarray) -> np.ndarray:
        """features : (n, d_in) float32 -> logits (n, n_clients) float32 (eval mode, no gradients).

        Raises ShapeError when the feature width differs from ``d_in``."""
        features = np.asarray(features, dtype=np.float32)
        if features.ndim != 2 or features.shape[1] != self.d_in:
            raise ShapeError(f"router features must have shape (n, {self.d_in}), got {features.shape}")
        self.eval()
        with torch.no_grad():
            return self(torch.from_numpy(features)).numpy().astype(np.float32)

    def get_parameters(self) -> dict[str, np.ndarray]:
        """name -> float32 array copy (what a client uploads)."""
        return {k: v.detach().cpu().numpy().astype(np.float32).copy() for k, v in self.state_dict().items()}

    def set_parameters(self, params: Mapping[str, np.ndarray]) -> None:
        """Raises ShapeError naming a missing/extra key or a wrong shape."""
        own = self.state_dict()
        if set(params) != set(own):
            raise ShapeError(f"router parameters {sorted(set(params) ^ set(own))} missing or unexpected")
        for k, v in params.items():
            if tuple(np.shape(v)) != tuple(own[k].shape):
                raise ShapeError(f"router parameter {k!r} has shape {np.shape(v)}, expected {tuple(own[k].shape)}")
        self.load_state_dict({k: torch.as_tensor(np.asarray(v, dtype=np.float32)) for k, v in params.items()})

    def n_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def save(self, directory: Path) -> None:
        from safetensors.numpy import save_file  # safetensors: optional heavy dependency, imported on use

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tmp = directory / "router.safetensors.tmp"
        save_file(self.get_parameters(), str(tmp))
        tmp.replace(directory / "router.safetensors")
        meta = {"format_version": FORMAT_VERSION, "d_in": self.d_in, "hidden": self.hidden,
                "n_clients": self.n_clients, "client_names": self.client_names, "dropout": self.dropout}
        tmp = directory / "router.json.tmp"
        tmp.write_text(json.dumps(meta, indent=2))
        tmp.replace(directory / "router.json")

    @classmethod
    def load(cls, directory: Path) -> ClientRouter:
        from safetensors.numpy import load_file  # safetensors: optional heavy dependency, imported on use

        path = Path(directory) / "router.json"
        if not path.is_file():
            raise InvalidInputError(f"no router.json in {str(directory)!r}")
        meta = json.loads(path.read_text())
        if meta.get("format_version") != FORMAT_VERSION:
            raise InvalidInputError(f"{path}: format_version {meta.get('format_version')!r}, expected {FORMAT_VERSION}")
        router = cls(meta["d_in"], meta["n_clients"], meta["hidden"], meta["dropout"], meta["client_names"])
        router.set_parameters(load_file(str(Path(directory) / "router.safetensors")))
        router.eval()
        return router


def own_client_targets(n: int, client_index: int, n_clients: int, smoothing: float = 0.0) -> np.ndarray:
    """One-hot targets ``e_k`` for n samples of client k: (n, n_clients) float32. With ``smoothing`` eps > 0:
    label smoothing (Szegedy et al. 2016, "Rethinking the Inception Architecture", Sec. 7),
    ``(1 - eps) e_k + eps / K``.

    Raises InvalidInputError: ``client_index`` not in ``[0, n_clients)``, n < 0 or eps not in [0, 1)."""
    if not 0 <= client_index < n_clients or n < 0:
        raise InvalidInputError(f"client_index={client_index} must be in [0, {n_clients}) and n={n} >= 0")
    if not 0.0 <= smoothing < 1.0:
        raise InvalidInputError(f"label smoothing must be in [0, 1), got {smoothing!r}")
    out = np.full((n, n_clients), smoothing / n_clients, dtype=np.float32)
    out[:, client_index] = 1.0 - smoothing + smoothing / n_clients
    return out


def router_bce_loss(logits_chosen: torch.Tensor, logits_rejected: torch.Tensor, client_index: int,
                    smoothing: float = 0.0) -> torch.Tensor:
    """``0.5 [BCE(z+, e_k) + BCE(z-, e_k)]`` (paper 001, ``L_router^(k)``), BCE with logits averaged
    over pairs and the K outputs; ``smoothing``: the targets of :func:`own_client_targets`.
    logits_* : (n, K) tensors. Returns a scalar tensor."""
    n, k = logits_chosen.shape
    target = torch.from_numpy(own_client_targets(n, client_index, k, smoothing))
    bce = nn.functional.binary_cross_entropy_with_logits
    return 0.5 * (bce(logits_chosen, target) + bce(logits_rejected, target))


def aggregate_routers(updates: Sequence[tuple[Mapping[str, np.ndarray], float]], weighting: str = "equal") -> dict[str, np.ndarray]:
    """Pure FedAvg of router parameters.

    Parameters
    ----------
    updates : sequence of (parameters, n_examples) from the clients of one round.
    weighting : ``"samples"`` (``w_k = n_k / sum n``, paper 001 Eq. FedAvg) or ``"equal"`` (``w_k = 1/|S|``).

    Returns dict name -> float32 ndarray. Raises InvalidInputError / ShapeError
    (:func:`trainer.routers.fedavg.validate_updates`) or on an unknown weighting.
    """
    if weighting not in WEIGHTINGS:
        raise InvalidInputError(f"weighting must be one of {list(WEIGHTINGS)}, got {weighting!r}")
    validate_updates(updates)
    weighted = updates if weighting == "samples" else [(p, 1.0) for p, _ in updates]
    return {k: v.astype(np.float32) for k, v in fedavg(weighted).items()}


@dataclass
class RouterConfig:
    """Federated router training.

    hidden, dropout : router width and dropout.
    rounds : communication rounds; local_epochs : passes over the local pairs per round.
    local_steps : if set, every client takes exactly this many minibatch steps per round instead of
        ``local_epochs`` passes (cycling through its pairs), so a small client moves the router as
        far per round as a large one (with ``weighting="equal"``: class-balanced training).
    lr, weight_decay, batch_size : local AdamW steps.
    weighting : ``"samples"`` or ``"equal"`` (:func:`aggregate_routers`).

    Defaults (30 rounds, lr 3e-3, 4 local steps, equal weighting) were chosen on validation pairs by
    ``benchmarks/mor_router_settings.py`` (``docs/mor_router_settings.json``, docs/mor.md).
    participation : share of clients sampled per round (at least one).
    seed : initialisation, sampling and shuffling seed.
    ensemble : m >= 1 routers, each trained by this FedAvg run from its own seed (``seed + 1000 j``, j < m; member 0
        is the single router), combined by the mean of their logits (:func:`stack_routers`: one router of width
        ``m * hidden``); m times the router communication per round. An ensemble average (Lakshminarayanan et al.
        2017, "Simple and Scalable Predictive Uncertainty Estimation using Deep Ensembles"), logits averaged so it stays
        one :class:`ClientRouter`. Simulation only (:class:`FederatedRouterTrainer`); on Flower run the strategy m
        times.
    label_smoothing : eps of the BCE targets ``(1 - eps) e_k + eps / K`` (:func:`own_client_targets`; 0: the paper).
    input_columns : None (the router reads every feature column, ``g_phi(x, y)`` of the paper) or n >= 1: only
        the first n columns reach the router (with n = the embedder width, ``e(x)`` alone: a prompt-only router
        ``g_phi(x)``, which routes every response to one prompt, a preference pair or a GRPO group, alike). The
        first layer's weights of the other columns start at zero and get no gradient, so they stay exactly zero
        through local AdamW steps (decoupled weight decay keeps a zero at zero) and FedAvg; the router keeps its
        input width, so saving, export and online routing are unchanged.
    """

    hidden: int = 128
    dropout: float = 0.1
    rounds: int = 30
    local_epochs: int = 1
    local_steps: int | None = 4
    lr: float = 3e-3
    weight_decay: float = 1e-4
    batch_size: int = 64
    weighting: str = "equal"
    participation: float = 1.0
    seed: int = 0
    input_columns: int | None = None
    label_smoothing: float = 0.0
    ensemble: int = 1

    def __post_init__(self) -> None:
        for name in ("hidden", "rounds", "local_epochs", "batch_size", "ensemble"):
            check_int(self, name, 1)
        check_int(self, "local_steps", 1, optional=True)
        check_int(self, "input_columns", 1, optional=True)
        check_int(self, "seed", 0)
        check_real(self, "lr", 0, low_open=True)
        check_real(self, "weight_decay", 0)
        check_real(self, "dropout", 0, 1, high_open=True)
        check_real(self, "label_smoothing", 0, 1, high_open=True)
        check_real(self, "participation", 0, 1, low_open=True)
        if self.weighting not in WEIGHTINGS:
            raise InvalidInputError(f"weighting must be one of {list(WEIGHTINGS)}, got {self.weighting!r}")


def stack_routers(routers: Sequence[ClientRouter]) -> ClientRouter:
    """One router whose logits are the MEAN of the logits of ``routers`` (an ensemble, e.g. of FedAvg-trained routers
    from different initialisation seeds): the trunks side by side (hidden = sum of the members' widths), the head
    ``[W_1 ... W_m] / m`` and bias ``mean(b_i)``; exact for the ``Linear - GELU - Dropout - Linear`` layout in eval
    mode. The result saves, exports and adapts online like any :class:`ClientRouter`.

    Raises InvalidInputError on no routers or members with a different input width, client count, names or dropout."""
    if not routers:
        raise InvalidInputError("stack_routers needs at least one router")
    r0 = routers[0]
    for r in routers:
        if (r.d_in, r.n_clients, r.client_names, r.dropout) != (r0.d_in, r0.n_clients, r0.client_names, r0.dropout):
            raise InvalidInputError("routers to stack must share d_in, n_clients, client_names and dropout")
    out = ClientRouter(r0.d_in, r0.n_clients, sum(r.hidden for r in routers), r0.dropout, r0.client_names)
    m = len(routers)
    with torch.no_grad():
        out.trunk[0].weight.copy_(torch.cat([r.trunk[0].weight for r in routers], 0))
        out.trunk[0].bias.copy_(torch.cat([r.trunk[0].bias for r in routers], 0))
        out.head.weight.copy_(torch.cat([r.head.weight for r in routers], 1) / m)
        out.head.bias.copy_(torch.stack([r.head.bias for r in routers]).mean(0))
    out.eval()
    return out


@dataclass
class ClientRouterData:
    """One client's router training data: pair features of its chosen and rejected responses.

    features_chosen, features_rejected : (n_pairs, d_in) float32; client_index : k.
    """

    features_chosen: np.ndarray
    features_rejected: np.ndarray
    client_index: int

    def __post_init__(self) -> None:
        if self.features_chosen.shape != self.features_rejected.shape or self.features_chosen.ndim != 2:
            raise ShapeError(f"chosen {self.features_chosen.shape} and rejected {self.features_rejected.shape} "
                             "features must be equal 2-d shapes")

    @property
    def n_pairs(self) -> int:
        return int(self.features_chosen.shape[0])


def local_rng(seed: int, server_round: int, client_index: int) -> np.random.Generator:
    """The shuffling generator of client k in round r: the same in the simulation and on Flower."""
    return np.random.default_rng([int(seed), int(server_round), int(client_index)])


def initial_router(d_in: int, n_clients: int, config: RouterConfig, client_names: Sequence[str] | None = None) -> ClientRouter:
    """The round-0 global router ``phi^(0)`` (initialised under ``torch.manual_seed(config.seed)``; with
    ``config.input_columns`` the first layer's weights of the other columns are zero).
    Raises InvalidInputError when ``input_columns`` is not below ``d_in``."""
    if config.input_columns is not None and not config.input_columns < d_in:
        raise InvalidInputError(f"input_columns={config.input_columns} must be < the feature width {d_in}")
    torch.manual_seed(config.seed)
    router = ClientRouter(d_in, n_clients, config.hidden, config.dropout, client_names)
    if config.input_columns is not None:
        with torch.no_grad():
            router.trunk[0].weight[:, config.input_columns:] = 0.0
    return router


def local_router_update(router: ClientRouter, data: ClientRouterData, config: RouterConfig,
                        rng: np.random.Generator) -> tuple[dict[str, np.ndarray], int]:
    """Client k's local step: ``local_epochs`` of AdamW on ``L_router^(k)`` (or ``local_steps``
    minibatches) from the router's current parameters (modified in place). Returns (parameters,
    n_pairs), the upload of the round. Raises InvalidInputError when the client holds no pair (its
    update would carry no information and ``local_steps`` would divide by its 0 pairs)."""
    if data.n_pairs == 0:
        raise InvalidInputError(f"client {data.client_index} holds no preference pair: it cannot update the router")
    opt = torch.optim.AdamW(router.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    fc, fr = torch.from_numpy(np.asarray(data.features_chosen, np.float32)), torch.from_numpy(np.asarray(data.features_rejected, np.float32))
    router.train()
    if config.local_steps is None:
        batches = [torch.from_numpy(o[s : s + config.batch_size]) for o in
                   (rng.permutation(data.n_pairs) for _ in range(config.local_epochs))
                   for s in range(0, data.n_pairs, config.batch_size)]
    else:
        per = -(-config.local_steps * config.batch_size // data.n_pairs)  # passes needed
        order = np.concatenate([rng.permutation(data.n_pairs) for _ in range(per)])
        batches = [torch.from_numpy(order[i * config.batch_size : (i + 1) * config.batch_size])
                   for i in range(config.local_steps)]
    for idx in batches:
        loss = router_bce_loss(router(fc[idx]), router(fr[idx]), data.client_index, config.label_smoothing)
        opt.zero_grad()
        loss.backward()
        if config.input_columns is not None:  # columns the router does not read get no update
            router.trunk[0].weight.grad[:, config.input_columns:] = 0.0
        nn.utils.clip_grad_norm_(router.parameters(), 1.0)
        opt.step()
    router.eval()
    return router.get_parameters(), data.n_pairs


@dataclass
class FederatedRouterTrainer:
    """Simulated federated training of the router: each round, sampled clients run
    :func:`local_router_update` from the global parameters and :func:`aggregate_routers` combines them.

    ``train(clients, client_names) -> ClientRouter``; ``bytes_per_round_`` is the upload + download of
    router parameters (float32) in the last round (summed over the members of ``RouterConfig.ensemble``).
    """

    args: RouterConfig = field(default_factory=RouterConfig)
    show_progress: bool = False

    def train(self, clients: Sequence[ClientRouterData], client_names: Sequence[str] | None = None) -> ClientRouter:
        a = self.args
        if a.ensemble > 1:  # m independent FedAvg runs, stacked (RouterConfig.ensemble)
            members, nbytes = [], 0
            for j in range(a.ensemble):
                rt = FederatedRouterTrainer(replace(a, ensemble=1, seed=a.seed + 1000 * j), self.show_progress)
                members.append(rt.train(clients, client_names))
                nbytes += rt.bytes_per_round_
            self.bytes_per_round_ = nbytes
            return stack_routers(members)
        if len(clients) < 2:
            raise InvalidInputError(f"federated router training needs >= 2 clients, got {len(clients)}")
        d_in = clients[0].features_chosen.shape[1]
        for c in clients:
            if c.features_chosen.shape[1] != d_in:
                raise ShapeError(f"client {c.client_index}: features of width {c.features_chosen.shape[1]}, expected {d_in}")
        rng = np.random.default_rng(a.seed)
        glob = initial_router(d_in, len(clients), a, client_names)
        local = ClientRouter(d_in, len(clients), a.hidden, a.dropout, client_names)
        params = glob.get_parameters()
        n_per_round = max(1, int(round(a.participation * len(clients))))
        for r in tqdm(range(1, a.rounds + 1), desc=f"router ({a.weighting})", disable=not self.show_progress, leave=False):
            chosen = sorted(rng.choice(len(clients), n_per_round, replace=False).tolist())
            updates = []
            for k in chosen:
                local.set_parameters(params)
                updates.append(local_router_update(local, clients[k], a, local_rng(a.seed, r, k)))
            params = aggregate_routers(updates, a.weighting)
            self.bytes_per_round_ = 2 * len(chosen) * sum(v.nbytes for v in params.values())
        glob.set_parameters(params)
        glob.eval()
        return glob
