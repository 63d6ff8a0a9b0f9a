"""Pairwise preference judgements ``(x, y_A, y_B, label)`` from three real sources (AlpacaEval, HH-RLHF
harmless, RouterBench), splits by prompt and multi-faceted clients; the pairs frame, the sources and the
length-only accuracies are in docs/prism.md (Data). Used by FedPrism and the reward mixtures.

Errors: missing files raise :class:`~trainer.data.errors.DataUnavailableError`, missing columns
:class:`~trainer.data.errors.DataFormatError` (naming the file and column), bad arguments
:class:`sdk.errors.InvalidInputError`.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from sdk.errors import InvalidInputError
from sdk.real_numbers import finite_float
from trainer.data.errors import DataFormatError, DataUnavailableError

__all__ = [
    "DOMAINS",
    "PAIR_COLUMNS",
    "check_split_fractions",
    "dirichlet_clients",
    "load_alpacaeval_pairs",
    "load_hh_harmless_pairs",
    "load_preference_pairs",
    "load_routerbench_pairs",
    "split_by_prompt",
]

DOMAINS = ("alpacaeval", "hh_harmless", "routerbench")
PAIR_COLUMNS = ("pair_id", "prompt_id", "domain", "subset", "prompt", "response_a", "response_b",
                "label", "source_a", "source_b")
ALPACA_REFERENCE = "gpt4_1106_preview"
ALPACA_EXCLUDED = ("NullModel", "gpt4_gamed")
ALPACA_EXCLUDED_SUFFIXES = ("_concise", "_verbose")


# ----------------------------------------------------------------------------- file access


def _read_parquet(path: Path, columns: Sequence[str]) -> pd.DataFrame:
    if not path.exists():
        raise DataUnavailableError(
            f"{path} not found; give the shared data folder (../shared/data, or $FEDROUTE_SHARED_DATA)"
        )
    try:
        df = pd.read_parquet(path)
    except Exception as exc:  # pyarrow raises several unrelated types for a broken file
        raise DataFormatError(f"cannot read parquet: {exc}", path=path) from exc
    for col in columns:
        if col not in df.columns:
            raise DataFormatError(f"missing column; the file has {sorted(map(str, df.columns))[:12]}",
                                  path=path, column=col)
    return df


def _key(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _balance(winners: pd.DataFrame, seed: int) -> pd.DataFrame:
    """(winner, loser) rows with columns win/lose/src_win/src_lose -> pairs frame, half swapped."""
    n = len(winners)
    rng = np.random.default_rng(seed)
    swap = np.zeros(n, dtype=bool)
    swap[rng.permutation(n)[: n // 2]] = True
    out = pd.DataFrame({
        "pair_id": winners["pair_id"].to_numpy(),
        "prompt_id": winners["prompt_id"].to_numpy(),
        "domain": winners["domain"].to_numpy(),
        "subset": winners["subset"].to_numpy(),
        "prompt": winners["prompt"].to_numpy(),
        "response_a": np.where(swap, winners["lose"], winners["win"]),
        "response_b": np.where(swap, winners["win"], winners["lose"]),
        "label": (~swap).astype(np.int8),
        "source_a": np.where(swap, winners["src_lose"], winners["src_win"]),
        "source_b": np.where(swap, winners["src_win"], winners["src_lose"]),
    })
    return out.reset_index(drop=True)


def _check_common(margin: float | None = None, max_pairs: int | None = None, name: str = "max_pairs") -> None:
    if margin is not None and not (np.isfinite(margin) and 0.0 <= margin <= 1.0):
        raise InvalidInputError(f"margin must be in [0, 1] (preference units), got {margin!r}")
    if max_pairs is not None and (not isinstance(max_pairs, (int, np.integer)) or max_pairs < 1):
        raise InvalidInputError(f"{name} must be an int >= 1 or None, got {max_pairs!r}")


# ----------------------------------------------------------------------------- loaders


def alpaca_generator_excluded(generator: str) -> bool:
    """True for the gamed generators and the reference (module docstring)."""
    return (generator in ALPACA_EXCLUDED or generator == ALPACA_REFERENCE
            or generator.endswith(ALPACA_EXCLUDED_SUFFIXES))


def load_alpacaeval_pairs(
    data_dir: str | os.PathLike[str],
    *,
    margin: float = 0.5,
    max_pairs_per_instruction: int | None = 8,
    include_reference_pairs: bool = True,
    seed: int = 0,
) -> pd.DataFrame:
    """Model-vs-model (and optionally model-vs-reference) pairs of AlpacaEval 2.0.

    Parameters
    ----------
    data_dir : the shared data folder (holding ``alpacaeval/``).
    margin : float in [0, 1], minimum ``|p_g1 - p_g2|`` of the judge preferences (module docstring).
    max_pairs_per_instruction : int or None, at most this many model-vs-model pairs per instruction
        (a seeded sample of the kept ones); reference pairs are capped at the same number separately.
    include_reference_pairs : add generator-vs-reference pairs (kept when ``|p_g - 1.5| >= margin / 2``).
    seed : int, sampling and side randomisation.

    Returns
    -------
    DataFrame with :data:`PAIR_COLUMNS`, domain ``'alpacaeval'``, subset = instruction ``dataset``.

    Raises
    ------
    DataUnavailableError, DataFormatError, InvalidInputError
    """
    _check_common(margin, max_pairs_per_instruction, "max_pairs_per_instruction")
    root = Path(data_dir) / "alpacaeval"
    instr = _read_parquet(root / "instructions.parquet", ("instruction_id", "instruction", "dataset"))
    judg = _read_parquet(root / "judgements.parquet", ("instruction_id", "generator", "output", "preference"))
    ref = _read_parquet(root / "reference_outputs.parquet", ("instruction_id", "reference_output", "reference_generator"))
    judg = judg[~judg["generator"].map(alpaca_generator_excluded)]
    judg = judg[judg["output"].str.strip().astype(bool)]
    info = instr.set_index("instruction_id")
    refs = ref.set_index("instruction_id")
    rng = np.random.default_rng(seed)
    rows: list[tuple] = []
    for iid, group in judg.groupby("instruction_id", sort=True):
        if iid not in info.index:
            raise DataFormatError(f"instruction_id {iid} has judgements but no instruction",
                                  path=root / "instructions.parquet", column="instruction_id")
        gens = group["generator"].to_numpy()
        outs = group["output"].to_numpy()
        pref = group["preference"].to_numpy(dtype=np.float64)
        i, j = np.triu_indices(len(gens), k=1)
        keep = np.abs(pref[i] - pref[j]) >= margin
        i, j = i[keep], j[keep]
        if max_pairs_per_instruction is not None and len(i) > max_pairs_per_instruction:
            pick = np.sort(rng.choice(len(i), max_pairs_per_instruction, replace=False))
            i, j = i[pick], j[pick]
        prompt, subset = info.at[iid, "instruction"], info.at[iid, "dataset"]
        for a, b in zip(i, j):
            w, l_ = (a, b) if pref[a] > pref[b] else (b, a)
            rows.append((iid, prompt, subset, outs[w], outs[l_], gens[w], gens[l_]))
        if include_reference_pairs and iid in refs.index:
            r_out, r_gen = refs.at[iid, "reference_output"], refs.at[iid, "reference_generator"]
            k = np.flatnonzero((np.abs(pref - 1.5) >= margin / 2) & (pref != 1.5))
            if max_pairs_per_instruction is not None and len(k) > max_pairs_per_instruction:
                k = np.sort(rng.choice(k, max_pairs_per_instruction, replace=False))
            for g in k:
                if pref[g] > 1.5:
                    rows.append((iid, prompt, subset, outs[g], r_out, gens[g], r_gen))
                else:
                    rows.append((iid, prompt, subset, r_out, outs[g], r_gen, gens[g]))
    frame = pd.DataFrame(rows, columns=["iid", "prompt", "subset", "win", "lose", "src_win", "src_lose"])
    frame["domain"] = "alpacaeval"
    frame["prompt_id"] = "alpacaeval:" + frame["iid"].astype(str)
    frame["pair_id"] = frame["prompt_id"] + ":" + frame["src_win"] + "|" + frame["src_lose"]
    return _balance(frame, seed)


def load_hh_harmless_pairs(data_dir: str | os.PathLike[str], *, seed: int = 0) -> pd.DataFrame:
    """Chosen vs rejected pairs of HH-RLHF harmless-base test (``test_parsed.parquet``).

    Rows whose two responses are whitespace-only or identical are dropped (4 and 0 rows).

    Returns
    -------
    DataFrame with :data:`PAIR_COLUMNS`, domain ``'hh_harmless'``, subset ``'harmless'``, sources
    ``'chosen'`` / ``'rejected'``; prompt_id keyed by the prompt text (2 prompts occur twice).

    Raises
    ------
    DataUnavailableError, DataFormatError
    """
    path = Path(data_dir) / "hh_rlhf_harmless" / "test_parsed.parquet"
    df = _read_parquet(path, ("row_id", "prompt", "chosen_response", "rejected_response"))
    ok = (df["chosen_response"].str.strip().astype(bool) & df["rejected_response"].str.strip().astype(bool)
          & (df["chosen_response"] != df["rejected_response"]))
    df = df[ok]
    frame = pd.DataFrame({
        "prompt": df["prompt"].to_numpy(),
        "subset": "harmless",
        "win": df["chosen_response"].to_numpy(),
        "lose": df["rejected_response"].to_numpy(),
        "src_win": "chosen",
        "src_lose": "rejected",
        "domain": "hh_harmless",
    })
    frame["prompt_id"] = "hh_harmless:" + frame["prompt"].map(_key)
    frame["pair_id"] = frame["prompt_id"] + ":" + df["row_id"].astype(str).to_numpy()
    return _balance(frame, seed)


def load_routerbench_pairs(
    data_dir: str | os.PathLike[str],
    *,
    max_pairs_per_prompt: int | None = 4,
    equal_length: str = "drop",
    seed: int = 0,
) -> pd.DataFrame:
    """Correct-vs-incorrect response pairs of RouterBench (train and test files, prompts merged by text).

    Parameters
    ----------
    data_dir : the shared data folder (holding ``routerbench/``).
    max_pairs_per_prompt : int or None, at most this many pairs per prompt (seeded sample).
    equal_length : ``'drop'`` pairs whose responses have the same number of characters, or ``'keep'``.
    seed : int

    Returns
    -------
    DataFrame with :data:`PAIR_COLUMNS`, domain ``'routerbench'``, subset = task, sources = model ids.

    Raises
    ------
    DataUnavailableError, DataFormatError, InvalidInputError
    """
    _check_common(None, max_pairs_per_prompt, "max_pairs_per_prompt")
    if equal_length not in ("drop", "keep"):
        raise InvalidInputError(f"equal_length must be 'drop' or 'keep', got {equal_length!r}")
    root = Path(data_dir) / "routerbench"
    parts = [_read_parquet(root / f, ("task", "prompt")) for f in ("train.parquet", "test.parquet")]
    df = pd.concat(parts, ignore_index=True)
    models = [c[: -len("|correctness")] for c in df.columns if c.endswith("|correctness")]
    if not models:
        raise DataFormatError("no '<model>|correctness' column", path=root / "train.parquet")
    for m in models:
        if f"{m}|response" not in df.columns:
            raise DataFormatError("missing response column", path=root / "train.parquet", column=f"{m}|response")
    rng = np.random.default_rng(seed)
    rows: list[tuple] = []
    # the columns as arrays once (indexing pandas per prompt and model cost ~45 s of a 70 s load)
    labels = {m: df[f"{m}|correctness"].to_numpy(dtype=np.float64) for m in models}
    responses = {m: df[f"{m}|response"].to_numpy(dtype=object) for m in models}
    tasks = df["task"].to_numpy(dtype=object)
    groups = df.groupby("prompt", sort=True).indices
    for prompt in sorted(groups):
        rows_of = groups[prompt]  # row positions of this prompt, in file order
        task = tasks[rows_of[0]]
        # merge twin rows: the first non-NaN label and its response per model
        correct, wrong = {}, {}
        for m in models:
            lab = labels[m][rows_of]
            ok = np.flatnonzero(~np.isnan(lab))
            if ok.size == 0:
                continue
            first = responses[m][rows_of[ok[0]]]
            if not isinstance(first, str) or not first.strip():
                continue
            (correct if lab[ok[0]] == 1.0 else wrong)[m] = first
        cand = [(c, w) for c in correct for w in wrong if correct[c] != wrong[w]]
        if equal_length == "drop":
            cand = [(c, w) for c, w in cand if len(correct[c]) != len(wrong[w])]
        if max_pairs_per_prompt is not None and len(cand) > max_pairs_per_prompt:
            cand = [cand[k] for k in np.sort(rng.choice(len(cand), max_pairs_per_prompt, replace=False))]
        for c, w in cand:
            rows.append((prompt, task, correct[c], wrong[w], c, w))
    frame = pd.DataFrame(rows, columns=["prompt", "subset", "win", "lose", "src_win", "src_lose"])
    frame["domain"] = "routerbench"
    frame["prompt_id"] = "routerbench:" + frame["prompt"].map(_key)
    frame["pair_id"] = frame["prompt_id"] + ":" + frame["src_win"] + "|" + frame["src_lose"]
    return _balance(frame, seed)


def load_preference_pairs(
    data_dir: str | os.PathLike[str],
    domains: Sequence[str] = DOMAINS,
    *,
    margin: float = 0.5,
    max_pairs_per_instruction: int | None = 8,
    include_reference_pairs: bool = True,
    max_pairs_per_prompt: int | None = 4,
    equal_length: str = "drop",
    seed: int = 0,
) -> pd.DataFrame:
    """The pairs of the chosen domains, concatenated (arguments as in the per-source loaders).

    Raises
    ------
    InvalidInputError
        An unknown or repeated domain (the message lists :data:`DOMAINS`).
    DataUnavailableError, DataFormatError
    """
    domains = tuple(domains)
    bad = [d for d in domains if d not in DOMAINS]
    if bad or not domains or len(set(domains)) != len(domains):
        raise InvalidInputError(f"domains must be distinct values of {DOMAINS}, got {domains}")
    frames = []
    for d in domains:
        if d == "alpacaeval":
            frames.append(load_alpacaeval_pairs(data_dir, margin=margin, seed=seed,
                                                max_pairs_per_instruction=max_pairs_per_instruction,
                                                include_reference_pairs=include_reference_pairs))
        elif d == "hh_harmless":
            frames.append(load_hh_harmless_pairs(data_dir, seed=seed))
        else:
            frames.append(load_routerbench_pairs(data_dir, max_pairs_per_prompt=max_pairs_per_prompt,
                                                 equal_length=equal_length, seed=seed))
    return pd.concat(frames, ignore_index=True)


# ----------------------------------------------------------------------------- splits and clients


def _check_seed(seed: object) -> None:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise InvalidInputError(f"seed must be an int >= 0 (numpy's default_rng), got {seed!r}")


def check_split_fractions(fractions: object, *, positive: bool = False, name: str = "fractions") -> np.ndarray:
    """``fractions`` (train, validation, test) as a (3,) float64 array if they are 3 numbers >= 0 (> 0 with
    ``positive``: no empty split) summing to 1.

    Raises
    ------
    InvalidInputError
        Anything else (a str, NaN, a negative or zero share, a sum other than 1).
    """
    try:
        fr = np.asarray(fractions, dtype=np.float64)
    except (TypeError, ValueError):
        fr = np.empty(0)
    ok = fr.shape == (3,) and bool(((fr > 0) if positive else (fr >= 0)).all()) and bool(np.isclose(fr.sum(), 1.0))
    if not ok:
        raise InvalidInputError(f"{name} must be 3 numbers {'> 0' if positive else '>= 0'} (train, validation, test) "
                                f"summing to 1, got {fractions!r}")
    return fr


def _require(df: pd.DataFrame, columns: Sequence[str]) -> None:
    missing = [c for c in columns if c not in df.columns]
    if missing:
        raise DataFormatError(f"missing columns {missing}", path="<pairs frame>", column=missing[0])


def split_by_prompt(
    df: pd.DataFrame, fractions: tuple[float, float, float] = (0.6, 0.2, 0.2), seed: int = 0
) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """Train / validation / test split by ``prompt_id`` within each domain (never by row).

    Parameters
    ----------
    df : pairs frame (needs ``prompt_id`` and ``domain``).
    fractions : three non-negative floats summing to 1, the share of each domain's prompts per part.
    seed : int

    Returns
    -------
    (train, val, test) frames, index reset; every prompt_id lies in exactly one of them.

    Raises
    ------
    InvalidInputError
        Fractions not three non-negative numbers summing to 1.
    DataFormatError
        A needed column is missing.
    """
    _require(df, ("prompt_id", "domain"))
    _check_seed(seed)
    fr = check_split_fractions(fractions)
    rng = np.random.default_rng(seed)
    part_of: dict[str, int] = {}
    for domain in sorted(df["domain"].unique()):
        ids = np.array(sorted(df.loc[df["domain"] == domain, "prompt_id"].unique()))
        ids = ids[rng.permutation(len(ids))]
        cuts = np.round(np.cumsum(fr)[:2] * len(ids)).astype(int)
        for k, chunk in enumerate(np.split(ids, cuts)):
            part_of.update(dict.fromkeys(chunk.tolist(), k))
    part = df["prompt_id"].map(part_of).to_numpy()
    return tuple(df[part == k].reset_index(drop=True) for k in range(3))  # type: ignore[return-value]


def dirichlet_clients(
    df: pd.DataFrame, n_clients: int = 20, alpha: float = 0.5, seed: int = 0, by: str = "subset"
) -> np.ndarray:
    """Multi-faceted clients: each a Dirichlet(alpha) mix over the values of ``by`` (module docstring).

    Parameters
    ----------
    df : pairs frame (needs ``prompt_id`` and ``by``).
    n_clients : int >= 1.
    alpha : float > 0, Dirichlet concentration of each client's mix (small = few groups per client).
    seed : int
    by : ``'subset'`` or ``'domain'``.

    Returns
    -------
    ndarray of shape (n_rows,), int64: the client of each row; all pairs of a prompt go to one client.

    Raises
    ------
    InvalidInputError
        Bad n_clients, alpha or by.
    DataFormatError
        A needed column is missing.
    """
    if by not in ("subset", "domain"):
        raise InvalidInputError(f"by must be 'subset' or 'domain', got {by!r}")
    if isinstance(n_clients, bool) or not isinstance(n_clients, (int, np.integer)) or n_clients < 1:
        raise InvalidInputError(f"n_clients must be an int >= 1, got {n_clients!r}")
    value = finite_float(alpha)
    if value is None or value <= 0:
        raise InvalidInputError(f"alpha must be finite and > 0, got {alpha!r}")
    _check_seed(seed)
    _require(df, ("prompt_id", by))
    rng = np.random.default_rng(seed)
    groups = sorted(df[by].unique())
    mix = rng.dirichlet(np.full(len(groups), float(alpha)), size=n_clients)  # (n_clients, G)
    client_of: dict[str, int] = {}
    for g, name in enumerate(groups):
        ids = sorted(df.loc[df[by] == name, "prompt_id"].unique())
        p = mix[:, g] / mix[:, g].sum()
        client_of.update(zip(ids, rng.choice(n_clients, size=len(ids), p=p).tolist()))
    return df["prompt_id"].map(client_of).to_numpy(dtype=np.int64)
