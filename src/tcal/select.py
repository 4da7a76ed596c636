"""Layer selection: which layers stay softmax attention (DESIGN.md §3, "Layer selection").

    0,4,8         explicit list
    uniform:K     K layers evenly spaced, layer 0 always kept
    ar:K          attention removal: zero each layer's attention output in turn, keep the K whose
                  removal raises held-out PPL most
    ga:K          greedy addition: for each layer i, a student keeping only i as attention (the rest
                  converted with the chosen init); keep the K whose students score best
K may be a fraction of the layers: uniform:25%.

Scores are measured on a validation slice of the *calibration* split (never on the evaluation
corpus) and cached by (teacher, data, protocol, init).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from tcal.errors import TcalError
from tcal.evaluate import window_ppl

POLICIES = ("uniform", "ar", "ga")


@dataclass
class Policy:
    kind: str  # "list" or one of POLICIES
    k: int
    layers: list[int] | None = None  # for "list"


def parse_policy(spec, num_layers: int) -> Policy:
    """'0,4,8' | [0, 4, 8] | 'uniform:8' | 'ar:25%' -> Policy."""
    if isinstance(spec, (list, tuple)):
        return Policy("list", len(spec), [int(i) for i in spec])
    spec = str(spec).strip()
    parts = [p.strip() for p in spec.split(",") if p.strip()]
    if parts and all(p.lstrip("-").isdigit() for p in parts):
        return Policy("list", len(parts), [int(p) for p in parts])
    kind, sep, count = spec.partition(":")
    if not sep or kind not in POLICIES:
        raise TcalError(
            f"unknown keep policy {spec!r}; use a list like 0,4,8 or one of "
            f"{', '.join(p + ':K' for p in POLICIES)} (K a count or a percentage like 25%)"
        )
    try:
        k = round(num_layers * float(count[:-1]) / 100) if count.endswith("%") else int(count)
    except ValueError:
        raise TcalError(f"keep policy {spec!r}: K must be a whole number or a percentage, got {count!r}") from None
    if k < 1:
        raise TcalError(f"keep policy {spec!r} keeps {k} layers; keep at least 1 attention layer")
    if k >= num_layers:
        raise TcalError(f"keep policy {spec!r} keeps {k} of {num_layers} layers: nothing would be converted; "
                        f"K must be below {num_layers}")
    return Policy(kind, k)


def uniform_layers(k: int, num_layers: int) -> list[int]:
    """k layers spread evenly over num_layers, always including layer 0 (every L/k-th)."""
    return sorted({math.floor(i * num_layers / k) for i in range(k)})


def top_k(scores: list[float], k: int, largest: bool) -> list[int]:
    order = sorted(range(len(scores)), key=lambda i: (-scores[i] if largest else scores[i], i))
    return sorted(order[:k])


@torch.no_grad()
def ar_scores(teacher, windows: torch.Tensor, *, batch_size: int = 4, progress: bool = True) -> list[float]:
    """Held-out PPL of the teacher with layer i's attention output zeroed, for every i."""
    from tqdm import tqdm

    scores = []
    layers = teacher.model.layers
    for i in tqdm(range(len(layers)), desc="ar: remove each attention layer", disable=not progress):
        hook = layers[i].self_attn.register_forward_hook(
            lambda mod, args, out: (torch.zeros_like(out[0]), *out[1:])
        )
        try:
            scores.append(window_ppl(teacher, windows, batch_size=batch_size, progress=False))
        finally:
            hook.remove()
    return scores


def gdn_for_every_layer(teacher, init: str, **init_kwargs) -> dict:
    """An initialised GDN module for every layer of the teacher.

    Calibration is teacher-forced and layer-local, so a layer's GDN does not depend on which
    other layers are converted: one conversion keeping only layer 0 as attention covers layers
    1..L-1, and one keeping every layer but 0 covers layer 0.
    """
    from tcal.convert import convert

    L = teacher.config.num_hidden_layers
    rest = convert(teacher, keep=[0], init=init, **init_kwargs).gdn_modules()
    first = convert(teacher, keep=list(range(1, L)), init=init, **init_kwargs).gdn_modules()
    return {0: first[0], **rest}


@contextlib.contextmanager
def assemble(teacher, keep: list[int], modules: dict):
    """Within the block, the teacher is the student keeping ``keep`` as attention and ``modules``
    (layer -> GDN) everywhere else; its own attention modules are put back afterwards."""
    layers = teacher.model.layers
    originals = {i: layers[i].self_attn for i in range(len(layers))}
    try:
        for j in range(len(layers)):
            if j not in keep:
                layers[j].self_attn = modules[j]
        yield teacher
    finally:
        for j, attn in originals.items():
            layers[j].self_attn = attn


@torch.no_grad()
def ga_scores(teacher, windows: torch.Tensor, modules: dict, *, batch_size: int = 4,
              progress: bool = True) -> list[float]:
    """Held-out PPL of the student that keeps only layer i as attention, for every i."""
    from tqdm import tqdm

    scores = []
    for i in tqdm(range(len(teacher.model.layers)), desc="ga: score one-attention students", disable=not progress):
        with assemble(teacher, [i], modules) as student:
            scores.append(window_ppl(student, windows, batch_size=batch_size, progress=False))
    return scores


