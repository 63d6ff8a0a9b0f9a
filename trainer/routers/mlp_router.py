"""Parametric MLP router and its FedAvg training (paper 002, "Federated parametric optimisation";
ARCHITECTURE.md §4).

Design notes: docs/routers-and-results.md (Module notes).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from sdk.cell_statistics import CellStatistics
from sdk.atomic_write import write_atomic
from sdk.errors import InvalidInputError
from trainer.config_fields import check_int, check_real
from trainer.data.client_data import ClientData
from trainer.routers.fedavg import fedavg
from trainer.routers.shrinkage import model_means
from trainer.routers.base import Router, read_meta

WEIGHTS_FILE = "router.safetensors"


@dataclass
class MLPRouterConfig:
    """Architecture and training settings (defaults: paper 002).

    hidden : trunk width. dropout : trunk dropout. lr, weight_decay, grad_clip : AdamW settings.
    batch_size : samples per step. local_epochs : epochs per round.
    rounds, patience : max rounds and early-stopping patience of federated training.
    epochs, epoch_patience : the same for one party training alone (local, centralised).
    participation : share of clients per round. val_fraction : held-out share of each log.
    interaction_penalty : weight of the per-model interaction penalty (see the design notes).
    model_prior_strength : pseudo-observations of the all-model mean in each head's initial bias.
    device : torch device string (``"cpu"``, ``"cuda"``).
    """

    hidden: int = 512
    dropout: float = 0.1
    lr: float = 1e-3
    weight_decay: float = 3e-4
    grad_clip: float = 1.0
    batch_size: int = 128
    local_epochs: int = 1
    rounds: int = 300
    patience: int = 40
    epochs: int = 60
    epoch_patience: int = 8
    participation: float = 0.6
    val_fraction: float = 0.2
    interaction_penalty: float = 1.0
    model_prior_strength: float = 10.0
    device: str = "cpu"

    def __post_init__(self) -> None:
        for name in ("hidden", "batch_size", "local_epochs", "rounds", "patience", "epochs", "epoch_patience"):
            check_int(self, name, 1)
        check_real(self, "lr", 0, low_open=True)
        check_real(self, "grad_clip", 0, low_open=True)
        for name in ("weight_decay", "interaction_penalty", "model_prior_strength"):
            check_real(self, name, 0)
        check_real(self, "dropout", 0, 1, high_open=True)
        check_real(self, "participation", 0, 1, low_open=True)
        check_real(self, "val_fraction", 0, 1, high_open=True)
        if self.patience > self.rounds:
            raise InvalidInputError(f"patience={self.patience} must be <= rounds={self.rounds}")


def build_network(d_emb: int, n_models: int, hidden: int, dropout: float):
    """The torch module: trunk + accuracy and cost heads. ``forward(x) -> (A, C_normalised)``."""
    import torch  # trainer extra (torch), imported on use
    from torch import nn  # trainer extra (torch), imported on use

    class MLPRouterNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.trunk = nn.Sequential(
                nn.Linear(d_emb, hidden), nn.LayerNorm(hidden), nn.GELU(), nn.Dropout(dropout),
                nn.Linear(hidden, hidden), nn.LayerNorm(hidden), nn.GELU(), nn.Dropout(dropout),
            )
            self.accuracy_head = nn.Linear(hidden, n_models)
            self.shared_accuracy = nn.Linear(hidden, 1, bias=False)
            self.cost_head = nn.Linear(hidden, n_models)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            h = self.trunk(x)
            # Per-model linear heads, parametrised as shared part + per-model part:
            # A(x, m) = (u + w_m) . h(x) + b_m. Only w_m . h(x) is penalised, so what all models
            # share (query difficulty) is learned from every observation.
            return self.accuracy_head(h) + self.shared_accuracy(h), self.cost_head(h)

    return MLPRouterNet()


class MLPRouter(Router):
    """Trained MLP router.

    Attributes
    ----------
    cost_scale_ : ndarray of shape (n_models,), float64, USD: cost = C_normalised * cost_scale_.
    available_ : ndarray of shape (n_models,), bool: models observed in training (others predict NaN).
    """

    kind = "mlp"

    def __init__(self, state: dict[str, np.ndarray], models: Sequence[str], d_emb: int,
                 cost_scale: np.ndarray, available: np.ndarray, hidden: int, dropout: float) -> None:
        import torch  # trainer extra (torch), imported on use

        self.models = tuple(models)
        self.d_emb = int(d_emb)
        self.hidden = int(hidden)
        self.dropout = float(dropout)
        self.cost_scale_ = np.asarray(cost_scale, dtype=np.float64)
        self.available_ = np.asarray(available, dtype=bool)
        self.network = build_network(self.d_emb, len(self.models), self.hidden, self.dropout)
        self.network.load_state_dict({k: torch.as_tensor(np.asarray(v, dtype=np.float32)) for k, v in state.items()})
        self.network.eval()

    def state(self) -> dict[str, np.ndarray]:
        return {k: v.detach().cpu().numpy().copy() for k, v in self.network.state_dict().items()}

    def _predict(self, embeddings: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        import torch  # trainer extra (torch), imported on use

        with torch.no_grad():
            a, c = self.network(torch.from_numpy(np.ascontiguousarray(embeddings)))
        acc = a.numpy().astype(np.float64)
        cost = c.numpy().astype(np.float64) * np.where(np.isfinite(self.cost_scale_), self.cost_scale_, 0.0)
        acc[:, ~self.available_] = np.nan
        cost[:, ~self.available_] = np.nan
        return acc, cost

    def save(self, directory: Path) -> None:
        from safetensors.numpy import save  # trainer extra

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        write_atomic(directory / WEIGHTS_FILE,
                     save({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in self.state().items()}))
        self._write_meta(directory, {
            "hidden": self.hidden,
            "dropout": self.dropout,
            "cost_scale_usd": [float(s) if np.isfinite(s) else None for s in self.cost_scale_],
            "available": self.available_.tolist(),
            "outputs": {"accuracy": "(batch, n_models) float32", "cost": "(batch, n_models) float32, x cost_scale_usd = USD"},
        })

    @classmethod
    def load(cls, directory: Path) -> MLPRouter:
        from safetensors.numpy import load_file  # trainer extra (safetensors), imported on use

        meta = read_meta(directory)
        state = load_file(str(Path(directory) / WEIGHTS_FILE))
        scale = np.array([np.nan if s is None else s for s in meta["cost_scale_usd"]], dtype=np.float64)
        return cls(state, meta["models"], meta["d_emb"], scale, np.array(meta["available"]), meta["hidden"], meta["dropout"])


@dataclass
class Party:
    """A client's training state in simulation: its train/val split and its own optimiser state."""

    train: ClientData
    val: ClientData
    optimizer_state: dict | None = field(default=None)


