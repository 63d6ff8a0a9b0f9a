"""``fedroute`` command line: ``simulate`` (the main job), ``ablate``, ``keygen``, ``export`` and ``add-model``.

Heavy libraries (torch, sentence-transformers) are imported inside the commands, so ``fedroute
--help`` works with the base (SDK-only) install and a missing extra gives a clear message.
"""

from __future__ import annotations

import json
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Annotated, Optional

import typer

from sdk.bundle_manifest import MAX_BUNDLE_VERSION
from sdk.cli_paths import PathCheckedGroup
from sdk.console import run_app
from sdk.errors import InvalidInputError
from sdk.finite_option import COUNT_MAX, finite_option
from export.bundle_writer import check_replaceable, check_version
from export.embedder_onnx import QUANTISED_PRECISIONS
from export.routed_selector_export import is_fedprism_run
from export.selector_export import export_selector_bundle, parity_pairs_for, run_pairs, validation_for
from export.errors import ParityError
from export.signing import load_signing_key
from trainer.out_folder import cache_folder_option, check_out_folder
from trainer.results_owner import claim_results
from trainer.torch_device import DEFAULT_CPU_THREADS, set_cpu_threads

app = typer.Typer(cls=PathCheckedGroup, add_completion=False, no_args_is_help=True, help="fedroute: federated cost-aware LLM routing.")


def _version(value: bool) -> None:
    if value:
        try:
            typer.echo(f"fedroute {version('fedroute')}")
        except PackageNotFoundError:
            typer.echo("fedroute (not installed: running from a source tree)")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True, help="print the version and exit")] = False,
) -> None:
    """fedroute: federated cost-aware LLM routing."""


def _need_trainer() -> None:
    try:
        import sentence_transformers  # noqa: F401
        import sklearn  # noqa: F401
        import torch  # noqa: F401
    except ImportError as exc:
        raise typer.BadParameter(
            f"this command needs the trainer extra ({exc.name} is missing): pip install 'fedroute[trainer]'"
        ) from exc


def _load_tables(data: Optional[Path], train: Optional[Path], test: Optional[Path], n_clients: Optional[int] = None,
                 option: str = "--n-clients"):
    """(train, test) EvalTables of --data or --train/--test; refuses ``n_clients`` (named ``option``) above the
    training rows, where clients would hold no query (no rows at all: the simulation names that)."""
    from trainer.data.routerbench import load_eval_file, load_routerbench_dir  # trainer extra: `fedroute --help` works without it

    if train is not None or test is not None:
        if train is None or test is None:
            raise typer.BadParameter("--train and --test go together")
        if train.resolve() == test.resolve():  # every test query would be a training query: inflated scores
            raise typer.BadParameter(f"--train and --test are the same file ({train}); give a held-out test file")
        tables = load_eval_file(train), load_eval_file(test)
    elif data is None:
        raise typer.BadParameter("give --data DIR (with train.parquet and test.parquet) or --train FILE --test FILE")
    else:
        tables = load_routerbench_dir(data)
    if n_clients is not None and 0 < tables[0].n_queries < n_clients:
        raise typer.BadParameter(f"{option} {n_clients}: more clients than the {tables[0].n_queries} training rows")
    return tables


DataOpt = Annotated[Optional[Path], typer.Option(help="folder with train.parquet and test.parquet (RouterBench schema)")]
TrainOpt = Annotated[Optional[Path], typer.Option(help="train log file (.parquet/.csv, same schema); overrides --data")]
TestOpt = Annotated[Optional[Path], typer.Option(help="test file scored by the run (.parquet/.csv, same schema)")]
OutOpt = Annotated[Path, typer.Option(help="output folder")]
SeedsOpt = Annotated[int, typer.Option(min=1, max=COUNT_MAX, help="number of seeds (0..K-1)")]
RoutersOpt = Annotated[str, typer.Option(help="comma-separated router kinds: mlp,kmeans")]
EmbedderOpt = Annotated[str, typer.Option(help="embedder: local path, 'all-MiniLM-L6-v2' or a hub id; "
                                         "'static:<model2vec folder or sentence-transformer>' for a static table (docs/static_embedder.md)")]
