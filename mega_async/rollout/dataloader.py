"""EpochLoader: the dataset as an endless, resumable stream of tagged items.

Each epoch is a seeded permutation of the dataset (seed + epoch), so the order is the same on every run
and after a resume; `state_dict()` is (epoch, position) and nothing else is needed to continue exactly.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch


@dataclass(frozen=True)
class Sample:
    """One dataset item with where it came from (the ledger's key: index within the dataset, epoch)."""

    index: int
    epoch: int
    data: Any

    @property
    def tag(self) -> dict[str, int]:
        return {"index": self.index, "epoch": self.epoch}


class EpochLoader:
    def __init__(self, items: Sequence[Any], seed: int = 0, shuffle: bool = True):
        if not len(items):
            raise ValueError("the dataset is empty: nothing to roll out")
        self.items = items
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0  # items drawn in the current epoch
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.items)))
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.items), generator=g).tolist()

    def __iter__(self) -> Iterator[Sample]:
        return self

    def __next__(self) -> Sample:
        if self.position >= len(self._order):
            self.epoch, self.position = self.epoch + 1, 0
            self._order = self._permutation(self.epoch)
        i = self._order[self.position]
        self.position += 1
        return Sample(i, self.epoch, self.items[i])

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "size": len(self.items),
                "shuffle": int(self.shuffle)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["size"] != len(self.items) or state["seed"] != self.seed or bool(state["shuffle"]) != self.shuffle:
            raise ValueError(f"the checkpoint's dataset order (size {state['size']}, seed {state['seed']}) does not "
                             f"match this run's (size {len(self.items)}, seed {self.seed}): resume with the same "
                             "data and seed")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._permutation(self.epoch)
