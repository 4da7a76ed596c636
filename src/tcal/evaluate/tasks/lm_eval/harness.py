"""lm-evaluation-harness on a loaded model, and two offline harness tasks built from held-out text.

The harness (``pip install 'tcal[eval]'``) runs on the model object itself, wrapped in its
``HFLM``; a tcal hybrid is never reloaded by name, so it needs no ``trust_remote_code``. Harness
task names (``lambada_openai``, ``hellaswag``, ...) go to the harness unchanged; its datasets come
from the Hugging Face hub, so they need network.

Local tasks need no network. Their passages come from a held-out evaluation split that tcal uses
for nothing else, ``shakespeare:eval`` by default (6 plays: no calibration, no perplexity, no
pool, no retrieval haystack reads it):

``tcal_lastword``
    LAMBADA-style: a passage that ends at the last word of a sentence; the model must continue
    it with that word. Metrics as the harness's ``lambada_openai``: ``acc`` (every token of the
    word is the argmax continuation, the harness's ``is_greedy``) and ``perplexity``
    (``exp(-mean log p(word | passage))`` over the passages). Only words that already occur in
    the passage are targets (as most of LAMBADA's are): the task measures use of the context,
    which is what replacing attention can break.
``tcal_cloze``
    The same kind of passage, the sentence-final word blanked out, four choices: the true word and
    three distractors drawn from the same document's words of nearly the same frequency (the 20
    nearest in the document's frequency ranking). Metrics ``acc`` and ``acc_norm`` (log-likelihood
    per character), chance 0.25.

How passages are made (per document, deterministic): a target is a sentence-final word (``.``
``!`` or ``?`` right after it) of three or more letters, lower-case after the first, with one
space before it, and not among the document's 100 most frequent words. Its passage starts at the
latest sentence or paragraph start that leaves at least 50 words before the target, and holds at
most 150; the final punctuation is dropped. Passages of one document never overlap. All passages
are shuffled with ``random.Random("<task>:<seed>")`` and the first ``limit`` are kept, so a
smaller limit gives a prefix of a larger one; distractors are drawn per passage, so they do not
depend on the limit either. The passages are written as JSON lines under the tcal cache
(``lm_eval/<task>-<hash>.jsonl``) and read by the harness as a ``json`` dataset.
"""
from __future__ import annotations

import bisect
import contextlib
import hashlib
import json
import logging
import os
import random
import re
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tcal.data.corpora import BUILTIN_CORPORA, as_corpus
from tcal.utils.cache import cache_root
from tcal.utils.errors import TcalError

INSTALL_HINT = "lm-eval is not installed: pip install 'tcal[eval]'"
DEFAULT_SOURCE = "shakespeare:eval"
LOCAL_TASKS = {
    "tcal_lastword": "LAMBADA-style last-word prediction (acc = greedy, perplexity of the word)",
    "tcal_cloze": "4-way multiple-choice cloze of the sentence-final word (acc, acc_norm)",
}
# bump when passages or distractors change, so that cached task files are rebuilt
BUILDER_VERSION = 1
MIN_CONTEXT_WORDS = 50
MAX_CONTEXT_WORDS = 150
COMMON_WORDS = 100
NEIGHBOURS = 10  # distractors come from this many ranks on either side of the true word
CHOICES = 4

_TOKEN = re.compile(r"\S+")
_TARGET = re.compile(r"([A-Za-z][a-z]{2,})[.!?]")
_SENTENCE_END = re.compile(r"[.!?][\"')\]]*$")
_EDGES = re.compile(r"^[^A-Za-z]+|[^A-Za-z]+$")
_WORD = re.compile(r"[a-z]+")


def require_lm_eval():
    """The ``lm_eval`` package, or a one-line TcalError saying how to install it."""
    try:
        import lm_eval
    except ImportError:
        raise TcalError(INSTALL_HINT) from None
    return lm_eval


def _core(token: str) -> str:
    return _EDGES.sub("", token).lower()


@dataclass(frozen=True)
class Passage:
    document: int  # index of the document in the source corpus
    offset: int  # character offset of the passage in that document
    context: str
    word: str


