"""Layer selection by score: which layers stay softmax attention (policies: tcal.conversion.policy).

    ar:K          attention removal: zero each layer's attention output in turn, keep the K whose
                  removal raises held-out PPL most
    ga:K          greedy addition: for each layer i, a student keeping only i as attention (the rest
                  converted with the chosen init); keep the K whose students score best
    niah:K        retrieval removal: zero each layer's attention output in turn and measure the
                  teacher's loss on the answers of needle-in-a-haystack prompts; keep the K layers
                  whose removal costs retrieval most. The prompts use a calibration-side haystack
                  and their own seed, never the evaluation prompts of tcal.evaluate.tasks.niah.ruler.
    answer:K      answer removal, for instruct teachers: zero each layer's attention output in turn
                  and measure the teacher's loss on the answers of chat-format code tasks (the
                  documented functions of a calibration-side code corpus, tcal.data.instruct); keep the
                  K layers whose removal costs the answers most.

Scores are measured on a validation slice of the *calibration* split (never on the evaluation
corpus) and cached by (teacher, data, protocol, init).
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from tcal.conversion.apply_init import initialise
from tcal.conversion.inits import get_init
from tcal.conversion.policy import (
    parse_policy,
    policy_scope,
    resolve_auto,
    scope_layers,
    top_k,
    uniform_layers,
)
from tcal.conversion.surgery import build_hybrid
from tcal.data.corpora import as_corpus
from tcal.data.instruct import chat_windows, code_tasks
from tcal.data.overlap import check_no_eval_text
from tcal.data.tokens import mixed_windows
from tcal.engines.placement import interval_layers
from tcal.evaluate import window_ppl
from tcal.evaluate.tasks.niah.ruler import make_samples
from tcal.modules.distill_loss import final_hidden, lm_parts
from tcal.utils.atomic import write_json
from tcal.utils.cache import cache_root
from tcal.utils.errors import TcalError


@torch.no_grad()
def removal_scores(teacher, score, *, desc: str, progress: bool = True) -> list[float]:
    """``score()`` of the teacher with layer i's attention output zeroed, for every layer i."""
    scores = []
    layers = teacher.model.layers
    for i in tqdm(range(len(layers)), desc=desc, disable=not progress):
        hook = layers[i].self_attn.register_forward_hook(
            lambda mod, args, out: (torch.zeros_like(out[0]), *out[1:])
        )
        try:
            scores.append(score())
        finally:
            hook.remove()
    return scores


def ar_scores(teacher, windows: torch.Tensor, *, batch_size: int = 4, progress: bool = True) -> list[float]:
    """Held-out PPL of the teacher with layer i's attention output zeroed, for every i."""
    return removal_scores(teacher, lambda: window_ppl(teacher, windows, batch_size=batch_size, progress=False),
                          desc="ar: remove each attention layer", progress=progress)


def answer_prompts(tokenizer, cfg: SelectionConfig) -> list[tuple[torch.Tensor, int]]:
    """Single-needle prompts with their answer appended: (token ids (1, T), answer tokens at the end)."""
    docs = as_corpus(cfg.niah_haystack).documents
    prompts = []
    # sized with 12 tokens of room (": " + 7 digits + "."), as when the niah:K layer sets in docs/results.md were picked;
    # the evaluation's 128 would shorten every haystack and change the picks
    for s in make_samples("single", tokenizer, cfg.niah_length, cfg.niah_samples, seed=cfg.niah_seed, documents=docs,
                          max_new_tokens=12):
        prompt = tokenizer(s.prompt, add_special_tokens=False)["input_ids"]
        answer = tokenizer(": " + s.answers[0] + ".", add_special_tokens=False)["input_ids"]
        prompts.append((torch.tensor([prompt + answer]), len(answer)))
    return prompts


NIAH_ANSWER_ROOM = 16  # tokens past the prompt for the appended answer (": " + 7 digits + ".")


def niah_length_for(teacher, length: int) -> int:
    """``length``, or less where the teacher's positions end before the prompt and its answer would."""
    limit = getattr(teacher.config, "max_position_embeddings", None)
    return length if not limit else max(1, min(length, int(limit) - NIAH_ANSWER_ROOM))


@torch.no_grad()
def niah_scores(teacher, tokenizer, cfg: SelectionConfig, *, progress: bool = True) -> list[float]:
    """Mean NLL of the needle's answer tokens with layer i's attention output zeroed, for every i.

    A continuous score where greedy accuracy would tie: most layers can go without retrieval
    failing outright, but they still move the answer's likelihood by different amounts."""
    prompts = answer_prompts(tokenizer, cfg)
    device = next(teacher.parameters()).device
    was_training = teacher.training
    teacher.eval()

    def answer_nll() -> float:
        total = 0.0
        for ids, n in prompts:
            logits = teacher(input_ids=ids.to(device), use_cache=False).logits[0, -n - 1:-1].float()
            total += float(torch.nn.functional.cross_entropy(logits, ids[0, -n:].to(device)))
        return total / len(prompts)

    try:
        return removal_scores(teacher, answer_nll, desc="niah: remove each attention layer", progress=progress)
    finally:
        teacher.train(was_training)


