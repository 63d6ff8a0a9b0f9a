"""Artefact kinds as plugins, the trainer side (ARCHITECTURE.md §9).

Same ``(family, name)`` keys as :mod:`sdk.kinds` (device runtime) and :mod:`export.kinds` (export
step). A trainer kind (:class:`TrainerKind`) supplies the trainer object of its artefact and loads
what it saved; a router kind (:class:`RouterTrainerKind`) also gives the
:class:`trainer.routers.base.Router` subclass and how the federated simulation (METRICS.md
protocol, :mod:`trainer.simulation`) fits it locally, federated and centralised. The server's round kind (open, validate, aggregate, publish) needs the ``server``
extra and is registered in :mod:`trainer.server.round_kinds` under the same name.

Built in: ``router/kmeans`` and ``router/mlp`` (paper 002). See ``docs/plugins.md``.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar, Protocol

import numpy as np

from sdk.errors import InvalidInputError
from sdk.kind_registry import KindRegistry, UnknownKindError
from trainer.data.client_data import ClientData
from trainer.routers.add_model import add_model_kmeans, add_model_mlp
from trainer.routers.base import Router, read_meta
from trainer.routers.kmeans_router import (
    KMeansRouter,
    KMeansRouterConfig,
    fit_federated_kmeans_router,
    fit_kmeans_router,
)
from trainer.routers.mlp_router import MLPRouter, MLPRouterConfig, train_mlp_router


class SimulationSettings(Protocol):
    """What a router kind's fit reads of the simulation's settings: one config per built-in family.
    :class:`trainer.simulation.SimulationConfig` is one (that module imports this one, not back)."""

    kmeans: KMeansRouterConfig
    mlp: MLPRouterConfig

ROUTER_FAMILY = "router"


class TrainerKind(abc.ABC):
    """What a kind supplies to the trainer: how to load the trained artefact it saved.

    Attributes
    ----------
    family, name : the registry key (``"router"``, ``"kmeans"``).
    display_name : str, how reports and plots name it (``"K-means"``).
    """

    family: ClassVar[str] = ""
    name: ClassVar[str] = ""
    display_name: ClassVar[str] = ""

    @abc.abstractmethod
    def load(self, directory: Path) -> Any:
        """The trained artefact saved in ``directory``."""


class RouterTrainerKind(TrainerKind):
    """A router kind: its :class:`~trainer.routers.base.Router` subclass (``save``/``load``; its
    ``kind`` equals ``name``) and how the simulation fits it.

    Attributes
    ----------
    router_class : the Router subclass.
    """

    family: ClassVar[str] = ROUTER_FAMILY
    router_class: ClassVar[type[Router]]

    def load(self, directory: Path) -> Router:
        return self.router_class.load(Path(directory))

    @abc.abstractmethod
    def fit_local(self, client: ClientData, models: Sequence[str], config: SimulationSettings,
                  rng: np.random.Generator) -> Router:
        """One party's router on its own log (the *local* setting, or *centralised* on the pooled
        logs). ``config`` is the simulation's; randomness comes from ``rng``."""

    @abc.abstractmethod
    def fit_federated(self, clients: Sequence[ClientData], models: Sequence[str], config: SimulationSettings,
                      rng: np.random.Generator, progress: bool = False) -> Router:
        """The *federated* router over the clients' logs (raw data never pooled); ``progress``
        shows a bar over rounds where there are rounds."""

    def add_model(self, router: Router, model: str, embeddings: np.ndarray, accuracy: np.ndarray,
                  cost: np.ndarray, price_usd: float) -> Router:
        """``router`` with one more model fitted on a calibration set, the old ones frozen
        (``fedroute add-model``, :mod:`trainer.routers.add_model`); embeddings (n, d_emb) float32,
        accuracy (n,) in [0, 1], cost (n,) and ``price_usd`` in USD per query.

        Raises
        ------
        InvalidInputError
            This kind cannot add a model without retraining (the default), or bad inputs.
        """
        raise InvalidInputError(f"router kind {self.name!r} does not support add-model; retrain it with the new model")


#: The trainer layer's kinds.
REGISTRY: KindRegistry[TrainerKind] = KindRegistry("trainer", TrainerKind)


