"""``fedroute export --selector RUN/fedprism_seed0``: FedPrism (prompt router + experts) -> one signed bundle.

The bundle (kind ``selector/routed_onnx_pair``, format in :mod:`sdk.routed_selector`) holds what
:meth:`trainer.experts.fedprism.FedPrismTrainer.predict_proba` uses: the frozen prompt embedder the router
reads (the sentence-transformer of ``trainer.embeddings.EmbedderConfig``, exported by optimum as the router
bundles' embedder is, :func:`export.embedder_onnx.export_embedder`), the prompt router's weights
(``prompt_router.npz``) and every expert as an ``onnx_pair`` graph (:func:`export.selector_export.selector_to_onnx`:
backbone with the expert's LoRA merged + pooling + pair head), or the ``top_k`` experts the router sends most
of the run's validation prompts to. With ``int8`` the embedder and the experts are also quantised
(onnxruntime dynamic; the embedder's and the selector's rules for what stays fp32).

Parity over the whole pipeline (:func:`check_routed_parity`, through ``sdk.Selector`` on the staged bundle,
exactly as an app loads it), on real held-out pairs, against the trainer's own path: prompt embedding by
``trainer.embeddings.embed_texts``, ``PromptRouter.route`` (restricted to the shipped experts), and the
routed expert's torch module with its adapter **not** merged:

- fp32: every prompt routed to the trainer's expert and ``max |logit_sdk - logit_torch| <=``
  :data:`export.selector_export.FP32_MAX_LOGIT_DIFF` over both orders of every pair;
- int8: decisions (``P(A better) > 0.5``) agree with the trainer's on ``>=``
  :data:`export.selector_export.INT8_MIN_DECISION_AGREEMENT` of the pairs (routing included).

A run trained with the generator prior (``generator_prior.json``: Bradley-Terry strengths and each expert's
weight) ships them as the manifest's ``selector.generator_prior`` (:mod:`sdk.routed_selector`); the parity pairs'
generators (``source_a`` / ``source_b``) are then also passed to ``Selector.prefer_many`` and compared with the
trainer's ``sigmoid((l(a, b) - l(b, a)) / 2 + gamma_k g)`` (:func:`trainer.generator_prior.generator_logit`):
fp32 ``max |P_sdk - P_torch| <=`` :data:`export.selector_export.FP32_MAX_LOGIT_DIFF`, int8 decisions as above.

A failed check raises :class:`~export.errors.ParityError` and writes nothing at ``out``.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

from export.bundle_writer import check_replaceable, check_version, next_bundle_version, write_bundle, write_checked_bundle
from export.embedder_onnx import export_embedder, quantize_embedder
from export.errors import ExportError
from export.scratch_folder import scratch_folder
from export.selector_export import (
    FP32_MAX_LOGIT_DIFF,
    INT8_MIN_DECISION_AGREEMENT,
    PARITY_COLUMNS,
    int8_excluded_matmuls,
    load_trained_selector,
    selector_fields,
    selector_to_onnx,
    torch_logits,
)
from export.signing import load_signing_key
from sdk import bundle_manifest as fmt
from sdk.errors import InvalidInputError
from sdk.routed_selector import EMBEDDER_FILES, EMBEDDER_TOKENIZER_FILE, KIND, ROLE_TAGS, ROUTER_FILE, expert_file, role_counts
from sdk.selector import FAMILY, MANIFEST_KEY, Selector
from trainer.preference_metrics import pairwise_accuracy


def is_fedprism_run(folder: Path) -> bool:
    """True when ``folder`` is a saved FedPrism run (``router.safetensors`` + ``fedprism_config.json``)."""
    return (Path(folder) / "router.safetensors").is_file() and (Path(folder) / "fedprism_config.json").is_file()


def load_run(run_dir: Path):
    """(PromptRouter, n_experts, FedPrismConfig dict, generator prior dict or None) of a saved FedPrism run.

    Raises
    ------
    ExportError
        The run's files cannot be read, its routing is not ``'router'`` (a baseline's folder: export one
        of its experts instead), or it is a ``length_prior='domain'`` run (its experts need the pair's
        domain, which ``Selector.prefer`` does not take), or its ``generator_prior.json`` is not the
        strengths and one finite weight per expert.
    """
    from safetensors.numpy import load_file  # safetensors: optional heavy dependency, imported on use

    from trainer.experts.prompt_router import PromptRouter  # trainer.experts.prompt_router imports torch: on use only

    run_dir = Path(run_dir)
    try:
        config = json.loads((run_dir / "fedprism_config.json").read_text())
        state = load_file(str(run_dir / "router.safetensors"))
        n_experts, hidden = int(config["n_experts"]), int(config["router_hidden"])
        router = PromptRouter(state["net.0.weight"].shape[1], n_experts, hidden)
        router.load_state(state)
    except Exception as exc:  # noqa: BLE001 - JSON / safetensors / shape errors: one clear message
        raise ExportError(f"{run_dir}: not a FedPrism run written by `fedroute prism train` "
                          f"({type(exc).__name__}: {exc})") from exc
    if config.get("routing") != "router":
        raise ExportError(f"{run_dir} routes by {config.get('routing')!r}, not by a prompt router: export one of its "
                          "experts (--selector RUN/<method>_seed0/expert_0)")
    if (run_dir / "length_prior.json").exists():
        raise ExportError(f"{run_dir} is a length_prior='domain' run: its experts need the pair's domain, which "
                          "Selector.prefer does not take; export one expert with --prior-domain D instead")
    missing = [k for k in range(n_experts) if not (run_dir / f"expert_{k}").is_dir()]
    if missing:
        raise ExportError(f"{run_dir} lacks expert folders {missing} of its {n_experts} experts")
    prior = None
    if (run_dir / "generator_prior.json").exists():
        try:
            saved = json.loads((run_dir / "generator_prior.json").read_text())
            prior = {"strengths": {str(k): float(v) for k, v in saved["strengths"].items()},
                     "weights": [float(v) for v in saved["weights"]]}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ExportError(f"{run_dir / 'generator_prior.json'}: not written by `fedroute prism train` "
                              f"({type(exc).__name__}: {exc})") from exc
        values = np.array([*prior["strengths"].values(), *prior["weights"]])
        if len(prior["weights"]) != n_experts or not np.isfinite(values).all():
            raise ExportError(f"{run_dir / 'generator_prior.json'}: needs {n_experts} finite weights and finite strengths")
    return router, n_experts, config, prior


def top_experts(router, prompt_emb: np.ndarray, k: int) -> list[int]:
    """The ``k`` experts the router sends most of ``prompt_emb`` to (ties: lower index), ascending.

    prompt_emb : ndarray (n, dim) float32, e.g. the run's validation prompts."""
    counts = np.bincount(router.route(prompt_emb), minlength=router.n_experts)
    return sorted(np.argsort(-counts, kind="stable")[:k].tolist())


