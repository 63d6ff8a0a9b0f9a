"""Exporter: parity measures (hand-computed), keys, and the full `fedroute export` on real prompts."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from export.errors import ExportError
from export.parity import cosine_stats, decision_agreement
from export.signing import generate_keypair, load_signing_key
from sdk import EvalLog, Router
from trainer.cli import app


def test_cosine_stats_hand_computed():
    a = np.array([[1.0, 0.0], [1.0, 1.0], [0.0, 2.0]])
    b = np.array([[1.0, 0.0], [1.0, 0.0], [0.0, -1.0]])
    stats = cosine_stats(a, b)
    assert stats["n"] == 3
    assert stats["min"] == pytest.approx(-1.0)
    assert stats["mean"] == pytest.approx((1.0 + 1 / np.sqrt(2) - 1.0) / 3)


def test_decision_agreement_hand_computed():
    # Two queries, two models (accuracy, cost USD); router b differs from a only in A(q0, m1).
    acc_a = np.array([[0.9, 0.8], [0.5, 0.9]])
    cost = np.array([[0.01, 0.0], [0.0, 0.001]])
    acc_b = np.array([[0.9, 0.2], [0.5, 0.9]])
    # lam = 0: a picks (0, 1), b picks (0, 1). lam = 100: a: q0 -0.1 vs 0.8 -> 1, b: -0.1 vs 0.2 -> 1;
    # q1 0.5 vs 0.8 -> 1 for both. lam = 1000: q0 -> 1 for both; q1 0.5 vs -0.1 -> 0 for both.
    assert decision_agreement((acc_a, cost), (acc_b, cost), [0.0, 100.0, 1000.0]) == 1.0
    # lam = 10: a: q0 0.8 vs 0.8 -> tie -> cheaper model 1; b: 0.8 vs 0.2 -> 0. q1 agree: 3 of 4 pairs.
    assert decision_agreement((acc_a, cost), (acc_b, cost), [0.0, 10.0]) == 0.75
    acc_c = np.array([[0.9, 0.95], [0.5, 0.9]])  # at lam = 0 q0 now picks model 1
    assert decision_agreement((acc_a, cost), (acc_c, cost), [0.0]) == 0.5


def test_parity_gates_fail_on_misses_and_on_nan():
    from export.parity import gate_failures

    good = {"cosine": {"mean": 0.999, "min": 0.99}, "decision_agreement": 0.995, "auc": 0.85, "auc_gap": 0.001}
    assert gate_failures("int8", good, 0.85) == []
    assert gate_failures("fp32", good, 0.85) == ["fp32 min cosine 0.99000 < 0.999"]
    nan = {"cosine": {"mean": float("nan"), "min": float("nan")}, "decision_agreement": float("nan"),
           "auc": float("nan"), "auc_gap": float("nan")}
    assert len(gate_failures("int8", nan, 0.85)) == 2  # decisions and AUC: int8 has no cosine gate
    assert len(gate_failures("fp32", nan, 0.85)) == 3
    worse = dict(good, decision_agreement=0.98, auc_gap=0.01)
    assert [f.split(" ")[1] for f in gate_failures("int8", worse, 0.85)] == ["decisions", "AUC"]


def test_parity_of_a_bundle_against_another_router_fails(make_bundle, tmp_path, signing_keys, fitted_routers):
    from export.parity import check_bundle

    bundle = make_bundle(tmp_path / "b", kind="kmeans", int8=False)
    report = check_bundle(bundle, signing_keys[1], fitted_routers["mlp"], fitted_routers["test_embeddings"],
                          fitted_routers["test"].with_models(fitted_routers["mlp"].models), ["fp32"],
                          progress=lambda _: None)
    assert not report["passed"]
    assert any("decisions agree" in f for f in report["failures"])


def test_keygen_refuses_to_overwrite_and_bad_keys_are_export_errors(tmp_path):
    private, public = generate_keypair(tmp_path)
    assert oct(private.stat().st_mode & 0o777) == "0o600"
    assert public.read_text().startswith("-----BEGIN PUBLIC KEY-----")
    with pytest.raises(ExportError, match="refusing to replace"):
        generate_keypair(tmp_path)
    (tmp_path / "junk.key").write_text("not a key")
    with pytest.raises(ExportError, match="not an unencrypted PEM private key"):
        load_signing_key(tmp_path / "junk.key")
    with pytest.raises(ExportError, match="cannot read signing key"):
        load_signing_key(tmp_path / "missing.key")


def _killed_exports_scratch_folder(out: Path) -> Path:
    """The scratch folder of an export to ``out`` killed with SIGKILL (it cleans nothing up)."""
    import os
    import signal
    import subprocess
    import sys

    from conftest import ROOT

    code = ("import os, signal, sys\nfrom export.scratch_folder import scratch_folder\n"
            "with scratch_folder(sys.argv[1]) as tmp:\n"
            "    (tmp / 'embedder.onnx').write_bytes(b'x'); print(tmp, flush=True)\n"
            "    os.kill(os.getpid(), signal.SIGKILL)")
    run = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == -signal.SIGKILL, run.stderr
    folder = Path(run.stdout.strip())
    assert folder.parent == out.parent and (folder / "embedder.onnx").is_file()
    return folder


def test_a_killed_exports_scratch_folder_is_removed_by_the_next_export(tmp_path):
    """A killed `fedroute export` left its /tmp/fedroute-export-* folder forever. The scratch folder is now beside
    --out, and the next export to it removes those whose process is gone (not a live one's, another host's or
    another bundle's)."""
    import os

    from export.scratch_folder import scratch_folder

    out = tmp_path / "bundles" / "kmeans"
    killed = _killed_exports_scratch_folder(out)
    host, dead_pid, _ = killed.name[len(".kmeans.export-"):].rsplit("-", 2)
    kept = [out.parent / f".kmeans.export-{host}-{os.getpid()}-0123abcd",  # a live process: this one
            out.parent / f".kmeans.export-{host}x-{dead_pid}-0123abcd",  # another host
            out.parent / f".other.export-{host}-{dead_pid}-0123abcd"]  # another bundle's
    for folder in kept:
        folder.mkdir()
    with scratch_folder(out) as scratch:
        assert scratch.parent == out.parent and scratch.is_dir() and list(scratch.iterdir()) == []
        assert not killed.exists() and all(folder.is_dir() for folder in kept)
    assert not scratch.exists()
    with pytest.raises(RuntimeError), scratch_folder(out) as scratch:  # removed however the export ends
        raise RuntimeError("parity failed")
    assert not scratch.exists() and sorted(out.parent.iterdir()) == sorted(kept)


def test_a_failed_export_removes_the_parent_folders_it_created(tmp_path):
    """The scratch folder created --out's missing parents (mkdir -p) and left them when the export then failed:
    a failed export to a/new/nested/bundle left a/new/nested. Now only the folders that were there stay; on
    success the parent (which then holds the bundle) stays."""
    from export.scratch_folder import scratch_folder

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "notes.txt").write_text("keep me")
    out = tmp_path / "a" / "new" / "nested" / "bundle"
    with pytest.raises(RuntimeError, match="parity failed"), scratch_folder(out) as scratch:
        assert scratch.parent == out.parent and scratch.is_dir()
        raise RuntimeError("parity failed")
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["notes.txt"]
    with scratch_folder(out) as scratch:
        (out.parent / ".bundle.v1-0123").mkdir()  # what the bundle writer leaves beside out
    assert not scratch.exists() and [p.name for p in out.parent.iterdir()] == [".bundle.v1-0123"]


