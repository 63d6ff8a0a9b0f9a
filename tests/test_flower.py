"""Federated K-means on Flower (trainer.federated.flower_app): a Ray simulation of 3 nodes whose EvalLogs
hold real RouterBench rows and MiniLM embeddings of their prompts must give exactly the pooled
statistics and the centralised Lloyd step; the wire format round-trips and bad replies are refused."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

pytest.importorskip("flwr")

from flwr.app import ConfigRecord, Context, Error, Message, MessageType, MetricRecord, RecordDict  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402
from flwr.serverapp import Grid  # noqa: E402

from sdk.cell_statistics import CellStatistics  # noqa: E402
from sdk.errors import InvalidInputError, PrivacyError, ShapeError  # noqa: E402
from sdk.eval_log import EvalLog  # noqa: E402
from sdk.local_update import KMeansUpdate, RoundSpec, centroid_threshold, centroids_hash  # noqa: E402
from sdk.voronoi import nearest_cell  # noqa: E402
from trainer.federated.flower_app import (  # noqa: E402
    UPDATE_ARRAYS,
    FederatedKMeansStrategy,
    centroids_record,
    client_update,
    make_client_app,
    make_server_app,
    round_spec_from_message,
    update_from_ndarrays,
    update_from_record,
    update_to_ndarrays,
    update_to_record,
)
from trainer.federated.gaussian_privacy import gaussian_epsilon  # noqa: E402
from trainer.federated.kmeans_aggregation import AggregationConfig, aggregate_kmeans  # noqa: E402
from trainer.routers.kmeans_router import KMeansRouter  # noqa: E402

N_CLIENTS = 3
EMBEDDER = "all-MiniLM-L6-v2"


# ------------------------------------------------------------------ real sparse logs


@pytest.fixture(scope="module")
def logs(fitted_routers, tmp_path_factory):
    """Three EvalLogs of real RouterBench test rows (one model per query, a client-specific skewed
    model mix, clients split by task) with MiniLM embeddings of the real prompts, plus one row
    without an embedding (skipped by the protocol). Returns the paths and the pooled columns."""
    table, emb = fitted_routers["test"], fitted_routers["test_embeddings"]
    rng = np.random.default_rng(7)
    order = np.argsort(table.tasks.astype(str), kind="stable")
    parts = np.array_split(order, N_CLIENTS)
    out = tmp_path_factory.mktemp("flower-logs")
    paths, pooled = {}, {"client": [], "embedding": [], "model": [], "score": [], "cost": []}
    for c, rows in enumerate(parts):
        mix = rng.dirichlet(np.full(len(table.models), 0.6))
        models = rng.choice(len(table.models), size=rows.size, p=mix)
        paths[c] = out / f"client{c}.sqlite"
        with EvalLog(paths[c], table.models) as log:
            for i, m in zip(rows, models):
                log.record(table.models[m], float(table.accuracy[i, m]), float(table.cost[i, m]), embedding=emb[i],
                           query=table.prompts[i])  # dropped: store_text is off
            log.record(table.models[0], 1.0, 0.01, cell=0)  # no embedding: not part of any update
        pooled["client"] += [c] * rows.size
        pooled["embedding"].append(emb[rows])
        pooled["model"].append(models)
        pooled["score"].append(table.accuracy[rows, models])
        pooled["cost"].append(table.cost[rows, models])
    pooled = {k: np.asarray(v) if k == "client" else np.concatenate(v) for k, v in pooled.items()}
    return {"paths": paths, "models": table.models, **pooled}


def pooled_statistics(logs, centroids) -> CellStatistics:
    cells = nearest_cell(logs["embedding"], centroids)
    return CellStatistics.from_samples(cells, logs["model"], logs["score"], logs["cost"], len(centroids),
                                       len(logs["models"]))


def centralised_lloyd_step(logs, centroids) -> np.ndarray:
    """One Lloyd step on the pooled embeddings (a cell with no query keeps its centroid)."""
    x = logs["embedding"].astype(np.float64)
    cells = nearest_cell(x, centroids)
    out = np.asarray(centroids, dtype=np.float64).copy()
    for k in np.unique(cells):
        out[k] = x[cells == k].mean(axis=0)
    return out.astype(np.float32)


def smallest_client_cell(logs, centroids) -> int:
    """Fewest queries of one client in one non-empty cell (a device reports no mean of fewer than 2)."""
    group = logs["client"] * len(centroids) + nearest_cell(logs["embedding"], centroids)
    sizes = np.bincount(group)
    return int(sizes[sizes > 0].min())


def seed_centroids(logs, k: int = 4) -> np.ndarray:
    """k of the logged real embeddings, evenly spaced, as initial centroids."""
    return logs["embedding"][:: len(logs["embedding"]) // k][:k]


# ------------------------------------------------------------------ the Flower simulation


def test_flower_simulation_gives_the_pooled_statistics_and_the_centralised_lloyd_step(
        logs, fitted_routers, monkeypatch):
    pytest.importorskip("ray")
    from flwr.simulation import run_simulation

    for name in ("flwr.supercore.telemetry", "flwr.common.telemetry"):  # hermetic: no usage events sent
        if hasattr(sys.modules.get(name), "FLWR_TELEMETRY_ENABLED"):
            monkeypatch.setattr(sys.modules[name], "FLWR_TELEMETRY_ENABLED", "0")
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    monkeypatch.setenv("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")  # silences a FutureWarning; no GPU used
    c0 = fitted_routers["kmeans"].centroids_  # 6 cells fitted on real train prompts
    strategy = FederatedKMeansStrategy(logs["models"], EMBEDDER, min_count=1, centroid_rounds=1,
                                       min_train_nodes=N_CLIENTS, min_available_nodes=N_CLIENTS,
                                       rng=np.random.default_rng(0))
    run_simulation(
        make_server_app(strategy, c0, num_rounds=2, timeout=900.0),
        make_client_app(logs["paths"]),
        num_supernodes=N_CLIENTS,
        # Ray on one CPU: one actor (a Python process importing the client app) runs the nodes in turn
        backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                        "init_args": {"num_cpus": 1, "include_dashboard": False}},
    )

    assert strategy.rejected_ == []
    assert len(strategy.clients_) == N_CLIENTS and strategy.n_aggregates_ == 2
    # With min_count=1 a device holds back only single-query cell means; these logs have none, so
    # the federated step must equal the pooled one exactly.
    assert smallest_client_cell(logs, c0) >= 2 and smallest_client_cell(logs, strategy.centroids_) >= 2
    # Round 1 moved the centroids by one Lloyd step; round 2 kept them and merged statistics.
    c1 = centralised_lloyd_step(logs, c0)
    assert np.abs(c1 - c0).max() > 1e-2
    np.testing.assert_allclose(strategy.centroids_, c1, rtol=0, atol=1e-6)
    expected = pooled_statistics(logs, strategy.centroids_)
    for name in ("count", "sum_accuracy", "sum_cost"):
        np.testing.assert_allclose(getattr(strategy.statistics_, name), getattr(expected, name), rtol=1e-12, atol=0)
    assert strategy.statistics_.count.sum() == len(logs["model"])  # every embedded row, none twice
    np.testing.assert_allclose(strategy.next_centroids_, centralised_lloyd_step(logs, strategy.centroids_),
                               rtol=0, atol=1e-6)
    # Only aggregates left the devices: cell means of >= 2 queries, never a single embedding.
    for _, update in strategy.latest_updates_.values():
        assert update.local_weights.min() >= centroid_threshold(1)
        gaps = np.linalg.norm(update.local_centroids[:, None] - logs["embedding"][None], axis=-1)
        assert gaps.min() > 1e-4
    # The router built from the merge predicts as the centralised router on the same cells.
    identity = fitted_routers["kmeans"].embedder
    router = strategy.to_router(prior_strength=16.0, model_prior_strength=10.0, embedder=identity)
    central = KMeansRouter(strategy.centroids_, expected, logs["models"], 16.0, 10.0)
    for got, want in zip(router.predict(logs["embedding"]), central.predict(logs["embedding"])):
        np.testing.assert_allclose(got, want, rtol=1e-12)
    assert router.embedder == identity


# ------------------------------------------------------------------ Flower's deployment engine


def free_ports(n: int) -> list[int]:
    """``n`` distinct free TCP ports of 127.0.0.1 (bound together, then released)."""
    import socket

    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def test_flwr_run_on_a_superlink_and_two_supernodes_gives_the_pooled_statistics(logs, fitted_routers, tmp_path):
    """The Flower App of pyproject.toml ([tool.flwr.app]: trainer.federated.flower_deploy) under Flower's
    deployment engine: a SuperLink and two SuperNodes on 127.0.0.1 (insecure: the docs show TLS and node
    authentication), each node with its EvalLog of real rows in --node-config, and `flwr run` of this
    repository. The merged router it writes holds exactly the two nodes' pooled statistics, on centroids
    one centralised Lloyd step from the prior router's (centroid-rounds = 1 of 2 rounds)."""
    import os
    import shutil
    import signal
    import socket
    import subprocess
    import time
    from pathlib import Path

    from trainer.federated.flower_deploy import SUMMARY_FILE

    root = Path(__file__).resolve().parents[1]
    bin_dir = Path(sys.executable).parent
    tools = {name: shutil.which(name, path=str(bin_dir)) or shutil.which(name)
             for name in ("flower-superlink", "flower-supernode", "flwr")}
    assert all(tools.values()), tools
    home = tmp_path / "flwr-home"  # Flower's config and installed apps: never the user's ~/.flwr
    env = {**os.environ, "FLWR_HOME": str(home), "FLWR_TELEMETRY_ENABLED": "0",
           "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": os.pathsep.join([str(root), *filter(None, [os.environ.get("PYTHONPATH")])])}
    fleet, appio, control, node_a, node_b = free_ports(5)
    nodes = (0, 1)  # two of the three clients' logs
    processes: list[subprocess.Popen] = []
    log_files = []

    def start(name: str, *args: str) -> None:
        log = open(tmp_path / f"{name}.log", "w")
        log_files.append(log)
        processes.append(subprocess.Popen([*args], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path,
                                          start_new_session=True))

    def tail() -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(tmp_path.glob("*.log")))

    out = tmp_path / "merged"
    try:
        start("superlink", tools["flower-superlink"], "--insecure", "--disable-runtime-dependency-installation",
              "--fleet-api-address", f"127.0.0.1:{fleet}", "--serverappio-api-address", f"127.0.0.1:{appio}",
              "--control-api-address", f"127.0.0.1:{control}")
        for c, port in zip(nodes, (node_a, node_b)):
            start(f"supernode-{c}", tools["flower-supernode"], "--insecure", "--superlink", f"127.0.0.1:{fleet}",
                  "--clientappio-api-address", f"127.0.0.1:{port}",
                  "--node-config", f'eval-log="{logs["paths"][c]}"')
        home.mkdir()
        (home / "config.toml").write_text(f'[superlink]\ndefault = "local"\n\n[superlink.local]\n'
                                          f'address = "127.0.0.1:{control}"\ninsecure = true\n')
        run_config = (f'prior-router="{fitted_routers["dir"] / "kmeans"}" out="{out}" num-server-rounds=2 '
                      f"centroid-rounds=1 min-nodes=2 min-count=1 round-timeout-s=600.0")
        deadline = time.monotonic() + 300
        while True:  # flwr run needs the SuperLink's Control API up (the SuperNodes retry on their own)
            try:
                socket.create_connection(("127.0.0.1", control), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline and processes[0].poll() is None, tail()
                time.sleep(0.5)
        # --stream: follows the ServerApp's log and returns when the run ends
        run = subprocess.run([tools["flwr"], "run", str(root), "local", "--run-config", run_config, "--stream"],
                             env=env, cwd=tmp_path, capture_output=True, text=True, timeout=900)
        assert run.returncode == 0 and (out / SUMMARY_FILE).exists(), \
            f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}\n{tail()}"
    finally:  # each process leads its own group: its flower-superexec children go with it
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process in processes:
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        for log in log_files:
            log.close()

    summary = json.loads((out / SUMMARY_FILE).read_text())
    assert len(summary["nodes"]) == 2 and summary["aggregates"] == 2 and summary["rejected"] == [], summary
    mask = np.isin(logs["client"], nodes)
    two = {k: (v[mask] if k in ("client", "embedding", "model", "score", "cost") else v) for k, v in logs.items()}
    c0 = fitted_routers["kmeans"].centroids_
    merged = KMeansRouter.load(out)
    assert smallest_client_cell(two, c0) >= 2 and smallest_client_cell(two, merged.centroids_) >= 2
    c1 = centralised_lloyd_step(two, c0)
    assert np.abs(c1 - c0).max() > 1e-2  # round 1 moved the centroids
    np.testing.assert_allclose(merged.centroids_, c1, rtol=0, atol=1e-6)
    expected = pooled_statistics(two, merged.centroids_)
    for name in ("count", "sum_accuracy", "sum_cost"):
        np.testing.assert_allclose(getattr(merged.statistics_, name), getattr(expected, name), rtol=1e-12, atol=0)
    assert merged.statistics_.count.sum() == summary["queries"] == mask.sum()
    assert json.loads((out / "router.json").read_text())["embedder"] == fitted_routers["kmeans"].embedder


