"""Protocol pieces of trainer.simulation on real RouterBench rows."""

import numpy as np

from trainer.data.routerbench import load_routerbench_dir
from trainer.simulation import SimulationConfig, client_test_indices, simulate_clients


def test_client_test_set_follows_the_clients_task_mix():
    test_tasks = np.array(["a"] * 500 + ["b"] * 500 + ["c"] * 50)
    client_tasks = np.array(["a"] * 30 + ["b"] * 10)  # 3/4 a, 1/4 b, no c
    idx = client_test_indices(test_tasks, client_tasks, np.random.default_rng(0), size=200)
    picked = test_tasks[idx]
    assert (picked == "a").sum() == 150 and (picked == "b").sum() == 50 and (picked == "c").sum() == 0
    assert np.unique(idx).shape == idx.shape


def test_client_test_set_is_capped_by_what_the_test_split_holds():
    test_tasks = np.array(["a"] * 20 + ["b"] * 500)
    idx = client_test_indices(test_tasks, np.array(["a"] * 9 + ["b"]), np.random.default_rng(0), size=100)
    assert (test_tasks[idx] == "a").sum() == 20 and (test_tasks[idx] == "b").sum() == 10


def test_simulated_clients_hold_every_logged_train_query_once(routerbench_dir):
    train, _ = load_routerbench_dir(routerbench_dir)
    emb = np.arange(train.n_queries, dtype=np.float32)[:, None].repeat(2, axis=1)  # row id as "embedding"
    clients, tasks = simulate_clients(train, emb, SimulationConfig(), np.random.default_rng(0))
    assert len(clients) == len(tasks) == 10
    rows = np.concatenate([c.embeddings[:, 0] for c in clients]).astype(int)
    loggable = np.flatnonzero(train.labelled().any(axis=1))
    assert np.array_equal(np.sort(rows), loggable)
    for c, t in zip(clients, tasks):
        r = c.embeddings[:, 0].astype(int)
        # exactly one revealed model per query, and what it revealed is that model's true label
        assert np.array_equal(c.accuracy, train.accuracy[r, c.model])
        assert np.array_equal(c.cost, train.cost[r, c.model])
        assert np.array_equal(t, train.tasks[r])
