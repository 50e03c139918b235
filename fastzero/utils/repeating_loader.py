"""DeepSpeed's ``deepspeed.utils.RepeatingLoader``: an endless iterator over a
data loader, for loops that count steps instead of epochs (pipeline
``train_batch`` scripts)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any


class RepeatingLoader:
    """Iterates `loader` without end: when it is exhausted, a fresh ``iter(loader)``
    starts it again (a DataLoader reshuffles then, a DistributedSampler only
    after ``set_epoch``). `loader` must be re-iterable (a DataLoader, a list):
    a one-shot iterator (a generator) runs once, then the repetition stops,
    as does an empty loader: StopIteration when a fresh pass yields nothing."""

    def __init__(self, loader: Iterable) -> None:
        self.loader = loader
        self.data_iter = iter(loader)

    def __iter__(self) -> Iterator:
        return self

    def __next__(self) -> Any:
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)  # StopIteration here: the fresh pass is empty
