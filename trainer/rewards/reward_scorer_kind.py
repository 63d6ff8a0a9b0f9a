"""``reward_scorer/mor`` in the trainer's kind registry (ARCHITECTURE.md §9, ``docs/plugins.md``).

The trained artefact of the kind is a saved MoR mixture (:func:`trainer.rewards.mixture.save_mixture`
layout); ``export`` turns one client of it into a reward-scorer bundle (:mod:`export.reward_export`)
that :class:`sdk.reward_scorer.RewardScorer` loads. Registered at import.
"""

from __future__ import annotations

from pathlib import Path

from trainer import kinds

FAMILY = "reward_scorer"
NAME = "mor"


class MoRRewardTrainerKind(kinds.TrainerKind):
    """Loads a saved mixture (router + client reward models + pair encoder)."""

    family = FAMILY
    name = NAME
    display_name = "MoR client reward model + client router"

    def load(self, directory: Path):
        """:func:`trainer.rewards.mixture.load_mixture` of ``directory``.

        Raises
        ------
        InvalidInputError
            No ``mixture.json`` or an unsupported format version.
        """
        from trainer.rewards.mixture import load_mixture  # trainer.rewards.mixture imports torch, tqdm: on use only

        return load_mixture(Path(directory))


if NAME not in kinds.names(FAMILY):
    kinds.register(MoRRewardTrainerKind())