def test_a_bundle_write_failing_under_its_lock_in_a_new_folder_leaves_no_folder(tmp_path, signing_keys, monkeypatch):
    """write_bundle takes the lock file .<name>.lock beside --out (kept on release, as filelock keeps it on
    purpose), so when publishing then failed (a full disk), the parent folder the export had created was not
    empty and stayed: a failed export to a/new/bundle left a/new/.bundle.lock. The scratch folder's cleanup now
    removes that lock file when the lock is free and nothing else is in the folder; a held lock, or a folder with
    anything else in it, stays."""
    import errno
    import os

    from filelock import FileLock

    from export.bundle_writer import write_bundle
    from export.scratch_folder import scratch_folder
    from sdk.bundle_install import read_version

    key = load_signing_key(signing_keys[0])
    (tmp_path / "a").mkdir()
    out = tmp_path / "a" / "new" / "bundle"
    real_replace = os.replace

    def disk_full(src, dst, *args, **kwargs):
        if Path(dst) == out:  # publish's link swap, after the lock is taken and the version written
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", disk_full)
    with pytest.raises(OSError, match="No space left"), scratch_folder(out):
        write_bundle(out, {"kmeans.npz": b"x"}, {"bundle_version": 1, "router_kind": "kmeans"}, key)
    assert list((tmp_path / "a").iterdir()) == []

    # The lock held by another writer: its file and so the folder stay (no unlink under a holder's feet).
    lock = out.parent / ".bundle.lock"
    held = FileLock(lock)
    with pytest.raises(OSError, match="No space left"), scratch_folder(out):
        try:
            write_bundle(out, {"kmeans.npz": b"x"}, {"bundle_version": 1, "router_kind": "kmeans"}, key)
        finally:
            held.acquire(timeout=5)  # write_bundle has released it; another writer takes it before the cleanup
    assert held.is_locked
    held.release()
    assert [p.name for p in out.parent.iterdir()] == [".bundle.lock"]
    monkeypatch.setattr(os, "replace", real_replace)
    write_bundle(out, {"kmeans.npz": b"x"}, {"bundle_version": 1, "router_kind": "kmeans"}, key)
    assert out.is_symlink() and read_version(out) == 1 and lock.is_file()  # published; the lock file is kept