GOOD_RUN_CONFIG = {"prior-router": "r", "out": "o", "num-server-rounds": 2, "centroid-rounds": 1, "min-nodes": 2,
                   "min-count": 5, "round-timeout-s": 60.0}


@pytest.mark.parametrize("key, value, message", [
    ("prior-router", "", "'prior-router' must name a folder"), ("out", " ", "'out' must name a folder"),
    ("num-server-rounds", 0, "'num-server-rounds' must be an int >= 1"),
    ("centroid-rounds", True, "'centroid-rounds' must be an int >= 0"), ("min-nodes", 1.5, "'min-nodes' must be"),
    ("min-count", 0, "'min-count' must be an int >= 1"), ("round-timeout-s", 0.0, "'round-timeout-s' must be > 0"),
])
def test_the_flower_apps_run_config_is_checked_before_any_round(key, value, message):
    """pyproject's [tool.flwr.app.config] leaves prior-router and out empty: a run that does not set them
    stops with the key named, before the strategy starts."""
    from trainer.federated.flower_deploy import DeployConfig

    config = DeployConfig.from_run_config(GOOD_RUN_CONFIG)
    assert (config.num_server_rounds, config.min_nodes, config.round_timeout_s) == (2, 2, 60.0)
    with pytest.raises(InvalidInputError, match=message):
        DeployConfig.from_run_config({**GOOD_RUN_CONFIG, key: value})