CacheOpt = Annotated[Optional[Path], typer.Option(callback=cache_folder_option, help="embedding cache folder (default $FEDROUTE_CACHE or ~/.cache/fedroute)")]
MaxTokensOpt = Annotated[int, typer.Option(min=8, max=COUNT_MAX, help="tokens the embedder reads (from the end of the prompt)")]
DeviceOpt = Annotated[str, typer.Option(help="torch device for embedding and MLP training: cpu, cuda, cuda:1")]
ThreadsOpt = Annotated[int, typer.Option(min=1, max=COUNT_MAX, help="torch CPU threads (one is fastest for these small "
                                                                   "models on a shared machine: docs/benchmarks.md)")]


def _check_device(device: str) -> None:
    from trainer.torch_device import check_torch_device  # imports torch (trainer extra) when it runs

    try:
        check_torch_device("--device", device)
    except InvalidInputError as exc:
        raise typer.BadParameter(str(exc)) from exc


def _config(n_clients: int, alpha: float, routers: str, device: str):
    from trainer.routers.mlp_router import MLPRouterConfig  # trainer extra: `fedroute --help` works without it
    from trainer.simulation import SimulationConfig  # trainer extra: `fedroute --help` works without it

    _check_device(device)
    kinds = tuple(k.strip() for k in routers.split(",") if k.strip())
    try:
        return SimulationConfig(n_clients=n_clients, alpha=alpha, routers=kinds, mlp=MLPRouterConfig(device=device))
    except InvalidInputError as exc:
        raise typer.BadParameter(str(exc)) from exc


@app.command()
def simulate(
    data: DataOpt = None,
    train: TrainOpt = None,
    test: TestOpt = None,
    out: OutOpt = Path("results"),
    seeds: Annotated[Optional[int], typer.Option(min=1, max=COUNT_MAX, help="number of seeds (0..K-1); "
                                                 "default 5, or 20 with --online")] = None,
    n_clients: Annotated[int, typer.Option(min=1, max=COUNT_MAX, help="N, number of clients")] = 10,
    alpha: Annotated[float, typer.Option(callback=finite_option, min=1e-6, help="Dirichlet concentration of the task split")] = 0.6,
    routers: Annotated[Optional[str], typer.Option(help="comma-separated router kinds: mlp,kmeans (default both; "
                                                   "not with --online)")] = None,
    embedder: EmbedderOpt = "all-MiniLM-L6-v2",
    max_tokens: MaxTokensOpt = 256,
    cache_dir: CacheOpt = None,
    device: DeviceOpt = "cpu",
    threads: ThreadsOpt = DEFAULT_CPU_THREADS,
    online: Annotated[bool, typer.Option("--online", help="online replay: stream the train queries through logging "
                                         "policies (METRICS.md online protocol)")] = False,
    policies: Annotated[Optional[str], typer.Option(help="--online only: comma-separated logging policies "
                                                    "(default fixed,uniform,thompson,top_two)")] = None,
    passes: Annotated[Optional[float], typer.Option(callback=finite_option, min=1.0, help="--online only: stream length "
                                                    "in passes over the train queries (extra queries drawn with "
                                                    "replacement; default 1)")] = None,
    round_labels: Annotated[Optional[int], typer.Option(min=1, max=COUNT_MAX, help="--online only: labels between "
                                                        "federated statistics rounds (R; default 250)")] = None,
) -> None:
    """Run the federated simulation protocol (METRICS.md) and write results.json, results.md, curves.png
    (with --online: the online replay, results.json / results.md / online.png)."""
    wrong = {"--routers": routers} if online else {"--policies": policies, "--passes": passes, "--round-labels": round_labels}
    given = [name for name, value in wrong.items() if value is not None]
    if given:  # an option the run would not use: refused, not ignored
        raise typer.BadParameter(f"{', '.join(given)} {'does not go with' if online else 'only goes with'} --online")
    check_out_folder(out)  # before the heavy imports and any work
    claim_results(out, "simulate")
    _need_trainer()
    set_cpu_threads(threads)  # imports torch (trainer extra) when it runs
    from trainer.embeddings import EmbedderConfig  # trainer extra: `fedroute --help` works without it
    from trainer.experiments import run_simulation  # trainer extra: `fedroute --help` works without it

    if online:
        _simulate_online(data, train, test, out, seeds or 20, n_clients, alpha, policies, passes, round_labels,
                         EmbedderConfig(model=embedder, max_tokens=max_tokens, device=device), cache_dir, threads)
        return
    seeds = seeds or 5
    config = _config(n_clients, alpha, "mlp,kmeans" if routers is None else routers, device)
    train_t, test_t = _load_tables(data, train, test, n_clients)
    summary = run_simulation(
        train_t, test_t, out, config, range(seeds),
        EmbedderConfig(model=embedder, max_tokens=max_tokens, device=device), cache_dir,
    )
    typer.echo((out / "results.md").read_text())
    typer.echo(f"results: {out / 'results.json'}  ({summary['seconds']} s)")