@dataclass
class SelectionConfig:
    data: str = "wiki:calib"
    window: int = 512
    val_windows: int = 8
    skip_windows: int = 64  # the validation slice starts after the windows calibration may use
    batch_size: int = 4
    init: str = "copy"  # for ga
    cache_dir: str | None = None


@dataclass
class Selection:
    policy: str
    layers: list[int]
    scores: list[float] | None = None
    score_name: str | None = None
    seconds: float = 0.0
    protocol: dict = field(default_factory=dict)
    cached: bool = False


def _teacher_key(teacher) -> str:
    h = hashlib.sha256()
    h.update(json.dumps(teacher.config.to_dict(), sort_keys=True, default=str).encode())
    for name, p in list(teacher.named_parameters())[:4]:  # cheap fingerprint of the actual weights
        h.update(name.encode())
        h.update(p.detach().float().flatten()[:4096].cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def _cache_file(cfg: SelectionConfig, kind: str, teacher, extra: dict) -> Path:
    from tcal.data import cache_root

    key = json.dumps({"teacher": _teacher_key(teacher), "kind": kind, "data": cfg.data, "window": cfg.window,
                      "val": cfg.val_windows, "skip": cfg.skip_windows, **extra}, sort_keys=True, default=str)
    digest = hashlib.sha256(key.encode()).hexdigest()[:20]
    return cache_root(cfg.cache_dir) / "selection" / f"{kind}-{digest}.json"


def validation_windows(tokenizer, cfg: SelectionConfig) -> torch.Tensor:
    """The validation slice: windows of the calibration split after the first ``skip_windows``."""
    from tcal.data import token_windows

    ids = token_windows(cfg.data, tokenizer, window=cfg.window, n_windows=cfg.skip_windows + cfg.val_windows)
    return ids[cfg.skip_windows:]


def select_layers(teacher, spec, *, tokenizer=None, cfg: SelectionConfig | None = None, progress: bool = True,
                  **init_kwargs) -> Selection:
    """Resolve a keep spec (list or policy) to the list of layers kept as attention."""
    cfg = cfg or SelectionConfig()
    L = teacher.config.num_hidden_layers
    pol = parse_policy(spec, L)
    if pol.kind == "list":
        return Selection("list", sorted(pol.layers))
    if pol.kind == "uniform":
        return Selection(f"uniform:{pol.k}", uniform_layers(pol.k, L))
    if tokenizer is None:
        raise TcalError(f"keep policy {pol.kind}:{pol.k} scores layers on text: pass the teacher's tokenizer")
    extra = {"init": cfg.init, **{k: str(v) for k, v in init_kwargs.items() if k != "calib_ids"}} \
        if pol.kind == "ga" else {}
    path = _cache_file(cfg, pol.kind, teacher, extra)
    protocol = {"data": cfg.data, "window": cfg.window, "val_windows": cfg.val_windows,
                "skip_windows": cfg.skip_windows, **extra}
    if path.exists():
        rec = json.loads(path.read_text())
        scores, seconds, cached = rec["scores"], rec["seconds"], True
    else:
        windows = validation_windows(tokenizer, cfg)
        t0 = time.perf_counter()
        if pol.kind == "ar":
            scores = ar_scores(teacher, windows, batch_size=cfg.batch_size, progress=progress)
        else:
            modules = gdn_for_every_layer(teacher, cfg.init, tokenizer=tokenizer, **init_kwargs)
            scores = ga_scores(teacher, windows, modules, batch_size=cfg.batch_size, progress=progress)
        seconds, cached = time.perf_counter() - t0, False
        from tcal.atomic import write_json

        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, {"scores": scores, "seconds": seconds, "protocol": protocol})
    # ar: the layers whose removal hurts most stay; ga: the best one-attention students win.
    layers = top_k(scores, pol.k, largest=(pol.kind == "ar"))
    name = "ppl_with_layer_attention_removed" if pol.kind == "ar" else "ppl_keeping_only_this_layer"
    return Selection(f"{pol.kind}:{pol.k}", layers, scores, name, seconds, protocol, cached)


def plot_selection(sel: Selection, path, teacher_ppl: float | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, len(sel.scores) * 0.3), 3.5))
    colors = ["tab:red" if i in sel.layers else "tab:gray" for i in range(len(sel.scores))]
    ax.bar(range(len(sel.scores)), sel.scores, color=colors)
    if teacher_ppl:
        ax.axhline(teacher_ppl, color="k", lw=0.8, ls="--", label=f"teacher {teacher_ppl:.1f}")
        ax.legend()
    ax.set_yscale("log")
    ax.set_xlabel("layer")
    ax.set_ylabel(sel.score_name.replace("_", " "))
    ax.set_title(f"{sel.policy}: kept layers in red")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def selection_record(sel: Selection) -> dict:
    return asdict(sel)
