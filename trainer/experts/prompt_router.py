"""FedPrism's instance-wise router: an MLP on frozen prompt embeddings, K-means initialised, PGPD-updated.

Paper 000 (FedPrism), Sec. 3.1-3.4 and ARCHITECTURE.md §7:

- :class:`PromptRouter`: ``logits = W2 tanh(W1 e + b1) + b2`` with ``e`` the frozen MiniLM prompt
  embedding (d_emb = 384, L2-normalised), 128 hidden units, one output per expert; the sample goes to
  ``argmax`` (:meth:`PromptRouter.route`).
- :func:`kmeans_init`: K-means (scikit-learn, M clusters) on embeddings of *public* prompts held by no
  client gives pseudo-labels; the router is fitted to them with cross-entropy, so routing starts by
  topic before any expert is trained.
- PGPD (Posterior-Guided Performance Distillation, paper 000 Sec. 3.2 Step 3): for each local sample the cross-entropy of every
  retrieved expert is computed; :func:`pgpd_pseudo_labels` takes the argmin (among the retrieved
  experts only); :func:`distil_router` minimises ``KL(onehot(argmin) || softmax(router(e)))``,
  which for a one-hot target equals the cross-entropy ``-log softmax(router(e))[argmin]``.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from sdk.errors import InvalidInputError, ShapeError


class PromptRouter(nn.Module):
    """MLP router (d_emb -> hidden, Tanh -> n_experts).

    Parameters
    ----------
    d_emb : int, prompt-embedding width (384 for MiniLM).
    n_experts : int >= 1.
    hidden : int, 128 in the paper.
    seed : int, initialisation. The weights are drawn from a forked torch RNG seeded with it, so
        building a router leaves the global torch RNG (the experts' dropout masks) where it was.
    """

    def __init__(self, d_emb: int, n_experts: int, hidden: int = 128, seed: int = 0) -> None:
        super().__init__()
        if n_experts < 1 or d_emb < 1 or hidden < 1:
            raise InvalidInputError(f"bad router sizes d_emb={d_emb}, n_experts={n_experts}, hidden={hidden}")
        with torch.random.fork_rng(devices=[]):  # seeded init without touching the caller's RNG stream
            torch.manual_seed(seed)
            self.net = nn.Sequential(nn.Linear(d_emb, hidden), nn.Tanh(), nn.Linear(hidden, n_experts))
        self.n_experts = n_experts

    def forward(self, emb: torch.Tensor) -> torch.Tensor:
        return self.net(emb)

    @torch.no_grad()
    def route(self, emb: np.ndarray) -> np.ndarray:
        """Expert of each prompt: emb (n, d_emb) float32 -> ndarray (n,) int64 (argmax, ties to the lower index)."""
        return self(torch.as_tensor(np.asarray(emb, dtype=np.float32))).argmax(1).numpy().astype(np.int64)

    def state(self) -> dict[str, np.ndarray]:
        return {k: v.detach().numpy().astype(np.float32).copy() for k, v in self.state_dict().items()}

    def load_state(self, state: dict[str, np.ndarray]) -> None:
        self.load_state_dict({k: torch.as_tensor(np.asarray(v, dtype=np.float32)) for k, v in state.items()})


def fit_router(router: PromptRouter, emb: np.ndarray, target: np.ndarray, *, lr: float, epochs: int,
               batch_size: int = 64, seed: int = 0) -> float:
    """Minimise the cross-entropy of ``router(emb)`` to integer targets (= KL to their one-hot); AdamW.

    Parameters
    ----------
    emb : ndarray of shape (n, d_emb), float32.
    target : ndarray of shape (n,), int, in [0, n_experts).

    Returns
    -------
    float, the mean loss of the last epoch.

    Raises
    ------
    ShapeError
        Shapes disagree or a target is out of range.
    """
    emb = np.asarray(emb, dtype=np.float32)
    target = np.asarray(target)
    if emb.ndim != 2 or target.shape != (emb.shape[0],) or emb.shape[0] == 0:
        raise ShapeError(f"emb {emb.shape} and target {target.shape} must be (n, d) and (n,), n > 0")
    if (target < 0).any() or (target >= router.n_experts).any():
        raise ShapeError(f"targets must lie in [0, {router.n_experts})")
    x, y = torch.from_numpy(emb), torch.from_numpy(target.astype(np.int64))
    opt = torch.optim.AdamW(router.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    last = float("nan")
    for _ in range(epochs):
        order = torch.randperm(len(y), generator=gen)
        total = 0.0
        for s in range(0, len(y), batch_size):
            idx = order[s:s + batch_size]
            loss = nn.functional.cross_entropy(router(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item() * len(idx)
        last = total / len(y)
    return last


def kmeans_init(router: PromptRouter, public_emb: np.ndarray, *, lr: float = 1e-2, epochs: int = 30,
                seed: int = 0) -> np.ndarray:
    """K-means pseudo-labels of public prompts, then fit the router to them.

    Parameters
    ----------
    public_emb : ndarray of shape (n_public, d_emb), float32, prompts held by no client.

    Returns
    -------
    ndarray of shape (n_public,), int64, the K-means cluster of each public prompt.

    Raises
    ------
    InvalidInputError
        Fewer public prompts than experts.
    """
    from sklearn.cluster import KMeans  # sklearn: optional heavy dependency, imported on use

    public_emb = np.asarray(public_emb, dtype=np.float32)
    if public_emb.shape[0] < router.n_experts:
        raise InvalidInputError(f"n_public={public_emb.shape[0]} should be >= n_experts={router.n_experts}")
    labels = KMeans(router.n_experts, n_init=10, random_state=seed).fit_predict(public_emb).astype(np.int64)
    fit_router(router, public_emb, labels, lr=lr, epochs=epochs, seed=seed)
    return labels


def centroid_distillation(router: PromptRouter, public_emb: np.ndarray, client_embs: list[np.ndarray], *,
                          rounds: int, lr: float, epochs: int = 2, seed: int = 0) -> np.ndarray:
    """Federated distillation of the K-means routing onto the clients' own prompts (after :func:`kmeans_init`).

    The router fitted to a few hundred public prompts generalises worse than their K-means partition (on
    the full validation split of docs/prism.md: 0.88-0.92 domain purity against 0.96-0.97 for the nearest
    centroid). The server broadcasts the M centroids of the public prompts (K-means as in
    :func:`kmeans_init`, same seed); per round each client labels its prompts by nearest centroid, fits a
    copy of the router to them (:func:`fit_router`, ``epochs``), and the server takes the FedAvg of the
    copies weighted by prompt counts (McMahan et al. 2017). No prompt leaves a client.

    Parameters
    ----------
    public_emb : ndarray (n_public, d_emb), float32; client_embs : list of ndarray (n_c, d_emb), float32,
        each client's prompt embeddings (empty clients are skipped); rounds : int >= 1.

    Returns
    -------
    ndarray (n_experts, d_emb), float64, the centroids.
    """
    from sklearn.cluster import KMeans  # sklearn: optional heavy dependency, imported on use

    from trainer.routers.fedavg import fedavg  # numpy only

    km = KMeans(router.n_experts, n_init=10, random_state=seed).fit(np.asarray(public_emb, dtype=np.float32))
    for r in range(rounds):
        ups = []
        for i, e in enumerate(client_embs):
            if len(e) == 0:
                continue
            local = PromptRouter(e.shape[1], router.n_experts, router.net[0].out_features)
            local.load_state(router.state())
            fit_router(local, e, km.predict(np.asarray(e, dtype=np.float32)), lr=lr, epochs=epochs,
                       seed=seed * 1000 + r * 100 + i)
            ups.append((local.state(), float(len(e))))
        router.load_state({k: v.astype(np.float32) for k, v in fedavg(ups).items()})
    return km.cluster_centers_.astype(np.float64)


def pgpd_pseudo_labels(ce: np.ndarray, retrieved: np.ndarray) -> np.ndarray:
    """PGPD pseudo-label of each sample: the retrieved expert with the lowest cross-entropy.

    Parameters
    ----------
    ce : ndarray of shape (n_samples, n_retrieved), float, CE of each retrieved expert on each sample.
    retrieved : ndarray of shape (n_retrieved,), int, the global indices of those experts.

    Returns
    -------
    ndarray of shape (n_samples,), int64: ``retrieved[argmin_j ce[:, j]]`` (ties: first column).

    Raises
    ------
    ShapeError
        Shapes disagree, no experts, or non-finite CE.
    """
    ce = np.asarray(ce, dtype=np.float64)
    retrieved = np.asarray(retrieved)
    if ce.ndim != 2 or ce.shape[1] != retrieved.shape[0] or ce.shape[1] == 0:
        raise ShapeError(f"ce {ce.shape} must be (n_samples, n_retrieved={retrieved.shape[0]}), n_retrieved > 0")
    if not np.isfinite(ce).all():
        raise ShapeError("ce holds NaN or inf")
    return retrieved[ce.argmin(axis=1)].astype(np.int64)
