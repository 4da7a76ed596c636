import pytest
import torch

from helpers import FAMILIES


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny matmuls are dominated by thread-pool wake-ups on a busy 2-core box; a fixed count also
    # keeps runs bit-identical (the resume tests compare weights exactly).
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(params=FAMILIES)
def family(request):
    return request.param