def test_pyprojects_flower_app_names_the_deployment_components():
    """[tool.flwr.app] as `flwr run` reads it: the components resolve to the deployment module's apps,
    and the run config's defaults pass DeployConfig once the two folders are given."""
    import tomllib
    from pathlib import Path

    from flwr.clientapp import ClientApp
    from flwr.serverapp import ServerApp

    from trainer.federated import flower_deploy

    app = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["tool"]["flwr"]["app"]
    assert app["components"] == {"serverapp": "trainer.federated.flower_deploy:server_app",
                                 "clientapp": "trainer.federated.flower_deploy:client_app"}
    assert isinstance(flower_deploy.server_app, ServerApp) and isinstance(flower_deploy.client_app, ClientApp)
    config = flower_deploy.DeployConfig.from_run_config({**app["config"], "prior-router": "r", "out": "o"})
    assert (config.num_server_rounds, config.centroid_rounds, config.min_count) == (2, 1, 5)


# ------------------------------------------------------------------ in process, without Ray


class InProcessGrid(Grid):
    """Delivers each message to a real ClientApp in this process (Flower's own Message path, no
    transport); nodes in ``absent`` do not answer."""

    def __init__(self, client_app, n_nodes: int, absent=()):
        self.app, self.absent = client_app, set(absent)
        self.contexts = {100 + i: Context(run_id=1, node_id=100 + i, node_config={"partition-id": i},
                                          state=RecordDict(), run_config={}) for i in range(n_nodes)}

    def set_run(self, run):  # pragma: no cover - not used by Strategy.start
        raise NotImplementedError

    @property
    def run(self):  # pragma: no cover
        raise NotImplementedError

    def create_message(self, *args, **kwargs):  # pragma: no cover
        raise NotImplementedError

    def get_node_ids(self):
        return list(self.contexts)

    def push_messages(self, messages):  # pragma: no cover
        raise NotImplementedError

    def pull_messages(self, message_ids):  # pragma: no cover
        raise NotImplementedError

    def send_and_receive(self, messages, *, timeout=None):
        return [self.app(m, self.contexts[m.metadata.dst_node_id]) for m in messages
                if m.metadata.dst_node_id not in self.absent]


def test_a_node_that_misses_a_round_keeps_its_latest_update(logs, tmp_path):
    c0 = seed_centroids(logs)
    paths = {c: tmp_path / f"c{c}.sqlite" for c in range(N_CLIENTS)}
    for c, src in logs["paths"].items():
        paths[c].write_bytes(src.read_bytes())
    strategy = FederatedKMeansStrategy(logs["models"], EMBEDDER, min_count=1, centroid_rounds=0,
                                       rng=np.random.default_rng(0))
    app = make_client_app(paths)
    strategy.start(grid=InProcessGrid(app, N_CLIENTS), initial_arrays=centroids_record(c0), num_rounds=1)
    first = strategy.statistics_
    # Node 0 logs more, then node 2 misses the next round: its round-1 update stays in the merge.
    extra = logs["embedding"][logs["client"] == 1][:5]
    with EvalLog(paths[0], logs["models"]) as log:
        for e in extra:
            log.record(logs["models"][1], 1.0, 0.5, embedding=e)
    strategy.start(grid=InProcessGrid(app, N_CLIENTS, absent={102}), initial_arrays=centroids_record(c0), num_rounds=1)

    assert strategy.clients_ == ("100", "101", "102")
    cells = nearest_cell(extra, c0)
    added = CellStatistics.from_samples(cells, np.ones(5, dtype=np.int64), np.ones(5), np.full(5, 0.5), len(c0),
                                        len(logs["models"]))
    np.testing.assert_allclose(strategy.statistics_.count, pooled_statistics(logs, c0).count + added.count)
    np.testing.assert_allclose(strategy.statistics_.sum_cost, first.sum_cost + added.sum_cost, rtol=1e-12)
    np.testing.assert_array_equal(strategy.centroids_, c0)  # centroid_rounds=0: the partition never moves


def test_a_failing_or_stale_reply_is_dropped_and_listed(logs, tmp_path):
    c0 = seed_centroids(logs)
    paths = dict(logs["paths"])
    paths[2] = tmp_path / "missing.sqlite"  # node 102 has no log: Flower error reply
    strategy = FederatedKMeansStrategy(logs["models"], EMBEDDER, rng=np.random.default_rng(0))
    app = make_client_app(paths)

    class ErrorGrid(InProcessGrid):
        def send_and_receive(self, messages, *, timeout=None):
            out = []
            for m in messages:
                try:
                    out.append(self.app(m, self.contexts[m.metadata.dst_node_id]))
                except Exception as exc:  # what Flower's runtime turns into an error reply
                    out.append(Message(Error(code=0, reason=str(exc)), reply_to=m))
            return out

    strategy.start(grid=ErrorGrid(app, N_CLIENTS), initial_arrays=centroids_record(c0), num_rounds=1)
    assert strategy.clients_ == ("100", "101")
    assert [(r.client_id, "no evaluation log" in r.reason) for r in strategy.rejected_] == [("102", True)]

    # A reply computed for other centroids is refused, not merged.
    spec_hash = "0" * 64
    update = strategy.latest_updates_["100"][1]
    instruction = Message(RecordDict(), dst_node_id=100, message_type=MessageType.TRAIN)
    strategy.configure_train(2, centroids_record(c0), ConfigRecord(), InProcessGrid(app, N_CLIENTS))
    strategy.aggregate_train(2, [Message(update_to_record(update, spec_hash), reply_to=instruction)])
    assert strategy.rejected_[-1].client_id == "100" and "centroids" in strategy.rejected_[-1].reason


