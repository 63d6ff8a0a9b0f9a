"""The device side of the federated sync (ARCHITECTURE.md §6): upload statistics, fetch the bundle.

:meth:`SyncClient.run_once` is one sync, meant for cron or a systemd timer (``fedroute-sync``):

1. ``GET /v1/rounds/current``; if a round is open, compute the device's update for its centroids
   from the :class:`sdk.EvalLog` (:func:`sdk.local_update.kmeans_update`: counts and sums per
   (cell, model), mean embeddings of cells with enough queries; never text, never a per-query
   embedding) and ``POST`` it with an ``Idempotency-Key`` derived from the round and the body, so a
   retry, or a rerun after a crash with the same log, is counted once.
2. ``GET /v1/bundles/latest`` (with ``If-None-Match``); if a newer bundle is published, verify its
   manifest signature, fetch the files it lists by sha256 (reusing identical files of the bundle in
   use, so an unchanged embedder is not downloaded again), verify every hash, check that it loads,
   and swap it in atomically (:mod:`sdk.bundle_install`). A failure leaves the old bundle in place.

Connection errors and 5xx answers are retried with exponential backoff and jitter; 4xx answers are
not (they raise :class:`sdk.errors.SyncRejectedError`). The state (last acknowledged upload, the
bundle's ETag) is a small JSON file written atomically, so it survives restarts. httpx, no torch.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import ssl
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from sdk import bundle_install
from sdk import bundle_manifest as fmt
from sdk.errors import BundleError, InvalidInputError, SyncError, SyncRejectedError
from sdk.eval_log import EvalLog, Evaluations
from sdk.local_update import RoundSpec, kmeans_update

STATE_VERSION = 1


@dataclass(frozen=True)
class SyncResult:
    """What one :meth:`SyncClient.run_once` did.

    round_id : the open round, or None if none was open.
    uploaded : True if an update was sent and acknowledged in this run (False if none was open or
        the same update had been acknowledged before).
    late : True if the server counts the update in the next round (the round closed meanwhile).
    update_id : the server's id of the acknowledged update, or None.
    log_size : evaluations the update summarises, or None.
    bundle_version : version of the bundle in use after the run, or None if there is none.
    bundle_updated : True if a new bundle was installed.
    skipped : why nothing was uploaded for an open round (an MLP round on a client without an
        ``mlp_trainer``, or too few evaluations to train), else None.
    """

    round_id: int | None
    uploaded: bool
    late: bool
    update_id: int | None
    log_size: int | None
    bundle_version: int | None
    bundle_updated: bool
    skipped: str | None = None

    def to_json(self) -> dict:
        return asdict(self)


class SyncClient:
    """Periodic sync of one device with the aggregation server.

    Parameters
    ----------
    server_url : ``https://host:port`` of the server (plain http is refused: the token would leak).
    token : the device's bearer token (``fedroute clients add``).
    eval_log : the device's :class:`sdk.EvalLog` (only read).
    bundle_dir : path of the bundle in use (replaced atomically by newer published bundles).
    public_key : key that must have signed any bundle installed (path, PEM or key object).
    ca_cert : PEM file of the CA that signed the server certificate (default: system CAs).
    state_path : JSON state file; default ``.<bundle name>.sync.json`` beside ``bundle_dir``.
    timeout_s : seconds per HTTP request.
    retries : retries after a connection error or 5xx (0 disables).
    backoff_s : first backoff in seconds; doubles each retry (with jitter), capped at ``max_backoff_s``.
    transport : an ``httpx.BaseTransport`` to send requests through (default: httpx's own).
    sleep : function used to wait between retries (seconds).
    mlp_trainer : for MLP rounds, ``f(evaluations, round_json, parameters_bytes, client_id) ->
        upload bytes or None`` (the SDK has no torch; ``trainer.federated.mlp_local.train_on_log`` is
        one). Without it MLP rounds are skipped (``SyncResult.skipped`` says so).

    Raises
    ------
    InvalidInputError
        A URL that is not https, an empty token, or negative retry settings.
    """

    def __init__(self, server_url: str, token: str, eval_log: EvalLog, bundle_dir, public_key, *,
                 ca_cert=None, state_path=None, timeout_s: float = 30.0, retries: int = 5,
                 backoff_s: float = 0.5, max_backoff_s: float = 30.0,
                 transport: httpx.BaseTransport | None = None,
                 sleep: Callable[[float], None] = time.sleep,
                 mlp_trainer: Callable[[Evaluations, dict, bytes, str], bytes | None] | None = None) -> None:
        url = httpx.URL(str(server_url))
        if url.scheme != "https":
            raise InvalidInputError(f"server_url must be https://..., got {str(server_url)!r}")
        if not isinstance(token, str) or not token.strip():
            raise InvalidInputError("token must be a non-empty string")
        if retries < 0 or backoff_s < 0 or max_backoff_s < 0:
            raise InvalidInputError("retries, backoff_s and max_backoff_s must be >= 0")
        self.eval_log = eval_log
        self.bundle_dir = Path(bundle_dir)
        self.public_key = fmt.load_public_key(public_key)
        self.state_path = Path(state_path) if state_path else self.bundle_dir.parent / f".{self.bundle_dir.name}.sync.json"
        self.retries, self.backoff_s, self.max_backoff_s, self._sleep = int(retries), backoff_s, max_backoff_s, sleep
        self.mlp_trainer = mlp_trainer
        verify = ssl.create_default_context(cafile=str(ca_cert)) if ca_cert else True
        self._http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token.strip()}"},
                                  timeout=timeout_s, verify=verify, transport=transport)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- one sync -----------------------------------------------------------------------------

    def run_once(self) -> SyncResult:
        """Upload this round's update (if a round is open), then install a newer bundle (if any).

        Raises
        ------
        SyncRejectedError
            The server refused a request (4xx); ``status`` says why.
        SyncError
            The server stayed unreachable or failing after the retries, or answered nonsense.
        BundleError
            A published bundle failed verification (nothing was installed).
        ShapeError
            The log's embeddings do not fit the round's embedder.
        """
        state = self._read_state()
        round_id = update_id = log_size = skipped = None
        uploaded = late = False
        answer = self._request("GET", "/v1/rounds/current")
        if answer.status_code == 200:
            body = _json(answer)
            round_id, payload, content_type, skipped = self._prepare_upload(body)
            if payload is not None:
                key = f"r{round_id}-{hashlib.sha256(payload).hexdigest()}"
                last = state.get("last_upload") or {}
                if last.get("key") == key:  # acknowledged before: same round, same log
                    update_id, late, log_size = last.get("update_id"), bool(last.get("late")), last.get("log_size")
                else:
                    receipt = _json(self._request(
                        "POST", f"/v1/rounds/{round_id}/updates", content=payload,
                        headers={"Idempotency-Key": key, "Content-Type": content_type}))
                    update_id, late, uploaded = receipt.get("update_id"), bool(receipt.get("late")), True
                    log_size = receipt.get("log_size")
                    state["last_upload"] = {"round_id": round_id, "key": key, "update_id": update_id,
                                            "late": late, "log_size": log_size}
                    self._write_state(state)
        elif answer.status_code != 204:
            raise SyncError(f"GET /v1/rounds/current answered {answer.status_code}")
        version, updated = self._update_bundle(state)
        return SyncResult(round_id, uploaded, late, update_id, log_size, version, updated, skipped)

    def _prepare_upload(self, body: dict) -> tuple[int, bytes | None, str, str | None]:
        """(round id, upload body or None, its content type, why nothing is uploaded)."""
        client_id = str(body.get("client_id", ""))
        if body.get("kind") == "mlp":
            return self._prepare_mlp(body, client_id)
        spec = RoundSpec.from_json(body)
        update = kmeans_update(self.eval_log.rows(), spec)
        payload = json.dumps(update.to_payload(client_id, spec), allow_nan=False, separators=(",", ":")).encode()
        return spec.round_id, payload, "application/json", None

    def _prepare_mlp(self, body: dict, client_id: str) -> tuple[int, bytes | None, str, str | None]:
        try:
            round_id, url, digest = int(body["round_id"]), str(body["parameters_url"]), str(body["parameters_hash"])
        except (KeyError, TypeError, ValueError) as exc:
            raise SyncError(f"malformed MLP round description from the server: {exc!r}") from exc
        ctype = "application/x-safetensors"
        if self.mlp_trainer is None:
            why = "MLP round: this client cannot train (no mlp_trainer; `fedroute sync` with the trainer extra can)"
            return round_id, None, ctype, why
        if not url.startswith("/v1/rounds/"):
            raise SyncError(f"MLP round: unexpected parameters URL {url!r}")
        parameters = self._request("GET", url).content
        if hashlib.sha256(parameters).hexdigest() != digest:
            raise SyncError(f"round {round_id}: parameters do not match their hash")
        payload = self.mlp_trainer(self.eval_log.rows(), body, parameters, client_id)
        if payload is None:
            return round_id, None, ctype, f"MLP round: fewer than min_count={body.get('min_count')} evaluations to train on"
        return round_id, payload, ctype, None

    # -- bundle -------------------------------------------------------------------------------

    def _update_bundle(self, state: dict) -> tuple[int | None, bool]:
        current = bundle_install.read_version(self.bundle_dir)
        headers = {}
        if state.get("bundle_etag") and state.get("bundle_version") == current:
            headers["If-None-Match"] = state["bundle_etag"]
        answer = self._request("GET", "/v1/bundles/latest", headers=headers, ok=(200, 304, 404))
        if answer.status_code in (304, 404):
            return current, False
        raw = answer.content
        manifest = fmt.verify_manifest(raw, self.public_key)
        version = int(manifest["bundle_version"])
        if current is None or version > current:
            self._install(manifest, raw)
        state.update(bundle_etag=answer.headers.get("etag"), bundle_version=max(version, current or 0))
        self._write_state(state)
        return max(version, current or 0), current is None or version > current

    def _install(self, manifest: dict, raw: bytes) -> None:
        local = self._local_files()
        with bundle_install.locked(self.bundle_dir):
            target = bundle_install.new_version_dir(self.bundle_dir, manifest["bundle_version"])
            try:
                for name, digest in manifest["files"].items():
                    if digest in local:
                        shutil.copyfile(local[digest], target / name)
                    else:
                        self._download(digest, target / name)
                bundle_install.write_synced(target / fmt.MANIFEST_FILE, raw)
                fmt.read_verified(target, self.public_key, wanted=())
                from sdk.router import Router

                Router.load(target, self.public_key)  # refuses router/embedder/price mismatches
            except BaseException:
                shutil.rmtree(target, ignore_errors=True)
                raise
            bundle_install.publish(self.bundle_dir, target)

    def _local_files(self) -> dict[str, Path]:
        """sha256 -> path of the files of the bundle in use (as its manifest lists them; the copy
        is re-verified after installation)."""
        try:
            directory = self.bundle_dir.resolve()
            listed = json.loads((directory / fmt.MANIFEST_FILE).read_text())["files"]
            return {h: directory / n for n, h in listed.items() if fmt.is_plain_file_name(n)}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return {}

    def _download(self, digest: str, path: Path) -> None:
        for attempt in range(self.retries + 1):
            try:
                h = hashlib.sha256()
                size = 0
                with self._http.stream("GET", f"/v1/bundles/files/{digest}") as answer:
                    if 500 <= answer.status_code < 600 and attempt < self.retries:
                        self._backoff(attempt)
                        continue
                    _raise_for_status(answer, read=True)
                    with path.open("wb") as f:
                        for chunk in answer.iter_bytes(1 << 20):
                            size += len(chunk)
                            if size > fmt.MAX_FILE_BYTES:
                                raise BundleError(f"{path.name}: download over the {fmt.MAX_FILE_BYTES}-byte limit")
                            h.update(chunk)
                            f.write(chunk)
                        f.flush()
                        os.fsync(f.fileno())
                if h.hexdigest() != digest:
                    raise BundleError(f"{path.name}: downloaded sha256 does not match the manifest")
                return
            except httpx.TransportError as exc:
                if attempt >= self.retries:
                    raise SyncError(f"downloading {path.name} failed after {attempt + 1} attempts: {exc!r}") from exc
                self._backoff(attempt)

    # -- HTTP with retries --------------------------------------------------------------------

    def _request(self, method: str, path: str, *, ok=(200, 201, 204), **kwargs) -> httpx.Response:
        last: str = ""
        for attempt in range(self.retries + 1):
            try:
                answer = self._http.request(method, path, **kwargs)
            except httpx.TransportError as exc:  # connect/read/write errors and timeouts
                last = repr(exc)
            else:
                if answer.status_code in ok:
                    return answer
                if not 500 <= answer.status_code < 600:
                    _raise_for_status(answer)
                last = f"{answer.status_code} {answer.text[:200]}"
            if attempt < self.retries:
                self._backoff(attempt)
        raise SyncError(f"{method} {path} failed after {self.retries + 1} attempts: {last}")

    def _backoff(self, attempt: int) -> None:
        delay = min(self.max_backoff_s, self.backoff_s * (2 ** attempt))
        self._sleep(delay * (0.5 + random.random() / 2))

    # -- state --------------------------------------------------------------------------------

    def _read_state(self) -> dict:
        try:
            state = json.loads(self.state_path.read_text())
        except FileNotFoundError:
            return {"version": STATE_VERSION}
        except (OSError, ValueError) as exc:
            raise SyncError(f"sync state {self.state_path} is unreadable ({exc}); delete it to start over") from exc
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise SyncError(f"sync state {self.state_path} has an unknown format; delete it to start over")
        return state

    def _write_state(self, state: dict) -> None:
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.state_path.with_name(self.state_path.name + f".tmp-{os.getpid()}")
        bundle_install.write_synced(tmp, json.dumps(state, sort_keys=True).encode())
        os.replace(tmp, self.state_path)
        bundle_install.fsync_dir(self.state_path.parent)


def _json(answer: httpx.Response) -> dict:
    try:
        body = answer.json()
    except ValueError as exc:
        raise SyncError(f"{answer.request.url.path} answered non-JSON ({answer.status_code})") from exc
    if not isinstance(body, dict):
        raise SyncError(f"{answer.request.url.path} answered JSON that is not an object")
    return body


def _raise_for_status(answer: httpx.Response, read: bool = False) -> None:
    if answer.status_code < 400:
        return
    if read:
        answer.read()
    try:
        detail = answer.json().get("detail", answer.text)
    except (ValueError, AttributeError):
        detail = answer.text
    if answer.status_code < 500:
        raise SyncRejectedError(answer.status_code, str(detail)[:500])
    raise SyncError(f"{answer.request.url.path} answered {answer.status_code}: {str(detail)[:200]}")