def _initial_state(d_emb: int, stats: CellStatistics, config: MLPRouterConfig, seed: int):
    import torch  # trainer extra (torch), imported on use

    torch.manual_seed(seed)
    net = build_network(d_emb, stats.n_models, config.hidden, config.dropout)
    acc_mean, cost_mean = model_means(stats, config.model_prior_strength)
    # normalised cost starts at 1 (= the model's mean cost; costs are not shrunk), or at 0 for a model whose
    # logged costs are all 0: its cost scale is 1 USD (train_mlp_router), so 1 would predict 1 USD per query
    cost_bias = np.where(np.isfinite(cost_mean) & (np.nan_to_num(cost_mean) > 0), 1.0, 0.0)
    with torch.no_grad():
        for head, bias in ((net.accuracy_head, np.nan_to_num(acc_mean, nan=0.0)),
                           (net.cost_head, cost_bias)):
            head.weight.zero_()
            head.bias.copy_(torch.as_tensor(bias, dtype=torch.float32))
        net.shared_accuracy.weight.zero_()
    return net


def _tensors(data: ClientData, cost_scale: np.ndarray, device: str):
    import torch  # trainer extra (torch), imported on use

    return (
        torch.as_tensor(data.embeddings, dtype=torch.float32, device=device),
        torch.as_tensor(data.model, dtype=torch.long, device=device),
        torch.as_tensor(data.accuracy, dtype=torch.float32, device=device),
        torch.as_tensor(data.cost / cost_scale[data.model], dtype=torch.float32, device=device),
    )


def _observed_loss(net, x, m, acc, cnorm):
    """Sum over the batch of the squared errors on the observed (x, m) pair only (paper 002, L_i)."""
    a, c = net(x)
    a_obs = a.gather(1, m[:, None]).squeeze(1)
    c_obs = c.gather(1, m[:, None]).squeeze(1)
    return ((a_obs - acc) ** 2 + (c_obs - cnorm) ** 2).sum()


def _interaction_penalty(net, x):
    """Mean over the batch of ``sum_m (w_m . h(x))^2``: the per-model deviation from the additive
    prediction ``b_m + u . h(x)``, penalised on *every* model at every query (a ridge in function
    space, so rescaling the trunk cannot evade it). It plays the role of the K-means router's
    ``prior_strength``: models with few observations stay near the additive prediction."""
    h = net.trunk(x)
    return ((net.accuracy_head(h) - net.accuracy_head.bias) ** 2).sum(dim=1).mean()