def test_the_strategy_applies_the_aggregation_options_as_the_pure_function(logs):
    c0 = seed_centroids(logs)
    config = AggregationConfig(clip_count=20.0, max_cost_usd=0.05, trim_fraction=0.34)
    strategy = FederatedKMeansStrategy(logs["models"], EMBEDDER, min_count=1, aggregation=config, centroid_rounds=0,
                                       rng=np.random.default_rng(0))
    strategy.start(grid=InProcessGrid(make_client_app(logs["paths"]), N_CLIENTS),
                   initial_arrays=centroids_record(c0), num_rounds=1)

    spec = RoundSpec(1, "kmeans", c0, centroids_hash(c0), tuple(logs["models"]), EMBEDDER, c0.shape[1], 1, "",
                     max_cost_usd=config.max_cost_usd)  # the nodes clip each cost to the round's bound
    updates = {str(100 + c): client_update(path, spec) for c, path in logs["paths"].items()}
    assert min(u.log_size for u in updates.values()) > config.clip_count  # clipping is at work
    expected = aggregate_kmeans(c0, updates, config, np.random.default_rng(0))
    for name in ("count", "sum_accuracy", "sum_cost"):
        np.testing.assert_array_equal(getattr(strategy.statistics_, name), getattr(expected.statistics, name))
    np.testing.assert_array_equal(strategy.next_centroids_, expected.next_centroids)


def toy_log(path) -> np.ndarray:
    """An EvalLog of 4 rows on 2 unit embeddings, costs 0.02, 0.30 (cell 0, model a) and 0.50, 0.05
    (cell 1, model b) USD; returns the centroids (the two embeddings)."""
    with EvalLog(path, ("a", "b")) as log:
        for emb, model, score, cost in (((1, 0), "a", 1.0, 0.02), ((1, 0), "a", 0.0, 0.30),
                                        ((0, 1), "b", 1.0, 0.50), ((0, 1), "b", 0.5, 0.05)):
            log.record(model, score, cost, embedding=np.array(emb, dtype=np.float32))
    return np.eye(2, dtype=np.float32)


@pytest.mark.parametrize("max_cost_usd, sum_cost", [
    (0.1, [[0.02 + 0.1, 0.0], [0.0, 0.1 + 0.05]]),  # 0.30 and 0.50 clipped to the bound
    (None, [[0.02 + 0.30, 0.0], [0.0, 0.50 + 0.05]]),  # no bound: the logged costs
])
def test_the_nodes_clip_each_cost_to_the_rounds_max_cost_usd(tmp_path, max_cost_usd, sum_cost):
    """The strategy's max_cost_usd bounded only its aggregation: the train message did not carry it,
    so a Flower node summed its logged costs unclipped, unlike a device of the HTTPS server
    (sdk.local_update.kmeans_update, docs/protocol.md section 2). Now the round config carries
    ``max-cost-usd`` and the node clips each cost to it. Hand-computed sums."""
    c0 = toy_log(tmp_path / "node.sqlite")
    config = AggregationConfig(max_cost_usd=max_cost_usd)  # no clip_count: the merge itself changes nothing
    strategy = FederatedKMeansStrategy(("a", "b"), "toy", min_count=1, aggregation=config, centroid_rounds=0,
                                       rng=np.random.default_rng(0))
    grid = InProcessGrid(make_client_app({0: tmp_path / "node.sqlite"}), 1)
    [message] = strategy.configure_train(1, centroids_record(c0), ConfigRecord(), grid)
    assert round_spec_from_message(message).max_cost_usd == max_cost_usd
    assert ("max-cost-usd" in message.content.config_records["config"]) == (max_cost_usd is not None)

    strategy.start(grid=grid, initial_arrays=centroids_record(c0), num_rounds=1)
    assert strategy.rejected_ == []
    node_update = strategy.latest_updates_["100"][1]  # as the node sent it
    np.testing.assert_allclose(node_update.statistics.sum_cost, sum_cost, rtol=1e-12, atol=0)
    np.testing.assert_allclose(strategy.statistics_.sum_cost, sum_cost, rtol=1e-12, atol=0)
    np.testing.assert_array_equal(strategy.statistics_.count, [[2, 0], [0, 2]])
    np.testing.assert_allclose(strategy.statistics_.sum_accuracy, [[1.0, 0.0], [0.0, 1.5]])


def unclipping_client_app(log_paths) -> ClientApp:
    """A buggy or hostile node: answers with the update of its log computed without the round's
    max-cost-usd (costs summed unclipped), through Flower's own Message path."""
    from dataclasses import replace

    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        spec = round_spec_from_message(msg)
        update = client_update(log_paths[int(context.node_config["partition-id"])], replace(spec, max_cost_usd=None))
        return Message(update_to_record(update, spec.centroids_hash), reply_to=msg)

    return app


def test_a_reply_above_the_rounds_max_cost_usd_is_refused_and_the_round_goes_on(tmp_path):
    """The strategy checked shapes and the privacy threshold but not costs: a node that did not clip
    (costs of 0.30 and 0.50 USD in a round bounded at 0.1 USD per query) was merged as it came, while
    the HTTPS server answers 422 to the same update. The strategy now applies the server's rule
    (trainer.federated.update_checks.check_kmeans_update): the reply is dropped and listed with its
    reason, and the honest node's update alone is aggregated."""
    c0 = toy_log(tmp_path / "honest.sqlite")
    toy_log(tmp_path / "hostile.sqlite")
    paths = {0: tmp_path / "honest.sqlite", 1: tmp_path / "hostile.sqlite"}
    honest, hostile = make_client_app(paths), unclipping_client_app(paths)

    class MixedGrid(InProcessGrid):  # node 100 honest, node 101 sends unclipped costs
        def send_and_receive(self, messages, *, timeout=None):
            return [(honest if m.metadata.dst_node_id == 100 else hostile)(m, self.contexts[m.metadata.dst_node_id])
                    for m in messages]

    strategy = FederatedKMeansStrategy(("a", "b"), "toy", min_count=1, aggregation=AggregationConfig(max_cost_usd=0.1),
                                       centroid_rounds=0, rng=np.random.default_rng(0))
    strategy.start(grid=MixedGrid(honest, 2), initial_arrays=centroids_record(c0), num_rounds=1)
    assert [(r.server_round, r.client_id, r.reason) for r in strategy.rejected_] == [
        (1, "101", "sum_cost: is above 0.1 USD per query (entry [0, 0]: 0.32 USD for 2 queries)")]
    assert strategy.clients_ == ("100",) and set(strategy.latest_updates_) == {"100"}
    np.testing.assert_allclose(strategy.statistics_.sum_cost, [[0.02 + 0.1, 0.0], [0.0, 0.1 + 0.05]], rtol=1e-12)
    np.testing.assert_array_equal(strategy.statistics_.count, [[2, 0], [0, 2]])


def test_an_honest_node_whose_clipped_costs_sum_above_the_bound_by_rounding_is_kept(tmp_path):
    """Ten queries clipped to 0.03 USD sum to 0.03 * 10 + 5.6e-17 in float64: the exact comparison of the
    HTTPS server refused such an honest device, and the shared check would have refused it here too.
    The bound has a relative slack of 1e-9 (update_checks.COST_BOUND_RTOL)."""
    with EvalLog(tmp_path / "node.sqlite", ("a", "b")) as log:
        for _ in range(10):
            log.record("a", 1.0, 0.05, embedding=np.array([1.0, 0.0], dtype=np.float32))
    c0 = np.eye(2, dtype=np.float32)
    strategy = FederatedKMeansStrategy(("a", "b"), "toy", aggregation=AggregationConfig(max_cost_usd=0.03),
                                       centroid_rounds=0, rng=np.random.default_rng(0))
    strategy.start(grid=InProcessGrid(make_client_app({0: tmp_path / "node.sqlite"}), 1),
                   initial_arrays=centroids_record(c0), num_rounds=1)
    assert strategy.rejected_ == []
    sent = strategy.statistics_.sum_cost[0, 0]
    assert sent > 10 * 0.03 and sent == pytest.approx(0.3, rel=1e-15)  # above n * bound, by rounding only


