"""A personal reward on the device: ``z`` inferred from the user's own labelled pairs, then ``r(x, y, z)`` (issue 28).

Runs the two graphs :mod:`export.vpa_export` writes from a FedVPA-GP / VPL model (``trainer.vpa.model.VPAModel``):
``vpa_encoder.onnx`` (``phi_w``, ``phi_l`` (U, C, d_in) float32 features of the preferred and dispreferred
responses, ``mask`` (U, C) -> ``mu``, ``logvar`` (U, d_z), the posterior ``q(z | C)``) and ``vpa_reward.onnx``
(``phi`` (U, T, d_in), ``z`` (U, d_z) -> ``reward`` (U, T)). The user's pairs never leave the device.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from sdk.embedder import SessionThreads, inference_session
from sdk.errors import InvalidInputError


class PersonalReward:
    """``infer_z`` from a user's context pairs, ``margins`` of pairs under a ``z`` (graphs as bytes)."""

    def __init__(self, encoder: bytes, reward: bytes, options: SessionThreads | None = None) -> None:
        self._encoder = inference_session(encoder, options, "vpa_encoder.onnx")
        self._reward = inference_session(reward, options, "vpa_reward.onnx")
        self.d_in = int(self._encoder.get_inputs()[0].shape[-1])

    def _pair(self, names: tuple[str, str], x: npt.ArrayLike, y: npt.ArrayLike) -> tuple[
            npt.NDArray[np.float32], npt.NDArray[np.float32]]:
        a, b = np.asarray(x, dtype=np.float32), np.asarray(y, dtype=np.float32)
        if a.ndim != 2 or a.shape != b.shape or len(a) == 0 or a.shape[1] != self.d_in or \
                not (np.isfinite(a).all() and np.isfinite(b).all()):
            raise InvalidInputError(f"{names[0]} {a.shape} and {names[1]} {b.shape} must be finite arrays of one "
                                    f"shape (n >= 1, {self.d_in})")
        return a, b

    def infer_z(self, phi_w: npt.ArrayLike, phi_l: npt.ArrayLike) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]:
        """Posterior ``(mu, logvar)``, each ``(d_z,) float32``, of one user's C context pairs.

        phi_w, phi_l : (C, d_in) float32, features of the response the user preferred / did not prefer.
        Raises InvalidInputError on shapes that differ, a wrong d_in, no pair or a non-finite value.
        """
        w, lo = self._pair(("phi_w", "phi_l"), phi_w, phi_l)
        mu, logvar = self._encoder.run(None, {"phi_w": w[None], "phi_l": lo[None],
                                              "mask": np.ones((1, len(w)), dtype=np.float32)})
        return mu[0], logvar[0]

    def margins(self, phi_a: npt.ArrayLike, phi_b: npt.ArrayLike, z: npt.ArrayLike) -> npt.NDArray[np.float32]:
        """``r(x, y_A, z) - r(x, y_B, z)``, shape (n,) float32 (> 0: A preferred); phi_a, phi_b (n, d_in); z (d_z,)."""
        a, b = self._pair(("phi_a", "phi_b"), phi_a, phi_b)
        zz = np.asarray(z, dtype=np.float32)[None]
        (ra,) = self._reward.run(None, {"phi": a[None], "z": zz})
        (rb,) = self._reward.run(None, {"phi": b[None], "z": zz})
        margin: npt.NDArray[np.float32] = (ra - rb)[0]
        return margin
