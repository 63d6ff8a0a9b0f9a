"""Direct Preference Optimisation of a causal-LM policy on a (synthetic) preference set, with TRL.

FedPrism's Phase III (paper 000, §3.3 "Phase III"; ARCHITECTURE.md §7) ends with the routed experts'
synthetic preference set aligning a policy. This module runs that last step with TRL's ``DPOTrainer``
(Rafailov et al. 2023, eq. 7: ``L = -log sigmoid(beta * [log pi(y_w|x)/pi_ref(y_w|x) - log pi(y_l|x)/pi_ref(y_l|x)])``)
and measures it on held-out pairs with the **implicit reward** ``r(x, y) = beta * (log pi(y|x) - log pi_ref(y|x))``
(same paper, eq. 5; log-probabilities summed over the completion tokens): held-out preference accuracy is
the share of pairs with ``r(x, y_w) > r(x, y_l)``, a tie counting 0.5 (METRICS.md "Pairwise ranking
accuracy"). Before training the policy equals the reference, every implicit reward is 0 and the accuracy
is exactly 0.5; we also report the policy's own log-likelihood ranking (``log pi(y_w|x) > log pi(y_l|x)``)
before and after, which is informative at step 0.

Design notes: docs/prism_device_and_dpo.md (Module notes).
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from sdk.atomic_write import replace_dir
from trainer.alignment.errors import AlignmentConfigError
from trainer.alignment.policy_models import load_policy
from trainer.config_fields import check_bool, check_int, check_real
from trainer.report import save_figure, write_json

PREFERENCE_COLUMNS = ("prompt", "chosen", "rejected")


@dataclass
class DPORunConfig:
    """Settings of one DPO run (validated in ``__post_init__``; no model is loaded).

    Parameters
    ----------
    model : str
        Policy path or hub id (loaded by :func:`~trainer.alignment.policy_models.load_policy`); the
        reference model is a second, frozen copy of it.
    beta : float, default=0.1
        DPO temperature (eq. 7), > 0.
    learning_rate : float, default=1e-5
        AdamW learning rate, > 0 (TRL's optimiser; 5e-7 is typical for a 0.5B policy, see ``gpu_preset``).
    max_steps : int, default=60
        Optimiser steps, >= 1.
    batch_size : int, default=8
        Pairs per device batch.
    gradient_accumulation_steps : int, default=1
    max_length : int, default=256
        Tokens per prompt + completion (TRL truncates beyond).
    chat : bool, default=True
        Give rows to TRL in conversational form (chat template) instead of plain text.
    device : str, default="cpu"
        ``"cpu"`` or a CUDA device string.
    dtype : {"float32", "bfloat16"}, default="float32"
        Training precision (bf16 mixed precision on GPU).
    gradient_checkpointing : bool, default=False
    num_threads : int or None, default=1
        ``torch.set_num_threads`` for the run on CPU; None leaves torch's setting.
    seed : int, default=0
    eval_batch_size : int, default=16
        Pairs per forward pass when scoring held-out pairs.
    """

    model: str
    beta: float = 0.1
    learning_rate: float = 1e-5
    max_steps: int = 60
    batch_size: int = 8
    gradient_accumulation_steps: int = 1
    max_length: int = 256
    chat: bool = True
    device: str = "cpu"
    dtype: str = "float32"
    gradient_checkpointing: bool = False
    num_threads: int | None = 1
    seed: int = 0
    eval_batch_size: int = 16
    warmup_ratio: float = field(default=0.0)

    def __post_init__(self) -> None:
        self.model = os.fspath(self.model)
        if not self.model:
            raise AlignmentConfigError("model='' is empty; pass a policy path or hub id")
        for name in ("beta", "learning_rate"):
            check_real(self, name, 0, low_open=True, error=AlignmentConfigError)
        for name in ("max_steps", "batch_size", "gradient_accumulation_steps", "max_length", "eval_batch_size"):
            check_int(self, name, 1, error=AlignmentConfigError)
        check_int(self, "num_threads", 1, optional=True, error=AlignmentConfigError)
        check_int(self, "seed", 0, error=AlignmentConfigError)
        check_real(self, "warmup_ratio", 0, 1, high_open=True, error=AlignmentConfigError)
        for name in ("chat", "gradient_checkpointing"):
            check_bool(self, name, error=AlignmentConfigError)
        if self.dtype not in ("float32", "bfloat16"):
            raise AlignmentConfigError(f"dtype={self.dtype!r} should be 'float32' or 'bfloat16'")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise AlignmentConfigError(f"device={self.device!r} should be 'cpu' or 'cuda[:i]'")
        if self.device == "cpu" and self.dtype == "bfloat16":
            raise AlignmentConfigError("dtype='bfloat16' with device='cpu': CPU runs train in float32")

    @classmethod
    def gpu_preset(cls, model: str, **overrides) -> DPORunConfig:
        """Settings for a GPU run on a Qwen2-0.5B-class policy: cuda, bf16, gradient checkpointing,
        lr 5e-7, batch 8 x 4 accumulation, 1024 tokens, 300 steps, warm-up 10 %."""
        settings = dict(model=model, device="cuda", dtype="bfloat16", gradient_checkpointing=True,
                        learning_rate=5e-7, batch_size=8, gradient_accumulation_steps=4, max_length=1024,
                        max_steps=300, num_threads=None, eval_batch_size=16, warmup_ratio=0.1)
        settings.update(overrides)
        return cls(**settings)


def validate_preference_rows(rows: Sequence[dict], *, what: str = "rows") -> list[dict]:
    """Check preference rows and return them as plain ``{"prompt", "chosen", "rejected"}`` dicts.

    Raises
    ------
    AlignmentConfigError
        No rows, a missing key, a non-string or empty text, or chosen == rejected; the message names
        the row index and the key.
    """
    if len(rows) == 0:
        raise AlignmentConfigError(f"{what}: no preference rows")
    clean = []
    for i, row in enumerate(rows):
        out = {}
        for key in PREFERENCE_COLUMNS:
            if key not in row:
                raise AlignmentConfigError(f"{what}: row {i} has no {key!r} (keys: {sorted(row)})")
            value = row[key]
            if not isinstance(value, str) or not value.strip():
                raise AlignmentConfigError(f"{what}: row {i} {key!r} should be a non-empty string, got {value!r:.60}")
            out[key] = value
        if out["chosen"] == out["rejected"]:
            raise AlignmentConfigError(f"{what}: row {i} has chosen == rejected")
        clean.append(out)
    return clean


def read_preference_rows(path: str | os.PathLike[str]) -> list[dict]:
    """Read a preference set written by Phase III: ``.jsonl`` (one object per line) or ``.parquet``,
    with string columns ``prompt``, ``chosen``, ``rejected`` (other columns are ignored).

    Raises
    ------
    AlignmentConfigError
        Unknown suffix, unreadable file, or rows that fail :func:`validate_preference_rows`.
    """
    p = Path(path)
    try:
        if p.suffix == ".jsonl":
            rows = [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
        elif p.suffix == ".parquet":
            import pandas as pd  # pandas: optional heavy dependency, imported on use

            rows = pd.read_parquet(p).to_dict("records")
        else:
            raise AlignmentConfigError(f"{p}: expected a .jsonl or .parquet preference file")
    except (OSError, ValueError) as exc:
        if isinstance(exc, AlignmentConfigError):
            raise
        raise AlignmentConfigError(f"{p}: cannot read preference rows: {exc}") from exc
    return validate_preference_rows(rows, what=str(p))


def _as_trl_rows(rows: Sequence[dict], chat: bool) -> list[dict]:
    if not chat:
        return [dict(r) for r in rows]
    return [{"prompt": [{"role": "user", "content": r["prompt"]}],
             "chosen": [{"role": "assistant", "content": r["chosen"]}],
             "rejected": [{"role": "assistant", "content": r["rejected"]}]} for r in rows]


def _encode_pair_parts(tokenizer, prompt: str, completion: str, chat: bool, max_length: int):
    """(prompt ids, completion ids) the way TRL splits them: the completion starts where the tokenised
    prompt and prompt + completion diverge; with ``chat=False`` the completion ends with EOS."""
    if chat:
        p = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                          tokenize=True)
        f = tokenizer.apply_chat_template([{"role": "user", "content": prompt},
                                           {"role": "assistant", "content": completion}], tokenize=True)
    else:
        p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        f = tokenizer(prompt + completion + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
    n = 0
    while n < min(len(p), len(f)) and p[n] == f[n]:
        n += 1
    ids = f[:max_length]
    return ids, min(n, len(ids))


def sequence_logps(model, tokenizer, prompts: Sequence[str], completions: Sequence[str], *, chat: bool = True,
                   max_length: int = 256, batch_size: int = 16):
    """Summed log-probability of each completion given its prompt.

    Parameters
    ----------
    model : transformers causal LM
    tokenizer : its tokenizer (prepared by ``prepare_tokenizer``)
    prompts, completions : sequences of str, same length n

    Returns
    -------
    ndarray of shape (n,), float64
        ``sum_t log p(y_t | x, y_<t)`` over the completion tokens (nats).
    """
    import torch  # torch: optional heavy dependency, imported on use

    device = next(model.parameters()).device
    encoded = [_encode_pair_parts(tokenizer, p, c, chat, max_length) for p, c in zip(prompts, completions)]
    out = np.zeros(len(encoded), dtype=np.float64)
    pad = tokenizer.pad_token_id
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for start in range(0, len(encoded), batch_size):
            chunk = encoded[start:start + batch_size]
            width = max(len(ids) for ids, _ in chunk)
            input_ids = torch.full((len(chunk), width), pad, dtype=torch.long)
            attention = torch.zeros((len(chunk), width), dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.bool)
            for row, (ids, n_prompt) in enumerate(chunk):
                input_ids[row, : len(ids)] = torch.tensor(ids)
                attention[row, : len(ids)] = 1
                mask[row, n_prompt: len(ids)] = True
            logits = model(input_ids=input_ids.to(device), attention_mask=attention.to(device)).logits.float()
            logp = torch.log_softmax(logits[:, :-1], dim=-1)
            token_logp = logp.gather(-1, input_ids[:, 1:].to(device).unsqueeze(-1)).squeeze(-1)
            out[start:start + len(chunk)] = (token_logp * mask[:, 1:].to(device)).sum(-1).cpu().numpy()
    model.train(was_training)
    return out


def pairwise_accuracy(score_chosen: np.ndarray, score_rejected: np.ndarray) -> float:
    """Share of pairs with ``score_chosen > score_rejected``, a tie counting 0.5 (METRICS.md).

    Parameters
    ----------
    score_chosen, score_rejected : array-like of shape (n_pairs,), float

    Raises
    ------
    AlignmentConfigError
        Different lengths, no pairs, or non-finite scores.
    """
    a = np.asarray(score_chosen, dtype=np.float64)
    b = np.asarray(score_rejected, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1 or a.size == 0:
        raise AlignmentConfigError(f"scores should be two 1-D arrays of one length >= 1, got {a.shape} and {b.shape}")
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        raise AlignmentConfigError("scores hold NaN or inf")
    return float(np.mean((a > b) + 0.5 * (a == b)))


@dataclass
class DPOResult:
    """What :meth:`DPOAlignmentTrainer.train` measured (also written as ``dpo_results.json``). ``n_train`` counts
    the pairs trained on; ``n_train_dropped`` those TRL dropped because their prompt alone fills ``max_length``."""

    loss_per_step: list[float]
    heldout_implicit_reward_accuracy_before: float
    heldout_implicit_reward_accuracy_after: float
    heldout_loglik_accuracy_before: float
    heldout_loglik_accuracy_after: float
    heldout_mean_margin_after: float
    n_train: int
    n_heldout: int
    model_dir: str
    n_train_dropped: int = 0

    @property
    def loss_first(self) -> float:
        return self.loss_per_step[0]

    @property
    def loss_last(self) -> float:
        return self.loss_per_step[-1]


class DPOAlignmentTrainer:
    """DPO of a policy with TRL's ``DPOTrainer``, measured on held-out pairs before and after.

    Parameters
    ----------
    args : DPORunConfig

    Examples
    --------
    >>> trainer = DPOAlignmentTrainer(DPORunConfig(model="path/to/policy"))   # doctest: +SKIP
    >>> result = trainer.train(train_rows, heldout_rows, out_dir="runs/dpo")  # doctest: +SKIP
    """

    def __init__(self, args: DPORunConfig) -> None:
        self.args = args

    def _score(self, policy, reference, tokenizer, rows, stage: str):
        """Held-out accuracies of ``policy`` against ``reference``; ``stage`` ("before training" / "after
        training") names when, should the policy's log-probabilities be NaN or inf (AlignmentConfigError)."""
        a = self.args
        prompts = [r["prompt"] for r in rows]
        kw = dict(chat=a.chat, max_length=a.max_length, batch_size=a.eval_batch_size)
        pw = sequence_logps(policy, tokenizer, prompts, [r["chosen"] for r in rows], **kw)
        pl = sequence_logps(policy, tokenizer, prompts, [r["rejected"] for r in rows], **kw)
        if not (np.isfinite(pw).all() and np.isfinite(pl).all()):  # else pairwise_accuracy's bare "scores hold NaN"
            cause = (f"the run diverged (learning_rate={a.learning_rate:g}, beta={a.beta:g}); lower --lr or --beta"
                     if stage == "after training" else f"the policy {a.model!r} is broken")
            raise AlignmentConfigError(f"the policy's log-probabilities are NaN or inf {stage}: {cause}")
        rw = sequence_logps(reference, tokenizer, prompts, [r["chosen"] for r in rows], **kw)
        rl = sequence_logps(reference, tokenizer, prompts, [r["rejected"] for r in rows], **kw)
        reward_w, reward_l = a.beta * (pw - rw), a.beta * (pl - rl)
        return {"implicit": pairwise_accuracy(reward_w, reward_l), "loglik": pairwise_accuracy(pw, pl),
                "margin": float(np.mean(reward_w - reward_l))}

    def train(self, train_rows: Sequence[dict], heldout_rows: Sequence[dict], out_dir: str | os.PathLike[str]
              ) -> DPOResult:
        """Run DPO on ``train_rows``, score ``heldout_rows`` before and after, write ``out_dir``.

        Parameters
        ----------
        train_rows, heldout_rows : sequences of {"prompt", "chosen", "rejected"} dicts of str
            Held-out rows must not share prompts with the training rows.
        out_dir : path
            Created if missing; ``model/``, ``dpo_results.json`` and ``dpo_loss.png`` are written in it.

        Raises
        ------
        AlignmentConfigError
            Bad rows, held-out prompts that also occur in training, or the policy's log-probabilities NaN or
            inf on the held-out pairs (before training: a broken policy; after: a diverged run, e.g. too high a
            learning rate; nothing is written then), or every training prompt filling ``max_length`` tokens
            on its own (TRL drops such pairs).
        PolicyUnavailableError
            The policy cannot be loaded.
        """
        import torch  # torch: optional heavy dependency, imported on use
        from datasets import Dataset  # datasets: optional heavy dependency, imported on use
        from trl import DPOConfig, DPOTrainer  # trl: optional heavy dependency, imported on use


        a = self.args
        train_rows = validate_preference_rows(train_rows, what="train rows")
        heldout_rows = validate_preference_rows(heldout_rows, what="held-out rows")
        shared = {r["prompt"] for r in train_rows} & {r["prompt"] for r in heldout_rows}
        if shared:
            raise AlignmentConfigError(f"{len(shared)} held-out prompts also occur in training, e.g. "
                                       f"{next(iter(shared))!r:.80}; split by prompt")
        out = Path(out_dir)
        previous_threads = torch.get_num_threads()
        if a.device == "cpu" and a.num_threads is not None:
            torch.set_num_threads(int(a.num_threads))
        try:
            torch.manual_seed(a.seed)
            policy, tokenizer = load_policy(a.model, device=a.device, dtype="float32")
            reference, _ = load_policy(a.model, device=a.device, dtype="float32")
            reference.requires_grad_(False)
            out.mkdir(parents=True, exist_ok=True)  # once the policy loaded: a bad --policy leaves no empty folder
            before = self._score(policy, reference, tokenizer, heldout_rows, "before training")

            config = DPOConfig(
                output_dir=str(out / "checkpoints"), beta=a.beta, learning_rate=a.learning_rate,
                max_steps=a.max_steps, per_device_train_batch_size=a.batch_size,
                gradient_accumulation_steps=a.gradient_accumulation_steps, max_length=a.max_length,
                bf16=a.dtype == "bfloat16", fp16=False, gradient_checkpointing=a.gradient_checkpointing,
                use_cpu=a.device == "cpu", logging_steps=1, save_strategy="no", report_to=[], seed=a.seed,
                data_seed=a.seed, warmup_ratio=a.warmup_ratio, lr_scheduler_type="linear",
                dataloader_num_workers=0, disable_tqdm=False,
            )
            trainer = DPOTrainer(model=policy, ref_model=reference, args=config,
                                 train_dataset=Dataset.from_list(_as_trl_rows(train_rows, a.chat)),
                                 processing_class=tokenizer)
            n_used = len(trainer.train_dataset)  # TRL drops the pairs whose prompt alone fills max_length
            if n_used == 0:  # else torch's "num_samples=0" traceback from the sampler
                raise AlignmentConfigError(f"every training prompt fills max_length={a.max_length} tokens on its own "
                                           "(TRL drops such pairs): no pair is left to train on; raise --max-length")
            trainer.train()
            losses = [float(h["loss"]) for h in trainer.state.log_history if "loss" in h]
            policy = trainer.model
            after = self._score(policy, reference, tokenizer, heldout_rows, "after training")
            # Saved whole beside the target, then swapped in: a run killed while saving over an earlier
            # run leaves the earlier model/ (and its dpo_results.json) as they were, never a mix.
            model_dir, staged = out / "model", out / ".model.partial"
            shutil.rmtree(staged, ignore_errors=True)
            trainer.save_model(str(staged))
            tokenizer.save_pretrained(str(staged))
            (out / "dpo_results.json").unlink(missing_ok=True)
            replace_dir(staged, model_dir)
        finally:
            torch.set_num_threads(previous_threads)

        result = DPOResult(
            loss_per_step=losses,
            heldout_implicit_reward_accuracy_before=before["implicit"],
            heldout_implicit_reward_accuracy_after=after["implicit"],
            heldout_loglik_accuracy_before=before["loglik"], heldout_loglik_accuracy_after=after["loglik"],
            heldout_mean_margin_after=after["margin"], n_train=n_used, n_heldout=len(heldout_rows),
            model_dir=str(model_dir), n_train_dropped=len(train_rows) - n_used,
        )
        self._write(out, result)
        return result

    def _write(self, out: Path, result: DPOResult) -> None:
        import matplotlib  # matplotlib: optional heavy dependency, imported on use

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # matplotlib: optional heavy dependency, imported on use


        payload = {"settings": asdict(self.args), **asdict(result),
                   "loss_first": result.loss_first, "loss_last": result.loss_last,
                   "metric": "implicit reward r = beta*(log pi - log pi_ref) summed over completion tokens; "
                             "accuracy = share of held-out pairs with r(chosen) > r(rejected), tie 0.5"}
        write_json(out / "dpo_results.json", payload)
        fig, ax = plt.subplots(figsize=(5, 3.2))
        ax.plot(np.arange(1, len(result.loss_per_step) + 1), result.loss_per_step, lw=1.2)
        ax.axhline(math.log(2), color="grey", ls=":", lw=1, label="log 2 (policy = reference)")
        ax.set_xlabel("optimiser step")
        ax.set_ylabel("DPO loss")
        ax.set_title(f"DPO: held-out implicit-reward acc {result.heldout_implicit_reward_accuracy_before:.2f}"
                     f" -> {result.heldout_implicit_reward_accuracy_after:.2f}", fontsize=9)
        ax.legend(fontsize=8)
        save_figure(fig, out / "dpo_loss.png")
