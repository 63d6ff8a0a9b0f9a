"""ONNX export of a FedVPA-GP / VPL model's context encoder and reward head, with a parity gate (issue 28).

``vpa_encoder.onnx`` and ``vpa_reward.onnx`` (layouts: :mod:`sdk.personal_reward`) via ``torch.onnx.export``
(TorchScript exporter, ``dynamo=False``, opset 17, batch and context / target axes dynamic), then
:func:`check_parity` runs :class:`sdk.personal_reward.PersonalReward` and the torch model on the same pairs and
raises :class:`export.errors.ParityError` when ``mu``, ``logvar`` or a margin differ by more than
:data:`PARITY_FP32` (fp32).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import onnx
import torch
from torch import nn

from export.embedder_onnx import quiet_libraries
from export.errors import ParityError
from sdk.personal_reward import PersonalReward

OPSET = 17
#: Largest absolute difference between device and trainer (mu, logvar, margins), fp32.
PARITY_FP32 = 1e-3


def _export(module: nn.Module, args: tuple, inputs: list[str], outputs: list[str], axes: dict) -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "graph.onnx"
        with torch.no_grad(), quiet_libraries():
            torch.onnx.export(module.eval(), args, str(path), dynamo=False, opset_version=OPSET,
                              input_names=inputs, output_names=outputs, dynamic_axes=axes)
        model = onnx.load(str(path))
    onnx.checker.check_model(model)
    return model.SerializeToString()


def _prior(protos) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    if protos is None:
        return None
    return (torch.tensor(protos.mu, dtype=torch.float32), torch.tensor(protos.logvar, dtype=torch.float32),
            torch.log(torch.tensor(protos.pi, dtype=torch.float32)))


def vpa_to_onnx(model, protos=None) -> tuple[bytes, bytes]:
    """``(vpa_encoder.onnx, vpa_reward.onnx)`` bytes of a :class:`trainer.vpa.model.VPAModel` (put in eval mode).

    protos : the FedVPA-GP prior (:class:`trainer.vpa.aggregation.Prototypes`) or None; with it the encoder graph
    outputs the mean and log variance of the mixture posterior (:meth:`~trainer.vpa.model.VPAModel.infer`), the
    prototypes being constants of the graph.
    """
    prior = _prior(protos)
    model = model.eval()
    d_in = model.pair_net[0].in_features
    d_z = model.head.in_features

    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, phi_w, phi_l, mask):
            return self.model.infer(phi_w, phi_l, mask, prior)

    class Reward(Encoder):
        def forward(self, phi, z):
            return self.model.reward(phi, z)

    enc = _export(Encoder(), (torch.zeros(2, 3, d_in), torch.zeros(2, 3, d_in), torch.ones(2, 3)),
                  ["phi_w", "phi_l", "mask"], ["mu", "logvar"],
                  {"phi_w": {0: "users", 1: "context"}, "phi_l": {0: "users", 1: "context"},
                   "mask": {0: "users", 1: "context"}, "mu": {0: "users"}, "logvar": {0: "users"}})
    rew = _export(Reward(), (torch.zeros(2, 3, d_in), torch.zeros(2, d_z)), ["phi", "z"], ["reward"],
                  {"phi": {0: "users", 1: "targets"}, "z": {0: "users"}, "reward": {0: "users", 1: "targets"}})
    return enc, rew


def check_parity(model, encoder: bytes, reward: bytes, phi_w: np.ndarray, phi_l: np.ndarray,
                 phi_a: np.ndarray, phi_b: np.ndarray, protos=None) -> dict:
    """Device vs trainer on one user's context (phi_w, phi_l: (C, d_in)) and target pairs (phi_a, phi_b: (n, d_in));
    ``protos`` as given to :func:`vpa_to_onnx`.

    Returns ``{'mu', 'logvar', 'margin'}`` max absolute differences. Raises ParityError above :data:`PARITY_FP32`.
    """
    device = PersonalReward(encoder, reward)
    mu_d, lv_d = device.infer_z(phi_w, phi_l)
    with torch.no_grad():
        w, lo = torch.as_tensor(phi_w[None], dtype=torch.float32), torch.as_tensor(phi_l[None], dtype=torch.float32)
        mu_t, lv_t = model.eval().infer(w, lo, torch.ones(1, len(phi_w)), _prior(protos))
        m_t = model.margin(torch.as_tensor(phi_a[None], dtype=torch.float32),
                           torch.as_tensor(phi_b[None], dtype=torch.float32), mu_t)[0].numpy()
    report = {"mu": float(np.abs(mu_d - mu_t[0].numpy()).max()), "logvar": float(np.abs(lv_d - lv_t[0].numpy()).max()),
              "margin": float(np.abs(device.margins(phi_a, phi_b, mu_d) - m_t).max()), "threshold": PARITY_FP32}
    if max(report["mu"], report["logvar"], report["margin"]) > PARITY_FP32:
        raise ParityError(f"vpa export disagrees with the trainer beyond {PARITY_FP32}: {report}", report)
    return report