def answer_windows(tokenizer, cfg: SelectionConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, answer mask) of the ``answer`` policy's scoring text: the first ``answer_tasks`` code tasks of
    ``answer_data`` with their reference answers, in the tokenizer's chat template, packed."""
    check_no_eval_text(cfg.answer_data, role="layer-scoring code", cache_dir=cfg.cache_dir)
    tasks = code_tasks(cfg.answer_data, limit=cfg.answer_tasks, cache_dir=cfg.cache_dir)
    if not tasks:
        raise TcalError(f"{cfg.answer_data} holds no documented Python functions to score layers on; "
                        "give answer_data a Python source corpus")
    return chat_windows(tokenizer, tasks, cfg.answer_window)


@torch.no_grad()
def answer_nll(model, ids: torch.Tensor, mask: torch.Tensor, batch_size: int = 4) -> float:
    """Mean NLL of the answer tokens of packed instruct windows (``mask`` marks the positions that predict them);
    the LM head runs on those rows only."""
    base, head = lm_parts(model)
    dev = head.weight.device
    total, n = 0.0, 0
    for s in range(0, ids.shape[0], batch_size):
        x, m = ids[s:s + batch_size].to(dev), mask[s:s + batch_size, :-1].to(dev)
        rows = final_hidden(base, x)[:, :-1][m]
        total += float(torch.nn.functional.cross_entropy(head(rows).float(), x[:, 1:][m], reduction="sum"))
        n += int(m.sum())
    return total / max(1, n)


def check_chat_tokenizer(tokenizer) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise TcalError("keep policy answer:K scores layers on chat-format answers: the teacher's tokenizer has no "
                        "chat template (an instruct model's); use ar:K or niah:K")


def answer_scores(teacher, tokenizer, cfg: SelectionConfig, *, progress: bool = True) -> list[float]:
    """Mean NLL of the code tasks' answer tokens with layer i's attention output zeroed, for every i."""
    check_chat_tokenizer(tokenizer)
    ids, mask = answer_windows(tokenizer, cfg)
    was_training = teacher.training
    teacher.eval()
    try:
        return removal_scores(teacher, lambda: answer_nll(teacher, ids, mask, cfg.batch_size),
                              desc="answer: remove each attention layer", progress=progress)
    finally:
        teacher.train(was_training)


def gdn_for_every_layer(teacher, init: str, calib_ids=None, *, seed: int = 0, progress: bool = False,
                        **init_options) -> dict:
    """An initialised GDN module for every layer of the teacher.

    Calibration is teacher-forced and layer-local, so a layer's GDN does not depend on which
    other layers are converted: one hybrid keeping only layer 0 as attention covers layers
    1..L-1, and one keeping every layer but 0 covers layer 0. An init whose later stages depend on
    the layout (the whole-model KL stage, sequential Phase 2) contributes its layer-local part here:
    the same init with layer-local Phase 2 and no KL stage.
    """
    spec = get_init(init)
    if spec.kl or spec.align != "local":
        spec = dataclasses.replace(spec, kl=False, align="local")
    L = teacher.config.num_hidden_layers
    modules = {}
    for keep in ([0], list(range(1, L))):
        hybrid = build_hybrid(teacher, keep, seed=seed, share_weights=True)  # only its GDN modules are kept
        initialise(hybrid, teacher, spec, calib_ids, progress=progress, **init_options)
        modules.update({i: m for i, m in hybrid.gdn_modules().items() if i not in modules})
    return modules


@contextlib.contextmanager
def student_of(teacher, keep: list[int], modules: dict):
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
    scores = []
    for i in tqdm(range(len(teacher.model.layers)), desc="ga: score one-attention students", disable=not progress):
        with student_of(teacher, [i], modules) as student:
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
    # niah: prompts of this many tokens (at most the teacher's position limit, less room for the answer) on this
    # haystack, this many of them, this seed. 2,048, not 512: scored at 512 the policy left out the layer a
    # 50 %-converted SmolLM2's retrieval at 1K-4K needed most, which it ranks 5th at 2,048 (docs/results.md,
    # *Layer selection*; bench/results/2026-12-02-retrieval-layer-revert/)
    niah_length: int = 2048
    niah_samples: int = 8
    niah_haystack: str = "sotu:calib"
    niah_seed: int = 1
    # answer: the first answer_tasks documented functions of answer_data, with their own code as the answer, in the
    # teacher's chat template, packed into windows of answer_window tokens
    answer_data: str = "code:calib"
    answer_tasks: int = 16
    answer_window: int = 1024


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
    key = json.dumps({"teacher": _teacher_key(teacher), "kind": kind, "data": cfg.data, "window": cfg.window,
                      "val": cfg.val_windows, "skip": cfg.skip_windows, **extra}, sort_keys=True, default=str)
    digest = hashlib.sha256(key.encode()).hexdigest()[:20]
    return cache_root(cfg.cache_dir) / "selection" / f"{kind}-{digest}.json"


