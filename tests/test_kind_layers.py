"""Every registered artefact kind is present in every layer it claims (ARCHITECTURE.md §9,
docs/plugins.md): the device (:mod:`sdk.kinds`), the trainer (:mod:`trainer.kinds`), the export step
(:mod:`export.kinds`) and, for kinds federated over HTTPS, the server (:mod:`trainer.server.round_kinds`);
and docs/plugins.md's table "Where each built-in kind lives" names the class of each layer."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: The modules that register the built-in kinds (each registers at import).
KIND_MODULES = ("sdk.kinds", "sdk.selector", "sdk.reward_scorer", "sdk.personal_reward", "trainer.kinds",
                "trainer.embeddings", "trainer.static_embedder", "trainer.rewards.reward_scorer_kind",
                "trainer.experts.selector_kind", "trainer.vpa.personal_reward_kind", "trainer.server.round_kinds",
                "export.kinds", "export.embedder_export", "export.reward_export", "export.selector_export",
                "export.vpa_export")
#: Kinds exported from another kind's trained artefact: export kind -> the trainer kind it reads.
TRAINED_AS = {("reward_scorer", "mor_lora"): ("reward_scorer", "mor")}
LAYERS = ("sdk", "trainer", "export", "server")


def test_the_module_list_holds_every_module_that_registers_a_kind():
    call = re.compile(r"^\s*(?:\w+\.)?register\((?:_kind|\w+Kind\(\))\)", re.M)
    registering = {".".join(p.relative_to(ROOT).with_suffix("").parts)
                   for pkg in ("sdk", "trainer", "export") for p in (ROOT / pkg).rglob("*.py")
                   if call.search(p.read_text())}
    assert registering == set(KIND_MODULES)


@pytest.fixture(scope="module")
def registries() -> dict[str, dict[tuple[str, str], object]]:
    """layer -> (family, name) -> registered kind, after importing every registering module."""
    for module in KIND_MODULES:
        importlib.import_module(module)
    from export import kinds as export_kinds
    from sdk import kinds as sdk_kinds
    from trainer import kinds as trainer_kinds
    from trainer.server import round_kinds

    regs = dict(zip(LAYERS, (sdk_kinds.REGISTRY, trainer_kinds.REGISTRY, export_kinds.REGISTRY, round_kinds.REGISTRY)))
    return {layer: {(f, k.name): k for f in reg.families() for k in reg.kinds(f)} for layer, reg in regs.items()}


def test_each_kind_is_in_every_layer_it_claims(registries):
    sdk, trainer, export, server = (set(registries[layer]) for layer in LAYERS)
    assert trainer | export <= sdk, "a trained or exported kind the device cannot load"
    assert trainer <= export, "a trained kind that cannot be exported"
    assert {k: TRAINED_AS.get(k) for k in export - trainer} == TRAINED_AS  # only the known exceptions ...
    assert set(TRAINED_AS.values()) <= trainer  # ... whose artefact a trainer kind loads
    federated = {key for key, kind in registries["sdk"].items() if kind.round_handler is not None}
    assert server == federated, "a device round handler without a server round kind, or the reverse"


def documented_table() -> dict[tuple[str, str], tuple[str, ...]]:
    text = (ROOT / "docs" / "plugins.md").read_text()
    section = text.split("### Where each built-in kind lives", 1)[1]
    rows = {}
    for line in section.splitlines():
        match = re.match(r"\| `(\w+)/(\w+)` \|(.*)\|$", line)
        if match:
            cells = [c.strip() for c in match.group(3).split("|")]
            rows[(match.group(1), match.group(2))] = tuple(
                c.split("`")[1] if c.startswith("`") else "-" for c in cells)
        elif rows and not line.startswith("|"):
            break
    return rows


def test_the_docs_table_names_each_layers_class(registries):
    actual = {key: tuple(f"{type(registries[layer][key]).__module__}.{type(registries[layer][key]).__qualname__}"
                         if key in registries[layer] else "-" for layer in LAYERS)
              for key in set().union(*registries.values())}
    assert documented_table() == actual
