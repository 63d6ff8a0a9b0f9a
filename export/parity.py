"""Parity of a bundle with the trainer, measured through the SDK exactly as an app loads it.

On real RouterBench test prompts, for each embedder precision in the bundle:

- embedding cosine against sentence-transformers+torch (the trainer's embeddings):
  fp32 min >= :data:`FP32_MIN_COSINE`; int8 mean >= :data:`INT8_MEAN_COSINE` and min >= :data:`INT8_MIN_COSINE`;
- routing decisions against the trainer's router on the trainer's embeddings, over the METRICS.md
  lambda grid: agreement on >= :data:`MIN_DECISION_AGREEMENT` of (query, lambda) pairs;
- the normalised AUC of the accuracy-cost curve (METRICS.md) within :data:`MAX_AUC_GAP`.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from sdk.router import Router
from sdk.utility import decide
from trainer import metrics

FP32_MIN_COSINE = 0.999
INT8_MEAN_COSINE = 0.995
INT8_MIN_COSINE = 0.98
MIN_DECISION_AGREEMENT = 0.99
MAX_AUC_GAP = 0.005


def cosine_stats(a: np.ndarray, b: np.ndarray) -> dict:
    """Row-wise cosine of two (n, d) arrays: ``{"mean", "min", "n"}``."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    return {"mean": float(cos.mean()), "min": float(cos.min()), "n": int(len(cos))}


def decision_agreement(pred_a: tuple[np.ndarray, np.ndarray], pred_b: tuple[np.ndarray, np.ndarray],
                       lambdas: Sequence[float]) -> float:
    """Fraction of (query, lambda) pairs where two routers' predictions pick the same model."""
    same = [decide(*pred_a, lam) == decide(*pred_b, lam) for lam in lambdas]
    return float(np.mean(same))


def cosine_failures(precision: str, cos: dict) -> list[str]:
    """Embedding-cosine thresholds missed by one precision (``cos`` from :func:`cosine_stats`);
    NaN never passes."""
    def below(value: float, threshold: float) -> bool:
        return not value >= threshold  # NaN -> True

    out = []
    if precision == "fp32" and below(cos["min"], FP32_MIN_COSINE):
        out.append(f"fp32 min cosine {cos['min']:.5f} < {FP32_MIN_COSINE}")
    if precision == "int8" and (below(cos["mean"], INT8_MEAN_COSINE) or below(cos["min"], INT8_MIN_COSINE)):
        out.append(f"int8 cosine mean {cos['mean']:.5f} / min {cos['min']:.5f} below "
                   f"{INT8_MEAN_COSINE} / {INT8_MIN_COSINE}")
    return out


def gate_failures(precision: str, entry: dict, trainer_auc: float) -> list[str]:
    """Thresholds missed by one precision's parity ``entry``; NaN never passes a gate."""
    def below(value: float, threshold: float) -> bool:
        return not value >= threshold  # NaN -> True

    out = cosine_failures(precision, entry["cosine"])
    if below(entry["decision_agreement"], MIN_DECISION_AGREEMENT):
        out.append(f"{precision} decisions agree on {entry['decision_agreement']:.4f} "
                   f"< {MIN_DECISION_AGREEMENT} of (query, lambda) pairs")
    if not entry["auc_gap"] <= MAX_AUC_GAP:
        out.append(f"{precision} AUC {entry['auc']:.4f} is {entry['auc_gap']:.4f} from the trainer's "
                   f"{trainer_auc:.4f} (> {MAX_AUC_GAP})")
    return out