def validation_windows(tokenizer, cfg: SelectionConfig) -> torch.Tensor:
    """The validation slice: windows of the calibration split (or mixture, interleaved as calibration reads it)
    after the first ``skip_windows``."""
    check_no_eval_text(cfg.data, role="calibration data", cache_dir=cfg.cache_dir)
    ids = mixed_windows(cfg.data, tokenizer, window=cfg.window, n_windows=cfg.skip_windows + cfg.val_windows)
    return ids[cfg.skip_windows:]


def select_layers(teacher, spec, *, tokenizer=None, cfg: SelectionConfig | None = None, calib_ids=None,
                  progress: bool = True, **init_options) -> Selection:
    """Resolve a keep spec (list or policy) to the list of layers kept as attention.

    ``ga`` converts every layer with ``cfg.init``; a calibrated init reads ``calib_ids``.
    """
    cfg = cfg or SelectionConfig()
    L = teacher.config.num_hidden_layers
    layer_types = getattr(teacher.config, "layer_types", None)
    spec = resolve_auto(spec, layer_types)
    # a scoped policy (uniform:50%@sliding) picks among the layers of one type; the others all stay attention
    scope = policy_scope(spec)
    cands = scope_layers(scope, layer_types, L)
    pol = parse_policy(spec, len(cands))
    label = f"{pol.kind}:{pol.k}" + ("" if scope is None else f"@{scope.split('_')[0]}")

    def keep_of(chosen: list[int]) -> list[int]:  # the chosen candidates and every layer outside the scope
        return sorted(set(chosen) | (set(range(L)) - set(cands)))

    if pol.kind == "list":
        return Selection("list", sorted(pol.layers))
    if pol.kind == "uniform":
        return Selection(label, keep_of([cands[i] for i in uniform_layers(pol.k, len(cands))]))
    if pol.kind == "interval":  # unscoped: cands is every layer
        return Selection(label, interval_layers(pol.k, L))
    if tokenizer is None:
        raise TcalError(f"keep policy {pol.kind}:{pol.k} scores layers on text: pass the teacher's tokenizer")
    extra = {}
    if pol.kind == "ga":
        extra = {"init": cfg.init, **{k: str(v) for k, v in init_options.items()}}
        if calib_ids is not None:
            extra["calib_ids"] = hashlib.sha256(torch.as_tensor(calib_ids).cpu().numpy().tobytes()).hexdigest()[:16]
    if pol.kind == "niah":
        cfg = dataclasses.replace(cfg, niah_length=niah_length_for(teacher, cfg.niah_length))
        extra = {"niah": [cfg.niah_length, cfg.niah_samples, cfg.niah_haystack, cfg.niah_seed]}
    if pol.kind == "answer":
        check_chat_tokenizer(tokenizer)
        extra = {"answer": [cfg.answer_data, cfg.answer_tasks, cfg.answer_window]}
    path = _cache_file(cfg, pol.kind, teacher, extra)
    protocol = {"data": cfg.data, "window": cfg.window, "val_windows": cfg.val_windows,
                "skip_windows": cfg.skip_windows, **extra}
    if path.exists():
        rec = json.loads(path.read_text())
        scores, seconds, cached = rec["scores"], rec["seconds"], True
    else:
        t0 = time.perf_counter()
        if pol.kind == "niah":
            check_no_eval_text(cfg.niah_haystack, role="layer-scoring haystack", cache_dir=cfg.cache_dir)
            scores = niah_scores(teacher, tokenizer, cfg, progress=progress)
        elif pol.kind == "answer":
            scores = answer_scores(teacher, tokenizer, cfg, progress=progress)
        elif pol.kind == "ar":
            scores = ar_scores(teacher, validation_windows(tokenizer, cfg), batch_size=cfg.batch_size,
                               progress=progress)
        else:
            modules = gdn_for_every_layer(teacher, cfg.init, calib_ids, progress=progress, **init_options)
            scores = ga_scores(teacher, validation_windows(tokenizer, cfg), modules, batch_size=cfg.batch_size,
                               progress=progress)
        seconds, cached = time.perf_counter() - t0, False

        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, {"scores": scores, "seconds": seconds, "protocol": protocol})
    # ar / niah / answer: the layers whose removal hurts most stay; ga: the best one-attention students win.
    picked = top_k([scores[i] for i in cands], pol.k, largest=(pol.kind != "ga"))
    name = {"ar": "ppl_with_layer_attention_removed", "ga": "ppl_keeping_only_this_layer",
            "niah": "answer_nll_with_layer_attention_removed",
            "answer": "code_answer_nll_with_layer_attention_removed"}[pol.kind]
    return Selection(label, keep_of([cands[i] for i in picked]), scores, name, seconds, protocol, cached)