def _simulate_online(data, train, test, out, seeds, n_clients, alpha, policies, passes, round_labels, embedder,
                     cache_dir, threads) -> None:
    from threadpoolctl import threadpool_limits  # scikit-learn's dependency (trainer extra)

    from trainer.online import OnlineConfig  # trainer extra: `fedroute --help` works without it
    from trainer.online_experiment import run_online_simulation  # trainer extra, as above

    given = {"passes": passes, "round_labels": round_labels}
    if policies is not None:
        given["policies"] = tuple(p.strip() for p in policies.split(",") if p.strip())
    try:  # OnlineConfig's defaults for the options not given
        config = OnlineConfig(**{k: v for k, v in given.items() if v is not None}, n_clients=n_clients, alpha=alpha)
    except InvalidInputError as exc:
        raise typer.BadParameter(str(exc)) from exc
    train_t, test_t = _load_tables(data, train, test, n_clients)
    with threadpool_limits(limits=threads):  # scikit-learn's K-means threads: 1 is fastest on a shared machine
        summary = run_online_simulation(train_t, test_t, out, config, range(seeds), embedder, cache_dir)
    typer.echo((out / "results.md").read_text())
    typer.echo(f"results: {out / 'results.json'}  ({summary['seconds']} s)")


@app.command()
def ablate(
    data: DataOpt = None,
    train: TrainOpt = None,
    test: TestOpt = None,
    out: OutOpt = Path("results/ablation"),
    seeds: SeedsOpt = 3,
    routers: RoutersOpt = "mlp,kmeans",
    embedder: EmbedderOpt = "all-MiniLM-L6-v2",
    max_tokens: MaxTokensOpt = 256,
    cache_dir: CacheOpt = None,
    device: DeviceOpt = "cpu",
    threads: ThreadsOpt = DEFAULT_CPU_THREADS,
) -> None:
    """N in {5, 10, 20, 40} and alpha in {0.03, 0.1, 0.6, 5.0} ablations into ablation.{json,md,png}."""
    check_out_folder(out)  # before the heavy imports and the hours of ablations
    _need_trainer()
    set_cpu_threads(threads)  # imports torch (trainer extra) when it runs
    from trainer.embeddings import EmbedderConfig  # trainer extra: `fedroute --help` works without it
    from trainer.experiments import ABLATION_N, run_ablation  # trainer extra: `fedroute --help` works without it

    config = _config(10, 0.6, routers, device)
    train_t, test_t = _load_tables(data, train, test, max(ABLATION_N), option="the ablation's N =")
    run_ablation(train_t, test_t, out, config, range(seeds),
                 EmbedderConfig(model=embedder, max_tokens=max_tokens, device=device), cache_dir)
    typer.echo((out / "ablation.md").read_text())