def passages(text: str, document: int = 0, *, in_context: bool = False) -> list[Passage]:
    """Non-overlapping passages of ``text`` that end at a sentence-final word (see the module doc).

    ``in_context``: keep only targets whose word (case-insensitive) occurs in the passage.
    """
    toks = list(_TOKEN.finditer(text))
    counts = Counter(_core(m.group()) for m in toks)
    common = {w for w, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:COMMON_WORDS]}
    starts = [i for i, m in enumerate(toks)
              if i == 0 or _SENTENCE_END.search(toks[i - 1].group()) or "\n\n" in text[toks[i - 1].end():m.start()]]
    out, taken_until = [], 0
    for t, m in enumerate(toks):
        hit = _TARGET.fullmatch(m.group())
        # one plain space before the word, so the target is exactly " word" after the context
        if not hit or text[m.start() - 1] != " " or text[m.start() - 2].isspace():
            continue
        word = hit.group(1)
        if word.lower() in common:
            continue
        j = bisect.bisect_right(starts, t - MIN_CONTEXT_WORDS) - 1
        if j < 0 or t - starts[j] > MAX_CONTEXT_WORDS or toks[starts[j]].start() < taken_until:
            continue
        s = starts[j]
        if in_context and word.lower() not in {_core(x.group()) for x in toks[s:t]}:
            continue
        out.append(Passage(document, toks[s].start(), text[toks[s].start():m.start() - 1], word))
        taken_until = m.end()
    return out


def check_source(source: str) -> None:
    """Refuse a built-in corpus that is not an evaluation split: the model may have seen it."""
    if isinstance(source, str) and source in BUILTIN_CORPORA and not source.endswith(":eval"):
        base = source.partition(":")[0]
        raise TcalError(f"local harness tasks read held-out text only, and {source} is not an evaluation split; "
                        f"use {base}:eval (default {DEFAULT_SOURCE})")


def _ranking(text: str) -> list[str]:
    counts = Counter(w for w in (_core(m.group()) for m in _TOKEN.finditer(text))
                     if len(w) >= 3 and _WORD.fullmatch(w))
    return sorted(counts, key=lambda w: (-counts[w], w))


def _distractors(p: Passage, ranking: list[str], rank: dict[str, int], seed: int) -> list[str]:
    w = p.word.lower()
    r = rank.get(w, len(ranking))
    pool = [x for x in ranking[max(0, r - NEIGHBOURS):r + NEIGHBOURS + 1] if x != w]
    if len(pool) < CHOICES - 1:
        return []
    rng = random.Random(f"tcal_cloze:{seed}:{p.document}:{p.offset}")
    picked = rng.sample(pool, CHOICES - 1)
    return [x.capitalize() for x in picked] if p.word[0].isupper() else picked


def local_docs(task: str, source=DEFAULT_SOURCE, *, limit: int | None = None, seed: int = 0) -> list[dict]:
    """The documents of a local task: the first ``limit`` (all if None) of its shuffled passages.

    ``tcal_lastword``: ``{"context", "target"}`` with ``target = " " + word``; ``tcal_cloze``:
    ``{"context", "choices", "label"}``. Both carry ``document``/``offset`` (where the passage
    sits in ``source``) and ``word``.
    """
    if task not in LOCAL_TASKS:
        raise TcalError(f"unknown local task {task!r}; local tasks: {', '.join(LOCAL_TASKS)}")
    if limit is not None and limit < 1:
        raise TcalError(f"the number of samples per task must be at least 1, got {limit}")
    check_source(source)
    corpus = as_corpus(source)  # a Corpus passes through unchanged
    found = [p for i, d in enumerate(corpus.documents) for p in passages(d, i, in_context=task == "tcal_lastword")]
    random.Random(f"{task}:{seed}").shuffle(found)
    docs = []
    if task == "tcal_lastword":
        docs = [{"document": p.document, "offset": p.offset, "word": p.word, "context": p.context,
                 "target": " " + p.word} for p in found[:limit]]
    else:
        rankings = {}
        for p in found:
            if p.document not in rankings:
                ranking = _ranking(corpus.documents[p.document])
                rankings[p.document] = ranking, {w: i for i, w in enumerate(ranking)}
            wrong = _distractors(p, *rankings[p.document], seed)
            if not wrong:
                continue
            choices = [p.word] + wrong
            random.Random(f"tcal_cloze:{seed}:order:{p.document}:{p.offset}").shuffle(choices)
            docs.append({"document": p.document, "offset": p.offset, "word": p.word, "context": p.context,
                         "choices": choices, "label": choices.index(p.word)})
            if limit is not None and len(docs) == limit:
                break
    if not docs:
        raise TcalError(f"{corpus.name} has no passage for {task} (it needs sentences of {MIN_CONTEXT_WORDS}+ "
                        f"words of context ending in a word and a full stop); pass another source text")
    return docs