def trainer_route(router, prompt_emb: np.ndarray, shipped: list[int]) -> np.ndarray:
    """The trainer's routing restricted to ``shipped``: argmax of the router's logits over those experts."""
    import torch  # torch: optional heavy dependency, imported on use

    with torch.no_grad():
        logits = router(torch.from_numpy(np.asarray(prompt_emb, dtype=np.float32))).numpy()
    idx = np.asarray(shipped, dtype=np.int64)
    return idx[np.argmax(logits[:, idx], axis=1)]


def trainer_logits(run_dir: Path, selector, router, prompt_emb: np.ndarray, shipped: list[int], pairs
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The trainer's (route, logit_ab, logit_ba) of each pair: routed by ``router`` on ``prompt_emb``, scored by
    the routed expert's torch module (adapter not merged). ``selector`` is reloaded with each expert in turn."""
    route = trainer_route(router, prompt_emb, shipped)
    ab, ba = np.zeros(len(pairs)), np.zeros(len(pairs))
    for k in np.unique(route):
        sel = route == k
        selector.load_expert(Path(run_dir) / f"expert_{k}")
        sub = pairs[sel]
        ab[sel], ba[sel] = torch_logits(selector, sub["prompt"].tolist(), sub["response_a"].tolist(), sub["response_b"].tolist())
    return route, ab, ba


def check_routed_parity(bundle_dir: Path, public_key, reference: tuple[np.ndarray, np.ndarray, np.ndarray], pairs,
                        precisions, progress: Callable[[str], None] = print, prior: dict | None = None) -> dict:
    """Parity of the staged routed bundle (loaded by ``sdk.Selector``) with the trainer's pipeline.

    reference : the trainer's (route, logit_ab, logit_ba) of each pair (:func:`trainer_logits`).
    pairs : DataFrame with :data:`export.selector_export.PARITY_COLUMNS` (and ``domain``, ``source_a``,
        ``source_b`` with ``prior``).
    prior : the run's generator prior (:func:`load_run`) or None.

    Returns
    -------
    dict with ``n_pairs`` (scored), ``n_refused_by_sdk`` (pairs with a text the SDK refuses as input: no token its
    tokenizer can read; left out), ``torch_accuracy`` (the trainer's pipeline), ``torch_route_share`` and per precision
    ``route_agreement``, ``max_abs_logit_diff``, ``max_abs_proba_diff``, ``decision_agreement``, ``accuracy``
    (with ``prior``: also ``torch_accuracy_with_generators``, ``share_with_prior`` (pairs whose two generators are
    known) and per precision ``with_generators``: ``max_abs_proba_diff``, ``decision_agreement``, ``accuracy``);
    ``failures`` and ``passed``.
    """
    prompts, ra, rb = (pairs[c].tolist() for c in ("prompt", "response_a", "response_b"))
    sels = {p: Selector.load(bundle_dir, public_key, precision=p) for p in precisions}
    keep = np.ones(len(pairs), dtype=bool)  # pairs the SDK refuses as input (a text with no readable token) are left out
    first = []  # the first precision's logits of the kept pairs, reused below
    for i, (x, a, b) in enumerate(zip(prompts, ra, rb)):
        try:
            first.append(sels[precisions[0]].logits(x, a, b))
        except InvalidInputError:
            keep[i] = False
    route_t, ab, ba = (v[keep] for v in reference)
    label = pairs["label"].to_numpy()[keep]
    prompts, ra, rb = ([t for t, k in zip(seq, keep) if k] for seq in (prompts, ra, rb))
    p_torch = 0.5 * (1.0 + np.tanh(0.25 * (ab - ba)))
    shares = np.bincount(route_t, minlength=int(route_t.max()) + 1) / len(route_t)
    report: dict = {"n_pairs": int(keep.sum()), "n_refused_by_sdk": int((~keep).sum()),
                    "torch_accuracy": pairwise_accuracy(p_torch, label), "torch_route_share": shares.tolist(), "failures": []}
    for precision in precisions:
        progress(f"parity: routed {precision} selector on {len(prompts)} real pairs (embed, route, both orders)")
        sel = sels[precision]
        route = np.array([sel.route(x) for x in prompts])
        logits = np.array(first if precision == precisions[0] else [sel.logits(x, a, b) for x, a, b in zip(prompts, ra, rb)],
                          dtype=np.float64)
        p = 0.5 * (1.0 + np.tanh(0.25 * (logits[:, 0] - logits[:, 1])))
        diff = float(np.max(np.abs(np.concatenate([logits[:, 0] - ab, logits[:, 1] - ba]))))
        agree = float(np.mean((p > 0.5) == (p_torch > 0.5)))
        routes = float(np.mean(route == route_t))
        report[precision] = {"route_agreement": routes, "max_abs_logit_diff": diff,
                             "max_abs_proba_diff": float(np.max(np.abs(p - p_torch))), "decision_agreement": agree,
                             "accuracy": pairwise_accuracy(p, label)}
        if precision == "fp32" and not (routes == 1.0 and diff <= FP32_MAX_LOGIT_DIFF):
            report["failures"].append(f"fp32 routes agree on {routes:.4f} of the prompts, max |logit diff| {diff:.2e} "
                                      f"(needs 1 and <= {FP32_MAX_LOGIT_DIFF:g})")
        if precision == "int8" and not agree >= INT8_MIN_DECISION_AGREEMENT:
            report["failures"].append(f"int8 decision agreement {agree:.4f} < {INT8_MIN_DECISION_AGREEMENT}")
    if prior is not None:
        _check_generator_parity(report, sels, pairs[keep], (route_t, ab, ba), prior, progress)
    report["passed"] = not report["failures"]
    return report


def _check_generator_parity(report: dict, sels: dict, pairs, reference, prior: dict, progress) -> None:
    """The parity of ``Selector.prefer_many`` given the pairs' generators with the trainer's prior-shifted
    probability (module docstring); adds to ``report``."""
    from trainer.generator_prior import generator_logit  # trainer side: on use only

    route_t, ab, ba = reference
    g = generator_logit(pairs, prior["strengths"])
    p_torch = 1.0 / (1.0 + np.exp(-(0.5 * (ab - ba) + np.asarray(prior["weights"])[route_t] * g)))
    label = pairs["label"].to_numpy()
    report["torch_accuracy_with_generators"] = pairwise_accuracy(p_torch, label)
    report["share_with_prior"] = float(np.mean(g != 0))
    texts = [pairs[c].tolist() for c in ("prompt", "response_a", "response_b", "source_a", "source_b")]
    for precision, sel in sels.items():
        progress(f"parity: routed {precision} selector with the pairs' generators (Bradley-Terry prior)")
        p = sel.prefer_many(*texts)
        entry = {"max_abs_proba_diff": float(np.max(np.abs(p - p_torch))),
                 "decision_agreement": float(np.mean((p > 0.5) == (p_torch > 0.5))), "accuracy": pairwise_accuracy(p, label)}
        report[precision]["with_generators"] = entry
        if precision == "fp32" and not entry["max_abs_proba_diff"] <= FP32_MAX_LOGIT_DIFF:
            report["failures"].append(f"fp32 with generators: max |P diff| {entry['max_abs_proba_diff']:.2e} > {FP32_MAX_LOGIT_DIFF:g}")
        if precision == "int8" and not entry["decision_agreement"] >= INT8_MIN_DECISION_AGREEMENT:
            report["failures"].append(f"int8 with generators: decision agreement {entry['decision_agreement']:.4f} "
                                      f"< {INT8_MIN_DECISION_AGREEMENT}")


def _router_npz(router) -> bytes:
    state = router.state()
    buf = io.BytesIO()
    np.savez(buf, w1=state["net.0.weight"], b1=state["net.0.bias"], w2=state["net.2.weight"], b2=state["net.2.bias"])
    return buf.getvalue()


def export_routed_selector_bundle(run_dir: Path, out: Path, signing_key: Path, parity_pairs, *, int8: bool = False,
                                  top_k: int | None = None, top_k_prompts: list[str] | None = None,
                                  bundle_version: int | None = None, cache_dir: Path | None = None,
                                  progress: Callable[[str], None] = print) -> dict:
    """Export the FedPrism run at ``run_dir`` (``RUN/fedprism_seed0``) as one signed routed selector bundle.

    Parameters
    ----------
    run_dir : folder written by ``FedPrismTrainer.save`` (router.safetensors, expert_<k>/, selector_config.json,
        fedprism_config.json).
    out : bundle directory to create or replace (atomically).
    signing_key : path of ``signing.key``.
    parity_pairs : DataFrame of real held-out pairs (:data:`export.selector_export.PARITY_COLUMNS`), >= 1 row.
    int8 : also ship the int8 embedder and experts (the SDK's default when present).
    top_k : ship only the ``top_k`` experts the router sends most of ``top_k_prompts`` to (the run's
        validation prompts); None ships all M.
    cache_dir : embedding cache of ``trainer.embeddings`` (the prompts' reference embeddings).

    Returns
    -------
    dict with ``manifest`` and ``parity`` (the report of :func:`check_routed_parity`).

    Raises
    ------
    ExportError
        See :func:`load_run`; no parity pairs or a missing column; ``top_k`` outside [1, M] or without prompts;
        ``out`` not replaceable.
    ParityError
        A parity threshold is missed; nothing is written at ``out``.
    """
    from trainer.embeddings import EmbedderConfig, embed_texts, resolve_model_path  # trainer side: on use only

    key = load_signing_key(signing_key)
    out, run_dir = Path(out), Path(run_dir)
    check_replaceable(out, FAMILY)
    version = bundle_version if bundle_version is not None else next_bundle_version(out)
    check_version(out, version)
    if parity_pairs is None or len(parity_pairs) == 0:
        raise ExportError("no parity pairs: give real preference pairs to check the export against")
    missing = [c for c in PARITY_COLUMNS if c not in getattr(parity_pairs, "columns", ())]
    if missing:
        raise ExportError(f"parity_pairs lacks columns {missing}: give a DataFrame with {list(PARITY_COLUMNS)}")
    router, n_experts, config, prior = load_run(run_dir)
    if prior is not None:
        missing = [c for c in ("domain", "source_a", "source_b") if c not in parity_pairs.columns]
        if missing:
            raise ExportError(f"parity_pairs lacks columns {missing}: a generator-prior run is checked with the pairs' generators")
    emb_config = EmbedderConfig()  # what `prism train` embeds prompts with (trainer.experts.experiment.prepare_data)
    scale = float(config.get("router_role_scale", 0.0))

    def router_input(prompts: list[str]) -> np.ndarray:  # the trainer's router input (FedPrismConfig.router_role_scale)
        e = embed_texts(prompts, emb_config, cache_dir, show_progress=False)
        return e if scale == 0 else np.c_[e, scale * role_counts(prompts)].astype(np.float32)
    shipped = list(range(n_experts))
    if top_k is not None:
        if not 1 <= top_k <= n_experts or not top_k_prompts:
            raise ExportError(f"top_k must be in [1, {n_experts}] and come with the prompts to rank experts on, got {top_k}")
        shipped = top_experts(router, router_input(top_k_prompts), top_k)
        progress(f"top-{top_k} experts by their share of {len(top_k_prompts)} validation prompts: {shipped}")
    selector = load_trained_selector(run_dir / f"expert_{shipped[0]}")
    precisions = ["fp32"] + (["int8"] if int8 else [])
    files: dict[str, bytes] = {fmt.TOKENIZER_FILE: selector.pair_encoder.tokenizer.to_str().encode("utf-8"),
                               ROUTER_FILE: _router_npz(router)}
    with scratch_folder(out) as tmp:
        progress(f"exporting the prompt embedder {emb_config.model} (optimum, opset 17)")
        emb = export_embedder(resolve_model_path(emb_config.model), tmp / "embedder", emb_config.max_tokens,
                              emb_config.truncation_side)
        files[EMBEDDER_TOKENIZER_FILE] = emb.tokenizer.read_bytes()
        files[EMBEDDER_FILES["fp32"]] = emb.model.read_bytes()
        if int8:
            files[EMBEDDER_FILES["int8"]] = quantize_embedder(emb.model, tmp / EMBEDDER_FILES["int8"]).read_bytes()
        for k in shipped:
            progress(f"exporting expert {k} ({selector.config.backbone}, LoRA merged) to ONNX")
            selector.load_expert(run_dir / f"expert_{k}")
            files[expert_file(k, "fp32")] = graph = selector_to_onnx(selector)
            if int8:
                fp32_path = tmp / expert_file(k, "fp32")
                fp32_path.write_bytes(graph)
                files[expert_file(k, "int8")] = quantize_embedder(
                    fp32_path, tmp / expert_file(k, "int8"), exclude=int8_excluded_matmuls(fp32_path)).read_bytes()
        fields = selector_fields(selector, "fedprism-routed", "fedprism", None, {}, version)
        fields[MANIFEST_KEY] = KIND
        fields["selector"] |= {
            "experts": shipped, "n_experts": n_experts, "top_k": top_k,
            "files": {p: [expert_file(k, p) for k in shipped] for p in precisions},
            "prompt_embedder": {"name": emb_config.model, "files": {p: EMBEDDER_FILES[p] for p in precisions},
                                "tokenizer": EMBEDDER_TOKENIZER_FILE, "dim": int(emb.dim),
                                "max_tokens": emb_config.max_tokens, "truncation_side": emb_config.truncation_side},
            "prompt_router": {"file": ROUTER_FILE, "hidden": int(config["router_hidden"])}
            | ({} if scale == 0 else {"role_tags": list(ROLE_TAGS), "role_scale": scale}),
        } | ({} if prior is None else {"generator_prior": prior})
        staged = tmp / "staged"
        write_bundle(staged, files, fields, key)
        progress(f"the trainer's pipeline on {len(parity_pairs)} parity pairs (embed, route, score both orders)")
        prompt_emb = router_input(parity_pairs["prompt"].tolist())
        reference = trainer_logits(run_dir, selector, router, prompt_emb, shipped, parity_pairs)
        report = check_routed_parity(staged, key.public_key(), reference, parity_pairs, precisions, progress=progress,
                                     prior=prior)
        manifest = write_checked_bundle(out, files, fields, key, report, "routed selector parity check")
    progress(f"wrote routed selector bundle v{manifest['bundle_version']} ({len(shipped)} of {n_experts} experts) to {out}")
    return {"manifest": manifest, "parity": report}