def register(kind: TrainerKind, *, replace: bool = False) -> TrainerKind:
    """Register a trainer kind (see :meth:`sdk.kind_registry.KindRegistry.register`).

    Raises
    ------
    InvalidInputError
        Not a :class:`TrainerKind`, a bad name, a name taken (without ``replace``), or a router
        kind whose ``router_class`` has another ``kind`` than the kind's name.
    """
    cls = getattr(kind, "router_class", None)
    if isinstance(kind, RouterTrainerKind) and (cls is None or cls.kind != kind.name):
        raise InvalidInputError(f"trainer kind {kind.name!r}: router_class must be a Router subclass whose "
                                f"kind is {kind.name!r}, got {cls!r}")
    return REGISTRY.register(kind, replace=replace)


def get(name: str, family: str = ROUTER_FAMILY) -> TrainerKind:
    """The trainer kind ``name``; :class:`~sdk.kind_registry.UnknownKindError` lists the valid ones."""
    return REGISTRY.get(family, name)


def names(family: str = ROUTER_FAMILY) -> tuple[str, ...]:
    """Registered kind names, sorted."""
    return REGISTRY.names(family)


def in_order(family: str = ROUTER_FAMILY) -> tuple[str, ...]:
    """Registered kind names in registration order (the simulation's default order of training)."""
    return tuple(k.name for k in REGISTRY.kinds(family))


def display_name(name: str, family: str = ROUTER_FAMILY) -> str:
    """How reports name kind ``name`` (the name itself when it is not registered)."""
    try:
        return get(name, family).display_name or name
    except UnknownKindError:
        return name


def unregister(name: str, family: str = ROUTER_FAMILY) -> None:
    """Remove a kind (tests)."""
    REGISTRY.unregister(family, name)


def router_class(kind: str) -> type[Router]:
    """The router class of the registered router kind ``kind``.

    Raises
    ------
    UnknownKindError
        (an InvalidInputError) ``kind`` is not registered; the message lists the valid kinds.
    """
    return get(kind, ROUTER_FAMILY).router_class


def load_router(directory: str | Path) -> Router:
    """Load a router saved by ``Router.save`` (its kind is read from ``router.json``), with its
    ``embedder`` and ``provenance`` entries.

    Raises
    ------
    InvalidInputError
        No readable ``router.json``, or an unregistered kind.
    """
    meta = read_meta(Path(directory))
    router = get(meta["kind"], ROUTER_FAMILY).load(Path(directory))
    router.embedder = meta.get("embedder")
    router.provenance = meta.get("provenance")
    return router


class KMeansTrainerKind(RouterTrainerKind):
    """``router/kmeans``: Lloyd + per-cell statistics (paper 002, K-means router)."""

    name = "kmeans"
    display_name = "K-means"
    router_class = KMeansRouter

    def fit_local(self, client, models, config, rng):
        return fit_kmeans_router(client, models, config.kmeans, int(rng.integers(2**31)))

    def fit_federated(self, clients, models, config, rng, progress=False):
        return fit_federated_kmeans_router(clients, models, config.kmeans, rng)

    def add_model(self, router, model, embeddings, accuracy, cost, price_usd):
        return add_model_kmeans(router, model, embeddings, accuracy, cost, price_usd)


class MlpTrainerKind(RouterTrainerKind):
    """``router/mlp``: trunk + per-model heads trained by FedAvg (paper 002, MLP router)."""

    name = "mlp"
    display_name = "MLP"
    router_class = MLPRouter

    def fit_local(self, client, models, config, rng):
        return train_mlp_router([client], models, config.mlp, rng, federated=False)

    def fit_federated(self, clients, models, config, rng, progress=False):
        return train_mlp_router(clients, models, config.mlp, rng, federated=True, progress=progress)

    def add_model(self, router, model, embeddings, accuracy, cost, price_usd):
        return add_model_mlp(router, model, embeddings, accuracy, cost, price_usd)


for _kind in (MlpTrainerKind(), KMeansTrainerKind()):
    register(_kind)

__all__ = ["REGISTRY", "RouterTrainerKind", "TrainerKind", "UnknownKindError", "display_name", "get", "in_order", "load_router", "names", "register", "router_class",
           "unregister"]
