"""GRPO on the routed reward of a mixture of client reward models, with online routing (MoR, paper 001,
Sec. "GRPO with MoR" and "Online Router Updating"; ARCHITECTURE.md §7).

Design notes: docs/mor_grpo_and_device.md (Module notes).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import copy

import numpy as np

from sdk.errors import InvalidInputError
from sdk.real_numbers import finite_float
from trainer.alignment.errors import AlignmentConfigError
from trainer.config_fields import check_config
from trainer.alignment.thompson_routing import NeuralThompsonRouting, ThompsonConfig, bandit_feedback
from trainer.alignment.policy_models import load_policy, prepare_tokenizer
from trainer.report import save_figure, write_json, write_text
from trainer.rewards.routing_rule import RoutingRule, prompt_groups

#: A client reward model as the server sees it: (prompts, responses) -> normalised scores (n,) float32.
ClientReward = Callable[[Sequence[str], Sequence[str]], np.ndarray]
#: The frozen pair encoder of the router: (prompts, responses) -> contexts (n, d) float32.
PairEncoderFn = Callable[[Sequence[str], Sequence[str]], np.ndarray]

ROUTING_MODES = ("sparse", "soft")
DEVICES = ("cpu", "cuda")


def _text(item) -> str:
    """A TRL prompt or completion as text: a str, or the contents of a conversational message list."""
    if isinstance(item, str):
        return item
    if isinstance(item, list) and all(isinstance(m, dict) and "content" in m for m in item):
        return "\n".join(str(m["content"]) for m in item)
    raise InvalidInputError(f"a prompt/completion must be a str or a list of chat messages, got {type(item).__name__}")


class RoutedGRPOReward:
    """The routed reward as a TRL reward function (see the design notes).

    Parameters
    ----------
    encoder : callable (prompts, responses) -> ndarray of shape (n, d), float32, the router's ``Enc(x, y)``.
    clients : sequence of K callables (prompts, responses) -> ndarray of shape (n,), float32: each
        client's z-normalised reward ``R_bar_k``. Only the clients a pair is routed to are called.
    routing : NeuralThompsonRouting over the router (K outputs); ``routing.config.enabled`` switches
        the online update (off = the offline router's argmax).
    mode : ``"sparse"`` (top-1 client per pair) or ``"soft"`` (softmax-weighted, every client asked).
    temperature, route_by, fallback : the rest of the routing rule (:class:`trainer.rewards.routing_rule.RoutingRule`, the
        code path of the evaluation and of ``RoutedReward``): ``softmax(z / temperature)`` weights; with
        ``route_by="prompt"`` the completions of one prompt in a call (a GRPO group) share the mean weights, so
        the group is scored by one client. With online routing on, ``z`` is the Thompson sample on the logit scale
        (``RoutingDecision.logits``); off, the router's logits, so the reward equals ``RoutedReward``'s.
        ``fallback`` > 0 (sparse): a pair whose largest weight is below it gets the soft reward (every client asked);
        its bandit arm is still the argmax.
    fallback_top, probabilities : as :class:`RoutingRule` (the fallback mixes only the ``fallback_top`` clients with the
        largest weights; ``"ovr"``: normalised sigmoids of the logits instead of the softmax).

    Attributes
    ----------
    n_queries_ : int, client reward queries made so far (sparse: one per pair).
    pending_ : list of (contexts, arms) routed since the last bandit feedback.
    calls_ : list of dict, per call: ``n_pairs``, ``changed_vs_offline`` (share of pairs routed to
        another client than the offline router's argmax), ``arm_share`` (K floats), ``reward_mean``.

    Raises
    ------
    AlignmentConfigError
        ``mode`` unknown, K clients but a router with another number of outputs, or ``soft`` with online
        routing enabled (the bandit needs one arm per pair).
    """

    __name__ = "routed_reward"  # TRL names reward columns after the callable

    def __init__(self, encoder: PairEncoderFn, clients: Sequence[ClientReward], routing: NeuralThompsonRouting,
                 mode: str = "sparse", temperature: float = 1.0, route_by: str = "response", fallback: float = 0.0,
                 fallback_top: int = 0, probabilities: str = "softmax") -> None:
        if mode not in ROUTING_MODES:
            raise AlignmentConfigError(f"mode must be one of {ROUTING_MODES}, got {mode!r}")
        self.rule = RoutingRule(mode, temperature, route_by, fallback, fallback_top, probabilities)
        if len(clients) != routing.n_arms:
            raise AlignmentConfigError(f"{len(clients)} client reward models but the router has {routing.n_arms} outputs")
        if mode == "soft" and routing.config.enabled:
            raise AlignmentConfigError("online routing (Thompson sampling) picks one client per pair: use mode='sparse', "
                                       "or disable it (ThompsonConfig(enabled=False)) for soft routing")
        self.encoder = encoder
        self.clients = list(clients)
        self.routing = routing
        self.n_queries_ = 0
        self.pending_: list[tuple[np.ndarray, np.ndarray]] = []
        self.calls_: list[dict] = []
        self.probe_contexts_: list[np.ndarray] = []

    def __call__(self, prompts, completions, log_metric=None, **_: object) -> list[float]:
        prompts = [_text(p) for p in prompts]
        responses = [_text(c) for c in completions]
        if len(prompts) != len(responses) or not prompts:
            raise InvalidInputError(f"{len(prompts)} prompts for {len(responses)} completions")
        contexts = np.asarray(self.encoder(prompts, responses), dtype=np.float32)
        decision = self.routing.select(contexts)
        self.probe_contexts_ = (self.probe_contexts_ + [contexts])[-8:]  # the latest pairs, to probe the router
        K, groups = len(self.clients), prompt_groups(prompts)
        # the routing rule of the evaluation and of RoutedReward, on the decision's logits (the router's, or
        # the Thompson sample's when online routing is on): one code path for the routed reward
        rewards, arms = self.rule.combine(self.rule.weights(decision.logits, groups), lambda k, rows: self._ask(
            k, [prompts[i] for i in rows], [responses[i] for i in rows]))
        offline_arms = self.rule.weights(decision.offline_logits, groups).argmax(1)
        if self.mode == "sparse":
            self.pending_.append((contexts, arms.copy()))
        n = len(prompts)
        share = np.bincount(arms, minlength=K) / n
        changed = float(np.mean(arms != offline_arms))
        self.calls_.append({"n_pairs": n, "changed_vs_offline": changed, "arm_share": share.tolist(),
                            "reward_mean": float(rewards.mean())})
        if log_metric is not None:  # TRL passes its metric logger to reward functions
            log_metric("routing/changed_vs_offline", changed)
            for k in range(K):
                log_metric(f"routing/client_{k}_share", float(share[k]))
        return rewards.tolist()

    @property
    def mode(self) -> str:
        return self.rule.mode

    def _ask(self, k: int, prompts: list[str], responses: list[str]) -> np.ndarray:
        scores = np.asarray(self.clients[k](prompts, responses), dtype=np.float64)
        if scores.shape != (len(prompts),) or not np.isfinite(scores).all():
            raise InvalidInputError(f"client {k} returned scores of shape {scores.shape} (finite: "
                                    f"{bool(np.isfinite(scores).all())}); expected ({len(prompts)},) finite")
        self.n_queries_ += len(prompts)
        return scores


def _callback_base():
    from transformers import TrainerCallback  # transformers: optional heavy dependency, imported on use

    return TrainerCallback


class OnlineRoutingCallback(_callback_base()):
    """Bandit feedback after each GRPO step, and the per-step history (design notes).

    Parameters
    ----------
    reward : the RoutedGRPOReward the trainer calls.
    progress : optional callable receiving one line per step.

    Attributes
    ----------
    history : list of dict, one per logged step: ``step``, ``loss``, ``reward``, ``kl``,
        ``changed_vs_offline``, ``arm_share``, ``feedback`` (None on the first step or when off),
        ``router_drift`` (``||phi - phi_0||``).
    """

    def __init__(self, reward: RoutedGRPOReward, progress: Callable[[str], None] | None = None) -> None:
        self.reward = reward
        self.progress = progress
        self.history: list[dict] = []
        self._previous_loss: float | None = None
        self._n_calls_seen = 0
        self._bar = None

    def on_train_begin(self, args, state, control, **kwargs):
        from tqdm.auto import tqdm  # tqdm: optional heavy dependency, imported on use

        self._bar = tqdm(total=state.max_steps, desc="GRPO", unit="step", leave=False)

    def on_train_end(self, args, state, control, **kwargs):
        if self._bar is not None:
            self._bar.close()

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        if "loss" not in logs or "reward" not in logs:
            return
        loss = float(logs["loss"])
        routing = self.reward.routing
        calls = self.reward.calls_[self._n_calls_seen:]
        self._n_calls_seen = len(self.reward.calls_)
        feedback = None
        if routing.config.enabled and self._previous_loss is not None and self.reward.pending_:
            feedback = bandit_feedback(self._previous_loss, loss)
            contexts = np.concatenate([c for c, _ in self.reward.pending_])
            arms = np.concatenate([a for _, a in self.reward.pending_])
            routing.update(contexts, arms, feedback)
        self.reward.pending_.clear()
        self._previous_loss = loss
        n = sum(c["n_pairs"] for c in calls) or 1
        row = {
            "step": int(state.global_step),
            "loss": loss,
            "reward": float(logs["reward"]),
            "kl": float(logs["kl"]) if "kl" in logs else float("nan"),
            "changed_vs_offline": sum(c["changed_vs_offline"] * c["n_pairs"] for c in calls) / n,
            "arm_share": (np.sum([np.asarray(c["arm_share"]) * c["n_pairs"] for c in calls], axis=0) / n).tolist()
            if calls else [],
            "feedback": feedback,
            "router_drift": routing.drift(),
        }
        self.history.append(row)
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(reward=f"{row['reward']:+.3f}", kl=f"{row['kl']:.4f}")
        if self.progress is not None:
            self.progress(f"step {row['step']}: routed reward {row['reward']:+.4f}  KL {row['kl']:.5f}  "
                          f"loss {loss:+.5f}  changed vs offline {row['changed_vs_offline']:.2f}")


@dataclass
class RoutedGRPOConfig:
    """Settings of a GRPO run on the routed reward (TRL ``GRPOConfig`` is built from these).

    model : causal LM, local path or hub id (loaded with :func:`~trainer.alignment.policy_models.load_policy`).
    output_dir : folder for ``history.json``, ``grpo.png`` and TRL's scratch files.
    beta : KL coefficient to the reference policy, > 0 (MoR keeps the KL penalty).
    learning_rate : AdamW learning rate of the policy.
    num_generations : M, completions per prompt (>= 2: advantages are group-relative).
    prompts_per_step : prompts per optimiser step (batch = prompts_per_step * num_generations completions).
    max_completion_length : tokens generated per completion.
    max_steps : optimiser steps.
    temperature : sampling temperature of the policy.
    routing_mode : ``"sparse"`` (MoR's practice) or ``"soft"``.
    thompson : ThompsonConfig of the online router update (``enabled=False`` = the ablation).
    device : ``"cpu"`` (float32, 1 thread, no gradient checkpointing) or ``"cuda"`` (bfloat16).
    seed : seed of TRL/transformers (sampling, shuffling).

    Raises
    ------
    AlignmentConfigError
        A value out of range (the message names the field and quotes the value).
    """

    model: str = ""
    output_dir: Path = Path("results/mor_grpo")
    beta: float = 0.04
    learning_rate: float = 1e-5
    num_generations: int = 4
    prompts_per_step: int = 2
    max_completion_length: int = 32
    max_steps: int = 50
    temperature: float = 1.0
    routing_mode: str = "sparse"
    thompson: ThompsonConfig = field(default_factory=ThompsonConfig)
    device: str = "cpu"
    seed: int = 0

    def __post_init__(self) -> None:
        self.output_dir = Path(self.output_dir)
        if isinstance(self.thompson, dict):
            self.thompson = ThompsonConfig(**self.thompson)
        check_config(self, "thompson", ThompsonConfig, error=AlignmentConfigError)

        def bad(name: str, rule: str) -> AlignmentConfigError:
            return AlignmentConfigError(f"{name}={getattr(self, name)!r} should be {rule}")

        for name in ("beta", "learning_rate", "temperature"):
            value = finite_float(getattr(self, name))
            if value is None or value <= 0:
                raise bad(name, "a finite number > 0" + (" (MoR's GRPO keeps a KL penalty)" if name == "beta" else ""))
        for name, low in (("num_generations", 2), ("prompts_per_step", 1), ("max_completion_length", 1),
                          ("max_steps", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise bad(name, f"an integer >= {low}")
        if self.routing_mode not in ROUTING_MODES:
            raise bad("routing_mode", f"one of {ROUTING_MODES}")
        if self.device not in DEVICES:
            raise bad("device", f"one of {DEVICES}")
        if self.routing_mode == "soft" and self.thompson.enabled:
            raise AlignmentConfigError("routing_mode='soft' with thompson.enabled=True: online routing needs "
                                       "sparse routing (one client per pair)")

    def to_dict(self) -> dict:
        out = asdict(self)
        out["output_dir"] = str(self.output_dir)
        return out

    def save(self, path: Path) -> None:
        """Write the config as JSON (atomic)."""

        write_json(Path(path), self.to_dict())

    def to_trl(self):
        """The TRL ``GRPOConfig`` of this run (logging every step, nothing saved, no external loggers)."""
        from trl import GRPOConfig  # trl: optional heavy dependency, imported on use

        gpu = self.device == "cuda"
        return GRPOConfig(
            output_dir=str(self.output_dir / "trl"),
            beta=float(self.beta),
            loss_type="grpo",
            learning_rate=float(self.learning_rate),
            num_generations=self.num_generations,
            per_device_train_batch_size=self.prompts_per_step * self.num_generations,
            gradient_accumulation_steps=1,
            max_completion_length=self.max_completion_length,
            max_steps=self.max_steps,
            temperature=float(self.temperature),
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            seed=self.seed,
            use_cpu=not gpu,
            bf16=gpu,
            gradient_checkpointing=False,
            dataloader_num_workers=0,
            disable_tqdm=True,  # OnlineRoutingCallback shows a tqdm bar with reward and KL
        )


@dataclass(frozen=True)
class GRPOResult:
    """What :meth:`RoutedGRPOTrainer.train` returns.

    history : list of per-step dicts (see :class:`OnlineRoutingCallback`).
    summary : dict: first/last-window routed reward, max KL, mean share of pairs routed away from
        the offline router, client queries, online routing on/off.
    """

    history: list[dict]
    summary: dict


def summarise(history: list[dict], n_queries: int, online: bool) -> dict:
    """Summary of a GRPO history: mean routed reward over the first and last quarter of the steps,
    the largest KL, the share of pairs routed away from the offline router, client queries.
    (:meth:`RoutedGRPOTrainer.train` adds ``router_argmax_changed``: on the pairs of the last steps,
    the share whose argmax under the updated router differs from the offline router's.)"""
    if not history:
        raise InvalidInputError("empty GRPO history: no step was logged")
    q = max(1, len(history) // 4)
    reward = np.array([h["reward"] for h in history])
    kl = np.array([h["kl"] for h in history])
    return {
        "n_steps": len(history),
        "online_routing": bool(online),
        "reward_first_quarter": float(reward[:q].mean()),
        "reward_last_quarter": float(reward[-q:].mean()),
        "reward_gain": float(reward[-q:].mean() - reward[:q].mean()),
        "kl_max": float(np.nanmax(kl)) if np.isfinite(kl).any() else float("nan"),
        "kl_all_finite": bool(np.isfinite(kl).all()),
        "changed_vs_offline_mean": float(np.mean([h["changed_vs_offline"] for h in history])),
        "router_drift": float(history[-1]["router_drift"]),
        "client_queries": int(n_queries),
    }


class RoutedGRPOTrainer:
    """GRPO (TRL) on a routed reward with optional online routing (design notes).

    Parameters
    ----------
    config : RoutedGRPOConfig.
    reward : RoutedGRPOReward (its routing's ``enabled`` must match ``config.thompson.enabled``).
    prompts : sequence of public prompts (str), the GRPO training queries.
    model, tokenizer : optional already loaded policy and tokenizer; default ``load_policy(config.model)``.

    Raises
    ------
    AlignmentConfigError
        Fewer prompts than ``config.prompts_per_step`` (no step would run), an empty prompt, or a reward whose
        online switch disagrees with the config.
    PolicyUnavailableError
        The policy cannot be loaded.
    """

    def __init__(self, config: RoutedGRPOConfig, reward: RoutedGRPOReward, prompts: Sequence[str],
                 model=None, tokenizer=None) -> None:
        if len(prompts) < config.prompts_per_step:  # TRL would run no step (its batches are whole)
            raise AlignmentConfigError(f"GRPO needs at least prompts_per_step={config.prompts_per_step} prompts for one "
                                       f"step, got {len(prompts)}")
        bad = [i for i, p in enumerate(prompts) if not isinstance(p, str) or not p.strip()]
        if bad:
            raise AlignmentConfigError(f"prompts {bad[:5]} are empty or not str")
        if reward.routing.config.enabled != config.thompson.enabled:
            raise AlignmentConfigError(f"config.thompson.enabled={config.thompson.enabled} but the reward's routing has "
                                       f"enabled={reward.routing.config.enabled}")
        if reward.mode != config.routing_mode:
            raise AlignmentConfigError(f"config.routing_mode={config.routing_mode!r} but the reward's mode is {reward.mode!r}")
        self.config = config
        self.reward = reward
        self.prompts = list(prompts)
        self._model, self._tokenizer = model, tokenizer

    def train(self, progress: Callable[[str], None] | None = None) -> GRPOResult:
        """Run ``max_steps`` GRPO steps; write ``history.json`` (config, history, summary) and ``grpo.png``.

        Returns
        -------
        GRPOResult

        Raises
        ------
        AlignmentConfigError
            The policy diverged (NaN or inf next-token probabilities in generation, e.g. too high a learning
            rate); nothing is written then.
        PolicyUnavailableError
            ``config.model`` cannot be loaded.
        """
        import torch  # torch: optional heavy dependency, imported on use
        from datasets import Dataset  # datasets: optional heavy dependency, imported on use
        from transformers import PrinterCallback  # transformers: optional heavy dependency, imported on use
        from trl import GRPOTrainer  # trl: optional heavy dependency, imported on use


        cfg = self.config
        if cfg.device == "cpu":
            torch.set_num_threads(1)
        model, tokenizer = self._model, self._tokenizer
        if model is None:
            model, tokenizer = load_policy(cfg.model, device=cfg.device,
                                           dtype="bfloat16" if cfg.device == "cuda" else "float32")
        prepare_tokenizer(tokenizer)  # no token_type_ids into generate(); pad token; chat template
        cfg.output_dir.mkdir(parents=True, exist_ok=True)
        callback = OnlineRoutingCallback(self.reward, progress)
        trainer = GRPOTrainer(model=model, reward_funcs=[self.reward], args=cfg.to_trl(),
                              train_dataset=Dataset.from_dict({"prompt": self.prompts}),
                              processing_class=tokenizer, callbacks=[callback])
        trainer.remove_callback(PrinterCallback)  # one progress display: the callback's bar and lines
        try:
            trainer.train()
        except RuntimeError as exc:  # torch.multinomial in generate(), once a step left NaN weights
            if "probability tensor contains" not in str(exc):
                raise
            raise AlignmentConfigError(f"the policy diverged during GRPO (its next-token probabilities are NaN or inf); "
                                       f"learning_rate={cfg.learning_rate:g}, beta={cfg.beta:g}: lower --learning-rate"
                                       ) from exc
        summary = summarise(callback.history, self.reward.n_queries_, cfg.thompson.enabled)
        if self.reward.calls_:
            probe = np.concatenate([c for c in self.reward.probe_contexts_])
            summary["router_argmax_changed"] = self.reward.routing.argmax_changed(probe)
        write_history(cfg.output_dir, cfg.to_dict(), callback.history, summary)
        self.trainer_ = trainer
        return GRPOResult(callback.history, summary)


def write_history(out: Path, config: dict, history: list[dict], summary: dict) -> None:
    """``history.json`` (config, per-step history, summary) and ``grpo.png`` (reward and KL per step)."""
    import matplotlib  # matplotlib: optional heavy dependency, imported on use

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # matplotlib: optional heavy dependency, imported on use


    out = Path(out)
    write_json(out / "history.json", {"config": config, "history": history, "summary": summary})
    steps = [h["step"] for h in history]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.2))
    reward = np.array([h["reward"] for h in history])
    axes[0].plot(steps, reward, lw=0.6, alpha=0.45, marker=".")
    axes[0].plot(steps, rolling_mean(reward, 10), lw=2.0, color="tab:blue", label="10-step mean")
    axes[0].set(title="routed reward (mean per step)", xlabel="step")
    axes[0].legend()
    axes[1].plot(steps, [h["kl"] for h in history], marker=".", color="tab:red")
    axes[1].set(title="KL to reference", xlabel="step")
    axes[2].plot(steps, [h["changed_vs_offline"] for h in history], marker=".", color="tab:green")
    axes[2].set(title="share routed away from offline router", xlabel="step", ylim=(-0.02, 1.02))
    save_figure(fig, out / "grpo.png")


def rolling_mean(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over up to ``window`` steps (shorter at the start): (n,) float64."""
    values = np.asarray(values, dtype=np.float64)
    csum = np.concatenate([[0.0], np.cumsum(values)])
    idx = np.arange(1, len(values) + 1)
    lo = np.maximum(0, idx - window)
    return (csum[idx] - csum[lo]) / (idx - lo)


def load_history(path: Path) -> dict:
    """Read a ``history.json`` written by :func:`write_history`."""
    return json.loads(Path(path).read_text())


def from_mixture(mixture, thompson: ThompsonConfig) -> RoutedGRPOReward:
    """A :class:`RoutedGRPOReward` over a trained MoR mixture (``trainer.rewards.mixture.RoutedReward``).

    The router is copied (the online update never changes the saved, offline router); the encoder is
    the mixture's ``PairEncoder``; client ``k`` answers with its normalised score (raw when the
    mixture has ``normalise=False``). The routing rule (every field of ``RoutingRule``) is the mixture's active
    one (``mixture.rule``: for a mixture saved by ``fedroute mor train``, the variant chosen on validation).
    """

    router = copy.deepcopy(mixture.router)
    clients = [_ClientScore(rm, mixture.normalise) for rm in mixture.reward_models]
    rule = mixture.rule
    return RoutedGRPOReward(mixture.encoder.encode, clients, NeuralThompsonRouting(router, thompson), rule.mode,
                            rule.temperature, rule.route_by, rule.fallback, rule.fallback_top, rule.probabilities)


class _ClientScore:
    """Client ``rm`` queried by the server: ``rm.score(prompts, responses, normalise)``."""

    def __init__(self, rm, normalise: bool) -> None:
        self.rm, self.normalise = rm, normalise

    def __call__(self, prompts, responses) -> np.ndarray:
        return self.rm.score(list(prompts), list(responses), normalise=self.normalise)


def compare_online(config: RoutedGRPOConfig, make_reward: Callable[[ThompsonConfig], RoutedGRPOReward],
                   prompts: Sequence[str], progress: Callable[[str], None] | None = None) -> dict:
    """Run the same GRPO twice, online routing on then off (same seed, same policy start), and write
    ``comparison.json``, ``comparison.md`` and ``comparison.png`` into ``config.output_dir``.

    Parameters
    ----------
    config : RoutedGRPOConfig; its ``thompson`` settings are used for the online run.
    make_reward : builds a fresh RoutedGRPOReward for a ThompsonConfig (e.g. ``lambda t: from_mixture(mix, t)``).
    prompts : the GRPO prompts.

    Returns
    -------
    dict ``{"online": summary, "offline": summary}``.
    """
    import matplotlib  # matplotlib: optional heavy dependency, imported on use

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # matplotlib: optional heavy dependency, imported on use


    out = Path(config.output_dir)
    runs: dict[str, GRPOResult] = {}
    for name, enabled in (("online", True), ("offline", False)):
        thompson = ThompsonConfig(**{**config.thompson.to_dict(), "enabled": enabled})
        cfg = RoutedGRPOConfig(**{**config.to_dict(), "output_dir": out / name, "thompson": thompson})
        if progress is not None:
            progress(f"GRPO with online routing {'on' if enabled else 'off'} -> {cfg.output_dir}")
        runs[name] = RoutedGRPOTrainer(cfg, make_reward(thompson), prompts).train(progress)
    summary = {name: r.summary for name, r in runs.items()}
    write_json(out / "comparison.json", {"config": config.to_dict(), "summary": summary,
                                         "history": {name: r.history for name, r in runs.items()}})
    rows = ["| online routing | reward, first quarter | reward, last quarter | max KL | share routed away from offline router "
            "| router argmax changed (last pairs) | router drift | client queries |", "|---|---|---|---|---|---|---|---|"]
    for name, s in summary.items():
        rows.append(f"| {'on' if name == 'online' else 'off'} | {s['reward_first_quarter']:+.3f} | "
                    f"{s['reward_last_quarter']:+.3f} | {s['kl_max']:.4f} | {s['changed_vs_offline_mean']:.3f} | "
                    f"{s.get('router_argmax_changed', float('nan')):.3f} | {s['router_drift']:.4f} | {s['client_queries']} |")
    write_text(out / "comparison.md", "\n".join(rows) + "\n")
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.4))
    for name, r in runs.items():
        steps = [h["step"] for h in r.history]
        label = f"online routing {'on' if name == 'online' else 'off'}"
        reward = np.array([h["reward"] for h in r.history])
        line, = axes[0].plot(steps, reward, lw=0.6, alpha=0.45)
        axes[0].plot(steps, rolling_mean(reward, 10), lw=2.0, color=line.get_color(), label=f"{label} (10-step mean)")
        axes[1].plot(steps, [h["kl"] for h in r.history], marker=".", label=label)
        axes[2].plot(steps, [h["changed_vs_offline"] for h in r.history], marker=".", label=label)
    axes[0].set(title="routed reward (mean per step)", xlabel="GRPO step")
    axes[1].set(title="KL to reference policy", xlabel="GRPO step")
    axes[2].set(title="share of pairs routed away from\nthe offline router's choice", xlabel="GRPO step", ylim=(-0.02, 1.02))
    axes[0].legend()
    save_figure(fig, out / "comparison.png")
    return summary