def test_an_export_that_fails_in_its_scratch_folder_leaves_no_new_folder(fitted_routers, tmp_path, signing_keys):
    """`fedroute export --out new/nested/bundle` with a router whose embedder cannot be exported failed (ExportError)
    but left new/nested behind, created for the scratch folder."""
    import shutil

    router_dir = tmp_path / "router"
    shutil.copytree(fitted_routers["dir"] / "kmeans", router_dir)
    meta = json.loads((router_dir / "router.json").read_text())
    meta["embedder"]["name"] = str(tmp_path / "no-such-embedder")
    (router_dir / "router.json").write_text(json.dumps(meta))
    out = tmp_path / "new" / "nested" / "bundle"
    result = CliRunner().invoke(app, ["export", "--router", str(router_dir), "--out", str(out), "--signing-key",
                                      str(signing_keys[0]), "--cache-dir", str(fitted_routers["cache"])],
                                env={"COLUMNS": "500", "HF_HUB_OFFLINE": "1"})
    assert isinstance(result.exception, ExportError), result.output
    assert str(result.exception).startswith(f"cannot export the embedder {str(tmp_path / 'no-such-embedder')!r}")
    assert not (tmp_path / "new").exists()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["kmeans", "mlp"])
def test_fedroute_export_end_to_end_with_parity(kind, fitted_routers, tmp_path):
    runner = CliRunner()
    keys = tmp_path / "keys"
    assert runner.invoke(app, ["keygen", "--out", str(keys)]).exit_code == 0
    out = tmp_path / "bundle"
    killed = _killed_exports_scratch_folder(out)
    result = runner.invoke(app, [
        "export", "--router", str(fitted_routers["dir"] / kind), "--out", str(out), "--int8",
        "--signing-key", str(keys / "signing.key"), "--cache-dir", str(fitted_routers["cache"]),
    ])
    assert result.exit_code == 0, result.output
    # the killed export's scratch folder is gone, and this one's too: nothing is left beside the bundle
    assert not killed.exists() and not list(tmp_path.glob(".bundle.export-*"))
    assert "parity passed" in result.output
    parity = json.loads((out / "parity.json").read_text())
    assert parity["passed"] and parity["n_queries"] == len(fitted_routers["test"].prompts)
    for precision in ("fp32", "int8"):
        entry = parity["precisions"][precision]
        assert entry["decision_agreement"] >= 0.99
        assert entry["auc_gap"] <= 0.005
    assert parity["precisions"]["fp32"]["cosine"]["min"] >= 0.999
    assert parity["precisions"]["int8"]["decision_agreement_vs_fp32"] >= 0.99
    assert 0.95 < parity["precisions"]["int8"]["cosine"]["mean"] < 1.0  # reported, not gated (CPU-dependent)
    # The bundle the app loads routes like the trainer's router.
    router = Router.load(out, keys / "signing.pub")
    assert router.precision == "int8" and router.router_kind == kind
    trained = fitted_routers[kind]
    emb = fitted_routers["test_embeddings"]
    expected = trained.decide(emb, 50.0)
    got = [c.index for c in router.choose_batch(list(fitted_routers["test"].prompts), 50.0)]
    assert np.mean(np.array(got) == expected) >= 0.95
    if kind == "mlp":
        return  # the version bump below is the bundle writer's, the same for every kind: one full re-export checks it
    # Exporting again bumps the version.
    again = runner.invoke(app, ["export", "--router", str(fitted_routers["dir"] / kind), "--out", str(out),
                                "--signing-key", str(keys / "signing.key"), "--cache-dir", str(fitted_routers["cache"])])
    assert again.exit_code == 0, again.output
    assert Router.load(out, keys / "signing.pub").bundle_version == 2