@app.command()
def keygen(
    # NonEmptyPath (PathCheckedGroup, sdk.cli_paths) refuses --out "" while the line is parsed
    out: Annotated[Path, typer.Option(help="folder for signing.key (private, mode 0600) and signing.pub")],
    force: Annotated[bool, typer.Option(help="replace an existing signing.key")] = False,
) -> None:
    """Create an Ed25519 key pair for signing bundles."""
    from export.signing import generate_keypair  # export: trainer extra (torch, onnx)

    private, public = generate_keypair(out, overwrite=force)
    typer.echo(f"wrote {private} (keep it secret) and {public} (ship it with the app)")


def _parse_prices(spec: Optional[Path]) -> dict:
    if spec is None:
        return {}
    shape = "JSON {model: {\"input\": USD per 1k tokens, \"output\": USD per 1k tokens}}"
    try:
        raw = json.loads(spec.read_text())
    except (OSError, ValueError) as exc:
        raise typer.BadParameter(f"--prices {spec}: expected {shape} ({exc})") from exc
    if not isinstance(raw, dict) or not all(isinstance(v, dict) for v in raw.values()):
        raise typer.BadParameter(f"--prices {spec}: expected {shape}")
    for model, entry in raw.items():
        extra = set(entry) - {"input", "output"}
        if extra:
            raise typer.BadParameter(f"--prices {spec}: {model!r} has unknown keys {sorted(extra)}; expected {shape}")
    return {str(m): (v.get("input"), v.get("output")) for m, v in raw.items()}


def _check_export_options(out: Path, signing_key: Path, router: Optional[Path], selector: Optional[Path],
                          precision: Optional[list[str]], data: Optional[Path], prices: Optional[Path],
                          bundle_version: Optional[int], prior_domain: Optional[str], parity_pairs: Optional[int] = None,
                          cache_dir: Optional[Path] = None, top_k: Optional[int] = None) -> dict:
    """Check ``fedroute export``'s options before torch is imported (so a typo fails at once); return the
    parsed ``--prices`` table ({} without it). Raises typer.BadParameter, InvalidInputError (``--out``) or
    ExportError (an existing ``--out``, ``--bundle-version``, ``--signing-key``)."""
    if (router is None) == (selector is None):
        raise typer.BadParameter("give exactly one of --router DIR and --selector DIR")
    if selector is not None:
        if prices is not None:
            raise typer.BadParameter("--prices is for router bundles (a selector has no model table)")
        if precision:
            raise typer.BadParameter("--precision is for router bundles (a selector takes --int8)")
        routed = is_fedprism_run(selector)
        if cache_dir is not None and not routed:
            raise typer.BadParameter("--cache-dir is for router bundles and routed FedPrism runs (a single selector export "
                                     "embeds nothing)")
        if not selector.is_dir():
            raise typer.BadParameter(f"--selector {selector} is not a folder; give a trained expert folder, e.g. "
                                     "RUN/fedprism_seed0/expert_2, or a FedPrism run folder (RUN/fedprism_seed0: "
                                     "prompt router + every expert)")
        if routed and prior_domain is not None:
            raise typer.BadParameter("--prior-domain is for one expert of a length_prior='domain' run, not a routed run")
        if top_k is not None and not routed:
            raise typer.BadParameter(f"--top-k is for a FedPrism run folder (router + experts); {selector} is not one")
    else:
        for option, value in (("--parity-pairs", parity_pairs), ("--prior-domain", prior_domain), ("--top-k", top_k)):
            if value is not None:
                raise typer.BadParameter(f"{option} is for --selector bundles; a router export checks parity on --data")
        unknown = sorted(set(precision or ()) - set(QUANTISED_PRECISIONS))
        if unknown:
            raise typer.BadParameter(f"--precision {', '.join(unknown)}: unknown; known: {sorted(QUANTISED_PRECISIONS)}")
        if not (router / "router.json").is_file():
            what = "holds no router.json" if router.is_dir() else "is not a folder"
            raise typer.BadParameter(f"--router {router} {what}; give the folder of a trained router, e.g. "
                                     "results/routers/kmeans")
    if data is not None and not data.exists():
        raise typer.BadParameter(f"--data {data} does not exist")
    table = _parse_prices(prices)
    load_signing_key(signing_key)
    check_out_folder(out, beside=True)
    check_replaceable(out)
    if bundle_version is not None:
        check_version(out, bundle_version)
    return table


