"""Online reward routing by neural Thompson sampling on the router's last layer (MoR, paper 001,
Sec. "Online Router Updating"; Neural Thompson Sampling, Zhang et al. 2021).

Design notes: docs/mor_grpo_and_device.md (Module notes).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
import torch
from torch import nn

from sdk.errors import InvalidInputError, ShapeError
from sdk.real_numbers import finite_float
from trainer.alignment.errors import AlignmentConfigError
from trainer.config_fields import check_bool, check_int


#: Posterior samples are clipped to [SAMPLE_CLIP, 1 - SAMPLE_CLIP] before the logit (RoutingDecision.logits).
SAMPLE_CLIP = 1e-9

#: Largest accepted ``nu`` and smallest accepted ``lam``: the range in which every posterior sample is a finite
#: float64. The sample is ``mean + nu sigma z`` with ``mean`` in [0, 1], ``|z| < 9`` (float64 Box-Muller) and
#: ``sigma^2 = lam g^T U^{-1} g / m <= |g|^2`` (``U >= lam I``), where ``|g| <= 0.25 sqrt(h + 1) max|a|`` and
#: the features ``a`` are finite float32 (``|a_i| < 3.5e38``): ``|nu sigma z| < 1e100 * 1e38 * 9 sqrt(h + 1)``.
#: Computing ``sigma^2`` goes through ``U^{-1} g`` and ``g^T U^{-1} g <= |g|^2 / lam < 1e76 (h + 1) * 1e100``,
#: also finite. ``--ts-nu 1e308`` (or ``lam=1e-320``) gave +-inf (NaN) samples, and their argmax went to arm 0.
NU_MAX = 1e100
LAM_MIN = 1e-100


@dataclass
class ThompsonConfig:
    """Settings of the online router update (the design notes have the equations).

    enabled : False = the ablation: argmax of the offline router, never updated.
    lam : lambda in [LAM_MIN, 2 / lr), the prior precision (``U_0 = lambda I``), the variance scale and
        the weight of the pull back to the offline router. The SGD step multiplies ``phi - phi_0`` by
        ``1 - lr lambda`` (plus the loss's own gradient), so ``lr lambda >= 2`` diverges: the last layer,
        then every posterior sample, turned NaN within a few feedbacks (``--ts-lambda 10`` at the default lr).
    nu : nu in [0, NU_MAX], exploration scale of the posterior sample (a huge nu is well defined: the samples'
        argmax becomes a uniform random arm, pure exploration). :data:`NU_MAX` and :data:`LAM_MIN` keep every
        posterior sample finite.
    width : m >= 1 in ``g g^T / m``; None = the input width ``h`` of the router's last layer (NeuralTS).
        1 reproduces the formula as printed in MoR.
    lr : learning rate of the SGD steps on the last layer.
    n_update_steps : SGD steps per bandit feedback.
    seed : seed of the posterior samples (a ``torch.Generator`` of its own).
    """

    enabled: bool = True
    lam: float = 1.0
    nu: float = 1.0
    width: int | None = None
    lr: float = 0.5
    n_update_steps: int = 5
    seed: int = 0

    def __post_init__(self) -> None:
        check_bool(self, "enabled")
        check_int(self, "seed", 0)
        lam, nu, lr = finite_float(self.lam), finite_float(self.nu), finite_float(self.lr)
        if lam is None or lam <= 0:
            raise InvalidInputError(f"lam must be a finite number > 0, got {self.lam!r}")
        if lam < LAM_MIN:  # U^{-1} g ~ g / lam overflowed: NaN posterior samples
            raise InvalidInputError(f"lam must be at least {LAM_MIN:g}, got {lam:g}: a smaller lam overflows the "
                                    "posterior variance lam g^T U^-1 g (its U^-1 g ~ g / lam), so the samples are NaN")
        if nu is None or nu < 0:
            raise InvalidInputError(f"nu must be a finite number >= 0, got {self.nu!r}")
        if nu > NU_MAX:  # nu sigma z overflowed: +-inf posterior samples
            raise InvalidInputError(f"nu must be at most {NU_MAX:g}, got {nu:g}: a larger nu can overflow the posterior "
                                    "sample mean + nu sigma z to +-inf")
        if self.width is not None and (isinstance(self.width, bool) or not isinstance(self.width, int) or self.width < 1):
            raise InvalidInputError(f"width must be an integer >= 1 or None, got {self.width!r}")
        if lr is None or lr <= 0:
            raise InvalidInputError(f"lr must be a finite number > 0, got {self.lr!r}")
        if lam * lr >= 2:  # gradient descent on lam/2 ||phi - phi_0||^2 scales phi - phi_0 by (1 - lr lam) per step
            raise InvalidInputError(f"lam must be below 2 / lr = {2 / lr:g} (lr {lr:g}, the online SGD step), got {lam:g}: "
                                    "a larger lam * lr makes the pull-back to the offline router diverge (its weights, "
                                    "then every posterior sample, become NaN)")
        if isinstance(self.n_update_steps, bool) or not isinstance(self.n_update_steps, int) or self.n_update_steps < 1:
            raise InvalidInputError(f"n_update_steps must be an integer >= 1, got {self.n_update_steps!r}")

    def to_dict(self) -> dict:
        return asdict(self)


def last_linear(router: nn.Module) -> nn.Linear:
    """The last ``nn.Linear`` of ``router`` in module order (its output layer).

    Raises
    ------
    InvalidInputError
        ``router`` holds no ``nn.Linear``.
    """
    layers = [m for m in router.modules() if isinstance(m, nn.Linear)]
    if not layers:
        raise InvalidInputError(f"router {type(router).__name__} has no nn.Linear layer to update online")
    return layers[-1]


def bandit_feedback(previous_loss: float, current_loss: float) -> float:
    """MoR's binary feedback: 1.0 if the GRPO loss did not increase (``Delta J <= 0``), else 0.0.

    Raises
    ------
    InvalidInputError
        A loss that is not finite.
    """
    if not (math.isfinite(previous_loss) and math.isfinite(current_loss)):
        raise InvalidInputError(f"GRPO losses must be finite, got {previous_loss!r} -> {current_loss!r}")
    return 1.0 if current_loss - previous_loss <= 0 else 0.0


@dataclass(frozen=True)
class RoutingDecision:
    """Arms chosen for n contexts.

    arms : ndarray of shape (n,), int64, the client index asked for each pair.
    mean : ndarray of shape (n, K), float64, ``r_hat_k(c; phi_{t-1})``.
    std : ndarray of shape (n, K), float64, ``nu * sigma_{t,k}`` (zeros when disabled).
    sampled : ndarray of shape (n, K), float64, the posterior samples (= mean when disabled).
    offline_arms : ndarray of shape (n,), int64, the offline router's argmax (``phi_0``) for comparison.
    logits : ndarray of shape (n, K), float64, the decision on the logit scale, for a routing rule
        (:class:`trainer.rewards.routing_rule.RoutingRule`): the current router's logits ``z`` when disabled,
        ``logit(clip(sampled, SAMPLE_CLIP, 1 - SAMPLE_CLIP))`` when enabled (monotone in the sample, so its
        argmax is ``arms`` but for samples clipped to a tie). None when not computed.
    offline_logits : ndarray of shape (n, K), float64, the offline router's logits (``phi_0``); None when not computed.
    """

    arms: np.ndarray
    mean: np.ndarray
    std: np.ndarray
    sampled: np.ndarray
    offline_arms: np.ndarray
    logits: np.ndarray | None = None
    offline_logits: np.ndarray | None = None


class NeuralThompsonRouting:
    """Neural Thompson sampling on the last linear layer of ``router`` (design notes).

    Parameters
    ----------
    router : nn.Module mapping contexts (n, d) float32 to client logits (n, K); its last
        ``nn.Linear`` (see :func:`last_linear`) is updated in place when enabled.
    config : ThompsonConfig.

    Attributes
    ----------
    n_arms : K.
    n_params_ : p = K * (h + 1), the bandit's parameter count.
    width_ : m.
    U_ : torch.Tensor of shape (p, p), float64, the covariance ``U_t``.
    n_updates_ : number of feedbacks applied.
    """

    def __init__(self, router: nn.Module, config: ThompsonConfig | None = None) -> None:
        self.router = router
        self.config = config or ThompsonConfig()
        self.layer = last_linear(router)
        self.n_arms = self.layer.out_features
        self._h = self.layer.in_features
        self._has_bias = self.layer.bias is not None
        self.n_params_ = self.n_arms * (self._h + (1 if self._has_bias else 0))
        self.width_ = int(self.config.width if self.config.width is not None else self._h)
        self.phi0_ = self._phi().detach().clone()
        self.U_ = self.config.lam * torch.eye(self.n_params_, dtype=torch.float64)
        self.n_updates_ = 0
        self._generator = torch.Generator().manual_seed(int(self.config.seed))
        for param in self.layer.parameters():
            param.requires_grad_(True)

    # -- parameters and features --------------------------------------------------------------

    def _phi(self) -> torch.Tensor:
        parts = [self.layer.weight.reshape(-1)]
        if self._has_bias:
            parts.append(self.layer.bias.reshape(-1))
        return torch.cat(parts)

    def features(self, contexts: np.ndarray | torch.Tensor) -> torch.Tensor:
        """Input ``a(c)`` of the last layer: (n, h) float32, computed without gradients (router in eval mode).

        Raises
        ------
        ShapeError
            Contexts not 2-D or not finite.
        """
        x = torch.as_tensor(np.asarray(contexts, dtype=np.float32) if not torch.is_tensor(contexts) else contexts,
                            dtype=torch.float32)
        if x.ndim != 2 or len(x) == 0:
            raise ShapeError(f"contexts must have shape (n >= 1, d), got {tuple(x.shape)}")
        if not torch.isfinite(x).all():
            raise ShapeError("contexts must be finite")
        captured: list[torch.Tensor] = []
        hook = self.layer.register_forward_hook(lambda _m, inputs, _out: captured.append(inputs[0].detach()))
        was_training = self.router.training
        self.router.eval()
        try:
            with torch.no_grad():
                self.router(x)
        finally:
            hook.remove()
            self.router.train(was_training)
        return captured[-1].to(torch.float32)

    def gradients(self, features: torch.Tensor, arms: np.ndarray | torch.Tensor | None = None) -> torch.Tensor:
        """``g_k = d r_hat_k / d phi`` at the current ``phi``; private kernel, does not validate.

        Parameters
        ----------
        features : (n, h) float32, from :meth:`features`.
        arms : (n,) ints, or None for every arm.

        Returns
        -------
        torch.Tensor float64 of shape (n, p) for given arms, else (n, K, p). ``phi`` is laid out as
        ``[W.flatten() (row k = arm k), b]``.
        """
        a = features.to(torch.float64)
        with torch.no_grad():
            z = a @ self.layer.weight.detach().to(torch.float64).T
            if self._has_bias:
                z = z + self.layer.bias.detach().to(torch.float64)
        s = torch.sigmoid(z)
        ds = s * (1 - s)  # (n, K)
        n, K, h = a.shape[0], self.n_arms, self._h
        grads = torch.zeros(n, K, self.n_params_, dtype=torch.float64)
        for k in range(K):
            grads[:, k, k * h:(k + 1) * h] = ds[:, k:k + 1] * a
            if self._has_bias:
                grads[:, k, K * h + k] = ds[:, k]
        if arms is None:
            return grads
        idx = torch.as_tensor(np.asarray(arms), dtype=torch.long)
        return grads[torch.arange(n), idx]

    def scores(self, features: torch.Tensor, phi: torch.Tensor | None = None) -> torch.Tensor:
        """``r_hat = sigmoid(W a + b)``: (n, K) float64, at ``phi`` (default the current one)."""
        W, b = self._unflatten(self._phi().detach() if phi is None else phi)
        z = features.to(torch.float64) @ W.to(torch.float64).T
        if b is not None:
            z = z + b.to(torch.float64)
        return torch.sigmoid(z)

    def logits(self, contexts) -> np.ndarray:
        """The router's current logits ``z = W a(c) + b``: (n, K) float64.

        Raises
        ------
        ShapeError
        """
        return self._logits_of(self.features(contexts))

    def _unflatten(self, phi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        K, h = self.n_arms, self._h
        return phi[:K * h].reshape(K, h), (phi[K * h:] if self._has_bias else None)

    # -- posterior and decision ---------------------------------------------------------------

    def posterior(self, contexts) -> tuple[np.ndarray, np.ndarray]:
        """Mean ``r_hat_k(c; phi_{t-1})`` and variance ``sigma^2 = lambda g^T U^{-1} g / m`` per arm.

        Parameters
        ----------
        contexts : ndarray of shape (n, d), float32 (``Enc(x, y)``).

        Returns
        -------
        (mean, variance), each ndarray of shape (n, K), float64.

        Raises
        ------
        ShapeError
        """
        a = self.features(contexts)
        mean = self.scores(a)
        g = self.gradients(a)  # (n, K, p)
        n, K, p = g.shape
        flat = g.reshape(n * K, p)
        solved = torch.linalg.solve(self.U_, flat.T)  # U^{-1} g for every (pair, arm), (p, n K)
        var = self.config.lam * (flat * solved.T).sum(1).reshape(n, K) / self.width_
        return mean.numpy(), var.clamp_min(0).numpy()

    def select(self, contexts) -> RoutingDecision:
        """Pick one client per context: Thompson sample when enabled, the offline argmax otherwise.

        Parameters
        ----------
        contexts : ndarray of shape (n, d), float32.

        Returns
        -------
        RoutingDecision

        Raises
        ------
        ShapeError
        AlignmentConfigError
            A posterior mean, variance or sample that is not finite (the argmax of NaN or of ties at +-inf would
            silently be the lowest arm); the message names the ThompsonConfig fields to change.
        """
        a = self.features(contexts)
        offline_logits = self._logits_of(a, self.phi0_)
        offline = offline_logits.argmax(1)
        if not self.config.enabled:
            mean = self.scores(a).numpy()
            zeros = np.zeros_like(mean)
            return RoutingDecision(mean.argmax(1), mean, zeros, mean, offline, self._logits_of(a), offline_logits)
        mean, var = self.posterior(contexts)
        if not (np.isfinite(mean).all() and np.isfinite(var).all()):
            raise AlignmentConfigError(
                f"Thompson sampling: the posterior mean or variance is not finite for {self._bad_rows(mean, var)} of "
                f"{len(mean)} contexts, so their samples are NaN and the argmax would silently be the lowest arm. The "
                "router's last layer, its features or the covariance U overflowed: lower ThompsonConfig.lr "
                f"(now {self.config.lr:g}) or raise ThompsonConfig.lam (--ts-lambda, now {self.config.lam:g})")
        z = torch.randn(mean.shape, generator=self._generator, dtype=torch.float64).numpy()
        with np.errstate(over="ignore", invalid="ignore"):  # an overflow is refused just below, by name
            std = self.config.nu * np.sqrt(var)
            sampled = mean + std * z
        if not np.isfinite(sampled).all():
            raise AlignmentConfigError(
                f"Thompson sampling: the posterior sample mean + nu sigma z is not finite for "
                f"{self._bad_rows(sampled)} of {len(sampled)} contexts (largest nu sigma "
                f"{float(np.max(std)):g}), and ties at +-inf would go to the lowest arm: lower ThompsonConfig.nu "
                f"(--ts-nu, now {self.config.nu:g}) or raise ThompsonConfig.lam (--ts-lambda, now {self.config.lam:g})")
        clipped = np.clip(sampled, SAMPLE_CLIP, 1 - SAMPLE_CLIP)
        return RoutingDecision(sampled.argmax(1), mean, std, sampled, offline, np.log(clipped) - np.log1p(-clipped),
                               offline_logits)

    @staticmethod
    def _bad_rows(*arrays: np.ndarray) -> int:
        """Number of rows (contexts) with a non-finite entry in any of ``arrays`` (each (n, K))."""
        return int(np.any([~np.isfinite(x).all(1) for x in arrays], axis=0).sum())

    def _logits_of(self, a: torch.Tensor, phi: torch.Tensor | None = None) -> np.ndarray:
        """``W a + b`` at ``phi`` (default the current one): (n, K) float64."""
        W, b = self._unflatten(self._phi().detach() if phi is None else phi)
        z = a.to(torch.float64) @ W.to(torch.float64).T
        return (z if b is None else z + b.to(torch.float64)).numpy()

    # -- update -------------------------------------------------------------------------------

    def update(self, contexts, arms, feedback: float) -> dict:
        """Apply one bandit feedback ``r_t`` to the pairs ``(c, k)`` routed in the step.

        SGD on ``mean_i 1/2 (r_hat_{k_i}(c_i; phi) - r_t)^2 + lambda/2 ||phi - phi_0||^2`` over the
        last layer, then ``U += sum_i g_i g_i^T / m`` with ``g_i`` taken at the updated ``phi``.
        A no-op when disabled.

        Parameters
        ----------
        contexts : ndarray of shape (n, d), float32.
        arms : ndarray of shape (n,), ints in [0, K).
        feedback : 0.0 or 1.0 (see :func:`bandit_feedback`).

        Returns
        -------
        dict with ``loss_before``, ``loss_after`` (the online loss) and ``n_pairs``; empty when disabled.

        Raises
        ------
        ShapeError, InvalidInputError
        AlignmentConfigError
            The step made the last layer or ``U`` non-finite (the message names the ThompsonConfig fields to
            change); the router and ``U`` are left as they were before the call.
        """
        if not self.config.enabled:
            return {}
        arms = np.asarray(arms)
        a = self.features(contexts)
        if arms.shape != (a.shape[0],) or not np.issubdtype(arms.dtype, np.integer):
            raise ShapeError(f"arms must be an int array of shape ({a.shape[0]},), got {arms.dtype} {arms.shape}")
        if arms.min() < 0 or arms.max() >= self.n_arms:
            raise InvalidInputError(f"arms must lie in [0, {self.n_arms}), got {arms.min()}..{arms.max()}")
        if feedback not in (0.0, 1.0):
            raise InvalidInputError(f"feedback must be 0.0 or 1.0, got {feedback!r}")
        idx = torch.as_tensor(arms, dtype=torch.long)
        params = [self.layer.weight] + ([self.layer.bias] if self._has_bias else [])
        optimiser = torch.optim.SGD(params, lr=self.config.lr)
        target = torch.tensor(float(feedback))
        phi0 = self.phi0_.to(self.layer.weight.dtype)

        def online_loss() -> torch.Tensor:
            z = nn.functional.linear(a, self.layer.weight, self.layer.bias)
            r_hat = torch.sigmoid(z[torch.arange(len(idx)), idx])
            return 0.5 * ((r_hat - target) ** 2).mean() + 0.5 * self.config.lam * ((self._phi() - phi0) ** 2).sum()

        saved = [p.detach().clone() for p in params]
        before = float(online_loss().detach())
        for _ in range(self.config.n_update_steps):
            optimiser.zero_grad()
            loss = online_loss()
            loss.backward()
            optimiser.step()
        optimiser.zero_grad()

        def restore() -> None:  # the router stays as it was before this feedback
            with torch.no_grad():
                for param, old in zip(params, saved):
                    param.copy_(old)

        if not torch.isfinite(self._phi().detach()).all():
            restore()
            raise AlignmentConfigError(
                "Thompson sampling: the online SGD step made the router's last layer non-finite (restored to its "
                f"values before this feedback): lower ThompsonConfig.lr (now {self.config.lr:g}) or "
                f"ThompsonConfig.n_update_steps (now {self.config.n_update_steps}), or raise ThompsonConfig.lam "
                f"(--ts-lambda, now {self.config.lam:g}) to pull it back harder to the offline router")
        after = float(online_loss().detach())
        try:
            self.update_covariance(self.gradients(a, arms))
        except AlignmentConfigError:
            restore()
            raise
        self.n_updates_ += 1
        return {"loss_before": before, "loss_after": after, "n_pairs": int(len(arms))}

    def update_covariance(self, grads: torch.Tensor) -> None:
        """``U += sum_i g_i g_i^T / m`` for gradients of shape (n, p) (float64); private kernel.

        Raises
        ------
        AlignmentConfigError
            The new ``U`` would not be finite; ``U`` is left as it was.
        """
        g = grads.to(torch.float64)
        updated = self.U_ + g.T @ g / self.width_
        if not torch.isfinite(updated).all():
            raise AlignmentConfigError(
                "Thompson sampling: the covariance U = lam I + sum g g^T / m would not be finite (the router's "
                "features a(c) of its last layer are too large); U is left as it was: raise ThompsonConfig.width "
                f"(m, now {self.width_}) or scale the router's features down")
        self.U_ = updated

    def argmax_changed(self, contexts) -> float:
        """Share of ``contexts`` (n, d) whose argmax client under the current router differs from the
        offline router's (``phi_0``): how much the online updates changed the router's own choices."""
        a = self.features(contexts)
        return float(np.mean(self.scores(a).argmax(1).numpy() != self.scores(a, self.phi0_).argmax(1).numpy()))

    def drift(self) -> float:
        """``||phi - phi_0||_2``: how far the online updates moved the last layer."""
        return float(torch.linalg.vector_norm(self._phi().detach().double() - self.phi0_.double()))