def test_a_process_exports_an_embedder_once_and_copies_it_after(tmp_path):
    """A second export_embedder call with the same model folder and settings copies the first one's files
    (same bytes, same modification times: optimum did not run again)."""
    from export.embedder_onnx import export_embedder
    from trainer.embeddings import resolve_model_path

    path = resolve_model_path("all-MiniLM-L6-v2")
    first = export_embedder(path, tmp_path / "a", 64, "left", fuse=True)
    second = export_embedder(path, tmp_path / "b", 64, "left", fuse=True)
    assert second.model == tmp_path / "b" / first.model.name and second.tokenizer == tmp_path / "b" / "tokenizer.json"
    assert (second.dim, second.fused_ops) == (first.dim, first.fused_ops) and first.dim == 384 and first.fused_ops
    for name in ("model.onnx", "model.fused.onnx", "tokenizer.json"):
        a, b = tmp_path / "a" / name, tmp_path / "b" / name
        assert a.read_bytes() == b.read_bytes() and a.stat().st_mtime_ns == b.stat().st_mtime_ns


def test_export_without_test_data_says_what_to_pass(fitted_routers, tmp_path, signing_keys):
    import shutil

    router_dir = tmp_path / "router"
    shutil.copytree(fitted_routers["dir"] / "kmeans", router_dir)
    meta = json.loads((router_dir / "router.json").read_text())
    meta["provenance"] = {"test": str(tmp_path / "gone.parquet")}
    (router_dir / "router.json").write_text(json.dumps(meta))
    from export.pipeline import export_bundle

    with pytest.raises(ExportError, match="pass --data"):
        export_bundle(router_dir, tmp_path / "out", signing_keys[0], progress=lambda _: None)
    assert not (tmp_path / "out").exists()


def test_export_cli_rejects_prices_for_unknown_models(fitted_routers, tmp_path, signing_keys):
    prices = tmp_path / "prices.json"
    prices.write_text(json.dumps({"not-a-model": {"input": 0.001, "output": 0.002}}))
    from trainer.cli import main

    import sys

    argv = sys.argv
    sys.argv = ["fedroute", "export", "--router", str(fitted_routers["dir"] / "kmeans"), "--out", str(tmp_path / "b"),
                "--signing-key", str(signing_keys[0]), "--prices", str(prices),
                "--cache-dir", str(fitted_routers["cache"])]
    try:
        with pytest.raises(SystemExit) as exit_info:
            main()
    finally:
        sys.argv = argv
    assert exit_info.value.code == 2
    assert not (tmp_path / "b").exists()


