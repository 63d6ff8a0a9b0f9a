"""Our own torch modules -> ONNX bytes, shared by the exporters of small heads and of LoRA-tuned encoders.

``torch.onnx.export`` with the TorchScript exporter (``dynamo=False``), opset 17, named inputs and
outputs, dynamic axes, metadata properties, then ``onnx.checker``. Used by :mod:`export.reward_export`
(MoR reward models and the client router) and :mod:`export.selector_export` (FedPrism selectors).

:func:`merged_lora_copy` is the LoRA half of both encoder exports: peft's ``merge_and_unload`` on a deep
copy (``W + (alpha / r) B A`` folded into each adapted weight; the same function without the adapter
branch, and the trainer's model keeps its adapter).
"""

from __future__ import annotations

import copy
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from export.embedder_onnx import quiet_libraries

OPSET = 17


def merged_lora_copy(peft_model):
    """A copy of ``peft_model`` (a peft ``PeftModel`` / ``LoraModel``) with the adapter merged into the base
    weights (peft ``merge_and_unload``), in eval mode; ``peft_model`` itself is not modified."""
    return copy.deepcopy(peft_model).merge_and_unload().eval()


def module_to_onnx(module, args: tuple, input_names: Sequence[str], output_names: Sequence[str],
                   dynamic_axes: Mapping[str, Mapping[int, str]], metadata: Mapping[str, str]) -> bytes:
    """ONNX bytes of ``module`` traced on ``args`` (module docstring).

    Parameters
    ----------
    module : torch.nn.Module, exported in eval mode.
    args : example inputs (tensors), in ``input_names`` order.
    input_names, output_names : graph input / output names.
    dynamic_axes : name -> {axis: symbolic name}, e.g. ``{"features": {0: "batch"}}``.
    metadata : written as the model's ``metadata_props``.

    Raises
    ------
    onnx.checker.ValidationError
        The exported graph does not check.
    """
    import onnx  # onnx: optional heavy dependency, imported on use
    import torch  # torch: optional heavy dependency, imported on use

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "graph.onnx"
        with torch.no_grad(), quiet_libraries():
            torch.onnx.export(module.eval(), tuple(args), str(path), dynamo=False, opset_version=OPSET,
                              input_names=list(input_names), output_names=list(output_names),
                              dynamic_axes={k: dict(v) for k, v in dynamic_axes.items()})
        model = onnx.load(str(path))
    for key, value in metadata.items():
        entry = model.metadata_props.add()
        entry.key, entry.value = key, str(value)
    onnx.checker.check_model(model)
    return model.SerializeToString()
