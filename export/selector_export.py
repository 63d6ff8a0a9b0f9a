"""``fedroute export --selector``: a trained binary selector -> signed, parity-checked ONNX bundle.

A FedPrism expert (paper 000 §3.2; ARCHITECTURE.md §7) is a frozen backbone + a LoRA adapter + a pair
head (:class:`trainer.experts.selector.PairSelector`). The export merges the adapter into a copy of the
backbone (peft ``merge_and_unload``: ``W + (alpha / r) B A``, the same function without the adapter
branch), wraps backbone + pooling + head in one module and writes it with ``torch.onnx.export``
(TorchScript exporter, ``dynamo=False``, opset 17, dynamic batch axis), as ``export.router_export`` does
for the MLP router. The graph's inputs and output are the contract of :mod:`sdk.selector`. Optionally an
int8 copy (onnxruntime dynamic quantisation, :func:`export.embedder_onnx.quantize_embedder`, the
embedder's rule for which MatMuls stay fp32).

Parity (through ``sdk.Selector`` on the staged bundle, exactly as an app loads it), on real preference
pairs, against the trainer's torch module with the adapter **not** merged:

- fp32: ``max |logit_onnx - logit_torch| <=`` :data:`FP32_MAX_LOGIT_DIFF` over both orders of every pair;
- int8: decisions (``P(A better) > 0.5``) agree with torch on ``>=`` :data:`INT8_MIN_DECISION_AGREEMENT`
  of the pairs.

A failed check raises :class:`~export.errors.ParityError` and writes nothing at ``out``; the figures go
into the bundle's signed ``parity.json``.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from export import kinds as export_kinds
from export.bundle_writer import check_replaceable, check_version, next_bundle_version, write_bundle, write_checked_bundle
from export.embedder_onnx import quantize_embedder
from export.errors import ExportError
from export.scratch_folder import scratch_folder
from export.torch_onnx import merged_lora_copy, module_to_onnx
from export.signing import load_signing_key
from sdk import bundle_manifest as fmt
from sdk.selector import FAMILY, KIND, MANIFEST_KEY, OUTPUT_NAME, SELECTOR_FILES, SWAPPED_OUTPUT_NAME
from export.embedder_onnx import sensitive_matmuls
from sdk.pair_features import pair_features_many
from sdk.selector import Selector
from trainer.preference_metrics import pairwise_accuracy

OPSET = 17
#: Columns of the real pairs the parity check reads (``trainer.data.preferences`` schema).
PARITY_COLUMNS = ("prompt", "response_a", "response_b", "label")
FP32_MAX_LOGIT_DIFF = 1e-3
INT8_MIN_DECISION_AGREEMENT = 0.99


@dataclass(frozen=True)
class SelectorExportResult:
    """What :func:`export_selector_bundle` wrote: ``manifest`` (dict) and the ``parity`` report (dict)."""

    out: Path
    manifest: dict
    parity: dict


def load_trained_selector(expert_dir: Path):
    """The trainer's :class:`~trainer.experts.selector.PairSelector` with the expert saved at
    ``expert_dir``, through the trainer kind ``selector/onnx_pair`` (:mod:`trainer.experts.selector_kind`).

    Raises
    ------
    ExportError
        Missing files or an expert that does not fit its config.
    """
    from sdk.errors import InvalidInputError
    from trainer import kinds as trainer_kinds
    from trainer.experts import selector_kind  # noqa: F401  (registers the trainer kind)

    try:
        return trainer_kinds.get(KIND, family=FAMILY).load(Path(expert_dir))
    except InvalidInputError as exc:
        raise ExportError(str(exc)) from exc


def _uses_token_types(selector) -> bool:
    return selector.config.encoding.prefix_token is not None


def selector_to_onnx(selector) -> bytes:
    """``selector.onnx`` bytes: backbone with the LoRA adapter merged + pooling + head (sdk.selector contract).

    Parameters
    ----------
    selector : trainer.experts.selector.PairSelector, with its expert loaded (not modified here).

    Returns
    -------
    bytes of an ONNX model (opset 17) with outputs ``logit`` and ``logit_ba`` of shape (batch,), float32: the
    logits of (a, b) and (b, a) from one encoding of the a and b segments.
    """
    import torch  # torch: optional heavy dependency, imported on use
    from torch import nn  # torch: optional heavy dependency, imported on use

    merged = merged_lora_copy(selector.backbone)
    pooling = selector.config.pooling
    token_types = _uses_token_types(selector)

    class Exported(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = merged
            self.head = copy.deepcopy(selector.head)
            self.length_skip = copy.deepcopy(selector.length_skip)

        def _pooled(self, ids, mask, types):
            kwargs = {"input_ids": ids, "attention_mask": mask}
            if types is not None:
                kwargs["token_type_ids"] = types
            hidden = self.encoder(**kwargs).last_hidden_state
            m = mask.to(hidden.dtype)
            if pooling == "mean":
                return (hidden * m.unsqueeze(-1)).sum(1) / m.sum(1, keepdim=True).clamp_min(1.0)
            last = mask.sum(1).long() - 1
            return hidden[torch.arange(hidden.shape[0]), last]

        def forward(self, input_ids_a, attention_mask_a, input_ids_b, attention_mask_b, length_features,
                    token_type_ids_a=None, token_type_ids_b=None):
            # One encoder call on the A and B segments stacked: each weight has one consumer in the graph
            # (quantisation then covers every MatMul) and the graph holds one copy of the backbone.
            n = input_ids_a.shape[0]
            types = None if token_type_ids_a is None else torch.cat([token_type_ids_a, token_type_ids_b])
            h = self._pooled(torch.cat([input_ids_a, input_ids_b]), torch.cat([attention_mask_a, attention_mask_b]),
                             types)
            h_a, h_b = h[:n], h[n:]
            # Both orders from the one encoding, through one head call: rows (a, b, f) then (b, a, -f).
            z = torch.cat([torch.cat([h_a, h_b, length_features], dim=1),
                           torch.cat([h_b, h_a, -length_features], dim=1)])
            f = torch.cat([length_features, -length_features])
            out = self.head(z).squeeze(1) + self.length_skip(f).squeeze(1)
            return out[:n], out[n:]

    module = Exported().eval()
    seq_len = selector.config.encoding.seq_len
    enc = selector.pair_encoder.encode_segments(["a prompt", "another prompt"], ["an answer", "a second answer"])
    ids, mask, types = (torch.from_numpy(enc[k]) for k in ("input_ids", "attention_mask", "token_type_ids"))
    feats = torch.zeros(2, len(selector.config.pair_features))
    names = ["input_ids_a", "attention_mask_a", "input_ids_b", "attention_mask_b", "length_features"]
    args: tuple = (ids, mask, ids.flip(0), mask.flip(0), feats)
    if token_types:
        names += ["token_type_ids_a", "token_type_ids_b"]
        args += (types, types.flip(0))
    # batch and sequence axes are dynamic: the SDK cuts the padding columns no segment uses (exact in fp32,
    # attention and pooling are masked) so int8 activation scales see real tokens only
    dynamic = {n: ({0: "batch"} if n == "length_features" else {0: "batch", 1: "seq"}) for n in names}
    dynamic.update({OUTPUT_NAME: {0: "batch"}, SWAPPED_OUTPUT_NAME: {0: "batch"}})
    return module_to_onnx(module, args, names, [OUTPUT_NAME, SWAPPED_OUTPUT_NAME], dynamic,
                          {"selector_kind": KIND, "backbone": selector.config.backbone, "seq_len": str(seq_len),
                           "pooling": pooling})


def int8_excluded_matmuls(model: Path) -> list[str]:
    """MatMuls kept in fp32 in ``selector.int8.onnx``: the embedder's rule
    (:func:`export.embedder_onnx.sensitive_matmuls`, FFN output projections of the lower two thirds of
    the layers) plus the pair head and the length path (``/head/``, ``/length_skip/``): a few thousand
    weights that turn pooled vectors and length features into the logit, where uint8 activation
    scales would move every decision near P = 0.5."""
    import onnx  # onnx: optional heavy dependency, imported on use


    graph = onnx.load(str(model), load_external_data=False).graph
    head = [n.name for n in graph.node if n.op_type in ("MatMul", "Gemm") and n.name.startswith(("/head/", "/length_skip/"))]
    return sensitive_matmuls(model) + head


def torch_logits(selector, prompts, responses_a, responses_b) -> tuple[np.ndarray, np.ndarray]:
    """The trainer's logits in both orders, adapter not merged (the reference of the parity check).

    Returns
    -------
    (logit_ab, logit_ba), each ndarray of shape (n_pairs,), float64.
    """
    import torch  # torch: optional heavy dependency, imported on use


    enc_a = selector.pair_encoder.encode_segments(list(prompts), list(responses_a))
    enc_b = selector.pair_encoder.encode_segments(list(prompts), list(responses_b))
    feats = torch.from_numpy(pair_features_many(list(prompts), list(responses_a), list(responses_b),
                                                selector.config.pair_features))
    t = lambda enc, k: torch.from_numpy(enc[k])  # noqa: E731
    with torch.no_grad():
        h_a = selector.full_pooled(t(enc_a, "input_ids"), t(enc_a, "attention_mask"), t(enc_a, "token_type_ids"))
        h_b = selector.full_pooled(t(enc_b, "input_ids"), t(enc_b, "attention_mask"), t(enc_b, "token_type_ids"))
        ab = selector.pair_logits(h_a, h_b, feats).double().numpy()
        ba = selector.pair_logits(h_b, h_a, -feats).double().numpy()
    return ab, ba


def check_selector_parity(bundle_dir: Path, public_key, selector, pairs, precisions,
                          progress: Callable[[str], None] = print) -> dict:
    """Parity of the staged bundle (loaded by ``sdk.Selector``) with the trainer's module.

    Parameters
    ----------
    pairs : DataFrame with ``prompt``, ``response_a``, ``response_b``, ``label`` (real preference pairs).
    precisions : the selector precisions in the bundle (``"fp32"``, ``"int8"``).

    Returns
    -------
    dict with ``n_pairs``, ``torch_accuracy`` and per precision ``max_abs_logit_diff``,
    ``decision_agreement``, ``accuracy``; ``failures`` (list of str) and ``passed`` (bool).
    """

    prompts, ra, rb = (pairs[c].tolist() for c in ("prompt", "response_a", "response_b"))
    label = pairs["label"].to_numpy()
    ab, ba = torch_logits(selector, prompts, ra, rb)
    p_torch = 0.5 * (1.0 + np.tanh(0.25 * (ab - ba)))
    report: dict = {"n_pairs": len(pairs), "torch_accuracy": pairwise_accuracy(p_torch, label), "failures": []}
    for precision in precisions:
        progress(f"parity: {precision} selector on {len(pairs)} real pairs (both orders)")
        sel = Selector.load(bundle_dir, public_key, precision=precision)
        logits = np.array([sel.logits(x, a, b) for x, a, b in zip(prompts, ra, rb)], dtype=np.float64)
        p = 0.5 * (1.0 + np.tanh(0.25 * (logits[:, 0] - logits[:, 1])))
        diff = float(np.max(np.abs(np.concatenate([logits[:, 0] - ab, logits[:, 1] - ba]))))
        agree = float(np.mean((p > 0.5) == (p_torch > 0.5)))
        report[precision] = {"max_abs_logit_diff": diff, "decision_agreement": agree,
                             "accuracy": pairwise_accuracy(p, label)}
        if precision == "fp32" and not diff <= FP32_MAX_LOGIT_DIFF:
            report["failures"].append(f"fp32 max |logit diff| {diff:.2e} > {FP32_MAX_LOGIT_DIFF:g}")
        if precision == "int8" and not agree >= INT8_MIN_DECISION_AGREEMENT:
            report["failures"].append(f"int8 decision agreement {agree:.4f} < {INT8_MIN_DECISION_AGREEMENT}")
    report["passed"] = not report["failures"]
    return report


class OnnxPairSelectorExportKind(export_kinds.ExportKind):
    """``selector/onnx_pair``: ``tokenizer.json`` + ``selector.onnx`` (:func:`selector_to_onnx`); parity by
    :func:`check_selector_parity` (``test`` is the DataFrame of real pairs, ``reference`` is unused)."""

    family = FAMILY
    name = KIND

    def files(self, artefact) -> dict[str, bytes]:
        return {fmt.TOKENIZER_FILE: artefact.pair_encoder.tokenizer.to_str().encode("utf-8"),
                SELECTOR_FILES["fp32"]: selector_to_onnx(artefact)}

    def parity(self, bundle_dir, public_key, artefact, reference, test, precisions, progress=print) -> dict:
        return check_selector_parity(bundle_dir, public_key, artefact, test, precisions, progress=progress)


if KIND not in export_kinds.REGISTRY.names(FAMILY):
    export_kinds.register(OnnxPairSelectorExportKind())


def _provenance(expert_dir: Path) -> tuple[str, int | None]:
    """(method, expert index) from the run layout ``<method>_seed<s>/expert_<k>``; ("selector", None) otherwise."""
    method = expert_dir.parent.name.split("_seed")[0] if "_seed" in expert_dir.parent.name else "selector"
    tail = expert_dir.name.rsplit("_", 1)
    expert = int(tail[1]) if len(tail) == 2 and tail[0] == "expert" and tail[1].isdigit() else None
    return method, expert


def selector_fields(selector, name: str, method: str, expert: int | None, files: dict[str, str],
                    bundle_version: int) -> dict:
    """Manifest fields of a selector bundle (see :mod:`sdk.selector`)."""
    c = selector.config
    return {
        "bundle_version": int(bundle_version),
        MANIFEST_KEY: KIND,
        "selector": {
            "name": name, "backbone": c.backbone, "method": method, "expert": expert, "files": files,
            "pair_encoding": c.encoding.to_dict(), "pair_features": list(c.pair_features),
            "n_length_features": len(c.pair_features),
            "pooling": c.pooling,
            "lora": {"r": c.lora_r, "alpha": c.lora_alpha,
                     "layers": None if c.lora_layers is None else list(c.lora_layers), "merged": True},
        },
    }


def _fold_length_prior(selector, expert_dir: Path, prior_domain: str | None) -> None:
    """Add the run's per-domain length prior of ``prior_domain`` to the selector's length path, in place
    (``length_prior='domain'`` runs only; see :func:`export_selector_bundle`)."""
    import torch  # torch: optional heavy dependency (trainer extra), imported on use

    from sdk.errors import InvalidInputError  # kept beside its one use, like load_trained_selector's
    from trainer.experts.length_init import read_length_prior, saved_length_prior  # trainer side of the run layout: on use only

    try:
        priors = read_length_prior(expert_dir.parent)
    except InvalidInputError as exc:
        raise ExportError(str(exc)) from exc
    if priors is None:
        return
    if prior_domain is None:
        saved = list(priors)
        raise ExportError(f"{expert_dir} is a residual over a per-domain length prior (length_prior='domain'); "
                          f"give the domain the bundle serves (prior_domain / --prior-domain), one of {saved}")
    try:
        w = saved_length_prior(expert_dir.parent, prior_domain)
    except InvalidInputError as exc:
        raise ExportError(str(exc)) from exc
    with torch.no_grad():
        selector.length_skip.weight.add_(torch.from_numpy(w)[None, :])


def check_beats_length_only(selector, validation_pairs, train_pairs) -> dict:
    """The single-selector gate: the selector's accuracy on validation pairs against the label-free
    length-only baseline (one logistic regression on the length features, fitted on ``train_pairs``; the
    selector reads no domain label either). The per-domain baseline is reported beside it.

    Returns
    -------
    dict with ``n_pairs``, ``selector_accuracy``, ``length_only_global``, ``length_only_per_domain``, ``per_domain``
    ({domain: the three accuracies on its pairs}) and ``passed``.
    """
    from trainer.length_baseline import LengthBaseline  # trainer.length_baseline imports pandas: on use only

    ab, ba = torch_logits(selector, validation_pairs["prompt"].tolist(), validation_pairs["response_a"].tolist(),
                          validation_pairs["response_b"].tolist())
    label, dom = validation_pairs["label"].to_numpy(), validation_pairs["domain"].to_numpy()
    proba = {"selector": 0.5 * (1.0 + np.tanh(0.25 * (ab - ba)))}
    for name, per in (("length_only_global", False), ("length_only_per_domain", True)):
        proba[name] = LengthBaseline(per_domain=per).fit(train_pairs).predict_proba(validation_pairs)
    acc = {name: pairwise_accuracy(p, label) for name, p in proba.items()}
    return {"n_pairs": len(validation_pairs), "selector_accuracy": acc["selector"],
            "length_only_global": acc["length_only_global"], "length_only_per_domain": acc["length_only_per_domain"],
            "per_domain": {d: {name: pairwise_accuracy(p[dom == d], label[dom == d]) for name, p in proba.items()}
                           for d in sorted(set(dom))},
            "passed": bool(acc["selector"] >= acc["length_only_global"])}


def export_selector_bundle(expert_dir: Path, out: Path, signing_key: Path, parity_pairs, *, int8: bool = False,
                           name: str | None = None, method: str | None = None, expert: int | None = None,
                           bundle_version: int | None = None, prior_domain: str | None = None,
                           validation: tuple | None = None,
                           progress: Callable[[str], None] = print) -> SelectorExportResult:
    """Export the expert saved at ``expert_dir`` as a signed selector bundle at ``out``.

    Parameters
    ----------
    expert_dir : folder written by ``PairSelector.save_expert`` (``adapter/``, ``head.safetensors``), with
        ``selector_config.json`` in it or in one of its two parents.
    out : bundle directory to create or replace (atomically).
    signing_key : path of ``signing.key`` (``fedroute keygen``).
    parity_pairs : DataFrame of real pairs (``prompt``, ``response_a``, ``response_b``, ``label``), >= 1 row.
    int8 : also ship ``selector.int8.onnx`` (the SDK's default when present).
    name : the selector's name in the manifest (default: ``<method>-expert-<expert>`` or ``<method>``).
    method, expert : provenance written to the manifest (e.g. ``"fedprism"``, 2; ``"fedbis"``, 0); default
        read from the run layout ``<method>_seed0/expert_<k>``.
    bundle_version : default 1 + the version at ``out``.
    prior_domain : for an expert of a ``length_prior='domain'`` run (``length_prior.json`` beside the
        expert folders): the domain whose fixed length prior ``w_d`` is folded into the exported length
        path (``v + w_d``: exact for pairs of that domain, since the prior is the linear offset
        ``w_d . f``), e.g. ``'alpacaeval'``; the bundle then serves that domain. Refused for an expert of
        another run (it has no domain prior).
    validation : (validation pairs, train pairs) of the run (DataFrames of ``trainer.data.preferences``), or None:
        the export refuses a selector whose accuracy on the validation pairs is below the label-free
        length-only baseline fitted on the train pairs (:func:`check_beats_length_only`; the figures go to
        ``parity.json["validation"]``). None skips the gate (``parity.json["validation"]`` is null).

    Raises
    ------
    ExportError
        Unreadable expert, config or key; no parity pairs or pairs without a column of
        :data:`PARITY_COLUMNS`; ``out`` not replaceable (e.g. a router bundle); an expert of a
        ``length_prior='domain'`` run without ``prior_domain`` (it is a residual, not a selector on its
        own), a domain the prior lacks, or a ``prior_domain`` for an expert of another run; a selector below
        length-only on the validation pairs.
    ParityError
        A parity threshold is missed; nothing is written at ``out``.
    """
    key = load_signing_key(signing_key)
    out = Path(out)
    check_replaceable(out, FAMILY)  # a router bundle at out is not replaced by this one
    version = bundle_version if bundle_version is not None else next_bundle_version(out)
    check_version(out, version)
    if parity_pairs is None or len(parity_pairs) == 0:
        raise ExportError("no parity pairs: give real preference pairs to check the export against")
    missing = [c for c in PARITY_COLUMNS if c not in getattr(parity_pairs, "columns", ())]
    if missing:  # a KeyError in the parity check, after the ONNX export, used to tell
        raise ExportError(f"parity_pairs lacks columns {missing}: give a DataFrame with {list(PARITY_COLUMNS)}")
    if prior_domain is not None and not (Path(expert_dir).parent / "length_prior.json").exists():
        # it was ignored: the bundle then served every domain although the user asked for one
        raise ExportError(f"prior_domain={prior_domain!r} (--prior-domain): {expert_dir} is not of a "
                          "length_prior='domain' run (no length_prior.json beside it); its selector serves every "
                          "domain and has no domain prior to fold in: leave --prior-domain out")
    selector = load_trained_selector(Path(expert_dir))
    _fold_length_prior(selector, Path(expert_dir), prior_domain)
    found_method, found_expert = _provenance(Path(expert_dir))
    method = method or found_method
    expert = found_expert if expert is None else expert
    if name is None:
        name = method if expert is None else f"{method}-expert-{expert}"
    gate = None
    if validation is not None:
        progress(f"validation gate: {name} against label-free length-only on {len(validation[0])} validation pairs")
        gate = check_beats_length_only(selector, *validation)
        if not gate["passed"]:
            raise ExportError(f"{name} ranks {gate['selector_accuracy']:.3f} of {gate['n_pairs']} validation pairs right, below "
                              f"the label-free length-only baseline ({gate['length_only_global']:.3f}; per domain "
                              f"{gate['length_only_per_domain']:.3f}): it would rank worse than response length; export "
                              "the routed run (--selector RUN/fedprism_seed0) or another expert")
    progress(f"exporting selector {name} ({selector.config.backbone}, LoRA merged) to ONNX (opset {OPSET})")
    kind = export_kinds.get(KIND, family=FAMILY)
    files = kind.files(selector)
    precisions = {"fp32": SELECTOR_FILES["fp32"]}
    with scratch_folder(out) as tmp:  # beside out; a killed export's is removed by the next (export.scratch_folder)
        if int8:
            progress("quantising the selector to int8 (onnxruntime dynamic, per-channel weights)")
            fp32_path = tmp / SELECTOR_FILES["fp32"]
            fp32_path.write_bytes(files[SELECTOR_FILES["fp32"]])
            int8_path = quantize_embedder(fp32_path, tmp / SELECTOR_FILES["int8"],
                                          exclude=int8_excluded_matmuls(fp32_path))
            files[SELECTOR_FILES["int8"]] = int8_path.read_bytes()
            precisions["int8"] = SELECTOR_FILES["int8"]
        fields = selector_fields(selector, name, method, expert, precisions, version)
        staged = tmp / "staged"
        write_bundle(staged, files, fields, key)
        report = kind.parity(staged, key.public_key(), selector, None, parity_pairs, list(precisions),
                             progress=progress)
        report["validation"] = gate
        manifest = write_checked_bundle(out, files, fields, key, report, "selector parity check")
    progress(f"wrote selector bundle v{manifest['bundle_version']} to {out}")
    return SelectorExportResult(out, manifest, report)


def run_pairs(run_dir: Path, data_dir: Path, part: str, n_pairs: int | None = 200, seed: int = 0):
    """Real pairs of the prompts of one part (``train``, ``val``, ``public``, ``test``) of the run at ``run_dir``
    (its ``splits.json``); ``n_pairs`` drawn evenly over the domains (seeded), or all of them with None.

    Raises
    ------
    ExportError
        The data folder or ``splits.json`` cannot be read, or no pair is left.
    """
    import pandas as pd  # pandas: optional heavy dependency, imported on use

    from trainer.data.preferences import load_preference_pairs  # trainer.data.preferences imports pandas: on use only

    splits = Path(run_dir) / "splits.json"
    try:
        ids = set(json.loads(splits.read_text())[part])
    except (OSError, ValueError, KeyError, TypeError) as exc:  # JSON errors are ValueErrors; a wrong layout KeyError/TypeError
        raise ExportError(f"{splits}: not the splits.json of `fedroute prism train` (no readable {part!r} list: "
                          f"{type(exc).__name__}: {exc})") from exc
    try:
        pairs = load_preference_pairs(data_dir, seed=0)
    except Exception as exc:  # noqa: BLE001 - DataUnavailableError / DataFormatError: one clear message
        raise ExportError(f"cannot read preference pairs from {data_dir}: {exc}") from exc
    pairs = pairs[pairs["prompt_id"].isin(ids)]
    if pairs.empty:
        raise ExportError(f"no preference pair of {data_dir} is a {part} prompt of {splits}: was the run trained on other data?")
    if n_pairs is None:
        return pairs.reset_index(drop=True)
    per = max(1, n_pairs // max(1, pairs["domain"].nunique()))
    parts = [g.sample(min(per, len(g)), random_state=seed) for _, g in pairs.groupby("domain", sort=True)]
    return pd.concat(parts, ignore_index=True)


def validation_for(run_dir: Path, data_dir: Path, n_pairs: int = 600, seed: int = 0) -> tuple | None:
    """(validation pairs, train pairs) of the run at ``run_dir`` for :func:`check_beats_length_only`: the pairs of its
    validation prompts, or of its public prompts (held by no client, their labels never trained on) when the
    run has no validation prompts (the quick preset); None when the folder has no ``splits.json``."""
    splits = Path(run_dir) / "splits.json"
    if not splits.exists():
        return None
    try:
        has_val = bool(json.loads(splits.read_text()).get("val"))
    except (OSError, ValueError, AttributeError) as exc:
        raise ExportError(f"{splits}: not the splits.json of `fedroute prism train` ({type(exc).__name__}: {exc})") from exc
    return (run_pairs(run_dir, data_dir, "val" if has_val else "public", n_pairs, seed),
            run_pairs(run_dir, data_dir, "train", None))


def parity_pairs_for(expert_dir: Path, data_dir: Path, n_pairs: int = 200, seed: int = 0):
    """Real pairs for the parity check of the expert at ``expert_dir``: the held-out (test) prompts of its
    run (``splits.json`` beside the expert) when present, else every prompt; ``n_pairs`` drawn evenly over
    the three domains (seeded).

    Raises
    ------
    ExportError
        The data folder or the run's ``splits.json`` cannot be read, or no pair is left.
    """
    import pandas as pd  # pandas: optional heavy dependency, imported on use

    from trainer.data.preferences import load_preference_pairs  # trainer.data.preferences imports pandas: on use only

    splits = Path(expert_dir).parent / "splits.json"
    test_ids = None
    if splits.exists():
        try:
            test_ids = set(json.loads(splits.read_text())["test"])
        except (OSError, ValueError, KeyError, TypeError) as exc:  # JSON errors are ValueErrors; a wrong layout KeyError/TypeError
            raise ExportError(f"{splits}: not the splits.json of `fedroute prism train` (no readable 'test' list: "
                              f"{type(exc).__name__}: {exc})") from exc
    try:
        pairs = load_preference_pairs(data_dir, seed=0)
    except Exception as exc:  # noqa: BLE001 - DataUnavailableError / DataFormatError: one clear message
        raise ExportError(f"cannot read preference pairs from {data_dir} for the parity check: {exc}") from exc
    if test_ids is not None:
        pairs = pairs[pairs["prompt_id"].isin(test_ids)]
    if pairs.empty:
        raise ExportError(f"no preference pair of {data_dir} is a held-out prompt of {splits} for the parity check: "
                          "was the run trained on other data?")
    per = max(1, n_pairs // max(1, pairs["domain"].nunique()))
    parts = [g.sample(min(per, len(g)), random_state=seed) for _, g in pairs.groupby("domain", sort=True)]
    return pd.concat(parts, ignore_index=True)