def _write_docs(task: str, docs: list[dict], key: str, cache_dir=None) -> Path:
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    path = cache_root(cache_dir) / "lm_eval" / f"{task}-{digest}.jsonl"
    if path.is_file():  # same key, same content: keeping the file keeps datasets' cache of it valid
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text("".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs), encoding="utf-8")
    os.replace(tmp, path)
    return path


def local_task_config(task: str, source=DEFAULT_SOURCE, *, limit: int | None = None, seed: int = 0,
                      cache_dir=None) -> dict:
    """The harness task config (a dict, as a task YAML would hold) of a local task, its data written."""
    check_source(source)
    corpus = as_corpus(source)
    docs = local_docs(task, corpus, limit=limit, seed=seed)
    key = json.dumps([BUILDER_VERSION, task, corpus.content_hash, seed, limit])
    path = _write_docs(task, docs, key, cache_dir)
    common = {
        "task": task,
        "dataset_path": "json",
        # datasets' arrow copy goes to the tcal cache too, not to ~/.cache/huggingface
        "dataset_kwargs": {"data_files": {"test": str(path)},
                           "cache_dir": str(cache_root(cache_dir) / "lm_eval" / "datasets")},
        "test_split": "test",
        "doc_to_text": "context",
        "num_fewshot": 0,
        "metadata": {"version": BUILDER_VERSION, "source": corpus.name, "source_sha256": corpus.content_hash,
                     "seed": seed, "documents": len(docs)},
    }
    if task == "tcal_lastword":
        return {**common, "output_type": "loglikelihood", "doc_to_target": "target",
                "metric_list": [{"metric": "perplexity", "aggregation": "perplexity", "higher_is_better": False},
                                {"metric": "acc", "aggregation": "mean", "higher_is_better": True}]}
    return {**common, "output_type": "multiple_choice", "doc_to_choice": "choices", "doc_to_target": "label",
            "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True},
                            {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True}]}


def parse_tasks(spec: str | Sequence[str]) -> list[str]:
    """A comma list (or a sequence) of task names, duplicates dropped; ``tcal_*`` names must be local."""
    names = spec.split(",") if isinstance(spec, str) else list(spec)
    names = list(dict.fromkeys(n.strip() for n in names if n and n.strip()))
    if not names:
        raise TcalError(f"no lm-eval task given; local offline tasks: {', '.join(LOCAL_TASKS)}, or any "
                        f"lm-evaluation-harness task name")
    for n in names:
        if n.startswith("tcal_") and n not in LOCAL_TASKS:
            raise TcalError(f"unknown local lm-eval task {n!r}; local offline tasks: {', '.join(LOCAL_TASKS)}")
    return names


@dataclass
class HarnessPlan:
    """What to run, checked and with local task data written, before any model is loaded."""

    tasks: list[str]
    specs: dict  # task name -> what simple_evaluate gets (a name, or a local task's config dict)
    manager: object = field(repr=False)  # lm_eval.tasks.TaskManager
    limit: int | None = None


def plan(tasks: str | Sequence[str], *, limit: int | None = None, source=DEFAULT_SOURCE, seed: int = 0,
         cache_dir=None) -> HarnessPlan:
    """Check task names and ``limit``, build the local tasks' data, index the harness's tasks if needed."""
    names = parse_tasks(tasks)
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise TcalError(f"the number of samples per task must be a whole number of at least 1, got {limit!r}")
    require_lm_eval()
    from lm_eval.tasks import TaskManager

    remote = [n for n in names if n not in LOCAL_TASKS]
    # indexing the harness's own ~15k task files takes seconds: only when a harness task is asked for
    manager = TaskManager(include_defaults=bool(remote))
    if remote:
        known = set(manager.all_tasks)
        for n in remote:
            if n not in known and not Path(n).is_file():
                raise TcalError(f"unknown lm-eval task {n!r}; local offline tasks: {', '.join(LOCAL_TASKS)}; "
                                f"harness tasks are listed by `lm-eval ls tasks`")
    specs = {n: local_task_config(n, source, limit=limit, seed=seed, cache_dir=cache_dir) if n in LOCAL_TASKS
             else n for n in names}
    return HarnessPlan(names, specs, manager, limit)


class _ObjectModelWarnings(logging.Filter):
    """Drops HFLM's two warnings that a model object was passed: here that is the intent."""

    PREFIXES = ("`pretrained` model kwarg is not of type", "Passed an already-initialized model")

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.PREFIXES)