@app.command("export")
def export_cmd(
    out: Annotated[Path, typer.Option(help="bundle folder to write (replaced atomically)")],
    signing_key: Annotated[Path, typer.Option(help="signing.key from `fedroute keygen`")],
    router: Annotated[Optional[Path], typer.Option(help="trained router folder, e.g. results/routers/kmeans")] = None,
    selector: Annotated[Optional[Path], typer.Option(help="a FedPrism run folder, RUN/fedprism_seed0 (prompt router + every expert, one bundle), or one expert folder, e.g. RUN/fedbis_seed0/expert_0 (instead of --router)")] = None,
    int8: Annotated[bool, typer.Option("--int8", help="also ship the int8 embedder / selector (the SDK's default when present)")] = False,
    precision: Annotated[Optional[list[str]], typer.Option("--precision", help="router bundles: quantised encoder to ship besides fp32, 'int8' or 'int8-all' (every MatMul int8; gated on decisions and AUC); repeatable")] = None,
    data: Annotated[Optional[Path], typer.Option(help="RouterBench folder or test file for parity checks (default: the one recorded at training); with --selector the shared data folder (default ../shared/data)")] = None,
    prices: Annotated[Optional[Path], typer.Option(help="JSON {model: {input: USD per 1k tokens, output: ...}} for the price table")] = None,
    bundle_version: Annotated[Optional[int], typer.Option(min=1, max=MAX_BUNDLE_VERSION, help="default: previous version at --out + 1")] = None,
    parity_pairs: Annotated[Optional[int], typer.Option(min=1, max=COUNT_MAX, help="--selector: real held-out pairs for the parity check (default 200)")] = None,
    prior_domain: Annotated[Optional[str], typer.Option(help="--selector of a length_prior='domain' run: the domain whose length prior is folded in")] = None,
    top_k: Annotated[Optional[int], typer.Option(min=1, max=COUNT_MAX, help="--selector RUN/fedprism_seed0: ship the K experts the router sends most validation prompts to (default: all)")] = None,
    cache_dir: CacheOpt = None,
) -> None:
    """Compile a trained router (or a preference selector) into a signed, parity-checked bundle for the SDK."""
    price_table = _check_export_options(out, signing_key, router, selector, precision, data, prices, bundle_version,
                                        prior_domain, parity_pairs, cache_dir, top_k)
    _need_trainer()
    if selector is not None and is_fedprism_run(selector):
        from export.routed_selector_export import export_routed_selector_bundle  # export: trainer extra (torch, onnx)

        data = data or Path("../shared/data")
        pairs = run_pairs(selector, data, "test", parity_pairs or 200)
        prompts = None
        if top_k is not None:
            splits = json.loads((selector / "splits.json").read_text())
            prompts = run_pairs(selector, data, "val" if splits.get("val") else "public", None).drop_duplicates("prompt_id")
            prompts = prompts["prompt"].tolist()
        try:
            result = export_routed_selector_bundle(selector, out, signing_key, pairs, int8=int8, top_k=top_k,
                                                   top_k_prompts=prompts, bundle_version=bundle_version,
                                                   cache_dir=cache_dir, progress=typer.echo)
        except ParityError as exc:
            typer.echo("parity report: " + json.dumps(exc.report), err=True)
            raise
        sel = result["manifest"]["selector"]
        typer.echo(f"routed selector bundle v{result['manifest']['bundle_version']} (experts {sel['experts']} of "
                   f"{sel['n_experts']}, {sorted(sel['files'])}) at {out}; parity passed: "
                   + json.dumps({k: v for k, v in result["parity"].items() if k in ("fp32", "int8", "n_pairs", "torch_accuracy")}))
        return
    if selector is not None:
        data = data or Path("../shared/data")
        pairs = parity_pairs_for(selector, data, parity_pairs or 200)
        try:
            result = export_selector_bundle(selector, out, signing_key, pairs, int8=int8,
                                            bundle_version=bundle_version, prior_domain=prior_domain,
                                            validation=validation_for(selector.parent, data), progress=typer.echo)
        except ParityError as exc:
            typer.echo("parity report: " + json.dumps(exc.report), err=True)
            raise
        sel = result.manifest["selector"]
        typer.echo(f"selector bundle v{result.manifest['bundle_version']} ({sel['name']}, {sorted(sel['files'])}) "
                   f"at {result.out}; parity passed: " + json.dumps({k: v for k, v in result.parity.items()
                                                                     if k in ("fp32", "int8", "n_pairs")}))
        return
    from export.pipeline import export_bundle  # export: trainer extra (torch, onnx)

    result = export_bundle(router, out, signing_key, int8=int8, precisions=tuple(precision or ()), data=data,
                           bundle_version=bundle_version,
                           prices=price_table, cache_dir=cache_dir, progress=typer.echo)
    typer.echo(f"bundle v{result.manifest['bundle_version']} ({result.manifest['router_kind']}, "
               f"{len(result.manifest['models'])} models, embedder {sorted(result.manifest['embedder']['files'])}) "
               f"at {result.out}; parity passed")


