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


@pytest.fixture()
def tmp_cache(tmp_path, monkeypatch):
    """A tcal cache of the test's own, so that no test reads or fills the user's cache."""
    monkeypatch.setenv("TCAL_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """The distillation tests' tiny teacher, its copy-init hybrid and token files, once per module."""
    from helpers import write_distill_assets

    return write_distill_assets(tmp_path_factory.mktemp("distill"))
