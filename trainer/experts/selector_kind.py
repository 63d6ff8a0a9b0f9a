"""The trainer side of the ``selector/onnx_pair`` kind (ARCHITECTURE.md §9, ``docs/plugins.md``).

A saved selector expert is the folder :meth:`trainer.experts.selector.PairSelector.save_expert` writes
(``adapter/`` + ``head.safetensors``) with ``selector_config.json`` in it or in one of its two parents
(the run layout ``RUN/<method>_seed0/expert_<k>`` of :mod:`trainer.experts.experiment`). The same
``(family, name)`` is registered in :mod:`sdk.selector` (device runtime) and
:mod:`export.selector_export` (export step and parity gate).
"""

from __future__ import annotations

from pathlib import Path

from sdk.errors import InvalidInputError
from trainer import kinds

FAMILY = "selector"
KIND = "onnx_pair"
CONFIG_FILE = "selector_config.json"


def find_selector_config(expert_dir: str | Path) -> Path:
    """``selector_config.json`` of a saved expert: in ``expert_dir`` or one of its two parents.

    Raises
    ------
    InvalidInputError
        ``expert_dir`` lacks ``adapter/`` or ``head.safetensors``, or no config is found.
    """
    expert_dir = Path(expert_dir)
    for need in ("adapter", "head.safetensors"):
        if not (expert_dir / need).exists():
            raise InvalidInputError(f"{expert_dir} is not a saved selector expert (no {need}); give the folder "
                                    "PairSelector.save_expert wrote, e.g. RUN/fedprism_seed0/expert_0")
    for folder in (expert_dir, expert_dir.parent, expert_dir.parent.parent):
        if (folder / CONFIG_FILE).exists():
            return folder / CONFIG_FILE
    raise InvalidInputError(f"no {CONFIG_FILE} in {expert_dir} or its two parents")


class PairSelectorTrainerKind(kinds.TrainerKind):
    """``selector/onnx_pair``: loads a saved expert as a :class:`~trainer.experts.selector.PairSelector`
    (frozen backbone + that expert's LoRA adapter and head), in eval mode."""

    family = FAMILY
    name = KIND
    display_name = "pair selector (LoRA expert)"

    def load(self, directory: Path):
        from trainer.experts.selector import PairSelector, load_selector_config  # trainer.experts.selector imports torch: on use only

        directory = Path(directory)
        selector = PairSelector(load_selector_config(find_selector_config(directory)))
        try:
            selector.load_expert(directory)
        except Exception as exc:  # noqa: BLE001 - safetensors/peft/shape errors: one clear message
            raise InvalidInputError(f"cannot load the selector expert at {directory}: {exc}") from exc
        return selector.eval()


if KIND not in kinds.REGISTRY.names(FAMILY):
    kinds.register(PairSelectorTrainerKind())
