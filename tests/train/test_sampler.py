"""The training data order: a function of (seed, step) alone."""
import numpy as np
import pytest
import torch

from tcal.train.sampler import WindowOrder, batch_for_step
from tcal.utils.errors import TcalError

SEQ = 16


def test_data_order_is_a_function_of_seed_and_step():
    tokens = np.arange(10 * SEQ, dtype=np.uint16)  # 10 windows
    order = WindowOrder(10, seed=3)
    seen = [order.window(i) for i in range(20)]
    assert sorted(seen[:10]) == list(range(10)) and sorted(seen[10:]) == list(range(10))  # epochs are permutations
    assert seen[:10] != seen[10:]
    b = batch_for_step(tokens, WindowOrder(10, seed=3), SEQ, step=3, batch_size=4)
    assert torch.equal(b, batch_for_step(tokens, order, SEQ, step=3, batch_size=4))
    assert [int(r[0]) // SEQ for r in b] == seen[12:16]
    assert all(torch.equal(r, torch.arange(int(r[0]), int(r[0]) + SEQ)) for r in b)  # whole windows, no padding
    assert [WindowOrder(10, seed=4).window(i) for i in range(10)] != seen[:10]
    assert b.dtype == torch.long and b.shape == (4, SEQ)


def test_no_full_window_is_an_error():
    with pytest.raises(TcalError, match="no full window"):
        WindowOrder(0, seed=0)