def check_bundle(bundle_dir, public_key, router, reference: np.ndarray, test, precisions: Sequence[str],
                 progress: Callable[[str], None] = print) -> dict:
    """Parity report of the bundle at ``bundle_dir`` (see module docstring).

    Parameters
    ----------
    bundle_dir, public_key : the staged bundle and the key that signed it.
    router : the trainer's router (``trainer.routers``) that was exported.
    reference : (n_queries, d_emb) float32, sentence-transformers embeddings of ``test.prompts``.
    test : fully labelled ``EvalTable`` with the router's models, in the router's order; or with a
        subset of them (models added with ``fedroute add-model`` have no test labels): the AUC of
        trainer and bundle is then taken over those columns only, decisions compared over all.
    precisions : embedder precisions to check (``"fp32"``, ``"int8"``).

    Returns
    -------
    dict with ``trainer_auc``, ``lambdas``, per-precision ``cosine``, ``decision_agreement``,
    ``auc``, ``auc_gap``, and ``passed`` / ``failures``.
    """
    from tqdm.auto import tqdm  # trainer extra

    lambdas = metrics.lambda_grid()
    trainer_pred = router.predict(reference)
    cols = [list(router.models).index(m) for m in test.models]  # all of them unless a model has no labels

    def auc_of(pred: tuple[np.ndarray, np.ndarray]) -> float:
        return metrics.evaluate_router(pred[0][:, cols], pred[1][:, cols], test.accuracy, test.cost).auc

    trainer_auc = auc_of(trainer_pred)
    report: dict = {"n_queries": int(test.n_queries), "n_lambdas": int(len(lambdas)),
                    "trainer_auc": float(trainer_auc), "precisions": {}, "failures": []}
    for precision in precisions:
        bundle = Router.load(bundle_dir, public_key, precision=precision, intra_op_threads=2)
        # One query at a time, as choose() embeds on the device (no padding in the input).
        emb = np.concatenate([bundle.embed([q]) for q in tqdm(test.prompts, desc=f"parity {precision}",
                                                                   unit="query", leave=False)])
        pred = bundle.predict_from_embeddings(emb)
        auc = auc_of(pred)
        entry = {
            "cosine": cosine_stats(emb, reference),
            "decision_agreement": decision_agreement(pred, trainer_pred, lambdas),
            "auc": float(auc),
            "auc_gap": float(abs(auc - trainer_auc)),
        }
        report["precisions"][precision] = entry
        progress(f"  {precision}: cosine mean {entry['cosine']['mean']:.5f} min {entry['cosine']['min']:.5f}, "
                 f"decisions agree {entry['decision_agreement']:.4f}, AUC {auc:.4f} (trainer {trainer_auc:.4f})")
        report["failures"].extend(gate_failures(precision, entry, trainer_auc))
    report["thresholds"] = {"fp32_min_cosine": FP32_MIN_COSINE, "int8_mean_cosine": INT8_MEAN_COSINE,
                            "int8_min_cosine": INT8_MIN_COSINE, "min_decision_agreement": MIN_DECISION_AGREEMENT,
                            "max_auc_gap": MAX_AUC_GAP}
    report["passed"] = not report["failures"]
    return report


def check_embedder(bundle_dir, public_key, reference: np.ndarray, prompts: Sequence[str], precisions: Sequence[str],
                   progress: Callable[[str], None] = print) -> dict:
    """Embedder-only parity of a bundle: per precision, the cosine of the SDK's embeddings (one
    query at a time, as ``choose()`` embeds) against the trainer's ``reference``
    ((n, d_emb) float32 of ``prompts``), gated like :func:`check_bundle` (fp32 min >=
    :data:`FP32_MIN_COSINE`; int8 mean >= :data:`INT8_MEAN_COSINE` and min >= :data:`INT8_MIN_COSINE`).

    Returns
    -------
    dict with ``n_queries``, per-precision ``cosine`` (``mean``, ``min``, ``n``) and ``passed`` / ``failures``.
    """
    report: dict = {"n_queries": len(prompts), "precisions": {}, "failures": []}
    for precision in precisions:
        bundle = Router.load(bundle_dir, public_key, precision=precision)
        emb = np.concatenate([bundle.embed([q]) for q in prompts])
        cos = cosine_stats(emb, reference)
        report["precisions"][precision] = {"cosine": cos}
        progress(f"  {precision}: cosine mean {cos['mean']:.6f} min {cos['min']:.6f} over {cos['n']} prompts")
        report["failures"].extend(cosine_failures(precision, cos))
    report["passed"] = not report["failures"]
    return report