def harness_lm(model, tokenizer, *, batch_size: int = 4):
    """The harness's ``HFLM`` around an already loaded model (its own device and dtype are kept)."""
    require_lm_eval()
    import copy

    from lm_eval.models.huggingface import HFLM

    hf_log = logging.getLogger(HFLM.__module__)
    if not any(isinstance(f, _ObjectModelWarnings) for f in hf_log.filters):
        hf_log.addFilter(_ObjectModelWarnings())

    if tokenizer is None:
        raise TcalError("the harness reads and writes text: the model needs a tokenizer (save one with it)")
    if batch_size < 1:
        raise TcalError(f"batch size must be at least 1, got {batch_size}")
    # HFLM sets a pad token on the tokenizer it gets; the caller's stays as it was
    return HFLM(pretrained=model, tokenizer=copy.deepcopy(tokenizer), backend="causal", batch_size=batch_size)


@contextlib.contextmanager
def _single_process_bootstrap():
    # The harness bootstraps perplexity's stderr in a multiprocessing pool, forking a process that
    # holds the model (and torch's threads); this switch makes it run in-process (same numbers:
    # its resamples are seeded by their index either way).
    old = os.environ.get("DISABLE_MULTIPROC")
    os.environ["DISABLE_MULTIPROC"] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("DISABLE_MULTIPROC", None)
        else:
            os.environ["DISABLE_MULTIPROC"] = old


def _number(x):
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def result_rows(results: dict) -> list[dict]:
    """``{task, metric, filter, value, stderr, samples}`` rows from a harness results dict."""
    rows = []
    n = results.get("n-samples", {})
    for task, entry in results.get("results", {}).items():
        for key, value in entry.items():
            metric, sep, filt = key.partition(",")
            if not sep or metric.endswith("_stderr"):
                continue
            rows.append({"task": task, "metric": metric, "filter": filt, "value": _number(value),
                         "stderr": _number(entry.get(f"{metric}_stderr,{filt}")),
                         "samples": n.get(task, {}).get("effective")})
    return rows


def run_task(lm, plan_: HarnessPlan, task: str, *, bootstrap_iters: int = 1000) -> dict:
    """One task of ``plan_`` on ``lm`` (from :func:`harness_lm`): rows, the harness's numbers, every sample.

    ``bootstrap_iters``: resamples for the stderr of non-mean metrics (perplexity); the harness's
    own default is 100,000.
    """
    if task not in plan_.specs:
        raise TcalError(f"task {task!r} is not in the plan ({', '.join(plan_.tasks)})")
    import lm_eval

    t0 = time.perf_counter()
    with _single_process_bootstrap():
        # the seeds are None so the global random/numpy/torch generators are left alone; zero-shot
        # log-likelihood tasks draw nothing, and few-shot sampling has its own seed
        res = lm_eval.simple_evaluate(model=lm, tasks=[plan_.specs[task]], task_manager=plan_.manager,
                                      limit=plan_.limit, bootstrap_iters=bootstrap_iters, log_samples=True,
                                      random_seed=None, numpy_random_seed=None, torch_random_seed=None)
    seconds = time.perf_counter() - t0
    return {"task": task, "rows": result_rows(res), "results": res.get("results", {}),
            "configs": res.get("configs", {}), "versions": res.get("versions", {}),
            "n-samples": res.get("n-samples", {}), "samples": res.get("samples", {}), "seconds": seconds,
            "lm_eval_version": lm_eval.__version__}


def lm_eval_tasks(model, tokenizer, tasks: str | Sequence[str], *, limit: int | None = None,
                  source=DEFAULT_SOURCE, seed: int = 0, batch_size: int = 4, bootstrap_iters: int = 1000,
                  cache_dir=None) -> dict:
    """Run harness tasks on a loaded model: ``{task: run_task(...)}`` (see :func:`run_task`).

    ``tasks``: comma list or sequence; ``tcal_lastword`` / ``tcal_cloze`` are built offline from
    ``source`` (an evaluation split), any other name is a harness task. ``limit``: samples per task.
    """
    p = plan(tasks, limit=limit, source=source, seed=seed, cache_dir=cache_dir)
    lm = harness_lm(model, tokenizer, batch_size=batch_size)
    return {t: run_task(lm, p, t, bootstrap_iters=bootstrap_iters) for t in p.tasks}