def test_an_update_that_reports_nothing_is_refused_and_keeps_the_nodes_latest_update(tmp_path):
    """The HTTPS server answers 422 to an update with every count 0 and no cell mean ("reports nothing"),
    but the strategy kept it: a node with an empty log counted as a client of the aggregate and, in a
    later round, replaced its own earlier statistics with nothing. The refusal now lives in the shared
    validator (update_checks.check_kmeans_update): the reply is dropped, listed, and the earlier update stays."""
    c0 = toy_log(tmp_path / "a.sqlite")
    toy_log(tmp_path / "b.sqlite")
    paths = {0: tmp_path / "a.sqlite", 1: tmp_path / "b.sqlite"}
    strategy = FederatedKMeansStrategy(("a", "b"), "toy", min_count=1, centroid_rounds=0, rng=np.random.default_rng(0))
    strategy.start(grid=InProcessGrid(make_client_app(paths), 2), initial_arrays=centroids_record(c0), num_rounds=1)
    assert strategy.clients_ == ("100", "101") and strategy.rejected_ == []
    EvalLog(tmp_path / "empty.sqlite", ("a", "b")).close()  # an empty log
    paths[1] = tmp_path / "empty.sqlite"  # node 101's log is now empty
    strategy.start(grid=InProcessGrid(make_client_app(paths), 2), initial_arrays=centroids_record(c0), num_rounds=1)
    assert [(r.server_round, r.client_id, r.reason) for r in strategy.rejected_] == [
        (1, "101", "count: the update reports nothing (no evaluation above min_count): do not upload it")]
    assert strategy.latest_updates_["101"][1].log_size == 4  # its round-1 statistics, not the empty reply
    np.testing.assert_array_equal(strategy.statistics_.count, [[4, 0], [0, 4]])


def _reply(node: int, content: RecordDict) -> Message:
    return Message(content, reply_to=Message(RecordDict(), dst_node_id=node, message_type=MessageType.TRAIN))


def _w(*values) -> dict:
    return {"w": np.array(values, dtype=np.float32)}


def _prism_reply(node, experts, n, router=None, n_router=0.0, needs=(0,)):
    from trainer.experts.flower_strategy import pack

    metrics = {f"n-expert-{k}": float(n) for k in experts}
    metrics["n-router"] = float(n_router)
    return _reply(node, RecordDict({"arrays": pack(experts, router), "metrics": MetricRecord(metrics),
                                    "config": ConfigRecord({"needs": list(needs)})}))


# Node 1 sends expert 0 = (1, 1) from 3 samples; node 2's reply is bad. Expected: node 2 dropped with the reason.
PRISM_BAD_REPLIES = {
    "zero samples": (_prism_reply(2, {0: _w(9, 9)}, 0), "the reply used no sample"),
    "no expert, no router": (_prism_reply(2, {}, 0), "the reply used no sample"),
    "negative samples": (_prism_reply(2, {0: _w(9, 9)}, -1), "reply, expert 0: sample count must be finite and >= 0"),
    "NaN samples": (_prism_reply(2, {0: _w(9, 9)}, float("nan")), "sample count must be finite"),
    "empty expert array": (_prism_reply(2, {0: _w()}, 4), "reply, expert 0: 'w' has shape (0,), expected (2,)"),
    "unknown expert": (_prism_reply(2, {5: _w(9, 9)}, 4), "expert index 5 outside [0, 1)"),
    "empty router array": (_prism_reply(2, {0: _w(9, 9)}, 4, {"r": np.zeros(0, np.float32)}, 4),
                           "router: 'r' has shape (0,), expected (1,)"),
    "negative router samples": (_prism_reply(2, {0: _w(9, 9)}, 4, {"r": np.ones(1, np.float32)}, -2),
                                "router: n_examples must be finite and > 0"),
}


@pytest.mark.parametrize("case", sorted(PRISM_BAD_REPLIES))
def test_fedprism_strategy_drops_a_reply_without_samples_or_with_bad_arrays(case):
    """FedPrismStrategy counted a reply that used no sample as a node, and a negative count or an
    empty array raised out of aggregate_train (one node ended the run). Each reply is now checked
    (aggregation.validate_component_update, fedavg.validate_updates) and a bad one dropped, as the HTTPS
    server refuses one upload and keeps the round."""
    from trainer.experts.flower_strategy import FedPrismStrategy

    bad, reason = PRISM_BAD_REPLIES[case]
    strategy = FedPrismStrategy([_w(0, 0)], {"r": np.zeros(1, np.float32)}, min_count=1)  # 3-4 samples pass
    arrays, metrics = strategy.aggregate_train(1, [_prism_reply(1, {0: _w(1, 1)}, 3), bad])
    assert metrics == MetricRecord({"nodes": 1})
    np.testing.assert_array_equal(strategy.experts_[0]["w"], [1, 1])  # node 1's expert alone
    np.testing.assert_array_equal(strategy.router_["r"], [0])
    [rejected] = strategy.rejected_
    assert (rejected.server_round, rejected.client_id) == (1, "2") and reason in rejected.reason
    # A reply that used no sample still says what it needs next round; a malformed one says nothing.
    assert set(strategy.needs_) == ({1, 2} if "no sample" in reason else {1})