def local_train(net, party: Party, cost_scale: np.ndarray, config: MLPRouterConfig, gen) -> None:
    """One client's local training of ``net`` in place (paper 002, ``L_i``): ``config.local_epochs``
    epochs of AdamW on the observed pairs of ``party.train`` plus the interaction penalty, resuming the
    party's optimiser state. ``cost_scale`` (n_models,) USD normalises costs; ``gen`` a torch Generator."""
    import torch  # trainer extra (torch), imported on use

    x, m, acc, cnorm = _tensors(party.train, cost_scale, config.device)
    opt = torch.optim.AdamW(net.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    if party.optimizer_state is not None:
        opt.load_state_dict(party.optimizer_state)
    net.train()
    for _ in range(config.local_epochs):
        perm = torch.randperm(x.shape[0], generator=gen)
        for start in range(0, x.shape[0], config.batch_size):
            b = perm[start : start + config.batch_size]
            opt.zero_grad()
            loss = _observed_loss(net, x[b], m[b], acc[b], cnorm[b]) / b.shape[0]
            if config.interaction_penalty > 0:
                loss = loss + config.interaction_penalty * _interaction_penalty(net, x[b])
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), config.grad_clip)
            opt.step()
    party.optimizer_state = copy.deepcopy(opt.state_dict())


def _val_loss(net, parties: Sequence[Party], cost_scale: np.ndarray, device: str) -> float:
    """Sample-weighted validation MSE over all parties (each sends a sum and a count)."""
    import torch  # trainer extra (torch), imported on use

    total, n = 0.0, 0
    net.eval()
    with torch.no_grad():
        for p in parties:
            if p.val.n_samples == 0:
                continue
            total += float(_observed_loss(net, *_tensors(p.val, cost_scale, device)))
            n += p.val.n_samples
    return total / n if n else float("nan")


def train_mlp_router(
    clients: Sequence[ClientData],
    models: Sequence[str],
    config: MLPRouterConfig,
    rng: np.random.Generator,
    federated: bool = True,
    progress: bool = False,
) -> MLPRouter:
    """Train an MLP router with FedAvg over ``clients`` (paper 002, Sec. "Federated parametric").

    With ``federated=False`` the clients must be one party (local or centralised setting) and rounds
    are epochs. Randomness (splits, participation, init, batches) comes from ``rng``.

    Parameters
    ----------
    clients : sequence of ClientData, embeddings (n_i, d_emb) float32.
    models : model ids, length n_models (the columns of the predictions).

    Raises
    ------
    InvalidInputError
        No client holds samples, or ``federated=False`` with several clients.
    """
    import torch  # trainer extra (torch), imported on use

    if not federated and len(clients) != 1:
        raise InvalidInputError(f"federated=False trains one party, got {len(clients)} clients")
    active = [c for c in clients if c.n_samples > 0]
    if not active:
        raise InvalidInputError("no client holds any sample")
    n_models = len(models)
    d_emb = int(active[0].embeddings.shape[1])
    parties = [Party(*c.split(config.val_fraction, rng)) for c in active]
    # Round 0: per-model count/sum statistics (train splits) fix cost scales and head biases.
    stats = CellStatistics.merge([p.train.model_statistics(n_models) for p in parties])
    _, cost_mean = model_means(stats)
    available = stats.count.sum(axis=0) > 0
    # a model whose observed costs are all 0 (a free, e.g. on-device, model) has mean 0: scale 1 keeps its
    # normalised targets at 0 instead of 0/0 = NaN (which poisoned the whole trunk); as trainer.federated.mlp_local
    cost_scale = np.where(available & (cost_mean > 0), cost_mean, 1.0)
    torch_seed = int(rng.integers(2**31))
    gen = torch.Generator().manual_seed(torch_seed)
    net = _initial_state(d_emb, stats, config, torch_seed).to(config.device)
    global_state = {k: v.detach().cpu().numpy().copy() for k, v in net.state_dict().items()}

    max_rounds = config.rounds if federated else config.epochs
    patience = config.patience if federated else config.epoch_patience
    n_part = max(1, int(round(config.participation * len(parties)))) if federated else 1
    best_state, best_loss, since_best = global_state, _val_loss(net, parties, cost_scale, config.device), 0
    rounds = range(max_rounds)
    if progress:
        from tqdm.auto import tqdm  # trainer extra (tqdm), imported on use

        rounds = tqdm(rounds, desc="MLP rounds" if federated else "MLP epochs", leave=False)
    for _ in rounds:
        updates = []
        for i in rng.choice(len(parties), size=n_part, replace=False):
            party = parties[int(i)]
            if party.train.n_samples == 0:
                continue
            net.load_state_dict({k: torch.as_tensor(v) for k, v in global_state.items()})
            local_train(net, party, cost_scale, config, gen)
            updates.append(({k: v.detach().cpu().numpy() for k, v in net.state_dict().items()}, party.train.n_samples))
        if updates:
            global_state = {k: v.astype(np.float32) for k, v in fedavg(updates).items()}
        net.load_state_dict({k: torch.as_tensor(v) for k, v in global_state.items()})
        loss = _val_loss(net, parties, cost_scale, config.device)
        if loss < best_loss - 1e-6 or not np.isfinite(best_loss):
            best_state, best_loss, since_best = global_state, loss, 0
        else:
            since_best += 1
            if since_best >= patience:
                break
    return MLPRouter(best_state, models, d_emb, np.where(available, cost_scale, np.nan), available,
                     config.hidden, config.dropout)
