"""``personal_reward/vpa`` in the trainer's kind registry (ARCHITECTURE.md §9, ``docs/plugins.md``).

The trained artefact of the kind is a saved FedVPA-GP model (:class:`trainer.vpa.artefact.PersonalRewardArtefact`,
``fedroute vpa train`` writes it to ``OUT/personal_reward``); ``export`` turns it into a signed bundle
(:mod:`export.vpa_export`) that :class:`sdk.personal_reward.PersonalRewardScorer` loads. Registered at import.
"""

from __future__ import annotations

from pathlib import Path

from trainer import kinds

FAMILY = "personal_reward"
NAME = "vpa"


class VPATrainerKind(kinds.TrainerKind):
    """Loads a saved FedVPA-GP model with its feature path."""

    family = FAMILY
    name = NAME
    display_name = "FedVPA-GP personal reward"

    def load(self, directory: Path):
        """:meth:`trainer.vpa.artefact.PersonalRewardArtefact.load` of ``directory``; InvalidInputError if it is not one."""
        from trainer.vpa.artefact import PersonalRewardArtefact  # torch: on use only

        return PersonalRewardArtefact.load(Path(directory))


if NAME not in kinds.names(FAMILY):
    kinds.register(VPATrainerKind())