def test_fedprism_strategy_drops_each_component_trained_on_fewer_than_min_count_samples():
    """FedPrismStrategy had no min_count: an expert trained on 1 sample was averaged in, where the HTTPS
    server answers 422 to a parameter upload whose n_samples is below the round's min_count. Each
    component (expert, PGPD router) is now checked on its own with the server's check and only those
    below the threshold are dropped, with the check's message; the default is the server's (5)."""
    from trainer.experts.flower_strategy import FedPrismStrategy, pack

    def reply(node, experts, router=None):  # experts: {k: (params, n)}; router: (params, n)
        metrics = {f"n-expert-{k}": float(n) for k, (_, n) in experts.items()}
        metrics["n-router"] = float(router[1]) if router else 0.0
        return _reply(node, RecordDict({"arrays": pack({k: p for k, (p, _) in experts.items()},
                                                        router[0] if router else None),
                                        "metrics": MetricRecord(metrics), "config": ConfigRecord({"needs": [0]})}))

    r0 = {"r": np.zeros(1, np.float32)}
    strategy = FedPrismStrategy([_w(0, 0), _w(0, 0)], r0)
    assert strategy.min_count == 5
    arrays, metrics = strategy.aggregate_train(1, [
        reply(1, {0: (_w(1, 1), 5), 1: (_w(9, 9), 1)}),  # expert 1 from 1 sample: dropped, expert 0 kept
        reply(2, {1: (_w(3, 3), 6)}, ({"r": np.ones(1, np.float32)}, 2)),  # router from 2 samples: dropped
        reply(3, {0: (_w(7, 7), 4), 1: (_w(7, 7), 0)}),  # nothing left above the threshold: not a node
    ])
    assert metrics == MetricRecord({"nodes": 2})
    np.testing.assert_array_equal(strategy.experts_[0]["w"], [1, 1])  # node 1 alone (was (1*5 + 7*4) / 9)
    np.testing.assert_array_equal(strategy.experts_[1]["w"], [3, 3])  # node 2 alone (was (9 + 3*6) / 7)
    np.testing.assert_array_equal(strategy.router_["r"], [0])
    assert [(r.server_round, r.client_id, r.reason) for r in strategy.rejected_] == [
        (1, "1", "expert 1: need min_count=5 <= n_samples=1"), (1, "2", "router: need min_count=5 <= n_samples=2"),
        (1, "3", "expert 0: need min_count=5 <= n_samples=4")]
    assert set(strategy.needs_) == {1, 2, 3}
    # An explicit threshold: 4 samples pass with min_count=4.
    strategy = FedPrismStrategy([_w(0, 0)], r0, min_count=4)
    strategy.aggregate_train(1, [reply(1, {0: (_w(2, 2), 4)}), reply(2, {0: (_w(8, 8), 3)})])
    np.testing.assert_array_equal(strategy.experts_[0]["w"], [2, 2])
    assert [r.reason for r in strategy.rejected_] == ["expert 0: need min_count=4 <= n_samples=3"]


def test_a_fedprism_node_keeps_components_trained_on_fewer_than_min_count_samples():
    """The FedPrism node was not told the threshold: an expert trained on 1-2 samples left the node and was
    only dropped by the strategy. The round config now carries min-count and the node's ClientApp sends
    only the components trained on at least that many samples (none of 0 < n < min-count)."""
    from flwr.app import ArrayRecord
    from trainer.experts.flower_strategy import FedPrismStrategy, make_client_app

    r0 = {"r": np.zeros(1, np.float32)}

    def local_step(experts, router, pgpd, pid):  # expert 0 from 6 samples, expert 1 from 2, router from 3
        return ({0: (_w(1, 1), 6.0), 1: (_w(9, 9), 2.0)}, {"r": np.ones(1, np.float32)}, 3.0, [0, 1])

    strategy = FedPrismStrategy([_w(0, 0), _w(0, 0)], r0, pgpd_rounds=[1], min_nodes=1)
    grid = InProcessGrid(make_client_app(local_step), 1)
    (message,) = strategy.configure_train(1, ArrayRecord(), ConfigRecord(), grid)
    assert message.content["config"]["min-count"] == 5
    (reply,) = grid.send_and_receive([message])
    sent = sorted(reply.content["arrays"].keys())
    assert sent == ["expert-0/w"]  # expert 1 (2 samples) and the router (3 samples) stayed on the node
    assert dict(reply.content["metrics"]) == {"n-expert-0": 6.0, "n-router": 0.0}
    strategy.aggregate_train(1, [reply])
    np.testing.assert_array_equal(strategy.experts_[0]["w"], [1, 1])
    np.testing.assert_array_equal(strategy.experts_[1]["w"], [0, 0])
    assert strategy.rejected_ == []


def _with_min_count(owner: str, min_count):
    """Build what takes a privacy threshold: each Flower strategy, or read a round config."""
    from trainer.experts.flower_strategy import FedPrismStrategy
    from trainer.federated.update_checks import round_min_count
    from trainer.rewards.flower_router import RouterFedAvg

    return {"fedprism": lambda: FedPrismStrategy([_w(0, 0)], {"r": np.zeros(1, np.float32)}, min_count=min_count),
            "mor router": lambda: RouterFedAvg("samples", min_count=min_count),
            "kmeans": lambda: FederatedKMeansStrategy(("a", "b"), "toy", min_count=min_count),
            "round config": lambda: round_min_count({"min-count": min_count})}[owner]()


@pytest.mark.parametrize("owner", ["fedprism", "mor router", "kmeans", "round config"])
@pytest.mark.parametrize("min_count", [0, -1, 2.5, True, "5"])
def test_every_strategy_refuses_a_bad_min_count_naming_it(owner, min_count):
    with pytest.raises(InvalidInputError) as info:
        _with_min_count(owner, min_count)
    assert str(info.value).split(" must ")[0].endswith(("min_count", "min-count"))


def _mor_reply(node, params, n):
    from flwr.app import Array, ArrayRecord

    return _reply(node, RecordDict({"arrays": ArrayRecord({k: Array(v) for k, v in params.items()}),
                                    "metrics": MetricRecord({"num-examples": n})}))


MOR_BAD_REPLIES = {
    "zero samples": ([_mor_reply(100, _w(1, 1, 1), 5), _mor_reply(101, _w(9, 9, 9), 0)],
                     ["n_examples must be finite and > 0, got 0.0"]),
    "empty array": ([_mor_reply(100, _w(1, 1, 1), 5), _mor_reply(101, _w(), 4)],
                    ["'w' has shape (0,), expected (3,)"]),
    "no arrays": ([_mor_reply(100, _w(1, 1, 1), 5), _mor_reply(101, {}, 4)],
                  ["parameter names ['w'] differ from the round's parameters"]),
}


@pytest.mark.parametrize("case", sorted(MOR_BAD_REPLIES))
def test_mor_router_fedavg_drops_a_reply_without_samples_or_with_bad_arrays(case):
    """RouterFedAvg raised out of aggregate_train on a reply with 0 samples or an empty array (one node
    ended the run), and when every reply had no arrays it published an empty router. Such a reply is
    now dropped with its reason and the others are averaged."""
    from trainer.rewards.flower_router import RouterFedAvg

    replies, reasons = MOR_BAD_REPLIES[case]
    strategy = RouterFedAvg("samples", min_train_nodes=2, min_available_nodes=2, fraction_evaluate=0.0)
    from flwr.app import Array, ArrayRecord

    strategy.configure_train(1, ArrayRecord({"w": Array(np.zeros(3, np.float32))}), ConfigRecord(),
                             InProcessGrid(None, 2))
    arrays, metrics = strategy.aggregate_train(1, replies)
    np.testing.assert_array_equal(arrays["w"].numpy(), [1, 1, 1])
    assert metrics == MetricRecord({"num-examples": 5.0})
    assert [(r.client_id, r.reason) for r in strategy.rejected_] == [("101", reasons[0])]


def test_mor_router_fedavg_publishes_nothing_when_every_reply_is_empty():
    from flwr.app import Array, ArrayRecord

    from trainer.rewards.flower_router import RouterFedAvg

    strategy = RouterFedAvg("equal", min_train_nodes=2, min_available_nodes=2, fraction_evaluate=0.0)
    strategy.configure_train(1, ArrayRecord({"w": Array(np.zeros(3, np.float32))}), ConfigRecord(),
                             InProcessGrid(None, 2))
    assert strategy.aggregate_train(1, [_mor_reply(100, {}, 5), _mor_reply(101, {}, 4)]) == (None, None)
    assert [r.client_id for r in strategy.rejected_] == ["100", "101"]


