"""Users who disagree: harmless and helpful users labelling the same HH-RLHF pairs (issue 28, FedVPA-GP).

Construction (the helpful users' labels are constructed, not collected)
----------------------------------------------------------------------
- **Pairs**: the chosen-vs-rejected pairs of HH-RLHF harmless-base test
  (:func:`trainer.data.preferences.load_hh_harmless_pairs`, 2,303 pairs, sides balanced by a seeded swap).
- **Harmless users** (type 0) keep the HH label (the less harmful response wins).
- **Helpful users** (type 1) prefer the complying answer on the same prompts: the HH label flipped. This
  is the standard construction for conflicting helpful/harmless preferences; no person gave these labels.
  Both types label pairs of the same prompt distribution, so the domain cannot give a user's type away;
  on every pair the two types disagree, so a monolithic model of a 50/50 population scores 0.5 by
  construction.
- **Splits** go by ``prompt_id`` (:func:`trainer.data.preferences.split_by_prompt`, train / validation /
  test = 0.6 / 0.2 / 0.2 of the prompts; validation is carved from what is not test). Training users draw their
  pairs from train prompts, validation users from validation prompts, test users from test prompts;
  inside one user every pair has its own prompt, so a user's context and held-out pairs share no prompt.
- **Clients**: N clients (default 20). ``mix='dirichlet'``: client ``i`` draws type shares
  ``pi_i ~ Dir(alpha * 1_2)`` and each of its users draws its type from ``pi_i``; ``mix='pure'``: clients
  alternate types (every user of client ``i`` has type ``i mod 2``).
- **Users**: each training user holds ``n_train_pairs`` labelled pairs (context and targets are drawn
  from them during training); each validation / test user holds ``C_max`` context pairs followed by
  ``n_heldout`` held-out pairs. The context of size C is the first C of the ``C_max`` (nested contexts).

A user's pairs and labels stay on its client: the trainer reads them only inside the client's local step.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import pandas as pd

from sdk.errors import InvalidInputError
from trainer.data.preferences import load_hh_harmless_pairs, split_by_prompt

#: User types, in index order (type 0 keeps the HH label, type 1 flips it).
TYPES = ("harmless", "helpful")
PARTS = ("train", "val", "test")


@dataclass(frozen=True)
class UsersConfig:
    """How the users and clients are drawn (module docstring).

    n_clients : int >= 2.
    mix : ``'dirichlet'`` | ``'pure'``.
    alpha : float > 0, Dirichlet concentration of each client's type shares (``mix='dirichlet'``).
    n_users : users per client per part, ``{'train': 8, 'val': 2, 'test': 6}``.
    n_train_pairs : labelled pairs of a training user.
    context_max : ``C_max``, context pairs of a validation / test user.
    n_heldout : held-out pairs of a validation / test user.
    """

    n_clients: int = 20
    mix: str = "dirichlet"
    alpha: float = 0.5
    n_train_users: int = 8
    n_val_users: int = 2
    n_test_users: int = 6
    n_train_pairs: int = 64
    context_max: int = 32
    n_heldout: int = 32

    def __post_init__(self) -> None:
        if self.mix not in ("dirichlet", "pure"):
            raise InvalidInputError(f"mix must be 'dirichlet' or 'pure', got {self.mix!r}")
        if self.n_clients < 2 or self.alpha <= 0:
            raise InvalidInputError(f"n_clients={self.n_clients} should be >= 2 and alpha={self.alpha} > 0")
        if min(self.n_train_users, self.n_val_users, self.n_test_users, self.n_train_pairs, self.context_max,
               self.n_heldout) < 1:
            raise InvalidInputError("user counts and pair counts must be >= 1")

    def n_users(self, part: str) -> int:
        return {"train": self.n_train_users, "val": self.n_val_users, "test": self.n_test_users}[part]


@dataclass
class ConflictingUsers:
    """The pairs and the users of one seed.

    pairs : the HH pairs frame (:data:`trainer.data.preferences.PAIR_COLUMNS`), row ``j`` is pair ``j``.
    part : ndarray of shape (n_pairs,), str, the split of each pair's prompt.
    client, type : ndarray of shape (n_users,), int64: the user's client and type (index into :data:`TYPES`).
    user_part : ndarray of shape (n_users,), str, ``'train'`` | ``'val'`` | ``'test'``.
    items : list of ndarray (int64) per user, pair indices: a training user's ``n_train_pairs``; a
        validation / test user's ``C_max`` context pairs, then ``n_heldout`` held-out pairs.
    """

    pairs: pd.DataFrame
    part: np.ndarray
    client: np.ndarray
    type: np.ndarray
    user_part: np.ndarray
    items: list[np.ndarray]
    context_max: int

    def labels(self, user: int, idx: np.ndarray) -> np.ndarray:
        """Labels of pairs ``idx`` as user ``user`` gives them: 1 = response_a preferred (int64)."""
        return self.pairs["label"].to_numpy()[idx].astype(np.int64) ^ int(self.type[user])

    def users(self, part: str, client: int | None = None) -> np.ndarray:
        """Indices of the users of ``part`` (and of ``client``, when given)."""
        ok = self.user_part == part
        if client is not None:
            ok &= self.client == client
        return np.flatnonzero(ok)

    def context(self, user: int, c: int) -> np.ndarray:
        """The first ``c`` context pairs of a validation / test user."""
        return self.items[user][:c]

    def heldout(self, user: int) -> np.ndarray:
        """The held-out pairs of a validation / test user."""
        return self.items[user][self.context_max:]


def make_users(pairs: pd.DataFrame, cfg: UsersConfig, seed: int = 0) -> ConflictingUsers:
    """Draw clients and users over ``pairs`` (module docstring).

    Parameters
    ----------
    pairs : HH pairs frame (needs ``prompt_id``, ``domain``, ``label``).
    cfg : UsersConfig.
    seed : int, seeds the split by prompt, the client mixes and the users' pairs.

    Raises
    ------
    InvalidInputError
        A part has fewer prompts than a user needs pairs (``C_max + n_heldout`` or ``n_train_pairs``).
    """
    pairs = pairs.reset_index(drop=True)
    rng = np.random.default_rng(seed)
    train, val, test = split_by_prompt(pairs, (0.6, 0.2, 0.2), seed=seed)
    part_of = {pid: name for name, frame in zip(PARTS, (train, val, test)) for pid in frame["prompt_id"]}
    part = pairs["prompt_id"].map(part_of).to_numpy().astype(str)
    # one array of pair indices per prompt: a user takes at most one pair of a prompt
    groups_all = pairs.groupby("prompt_id", sort=True).indices
    by_part = {name: [groups_all[p] for p in sorted(groups_all) if part_of[p] == name] for name in PARTS}
    if cfg.mix == "dirichlet":
        shares = rng.dirichlet(np.full(len(TYPES), cfg.alpha), size=cfg.n_clients)
    else:
        shares = np.eye(len(TYPES))[np.arange(cfg.n_clients) % len(TYPES)]
    client, utype, upart, items = [], [], [], []
    for name in PARTS:
        need = cfg.n_train_pairs if name == "train" else cfg.context_max + cfg.n_heldout
        groups = by_part[name]
        if len(groups) < need:
            raise InvalidInputError(f"part {name!r} has {len(groups)} prompts, fewer than the {need} pairs a user needs")
        for i in range(cfg.n_clients):
            for _ in range(cfg.n_users(name)):
                chosen = rng.choice(len(groups), size=need, replace=False)
                items.append(np.array([rng.choice(groups[g]) for g in chosen], dtype=np.int64))
                client.append(i)
                utype.append(int(rng.choice(len(TYPES), p=shares[i])))
                upart.append(name)
    return ConflictingUsers(pairs=pairs, part=part, client=np.array(client), type=np.array(utype),
                            user_part=np.array(upart), items=items, context_max=cfg.context_max)


def load_conflicting_users(data_dir: str | os.PathLike[str], cfg: UsersConfig | None = None,
                           seed: int = 0) -> ConflictingUsers:
    """:func:`make_users` over the HH-RLHF harmless pairs of ``data_dir`` (``hh_rlhf_harmless/test_parsed.parquet``).

    Raises DataUnavailableError / DataFormatError (the loader's) and InvalidInputError (:func:`make_users`).
    """
    return make_users(load_hh_harmless_pairs(data_dir, seed=0), cfg or UsersConfig(), seed=seed)
