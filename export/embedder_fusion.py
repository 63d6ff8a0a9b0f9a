"""Graph fusion of the exported encoder before quantisation (issue 13): onnxruntime's transformer
optimizer (``onnxruntime.transformers.optimizer.optimize_model``, ``model_type="bert"``).

Design notes: docs/device-and-bundles.md (Module notes).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from export.errors import ExportError
from sdk.atomic_write import commit_file, temporary_path

#: transformers ``model_type`` values whose graphs the optimizer's BERT fusions recognise.
FUSABLE_MODEL_TYPES = ("bert",)
#: contrib ops of a fused encoder, and how many each layer has.
FUSED_OPS_PER_LAYER = {"Attention": 1, "BiasGelu": 1}
#: ops a fused encoder must not hold (see the design notes for why).
UNFUSED_OPS = ("SkipLayerNormalization",)
#: largest |difference| between the fused and the unfused fp32 sentence embeddings on the probe
#: batch (unit vectors; fusion reorders float sums, measured ~1e-7).
MAX_FUSION_DIFF = 1e-4
_PROBE = ("dimension probe", "Is a whale a fish? Answer with one word.",
          "Translate to French: the cat sleeps on the warm windowsill all afternoon.")


def encoder_shape(config_json: Path) -> dict | None:
    """``{"num_heads", "hidden_size", "num_layers"}`` from the transformers ``config.json`` that
    optimum writes beside the graph; None when its ``model_type`` is not in
    :data:`FUSABLE_MODEL_TYPES` (the graph is then shipped unfused)."""
    config = json.loads(Path(config_json).read_text())
    if config.get("model_type") not in FUSABLE_MODEL_TYPES:
        return None
    return {"num_heads": int(config["num_attention_heads"]), "hidden_size": int(config["hidden_size"]),
            "num_layers": int(config["num_hidden_layers"])}


def fused_op_counts(model: Path) -> dict[str, int]:
    """How many of each :data:`FUSED_OPS_PER_LAYER` and :data:`UNFUSED_OPS` op (and ``QAttention``) the
    ONNX file holds."""
    import onnx  # export needs onnx (trainer extra), imported on use

    graph = onnx.load(str(model), load_external_data=False).graph
    names = (*FUSED_OPS_PER_LAYER, *UNFUSED_OPS, "QAttention")
    return {name: sum(n.op_type == name for n in graph.node) for name in names}


def fuse_embedder(model: Path, out: Path, config_json: Path, tokenizer_json: Path) -> dict[str, int] | None:
    """Fuse the fp32 encoder ``model`` into ``out`` (written atomically; see the design notes).

    Parameters
    ----------
    model : Path of optimum's fp32 ONNX export (output ``sentence_embedding``).
    out : Path of the fused fp32 graph.
    config_json : the transformers ``config.json`` of the model (heads, hidden size, layers).
    tokenizer_json : the export's ``tokenizer.json`` (padding off), for the probe batch.

    Returns
    -------
    {op type: count} of the fused graph (:func:`fused_op_counts`), or None (nothing written) when the
    model type is not fusable (:func:`encoder_shape`).

    The optimizer logs its progress; :func:`export.embedder_onnx.export_embedder` calls this inside
    ``quiet_libraries()``.

    Raises
    ------
    ExportError
        The fused graph lacks the expected ops (``FUSED_OPS_PER_LAYER`` x layers) or holds one of
        :data:`UNFUSED_OPS`, or its
        embeddings of a padded probe batch differ from the unfused graph's by more than
        :data:`MAX_FUSION_DIFF`.
    """
    from onnxruntime.transformers.fusion_options import FusionOptions  # native library, imported on use
    from onnxruntime.transformers.optimizer import optimize_model  # native library, imported on use

    shape = encoder_shape(config_json)
    if shape is None:
        return None
    options = FusionOptions("bert")
    options.enable_embed_layer_norm = False
    options.enable_skip_layer_norm = False
    options.enable_bias_skip_layer_norm = False
    options.use_raw_attention_mask(True)
    out = Path(out)
    tmp = temporary_path(out)
    optimized = optimize_model(str(model), model_type="bert", num_heads=shape["num_heads"],
                               hidden_size=shape["hidden_size"], opt_level=0, optimization_options=options)
    optimized.save_model_to_file(str(tmp), use_external_data_format=False)
    counts = fused_op_counts(tmp)
    expected = {op: n * shape["num_layers"] for op, n in FUSED_OPS_PER_LAYER.items()}
    expected.update({op: 0 for op in UNFUSED_OPS})
    missing = {op: (counts[op], n) for op, n in expected.items() if counts[op] != n}
    if missing:
        tmp.unlink(missing_ok=True)
        raise ExportError(f"graph fusion of {model} found {{op: (found, expected)}} {missing}; "
                          "the optimizer did not recognise this encoder's layers")
    diff = _probe_difference(model, tmp, tokenizer_json)
    if not diff <= MAX_FUSION_DIFF:
        tmp.unlink(missing_ok=True)
        raise ExportError(f"the fused encoder's embeddings differ from the unfused one's by {diff:.2e} "
                          f"(> {MAX_FUSION_DIFF}) on the probe batch")
    commit_file(tmp, out)
    return counts


def _probe_difference(model: Path, fused: Path, tokenizer_json: Path) -> float:
    """max |fused - unfused| of the ``sentence_embedding`` of :data:`_PROBE`, one padded batch."""
    import onnxruntime as ort  # native library, imported on use
    from tokenizers import Tokenizer  # native library, imported on use

    tokenizer = Tokenizer.from_file(str(tokenizer_json))
    tokenizer.enable_padding(pad_id=tokenizer.token_to_id("[PAD]") or 0, pad_token="[PAD]")
    enc = tokenizer.encode_batch(list(_PROBE))
    outs = []
    for path in (model, fused):
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        feeds = {"input_ids": np.array([e.ids for e in enc], dtype=np.int64),
                 "attention_mask": np.array([e.attention_mask for e in enc], dtype=np.int64)}
        if "token_type_ids" in {i.name for i in session.get_inputs()}:
            feeds["token_type_ids"] = np.array([e.type_ids for e in enc], dtype=np.int64)
        outs.append(session.run(["sentence_embedding"], feeds)[0])
    return float(np.abs(outs[0] - outs[1]).max())