def test_mor_router_fedavg_drops_a_reply_trained_on_fewer_than_min_count_samples():
    """RouterFedAvg had no min_count: over Flower a router update trained on 2 pairs was averaged in,
    where the HTTPS server answers 422 to an MLP upload whose n_samples is below the round's min_count.
    The strategy now applies the server's check (update_checks.check_sample_count) and drops such a
    reply with the server's reason; its default threshold is the server's default round min_count (5)."""
    from flwr.app import Array, ArrayRecord

    from trainer.federated.update_checks import DEFAULT_MIN_COUNT
    from trainer.rewards.flower_router import RouterFedAvg

    assert DEFAULT_MIN_COUNT == 5
    for kwargs, small in (({}, 2), ({"min_count": 8}, 7)):
        strategy = RouterFedAvg("samples", min_train_nodes=2, min_available_nodes=2, fraction_evaluate=0.0, **kwargs)
        assert strategy.min_count == kwargs.get("min_count", 5)
        strategy.configure_train(1, ArrayRecord({"w": Array(np.zeros(3, np.float32))}), ConfigRecord(),
                                 InProcessGrid(None, 2))
        arrays, metrics = strategy.aggregate_train(1, [_mor_reply(100, _w(1, 1, 1), strategy.min_count),
                                                       _mor_reply(101, _w(9, 9, 9), small)])
        np.testing.assert_array_equal(arrays["w"].numpy(), [1, 1, 1])  # node 100's parameters alone
        assert metrics == MetricRecord({"num-examples": float(strategy.min_count)})
        assert [(r.server_round, r.client_id, r.reason) for r in strategy.rejected_] == [
            (1, "101", f"need min_count={strategy.min_count} <= n_samples={small}")]
    # Every reply below the threshold: nothing is published.
    strategy = RouterFedAvg("equal", min_train_nodes=2, min_available_nodes=2, fraction_evaluate=0.0)
    strategy.configure_train(1, ArrayRecord({"w": Array(np.zeros(3, np.float32))}), ConfigRecord(),
                             InProcessGrid(None, 2))
    replies = [_mor_reply(100, _w(1, 1, 1), 1), _mor_reply(101, _w(2, 2, 2), 4)]
    assert strategy.aggregate_train(1, replies) == (None, None)
    assert [r.client_id for r in strategy.rejected_] == ["100", "101"]


def test_a_mor_router_node_below_min_count_sends_no_update():
    """make_router_client_app trained and sent its router with 2 pairs (the strategy then dropped it:
    the parameters had left the node). The round config now carries min-count, as the K-means strategy
    sends it, and a node holding fewer pairs replies with no array and num-examples 0; the strategy
    lists that reply and averages the others."""
    from flwr.app import Array, ArrayRecord

    from trainer.rewards.client_router import ClientRouterData, RouterConfig, initial_router
    from trainer.rewards.flower_router import RouterFedAvg, arrays_to_numpy, make_router_client_app

    rng = np.random.default_rng(0)
    data = {k: ClientRouterData(rng.normal(size=(n, 5)).astype(np.float32), rng.normal(size=(n, 5)).astype(np.float32),
                                k) for k, n in enumerate((2, 6))}
    config = RouterConfig(hidden=4, dropout=0.0, rounds=1, batch_size=4)
    app = make_router_client_app(data, config, 5, 2)
    grid = InProcessGrid(app, 2)
    strategy = RouterFedAvg("samples", min_train_nodes=2, min_available_nodes=2, fraction_evaluate=0.0)
    initial = ArrayRecord({k: Array(v) for k, v in initial_router(5, 2, config).get_parameters().items()})
    messages = list(strategy.configure_train(1, initial, ConfigRecord(), grid))
    assert [m.content["config"]["min-count"] for m in messages] == [5, 5]
    replies = grid.send_and_receive(messages)
    small, large = sorted(replies, key=lambda m: m.metadata.src_node_id)
    assert dict(small.content["arrays"]) == {} and small.content["metrics"]["num-examples"] == 0  # nothing left
    assert set(arrays_to_numpy(large.content["arrays"])) == set(arrays_to_numpy(initial))
    assert large.content["metrics"]["num-examples"] == 6
    arrays, metrics = strategy.aggregate_train(1, replies)
    assert metrics == MetricRecord({"num-examples": 6.0}) and [n for _, n in strategy.last_updates_] == [6.0]
    assert [(r.server_round, r.client_id, r.reason) for r in strategy.rejected_] == [
        (1, "100", "no update: the node holds fewer than min_count=5 pairs")]
    # With min_count=2 both nodes train and send.
    strategy = RouterFedAvg("samples", min_count=2, min_train_nodes=2, min_available_nodes=2, fraction_evaluate=0.0)
    replies = grid.send_and_receive(list(strategy.configure_train(1, initial, ConfigRecord(), grid)))
    strategy.aggregate_train(1, replies)
    assert sorted(n for _, n in strategy.last_updates_) == [2.0, 6.0] and strategy.rejected_ == []
    with pytest.raises(InvalidInputError, match="'min-count'"):
        strategy.configure_train(1, initial, ConfigRecord({"min-count": 1}), grid)


def test_rejected_reply_lives_in_a_neutral_module_and_flower_app_reexports_it():
    from trainer.federated import flower_app
    from trainer.federated.rejected_reply import RejectedReply

    assert flower_app.RejectedReply is RejectedReply
    assert RejectedReply(1, "7", "why") == RejectedReply(server_round=1, client_id="7", reason="why")


def test_the_round_config_may_not_set_max_cost_usd_itself(tmp_path):
    c0 = toy_log(tmp_path / "node.sqlite")
    strategy = FederatedKMeansStrategy(("a", "b"), "toy", rng=np.random.default_rng(0))
    with pytest.raises(InvalidInputError, match=r"\['max-cost-usd'\]"):
        strategy.configure_train(1, centroids_record(c0), ConfigRecord({"max-cost-usd": 5.0}),
                                 InProcessGrid(make_client_app({0: tmp_path / "node.sqlite"}), 1))


def test_noise_is_accounted_over_the_published_aggregates(logs):
    pytest.importorskip("dp_accounting")
    config = AggregationConfig(clip_count=20.0, max_cost_usd=0.05, noise_multiplier=1.0, delta=1e-5)
    strategy = FederatedKMeansStrategy(logs["models"], EMBEDDER, aggregation=config, rng=np.random.default_rng(0))
    strategy.start(grid=InProcessGrid(make_client_app(logs["paths"]), N_CLIENTS),
                   initial_arrays=centroids_record(seed_centroids(logs)), num_rounds=2)
    assert strategy.n_aggregates_ == 2
    assert strategy.epsilon_ == gaussian_epsilon(1.0, 1e-5)
    assert strategy.epsilon_spent() == gaussian_epsilon(1.0, 1e-5, 2) > strategy.epsilon_


