"""``fedroute mor ...``: mixtures of client reward models (MoR, paper 001).

Commands: ``grpo`` and ``export`` (:mod:`trainer.alignment.grpo_cli`).
"""

from __future__ import annotations

import typer

mor_app = typer.Typer(no_args_is_help=True, help="MoR: client reward models, their router, GRPO, export")


def _register() -> None:
    from trainer.alignment.grpo_cli import register

    register(mor_app)


_register()
