"""The export tests' fixtures (their hybrids: helpers.target_hybrid)."""
import pytest


@pytest.fixture(params=[False, True], ids=["no-conv", "short-conv"])
def short_conv(request):
    return request.param