# ------------------------------------------------------------------ wire format and validation


def small_update() -> KMeansUpdate:
    stats = CellStatistics(np.array([[2.0, 0.0], [0.0, 3.0]]), np.array([[1.0, 0.0], [0.0, 2.5]]),
                           np.array([[0.002, 0.0], [0.0, 0.3]]))
    return KMeansUpdate(stats, np.array([0, 1], dtype=np.int64), np.array([[0.6, 0.8], [1.0, 0.0]]),
                        np.array([2.0, 3.0]), log_size=6)


def test_the_kmeans_strategy_applies_the_servers_default_min_count_when_none_is_given(tmp_path):
    """FederatedKMeansStrategy defaulted to min_count=1 where the HTTPS server's round defaults to
    DEFAULT_MIN_COUNT (5): without an explicit threshold an entry of 2 queries was accepted. The
    default is now the server's: the round config tells the nodes 5, and a reply with an entry of 2
    queries is dropped with the shared check's reason."""
    from trainer.federated.update_checks import DEFAULT_MIN_COUNT

    c0 = toy_log(tmp_path / "node.sqlite")
    strategy = FederatedKMeansStrategy(("a", "b"), "toy", centroid_rounds=0, rng=np.random.default_rng(0))
    assert strategy.min_count == DEFAULT_MIN_COUNT == 5
    [message] = strategy.configure_train(1, centroids_record(c0), ConfigRecord(),
                                         InProcessGrid(make_client_app({0: tmp_path / "node.sqlite"}), 1))
    assert message.content["config"]["min-count"] == 5
    reply = _reply(100, update_to_record(small_update(), centroids_hash(c0)))
    assert strategy.aggregate_train(1, [reply]) == (None, None)
    assert [(r.server_round, r.client_id, r.reason) for r in strategy.rejected_] == [
        (1, "100", "count: entry [0, 0]=2 is below min_count=5: such entries are not reported")]


def test_update_round_trips_exactly_through_numpy_and_flower_records():
    update = small_update()
    arrays = update_to_ndarrays(update)
    assert list(arrays) == list(UPDATE_ARRAYS)
    assert {k: (str(a.dtype), a.shape) for k, a in arrays.items()} == {
        "count": ("float64", (2, 2)), "sum_accuracy": ("float64", (2, 2)), "sum_cost": ("float64", (2, 2)),
        "centroid_cells": ("int64", (2,)), "local_centroids": ("float64", (2, 2)), "local_weights": ("float64", (2,)),
        "log_size": ("int64", ()),
    }
    for back in (update_from_ndarrays(arrays), update_from_record(update_to_record(update, "h" * 64))[0]):
        for name, a in update_to_ndarrays(back).items():
            np.testing.assert_array_equal(a, arrays[name])
            assert a.dtype == arrays[name].dtype
    record = update_to_record(update, "h" * 64)
    assert set(record) == {"update", "config", "metrics"}
    assert record["metrics"] == MetricRecord({"num-examples": 6})


def _with(name, value):
    arrays = update_to_ndarrays(small_update())
    arrays[name] = value
    return arrays


@pytest.mark.parametrize("arrays, field", [
    ({k: v for k, v in update_to_ndarrays(small_update()).items() if k != "log_size"}, "log_size"),  # missing
    ({**update_to_ndarrays(small_update()), "queries": np.zeros(1)}, "queries"),  # unexpected
    (_with("centroid_cells", np.array([0.0, 1.0])), "centroid_cells"),  # not integers
    (_with("count", np.array([2.0, 3.0])), "count"),  # not 2-D
    (_with("sum_accuracy", np.array([[3.0, 0.0], [0.0, 2.5]])), "sum_accuracy"),  # above count
    (_with("sum_cost", np.array([[-1.0, 0.0], [0.0, 0.3]])), "sum_cost"),  # negative
])
def test_malformed_arrays_are_refused_naming_the_array(arrays, field):
    with pytest.raises(ShapeError) as info:
        update_from_ndarrays(arrays)
    assert field in str(info.value)


def validate(arrays: dict, n_cells: int = 2, min_count: int = 1, max_cost_usd: float | None = None):
    """The shared validator on a reply's arrays, as the strategy calls it (2 models, d_emb 2)."""
    from trainer.federated.update_checks import check_kmeans_update

    return check_kmeans_update(arrays, int(arrays["log_size"]), (n_cells, 2), 2, min_count, max_cost_usd)


@pytest.mark.parametrize("arrays, min_count, error, field", [
    (update_to_ndarrays(small_update()), 3, PrivacyError, "count"),  # an entry of 2 < min_count
    (_with("log_size", np.array(4)), 1, ShapeError, "count"),  # counts sum to 5 > log_size
    (_with("count", np.array([[1.5, 0.0], [0.0, 3.0]])), 1, ShapeError, "count"),
    (_with("centroid_cells", np.array([0, 5])), 1, ShapeError, "centroid_cells"),
    (_with("centroid_cells", np.array([1, 1])), 1, ShapeError, "centroid_cells"),
    (_with("local_centroids", np.zeros((2, 3))), 1, ShapeError, "local_centroids"),
    (_with("local_weights", np.array([1.0, 3.0])), 1, PrivacyError, "local_weights"),
    (_with("local_centroids", np.array([[np.nan, 0.0], [1.0, 0.0]])), 1, ShapeError, "local_centroids"),
    (_with("sum_cost", np.array([[2000.5, 0.0], [0.0, 0.3]])), 1, ShapeError, "sum_cost"),  # above 1000 USD/query
])
def test_an_update_that_breaks_the_round_is_refused_naming_its_field(arrays, min_count, error, field):
    with pytest.raises(error) as info:
        validate(arrays, min_count=min_count)
    assert type(info.value) is error and str(info.value).split(":")[0] == field


def test_the_cost_bound_is_the_rounds_max_cost_usd():
    arrays = update_to_ndarrays(small_update())  # 0.3 USD over 3 queries in entry [1, 1]
    validate(arrays, max_cost_usd=0.1)
    with pytest.raises(ShapeError) as info:
        validate(arrays, max_cost_usd=0.09)
    assert str(info.value).startswith("sum_cost: is above 0.09 USD per query")


def test_a_valid_update_passes_and_a_wrong_shape_of_statistics_does_not():
    update = validate(update_to_ndarrays(small_update()), min_count=2)
    np.testing.assert_array_equal(update.statistics.count, small_update().statistics.count)
    with pytest.raises(ShapeError) as info:
        validate(update_to_ndarrays(small_update()), n_cells=3)
    assert str(info.value) == "count: must have shape (3, 2), got (2, 2)"


def test_centroids_record_refuses_bad_centroids():
    assert centroids_record(np.eye(2))["centroids"].numpy().dtype == np.float32
    with pytest.raises(ShapeError, match="finite"):
        centroids_record(np.array([[np.inf, 0.0]]))
    with pytest.raises(ShapeError, match=r"shape \(n_cells, d_emb\)"):
        centroids_record(np.zeros(3))