def _register_server_commands() -> None:
    # This is the console-script module at the top (ARCHITECTURE.md §2): the only one that imports
    # sdk, trainer and export, and it hands export's publishing to the server.
    from export.publish import BundlePublisher
    from sdk.sync_cli import make_sync_command  # sdk (httpx), with the sync command
    from trainer.federated.mlp_local import train_on_log  # trainer extra: `fedroute --help` works without it
    from trainer.server.cli import register  # typer commands; the server extra is imported inside them

    from trainer.demo_log import demo_log  # sdk.Router + the RouterBench loader
    from trainer.online_offpolicy import offpolicy  # sdk.Router + sdk.EvalLog

    register(app, publisher=BundlePublisher())
    app.command("sync")(make_sync_command(mlp_trainer=train_on_log))
    app.command("demo-log")(demo_log)
    app.command("offpolicy")(offpolicy)


_register_server_commands()


def _register_mor_commands() -> None:
    """``fedroute mor train|eval|audit|grpo|export``, registered here so that trainer.rewards imports neither alignment nor export."""
    from export.reward_cli import register as register_reward_export  # sub-app registered by the console-script module (ARCHITECTURE.md §2)
    from trainer.alignment.grpo_cli import register as register_grpo  # sub-app registered by the console-script module (ARCHITECTURE.md §2)
    from trainer.rewards.cli import app as mor_app  # sub-app registered by the console-script module (ARCHITECTURE.md §2)

    register_grpo(mor_app)
    register_reward_export(mor_app)
    app.add_typer(mor_app, name="mor")


_register_mor_commands()


def _register_prism_commands() -> None:
    from trainer.experts.cli import app as prism_app  # sub-app registered by the console-script module (ARCHITECTURE.md §2)

    app.add_typer(prism_app, name="prism")


_register_prism_commands()


def _register_vpa_commands() -> None:
    """``fedroute vpa train|export``, registered here so that trainer.vpa does not import export."""
    from export.vpa_cli import register as register_vpa_export  # sub-app registered by the console-script module (ARCHITECTURE.md §2)
    from trainer.vpa.cli import app as vpa_app  # typer only; torch is imported when the command runs

    register_vpa_export(vpa_app)
    app.add_typer(vpa_app, name="vpa")


_register_vpa_commands()


def _register_add_model_command() -> None:
    from trainer.add_model_cli import add_model_command  # the command module imports torch only when it runs

    app.command("add-model")(add_model_command)


_register_add_model_command()


def _register_proxy_command() -> None:
    from sdk.proxy.cli import proxy  # typer only; the proxy extra is imported when the command runs

    app.command("proxy")(proxy)


_register_proxy_command()


def main() -> None:
    """Console-script entry point: errors of ours print one line and exit 2, not a traceback."""
    run_app(app)


if __name__ == "__main__":
    main()
