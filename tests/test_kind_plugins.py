"""A router kind added by a plugin module, with no edit anywhere else (docs/plugins.md).

The toy kind ``mean`` predicts, for every query, each model's mean observed accuracy and cost (the
per-model global-mean baseline). This module registers it in the three layers (sdk, trainer,
export), then trains it, saves and reloads it, exports it into a signed bundle with the exporter's
own assembly and writer, loads that bundle with ``sdk.Router`` and routes, all with hand-computed
answers. Registration is undone after each test.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from sdk import kinds as sdk_kinds
from sdk.errors import BundleError, InvalidInputError
from trainer import kinds as trainer_kinds
from trainer.data.client_data import ClientData
from trainer.routers.base import Router, read_meta

MODELS = ("cheap", "mid", "strong")
MEAN_FILE = "mean.json"


# --- the plugin: one kind, three layers -------------------------------------------------------


class MeanRouter(Router):
    """Trainer side: per-model mean accuracy and cost (USD) over the observed pairs; NaN if unseen."""

    kind = "mean"

    def __init__(self, accuracy, cost, models, d_emb: int) -> None:
        self.accuracy_ = np.asarray(accuracy, dtype=np.float64)
        self.cost_ = np.asarray(cost, dtype=np.float64)
        self.models = tuple(models)
        self.d_emb = int(d_emb)

    @classmethod
    def fit(cls, clients, models, d_emb):
        n = np.zeros(len(models))
        s_acc, s_cost = np.zeros(len(models)), np.zeros(len(models))
        for c in clients:  # sufficient statistics: summing them over clients is the pooled fit
            np.add.at(n, c.model, 1.0)
            np.add.at(s_acc, c.model, c.accuracy)
            np.add.at(s_cost, c.model, c.cost)
        with np.errstate(invalid="ignore", divide="ignore"):
            return cls(s_acc / n, s_cost / n, models, d_emb)

    def _predict(self, embeddings):
        n = embeddings.shape[0]
        return np.tile(self.accuracy_, (n, 1)), np.tile(self.cost_, (n, 1))

    def save(self, directory: Path) -> None:
        self._write_meta(Path(directory), {"accuracy": self.accuracy_.tolist(), "cost": self.cost_.tolist()})

    @classmethod
    def load(cls, directory: Path) -> MeanRouter:
        meta = read_meta(Path(directory))
        return cls(meta["accuracy"], meta["cost"], meta["models"], meta["d_emb"])


class MeanTrainerKind(trainer_kinds.RouterTrainerKind):
    name = "mean"
    display_name = "Global mean"
    router_class = MeanRouter

    def fit_local(self, client, models, config, rng):
        return MeanRouter.fit([client], models, client.embeddings.shape[1])

    def fit_federated(self, clients, models, config, rng, progress=False):
        return MeanRouter.fit(clients, models, clients[0].embeddings.shape[1])


class MeanScorer:
    """Device side: the table of ``mean.json``, the same for every query."""

    def __init__(self, data: bytes, models, embedder: dict) -> None:
        table = json.loads(data)
        if table["models"] != list(models) or table["embedder_dim"] != embedder["dim"]:
            raise BundleError("mean.json: other models or embedder than the manifest's")
        self.accuracy = np.array(table["accuracy"], dtype=np.float64)
        self.cost = np.array(table["cost"], dtype=np.float64)

    def predict(self, embeddings):
        n = embeddings.shape[0]
        return np.tile(self.accuracy, (n, 1)), np.tile(self.cost, (n, 1)), None


class MeanSdkKind(sdk_kinds.ArtefactKind):
    family = "router"
    name = "mean"

    def files(self, manifest, precision):
        return (MEAN_FILE,)

    def load(self, context):
        return MeanScorer(context.files[MEAN_FILE], context.models, context.embedder)


def _export_kinds():
    from export import kinds as export_kinds

    class MeanExportKind(export_kinds.RouterExportKind):
        name = "mean"

        def files(self, router):
            table = {"models": list(router.models), "embedder_dim": router.d_emb,
                     "accuracy": router.accuracy_.tolist(), "cost": router.cost_.tolist()}
            return {MEAN_FILE: json.dumps(table).encode()}

        def mean_costs(self, router):
            return [None if np.isnan(c) else float(c) for c in router.cost_]

    return export_kinds, MeanExportKind()


@pytest.fixture
def mean_kind():
    """The ``mean`` kind registered in every layer, for one test."""
    export_kinds, export_kind = _export_kinds()
    sdk_kinds.register(MeanSdkKind())
    trainer_kinds.register(MeanTrainerKind())
    export_kinds.register(export_kind)
    yield
    sdk_kinds.unregister("router", "mean")
    trainer_kinds.unregister("mean")
    export_kinds.unregister("mean")


def _clients(d_emb: int = 384) -> list[ClientData]:
    rng = np.random.default_rng(0)

    def client(model, accuracy, cost):
        emb = rng.normal(size=(len(model), d_emb)).astype(np.float32)
        emb /= np.linalg.norm(emb, axis=1, keepdims=True)
        return ClientData(emb, np.array(model, dtype=np.int64), np.array(accuracy, float), np.array(cost, float))

    # cheap: acc (0.2, 0.4, 0.3) cost 0.001 each; mid: acc (0.6, 0.8) cost (0.004, 0.006); strong: acc 1.0, cost 0.05
    return [client([0, 0, 1], [0.2, 0.4, 0.6], [0.001, 0.001, 0.004]),
            client([0, 1, 2], [0.3, 0.8, 1.0], [0.001, 0.006, 0.05])]


# --- the tests ----------------------------------------------------------------------------------


def test_a_toy_kind_trains_saves_and_loads_through_the_trainer_registry(mean_kind, tmp_path):
    from trainer.simulation import SimulationConfig

    clients = _clients()
    fed = trainer_kinds.get("mean").fit_federated(clients, MODELS, None, np.random.default_rng(0))
    central = trainer_kinds.get("mean").fit_local(ClientData.pool(clients), MODELS, None, np.random.default_rng(0))
    np.testing.assert_allclose(fed.accuracy_, [0.3, 0.7, 1.0])  # (0.2+0.4+0.3)/3, (0.6+0.8)/2, 1.0
    np.testing.assert_allclose(fed.cost_, [0.001, 0.005, 0.05])
    np.testing.assert_allclose(central.accuracy_, fed.accuracy_)
    fed.save(tmp_path / "r")
    loaded = trainer_kinds.load_router(tmp_path / "r")
    assert isinstance(loaded, MeanRouter) and loaded.models == MODELS
    np.testing.assert_allclose(loaded.predict(clients[0].embeddings)[1], np.tile([0.001, 0.005, 0.05], (3, 1)))
    assert SimulationConfig(routers=("mean", "kmeans")).routers == ("mean", "kmeans")
    assert trainer_kinds.display_name("mean") == "Global mean"


def test_the_registries_refuse_a_kind_that_is_not_registered():
    from trainer.simulation import SimulationConfig

    with pytest.raises(InvalidInputError, match=r"'mean'.*\['kmeans', 'mlp'\]"):
        trainer_kinds.router_class("mean")
    with pytest.raises(InvalidInputError, match=r"unknown router kind\(s\) \['mean'\]"):
        SimulationConfig(routers=("mean",))
    with pytest.raises(InvalidInputError, match="already registered"):
        sdk_kinds.register(sdk_kinds.get("router", "kmeans"))
    with pytest.raises(InvalidInputError, match="router_class"):

        class Misnamed(MeanTrainerKind):
            name = "average"  # its router_class says "mean"

        trainer_kinds.register(Misnamed())
    with pytest.raises(InvalidInputError, match="unknown artefact family 'selectorz'"):

        class Stray(MeanSdkKind):
            family = "selectorz"

        sdk_kinds.register(Stray())


def test_a_toy_kind_is_exported_into_a_signed_bundle_and_routes_on_the_device(
        mean_kind, exported_embedder, signing_keys, tmp_path):
    from export.bundle_writer import write_bundle
    from export.pipeline import assemble
    from export.signing import load_signing_key
    from sdk import Router

    router = trainer_kinds.get("mean").fit_federated(_clients(), MODELS, None, np.random.default_rng(0))
    router.embedder = {"name": "all-MiniLM-L6-v2", "dim": 384}
    exported, _ = exported_embedder
    files, fields = assemble(router, exported, None, "all-MiniLM-L6-v2", 64, "left", {"strong": (0.01, 0.03)}, 1)
    assert fields["router_kind"] == "mean" and MEAN_FILE in files
    assert [m["mean_cost_usd"] for m in fields["models"]] == pytest.approx([0.001, 0.005, 0.05])
    write_bundle(tmp_path / "bundle", files, fields, load_signing_key(signing_keys[0]))

    device = Router.load(tmp_path / "bundle", signing_keys[1])
    assert device.router_kind == "mean" and device.model_ids == MODELS
    acc, cost = device.predict(["what is 2 + 2?", "write a haiku about rain"])
    np.testing.assert_allclose(acc, np.tile([0.3, 0.7, 1.0], (2, 1)))
    np.testing.assert_allclose(cost, np.tile([0.001, 0.005, 0.05], (2, 1)))
    # U = A - lam C: lam = 0 -> strong (1.0); lam = 20 -> 0.3-0.02, 0.7-0.1, 1.0-1.0 -> mid; lam = 200 -> cheap
    assert [device.choose("what is 2 + 2?", lam).model for lam in (0.0, 20.0, 200.0)] == ["strong", "mid", "cheap"]


def test_a_bundle_of_an_unregistered_kind_is_refused_naming_the_registered_ones(
        mean_kind, exported_embedder, signing_keys, tmp_path):
    from export.bundle_writer import write_bundle
    from export.pipeline import assemble
    from export.signing import load_signing_key
    from sdk import Router

    router = MeanRouter.fit(_clients(), MODELS, 384)
    router.embedder = {"name": "all-MiniLM-L6-v2", "dim": 384}
    files, fields = assemble(router, exported_embedder[0], None, "all-MiniLM-L6-v2", 64, "left", {}, 1)
    write_bundle(tmp_path / "bundle", files, fields, load_signing_key(signing_keys[0]))
    sdk_kinds.unregister("router", "mean")  # a device whose SDK lacks the plugin
    with pytest.raises(BundleError, match=r"router_kind .*'mean'"):
        Router.load(tmp_path / "bundle", signing_keys[1])


# --- a new family (docs/plugins.md: "A new family", "Non-router families") ---------------------

TOY_FAMILY, TOY_FILE = "lengthscore", "linear.json"


def _toy_family():
    from typing import Protocol, runtime_checkable

    from export import kinds as export_kinds

    @runtime_checkable
    class LengthScoreInterface(Protocol):
        def score(self, text: str) -> float: ...

    class LinearScorer:
        def __init__(self, a: float, b: float) -> None:
            self.a, self.b = a, b

        def score(self, text: str) -> float:
            return self.a * len(text) + self.b

    class LinearSdkKind(sdk_kinds.ArtefactKind):
        family, name = TOY_FAMILY, "linear"

        def files(self, manifest, precision):
            return (TOY_FILE,)

        def load(self, context):
            table = json.loads(context.files[TOY_FILE])
            return LinearScorer(float(table["a"]), float(table["b"]))

    class LinearExportKind(export_kinds.ExportKind):
        family, name = TOY_FAMILY, "linear"

        def files(self, artefact):
            return {TOY_FILE: json.dumps(artefact).encode()}

        def parity(self, bundle_dir, public_key, artefact, reference, test, precisions, progress=print):
            from sdk import bundle_manifest

            bundle = bundle_manifest.read_verified(bundle_dir, public_key)
            runtime = sdk_kinds.load_artefact(TOY_FAMILY, bundle.manifest, bundle.files)
            diff = max(abs(runtime.score(t) - (artefact["a"] * len(t) + artefact["b"])) for t in test)
            return {"passed": diff <= 1e-12, "failures": [] if diff <= 1e-12 else [f"max diff {diff}"]}

    sdk_kinds.register_family(TOY_FAMILY, LengthScoreInterface, needs_embedder=False)
    sdk_kinds.register(LinearSdkKind())
    export_kinds.register(LinearExportKind())
    return export_kinds


def test_a_new_family_is_exported_loaded_and_removed_as_the_plugin_doc_says(signing_keys, tmp_path):
    from export.bundle_writer import write_bundle, write_checked_bundle
    from export.errors import ExportError
    from export.signing import load_signing_key
    from sdk import Router, bundle_manifest

    export_kinds = _toy_family()
    try:
        kind, artefact = export_kinds.get("linear", family=TOY_FAMILY), {"a": 0.5, "b": 1.0}
        key = load_signing_key(signing_keys[0])
        files, fields = kind.files(artefact), {"bundle_version": 1, **kind.manifest_fields(artefact)}
        assert fields == {"bundle_version": 1, "lengthscore_kind": "linear"}
        write_bundle(tmp_path / "staged", files, fields, key)
        report = kind.parity(tmp_path / "staged", key.public_key(), artefact, None, ["a", "abcd"], ["fp32"])
        manifest = write_checked_bundle(tmp_path / "bundle", dict(files), fields, key, report)
        assert "embedder" not in manifest and "models" not in manifest and "parity.json" in manifest["files"]
        bundle = bundle_manifest.read_verified(tmp_path / "bundle", signing_keys[1])
        assert sdk_kinds.load_artefact(TOY_FAMILY, bundle.manifest, bundle.files).score("hello") == 3.5
        with pytest.raises(BundleError, match=r"sdk\.kinds\.load_bundle"):  # it declared no loader
            Router.load(tmp_path / "bundle", signing_keys[1])
        with pytest.raises(ExportError, match="holds a lengthscore bundle"):
            write_bundle(tmp_path / "bundle", files, {"bundle_version": 2, "router_kind": "kmeans"}, key)
    finally:
        export_kinds.unregister("linear", family=TOY_FAMILY)
        sdk_kinds.unregister_family(TOY_FAMILY)  # its kinds go with it
    assert TOY_FAMILY not in sdk_kinds.families() and sdk_kinds.REGISTRY.names(TOY_FAMILY) == ()
    with pytest.raises(BundleError, match=r"names no artefact.*'router_kind'"):
        sdk_kinds.check_manifest_kinds({"lengthscore_kind": "linear"})


def test_the_built_in_families_cannot_be_unregistered():
    for family in ("router", "embedder", "selector", "reward_scorer"):
        with pytest.raises(InvalidInputError, match=f"family {family!r} is built in"):
            sdk_kinds.unregister_family(family)
    sdk_kinds.unregister_family("never_declared")  # unknown names are ignored, as for kinds