def test_example_cost_aware_chat_dry_run_records_outcomes(make_bundle, signing_keys, tmp_path, capsys):
    import runpy

    from conftest import ROOT

    bundle = make_bundle(tmp_path / "bundle")
    log_path = tmp_path / "log.sqlite"
    module = runpy.run_path(str(ROOT / "examples" / "cost_aware_chat.py"))
    code = module["main"](["--bundle", str(bundle), "--public-key", str(signing_keys[1]), "--log", str(log_path),
                           "--dry-run", "--score", "1", "--lam", "50", "What is the boiling point of water?",
                           "Summarise the causes of the French revolution."])
    assert code == 0
    out = capsys.readouterr().out
    assert out.count("recorded evaluation") == 2
    router = Router.load(bundle, signing_keys[1])
    with EvalLog(log_path, router.model_ids) as log:
        rows = log.rows()
    assert len(rows) == 2 and list(rows.score) == [1.0, 1.0] and list(rows.cost_usd) == [0.0, 0.0]
    expected = router.choose("What is the boiling point of water?", 50.0)
    assert rows.model[0] == expected.model and rows.cell[0] == expected.cell
    np.testing.assert_allclose(rows.embedding[0], expected.embedding, atol=1e-6)
    assert all(q is None for q in rows.query)  # the text is not stored


def test_example_calls_an_openai_compatible_endpoint_and_logs_the_priced_cost(make_bundle, signing_keys, tmp_path,
                                                                               monkeypatch, capsys):
    """The live path of the example against a local OpenAI-compatible server (stdlib http.server)."""
    import runpy
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from conftest import ROOT
    from test_bundle import ROUTERBENCH_MODELS

    received: list[dict] = []

    class ChatCompletions(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's naming
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            received.append({"path": self.path, **body})
            reply = {"id": "c1", "object": "chat.completion", "created": 0, "model": body["model"],
                     "choices": [{"index": 0, "finish_reason": "stop",
                                  "message": {"role": "assistant", "content": "100 degrees Celsius."}}],
                     "usage": {"prompt_tokens": 12, "completion_tokens": 30, "total_tokens": 42}}
            data = json.dumps(reply).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            """Keep the test output clean: no per-request log line on stderr."""

    server = ThreadingHTTPServer(("127.0.0.1", 0), ChatCompletions)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        models = [{"id": m, "price_per_1k_input_usd": 0.001, "price_per_1k_output_usd": 0.002, "mean_cost_usd": None}
                  for m in ROUTERBENCH_MODELS]
        bundle = make_bundle(tmp_path / "bundle", models=models)
        model_map = tmp_path / "map.json"
        model_map.write_text(json.dumps({m: "local-model" for m in ROUTERBENCH_MODELS}))
        monkeypatch.setenv("OPENAI_API_KEY", "test-key")
        module = runpy.run_path(str(ROOT / "examples" / "cost_aware_chat.py"))
        log_path = tmp_path / "log.sqlite"
        code = module["main"](["--bundle", str(bundle), "--public-key", str(signing_keys[1]), "--log", str(log_path),
                               "--score", "0.5", "--base-url", f"http://127.0.0.1:{server.server_port}/v1",
                               "--model-map", str(model_map), "What is the boiling point of water?"])
    finally:
        server.shutdown()
    assert code == 0
    assert "100 degrees Celsius." in capsys.readouterr().out
    assert received[0]["path"] == "/v1/chat/completions" and received[0]["model"] == "local-model"
    assert received[0]["messages"] == [{"role": "user", "content": "What is the boiling point of water?"}]
    with EvalLog(log_path, ROUTERBENCH_MODELS) as log:
        rows = log.rows()
    assert len(rows) == 1 and rows.score[0] == 0.5
    assert rows.cost_usd[0] == pytest.approx((12 * 0.001 + 30 * 0.002) / 1000)
    assert rows.latency_ms[0] > 0


def test_example_without_prices_names_its_prices_option(make_bundle, signing_keys, tmp_path, monkeypatch, capsys):
    """A bundle without a price table and no --prices: the example stops before any call and points at
    its own --prices option (the PriceError itself names RoutedChat's `prices=` argument)."""
    import runpy

    from conftest import ROOT

    bundle = make_bundle(tmp_path / "bundle")
    monkeypatch.setenv("OPENAI_API_KEY", "test-key")
    module = runpy.run_path(str(ROOT / "examples" / "cost_aware_chat.py"))
    code = module["main"](["--bundle", str(bundle), "--public-key", str(signing_keys[1]), "--log",
                           str(tmp_path / "log.sqlite"), "--base-url", "http://127.0.0.1:9/v1", "hello"])
    assert code == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("error: ") and "price" in err[0]
    assert err[1] == "(in this example: --prices FILE, see --help)"


def test_export_refuses_bad_targets_before_any_work(fitted_routers, tmp_path, signing_keys, make_bundle):
    from export.pipeline import export_bundle

    def run(out, **kwargs):
        export_bundle(fitted_routers["dir"] / "kmeans", out, signing_keys[0], progress=lambda _: None, **kwargs)

    precious = tmp_path / "docs"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    with pytest.raises(ExportError, match="not a fedroute bundle"):
        run(precious)
    existing = make_bundle(tmp_path / "b", bundle_version=5)
    with pytest.raises(ExportError, match="not above the version 5"):
        run(existing, bundle_version=1)
    for bad, match in (({"not-a-model": (0.1, 0.2)}, "does not have"), ({"claude-v1": ("0.008", 1.0)}, "number >= 0"),
                       ({"claude-v1": (-1.0, 1.0)}, "number >= 0"), ({"claude-v1": (float("nan"), None)}, "number >= 0")):
        with pytest.raises(ExportError, match=match):
            run(tmp_path / "new", prices=bad)
    with pytest.raises(ExportError, match="does not exist"):
        run(tmp_path / "new", data=tmp_path / "nowhere")
    assert not (tmp_path / "new").exists() and Router.load(existing, signing_keys[1]).bundle_version == 5


def test_keygen_into_a_file_is_a_clear_error(tmp_path):
    target = tmp_path / "afile"
    target.write_text("x")
    with pytest.raises(ExportError, match="is a file"):
        generate_keypair(target)


@pytest.mark.parametrize("out", ["", "  "])
def test_keygen_into_an_empty_path_is_refused(tmp_path, monkeypatch, out):
    """`fedroute keygen --out ""` wrote signing.key and signing.pub into the current folder (typer: Path('.')).
    The command line refuses it while parsed (a Path option wrapped in sdk.cli_paths.NonEmptyPath: exit 2), the
    function for a str of its own."""
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["keygen", "--out", out], env={"COLUMNS": "500"})
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    flat = lambda text: " ".join(text.replace("│", " ").split())  # noqa: E731 - rich's box and line breaks out
    assert flat(f"Invalid value for '--out': the path is empty ({out!r})") in flat(result.output)
    with pytest.raises(ExportError, match="key folder"):
        generate_keypair(out)
    assert list(tmp_path.iterdir()) == []


