"""fastzero.utils.RepeatingLoader (DeepSpeed's deepspeed.utils.RepeatingLoader)."""

import itertools

import pytest
import torch

from fastzero.utils import RepeatingLoader


def test_restarts_when_exhausted():
    loader = RepeatingLoader([1, 2, 3])
    assert iter(loader) is loader
    assert list(itertools.islice(loader, 8)) == [1, 2, 3, 1, 2, 3, 1, 2]


def test_a_dataloader_is_iterated_afresh_each_pass():
    data = torch.utils.data.TensorDataset(torch.arange(5.0))
    loader = RepeatingLoader(torch.utils.data.DataLoader(data, batch_size=2))  # batches of 2, 2, 1
    sizes = [len(batch[0]) for batch in itertools.islice(loader, 7)]
    assert sizes == [2, 2, 1, 2, 2, 1, 2]


def test_an_empty_or_one_shot_iterable_stops():
    with pytest.raises(StopIteration):
        next(RepeatingLoader([]))
    assert list(RepeatingLoader(iter([1, 2]))) == [1, 2]  # a generator cannot restart
