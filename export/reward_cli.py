"""``fedroute mor export``: a client's MoR reward model and the client router as a signed reward-scorer
bundle for :class:`sdk.reward_scorer.RewardScorer`. Registered on the ``mor`` sub-app by the console-script
module (``trainer.cli``), since ``export`` may import ``trainer`` but not the reverse.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from sdk.bundle_manifest import MAX_BUNDLE_VERSION
from sdk.finite_option import COUNT_MAX
from export.bundle_writer import check_replaceable, check_version, next_bundle_version
from export.reward_export import export_reward_bundle
from export.signing import load_signing_key
from trainer import kinds
from trainer.out_folder import cache_folder_option, check_out_option
from trainer.rewards.reward_scorer_kind import FAMILY, NAME

MixtureOpt = Annotated[Path, typer.Option("--mixture", help="a saved MoR mixture (mixture.json + router + clients)")]
DataOpt = Annotated[Path, typer.Option("--data", help="the shared data folder (alpacaeval/, hh_rlhf_harmless/, routerbench/)")]


def export_reward(
    mixture: MixtureOpt,
    client: Annotated[str, typer.Option(help="the client whose reward model ships")],
    out: Annotated[Path, typer.Option(help="bundle directory (created or replaced atomically)")],
    signing_key: Annotated[Path, typer.Option(help="signing.key from `fedroute keygen`")],
    data: DataOpt = Path("../shared/data"),
    n_parity: Annotated[int, typer.Option(min=1, max=COUNT_MAX, help="real pairs for the parity check")] = 200,
    bundle_version: Annotated[Optional[int], typer.Option(min=1, max=MAX_BUNDLE_VERSION, help="default: 1 + the version at OUT")] = None,
    cache_dir: Annotated[Optional[Path], typer.Option(callback=cache_folder_option, help="embedding cache folder")] = None,
) -> None:
    """Export CLIENT's reward model and the client router as a signed reward-scorer bundle (sdk.RewardScorer)."""
    from trainer.data.preferences import load_preference_pairs  # trainer.data.preferences imports pandas: on use only

    # before the mixture is loaded (torch, the reward models: seconds to minutes): a missing, unreadable or
    # non-Ed25519 key was refused only by export_reward_bundle, after that loading (ExportError: exit 2, one line)
    load_signing_key(signing_key)
    check_out_option(out, beside=True)  # before the mixture is loaded: the bundle's versions go beside OUT
    check_replaceable(out, FAMILY)  # a router or selector bundle at OUT is refused before the loading, too
    check_version(out, bundle_version if bundle_version is not None else next_bundle_version(out))
    mix = kinds.get(NAME, FAMILY).load(mixture)
    if cache_dir is not None:
        mix.encoder.cache_dir = cache_dir
        for rm in mix.reward_models:
            if hasattr(rm, "encoder"):
                rm.encoder.cache_dir = cache_dir
    pairs = load_preference_pairs(data, ("alpacaeval", "hh_harmless", "routerbench"))
    pairs = pairs.sample(n=min(n_parity, len(pairs)), random_state=0)
    prompts = pairs["prompt"].tolist() + pairs["prompt"].tolist()
    responses = pairs["response_a"].tolist() + pairs["response_b"].tolist()
    result = export_reward_bundle(mix, client, out, signing_key, prompts, responses, bundle_version=bundle_version,
                                  progress=typer.echo)
    g, e = result.parity["graphs"], result.parity["end_to_end"]
    typer.echo(f"parity on {result.parity['n_pairs']} real (prompt, response) pairs: graphs max|diff| reward "
               f"{g['reward_max_abs_diff']:.2e}, logits {g['logits_max_abs_diff']:.2e}; end to end reward "
               f"{e['reward_max_abs_diff']:.2e}, client choice agreement {e['choice_agreement']:.4f}")



def register(mor_app: typer.Typer) -> None:
    """Add ``export`` to the ``fedroute mor`` sub-app."""
    mor_app.command("export")(export_reward)