def test_keygen_into_a_folder_it_cannot_create_is_a_clear_error(tmp_path):
    """`fedroute keygen --out /sys/keys` (or under a file, or a read-only folder) ended in a PermissionError /
    NotADirectoryError traceback from mkdir."""
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ExportError, match=r"key pair.*afile/keys"):
        generate_keypair(tmp_path / "afile" / "keys")
    assert (tmp_path / "afile").read_text() == "x"


def test_example_dry_run_never_writes_the_real_log(make_bundle, signing_keys, tmp_path, monkeypatch, capsys):
    import runpy

    from conftest import ROOT

    bundle = make_bundle(tmp_path / "bundle")
    monkeypatch.chdir(tmp_path)
    module = runpy.run_path(str(ROOT / "examples" / "cost_aware_chat.py"))
    assert module["main"](["--bundle", str(bundle), "--public-key", str(signing_keys[1]), "--dry-run", "--score", "1",
                           "What is 2 + 2?"]) == 0
    assert "dry run: no model was called" in capsys.readouterr().out
    assert (tmp_path / "chat_log.dry_run.sqlite").exists() and not (tmp_path / "chat_log.sqlite").exists()


def test_price_table_refuses_an_int_beyond_the_float_range():
    """An int beyond the float range (10**400) used to end in an OverflowError traceback."""
    from export.pipeline import check_prices  # as the other tests here: export.pipeline loads on use

    with pytest.raises(ExportError, match=r"prices\['a'\].output"):
        check_prices({"a": (0.001, 10**400)}, ["a"])
    assert check_prices({"a": (None, 2)}, ["a"]) == {"a": (None, 2.0)}
