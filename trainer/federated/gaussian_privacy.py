"""Privacy accounting of the Gaussian mechanism, shared by the K-means and MLP aggregations and Flower."""

from __future__ import annotations

import math

from sdk.errors import InvalidInputError


def gaussian_epsilon(noise_multiplier: float, delta: float, releases: int = 1) -> float:
    """Epsilon of ``releases`` compositions of the Gaussian mechanism with noise multiplier ``z``
    (std / L2 sensitivity) at ``delta``.

    ``r`` Gaussian releases compose exactly into one with multiplier ``z / sqrt(r)`` (Dong, Roth &
    Su 2022, Gaussian differential privacy, Cor. 3.3); its epsilon is the analytic one of Balle &
    Wang 2018 (ICML, Thm. 8), computed by ``dp_accounting.get_epsilon_gaussian``.

    Returns inf for ``z = 0``.

    Raises
    ------
    InvalidInputError
        ``z < 0``, ``delta`` outside (0, 1) or ``releases < 1``.
    """
    if not (noise_multiplier >= 0 and 0 < delta < 1 and releases >= 1):
        raise InvalidInputError(f"need z >= 0, 0 < delta < 1, releases >= 1; got {noise_multiplier}, {delta}, {releases}")
    if noise_multiplier == 0:
        return math.inf
    from dp_accounting import get_epsilon_gaussian  # server extra (dp-accounting), only under DP noise

    return float(get_epsilon_gaussian(noise_multiplier / math.sqrt(releases), delta))
