"""A personal reward on the device: ``z`` inferred from the user's own labelled pairs, then ``r(x, y, z)`` (issue 28).

Runs the two graphs :mod:`export.vpa_export` writes from a trained FedVPA-GP / VPL model
(:class:`trainer.vpa.model.VPAModel`) with onnxruntime (numpy only here):

- ``vpa_encoder.onnx``: inputs ``phi_w``, ``phi_l`` ``(U, C, d_in) float32`` (features of the preferred and the
  dispreferred response of each context pair, by the user's own labels) and ``mask`` ``(U, C) float32``;
  outputs ``mu``, ``logvar`` ``(U, d_z) float32``, the posterior ``q(z | C)``.
- ``vpa_reward.onnx``: inputs ``phi`` ``(U, T, d_in) float32`` and ``z`` ``(U, d_z) float32``; output ``reward``
  ``(U, T) float32``.

The user's pairs are only ever inputs of :meth:`PersonalReward.infer_z` on the device: nothing here sends
anything. Features ``phi`` are the trainer's (:mod:`trainer.vpa.features`); building them on the device
(embedder, length and marker columns, the PCA projection) is not part of this module.
"""

from __future__ import annotations

import numpy as np

from sdk.embedder import inference_session
from sdk.errors import InvalidInputError


class PersonalReward:
    """``infer_z`` from a user's context pairs, ``margins`` of pairs under a ``z``.

    Parameters
    ----------
    encoder, reward : bytes of ``vpa_encoder.onnx`` / ``vpa_reward.onnx``.
    options : onnxruntime ``SessionOptions`` or None.
    """

    def __init__(self, encoder: bytes, reward: bytes, options=None) -> None:
        self._encoder = inference_session(encoder, options, "vpa_encoder.onnx")
        self._reward = inference_session(reward, options, "vpa_reward.onnx")
        self.d_in = int(self._encoder.get_inputs()[0].shape[-1])

    def _check(self, name: str, arr: np.ndarray, ndim: int) -> np.ndarray:
        arr = np.asarray(arr, dtype=np.float32)
        if arr.ndim != ndim or arr.shape[-1] != self.d_in or not np.all(np.isfinite(arr)) or arr.shape[0] == 0:
            raise InvalidInputError(f"{name} must be a finite (n >= 1, {self.d_in}) array, got shape {arr.shape}")
        return arr

    def infer_z(self, phi_w: np.ndarray, phi_l: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Posterior ``(mu, logvar)``, each ``(d_z,) float32``, of one user's C context pairs.

        phi_w, phi_l : (C, d_in) float32, features of the response the user preferred / did not prefer.
        Raises InvalidInputError on shapes that differ, a wrong d_in, no pair or a non-finite value.
        """
        w, lo = self._check("phi_w", phi_w, 2), self._check("phi_l", phi_l, 2)
        if w.shape != lo.shape:
            raise InvalidInputError(f"phi_w {w.shape} and phi_l {lo.shape} must have the same shape")
        mu, logvar = self._encoder.run(None, {"phi_w": w[None], "phi_l": lo[None],
                                              "mask": np.ones((1, len(w)), dtype=np.float32)})
        return mu[0], logvar[0]

    def margins(self, phi_a: np.ndarray, phi_b: np.ndarray, z: np.ndarray) -> np.ndarray:
        """``r(x, y_A, z) - r(x, y_B, z)``, shape (n,) float32 (> 0: A preferred); phi_a, phi_b (n, d_in); z (d_z,)."""
        a, b = self._check("phi_a", phi_a, 2), self._check("phi_b", phi_b, 2)
        if a.shape != b.shape:
            raise InvalidInputError(f"phi_a {a.shape} and phi_b {b.shape} must have the same shape")
        z = np.asarray(z, dtype=np.float32)[None]
        (ra,) = self._reward.run(None, {"phi": a[None], "z": z})
        (rb,) = self._reward.run(None, {"phi": b[None], "z": z})
        return (ra - rb)[0]
