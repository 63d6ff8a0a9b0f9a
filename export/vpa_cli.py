"""``fedroute vpa export``: a ``fedroute vpa train`` run's FedVPA-GP as a signed personal-reward bundle for
:class:`sdk.personal_reward.PersonalRewardScorer`. Registered on the ``vpa`` sub-app by the console-script module
(``trainer.cli``), since ``export`` may import ``trainer`` but not the reverse. Heavy imports happen in the command.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from export.bundle_writer import check_replaceable, check_version, next_bundle_version
from export.signing import load_signing_key
from sdk.bundle_manifest import MAX_BUNDLE_VERSION
from sdk.finite_option import COUNT_MAX
from trainer import kinds
from trainer.out_folder import cache_folder_option, check_out_option
from trainer.vpa.personal_reward_kind import FAMILY, NAME


def export_vpa(
    run: Annotated[Path, typer.Option(help="a `fedroute vpa train --out` folder (its personal_reward/ is exported)")],
    out: Annotated[Path, typer.Option(help="bundle directory (created or replaced atomically)")],
    signing_key: Annotated[Path, typer.Option(help="signing.key from `fedroute keygen`")],
    data: Annotated[Path, typer.Option(help="shared data folder (hh_rlhf_harmless/): real pairs for the parity check")] = Path("../shared/data"),
    parity_users: Annotated[int, typer.Option(min=1, max=COUNT_MAX, help="users of real pairs in the parity check (half of each type)")] = 8,
    context: Annotated[int, typer.Option(min=1, max=COUNT_MAX, help="context pairs C of each parity user")] = 8,
    bundle_version: Annotated[Optional[int], typer.Option(min=1, max=MAX_BUNDLE_VERSION, help="default: 1 + the version at OUT")] = None,
    cache_dir: Annotated[Optional[Path], typer.Option(callback=cache_folder_option, help="embedding cache folder")] = None,
) -> None:
    """Export RUN's FedVPA-GP (seed 0) as a signed personal-reward bundle (sdk.PersonalRewardScorer)."""
    from export.vpa_export import export_personal_reward_bundle, parity_users as make_users  # torch, onnx: on use only
    from trainer.data.preferences import load_hh_harmless_pairs
    from trainer.vpa.artefact import ARTEFACT_DIR

    load_signing_key(signing_key)  # key, --out and version before the model and the data are loaded
    check_out_option(out, beside=True)
    check_replaceable(out, FAMILY)
    check_version(out, bundle_version if bundle_version is not None else next_bundle_version(out))
    artefact = kinds.get(NAME, FAMILY).load(run / ARTEFACT_DIR)
    # the last rows of the shuffled pairs: real text, with both types' labels
    pairs = load_hh_harmless_pairs(data, seed=0).iloc[::-1]
    users = make_users(pairs, parity_users, context, context)
    result = export_personal_reward_bundle(artefact, out, signing_key, users, bundle_version=bundle_version,
                                           cache_dir=cache_dir, progress=typer.echo)
    d = result.parity["max_abs_diff"]
    typer.echo(f"parity on {len(users)} users x ({context} context + {context} target pairs): max|diff| z {d['z']:.2e}, "
               f"mu {d['mu']:.2e}, logvar {d['logvar']:.2e}, rewards {d['rewards']:.2e}")


def register(vpa_app: typer.Typer) -> None:
    """Add ``export`` to the ``fedroute vpa`` sub-app."""
    vpa_app.command("export")(export_vpa)
