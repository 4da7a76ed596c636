"""Instruct-format text for instruct teachers: code tasks, rendered in the teacher's own chat template, packed into
windows with a mask of the answer tokens.

An instruct model is used by asking it things; a hybrid of one keeps its answers only if the new layers are fitted
where it answers: after a chat template's user turn, inside its own reply. Raw source files teach next-token
prediction on code, not answering (docs/results.md, *Qwen2.5-Coder 0.5B and 1.5B*). This module makes the other
kind of text from what packages ship:

- :func:`code_tasks`: every top-level Python function with a docstring in a code corpus (``code:calib``, the pool
  source ``python-src``, a directory of yours) becomes a task: the prompt is its signature and docstring, the
  reference answer the whole function.
- :func:`render`: one task as the teacher's chat (a user turn asking for the function, then the answer as the
  assistant's reply, closed by the template's end of turn), as token ids: ``(prompt ids, answer ids)``.
- :func:`pack`: rendered samples, whole, into ``(N, T)`` windows and an ``(N, T)`` mask that marks the positions
  whose next token is an answer token: the positions a loss on answers is over.

The answer is either the task's own function (``reference``) or what the teacher itself replies (self-distillation:
the recipes generate it and hand it to :func:`render`). Tasks come from calibration-side text only; the caller
drops any task that shares a word 13-gram with an evaluation text it names (HumanEval's problems).
"""
from __future__ import annotations

import ast
import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tcal.data.corpora import as_corpus
from tcal.data.overlap import ngram_hashes
from tcal.utils.errors import TcalError

# The user turns the tasks are asked in, one per task by a hash of its key: phrasings of what users ask a coder for.
# None of them is an evaluation harness's wording.
INSTRUCTIONS = (
    "Complete the following Python function. Reply with the whole function in a markdown code block.",
    "Write the Python function described below, with its signature and docstring unchanged.",
    "Implement this function in Python and return the complete code in a code block.",
    "Here is a function signature with its documentation. Write the full implementation.",
)
# the end-of-turn tokens of the chat templates tcal knows, in the order they are looked for
END_OF_TURN = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|end|>")


@dataclass(frozen=True)
class CodeTask:
    key: str  # "<source>:<document index>:<function name>", stable for one corpus
    name: str  # the function's name
    prompt: str  # its signature and docstring, as written
    solution: str  # the whole function, as written

    def instruction(self) -> str:
        """The user turn's request, fixed per task."""
        h = int(hashlib.sha256(self.key.encode()).hexdigest(), 16)
        return INSTRUCTIONS[h % len(INSTRUCTIONS)]


def functions(source: str, *, max_doc_lines: int = 20, min_body_lines: int = 2, max_body_lines: int = 30
              ) -> Iterable[tuple[str, str, str]]:
    """(name, signature + docstring, whole function) of each undecorated top-level function with a docstring of
    at most ``max_doc_lines`` lines and a body after it of ``min_body_lines`` to ``max_body_lines`` lines. Source
    that does not parse gives none."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return
    lines = source.splitlines()
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef) or node.decorator_list or not ast.get_docstring(node):
            continue
        doc = node.body[0]
        body = node.end_lineno - doc.end_lineno
        if doc.end_lineno - doc.lineno + 1 > max_doc_lines or not min_body_lines <= body <= max_body_lines:
            continue
        head = "\n".join(lines[node.lineno - 1:doc.end_lineno])
        yield node.name, head, "\n".join(lines[node.lineno - 1:node.end_lineno])


def code_tasks(documents: Iterable[str] | str = "code:calib", *, source: str = "", exclude: Sequence[str] = (),
               limit: int | None = None, cache_dir=None, **limits) -> list[CodeTask]:
    """The tasks of Python source ``documents`` (or of a corpus spec: a built-in split, a path), in order; any task
    sharing a word 13-gram with one of the ``exclude`` texts (an evaluation set's problems) is left out. ``source``
    prefixes the task keys; ``limits``: :func:`functions`'s bounds."""
    if isinstance(documents, str):
        source = source or documents
        documents = as_corpus(documents, cache_dir=cache_dir).documents
    banned = ngram_hashes(exclude) if exclude else np.zeros(0, dtype=np.uint64)
    tasks = []
    for i, doc in enumerate(documents):
        for name, head, whole in functions(doc, **limits):
            if banned.size and np.isin(ngram_hashes([whole]), banned).any():
                continue
            tasks.append(CodeTask(f"{source}:{i}:{name}", name, head, whole))
            if limit is not None and len(tasks) >= limit:
                return tasks
    return tasks


def end_of_turn_id(tokenizer) -> int:
    """The token that closes the assistant's turn in the tokenizer's chat template."""
    for tok in END_OF_TURN:
        i = tokenizer.convert_tokens_to_ids(tok)
        if isinstance(i, int) and i >= 0 and i != tokenizer.unk_token_id:
            return i
    if tokenizer.eos_token_id is None:
        raise TcalError("the tokenizer has no end-of-turn or EOS token to close an answer with")
    return int(tokenizer.eos_token_id)


def user_turn(task: CodeTask) -> str:
    return f"{task.instruction()}\n```python\n{task.prompt}\n```"


def prompt_text(tokenizer, task: CodeTask) -> str:
    """The chat up to where the assistant's reply begins (special tokens written out), as the model is asked it."""
    if not getattr(tokenizer, "chat_template", None):
        raise TcalError("instruct-format text needs a tokenizer with a chat template (an instruct model's)")
    return tokenizer.apply_chat_template([{"role": "user", "content": user_turn(task)}], tokenize=False,
                                         add_generation_prompt=True)


def reference_answer(task: CodeTask) -> str:
    return f"```python\n{task.solution}\n```"


def render(tokenizer, task: CodeTask, answer: str | None = None) -> tuple[list[int], list[int]]:
    """(prompt ids, answer ids) of one task: ``answer`` (default: the reference answer) closed by the end of turn."""
    return render_texts(tokenizer, prompt_text(tokenizer, task), reference_answer(task) if answer is None else answer)


def render_texts(tokenizer, prompt: str, answer: str) -> tuple[list[int], list[int]]:
    """(prompt ids, answer ids) of a rendered prompt (special tokens written out) and its answer, which the end of
    turn closes."""
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    reply = tokenizer(answer, add_special_tokens=False)["input_ids"]
    return list(ids), list(reply) + [end_of_turn_id(tokenizer)]


def pack(samples: Sequence[tuple[Sequence[int], Sequence[int]]], seq_len: int, pad_id: int
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole samples (prompt ids, answer ids), in order, first fit into windows of ``seq_len`` tokens (padded with
    ``pad_id``): ``(ids (N, T) long, mask (N, T) bool)``, ``mask[n, t]`` true where token ``t + 1`` of the window is
    an answer token. A sample longer than a window (or without a prompt or an answer) is left out; none that fits is
    split."""
    rows: list[list[int]] = []
    masks: list[list[bool]] = []
    for prompt, answer in samples:
        n = len(prompt) + len(answer)
        if n > seq_len or not prompt or not answer:
            continue
        if not rows or len(rows[-1]) + n > seq_len:
            rows.append([])
            masks.append([])
        rows[-1] += list(prompt) + list(answer)
        # position t predicts token t + 1: from the last prompt token (-> the first answer token) to the answer's
        # last-but-one token (-> its end of turn); the end of turn predicts the next sample, not this answer
        masks[-1] += [False] * (len(prompt) - 1) + [True] * len(answer) + [False]
    if not rows:
        raise TcalError(f"no sample fits in windows of {seq_len} tokens; use longer windows")
    ids = torch.full((len(rows), seq_len), int(pad_id), dtype=torch.long)
    mask = torch.zeros((len(rows), seq_len), dtype=torch.bool)
    for r, (row, m) in enumerate(zip(rows, masks)):
        ids[r, :len(row)] = torch.tensor(row)
        mask[r, :len(m)] = torch.tensor(m)
    return ids, mask


def count_fitting(samples: Sequence[tuple[Sequence[int], Sequence[int]]], seq_len: int) -> int:
    """How many rendered samples (prompt ids, answer ids) :func:`pack` keeps in windows of ``seq_len`` tokens."""
    return sum(1 for prompt, answer in samples if len(prompt) + len(answer) <= seq_len)


def pad_id(tokenizer) -> int:
    """The token instruct windows are padded with: the tokenizer's pad token, else its EOS."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def chat_windows(tokenizer, tasks: Sequence[CodeTask], seq_len: int, answers: dict | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`pack` of the tasks rendered in the tokenizer's chat template (``answers``: task key -> answer text;
    a task without one answers with its own function), padded with :func:`pad_id`."""
    answers = answers or {}
    return pack([render(tokenizer, t, answers.get(t.key)) for t in tasks], seq_len, pad_id(tokenizer))


def read_samples(path, notes: list[str] | None = None) -> list[dict]:
    """The records of a ``samples.jsonl`` that `tcal instruct` wrote (``.xz``-compressed too): key, split, prompt,
    answer, in file order; each task once, with a prompt and an answer. A task that an earlier tcal wrote more than
    once is read once (its first record; a task in both splits only as a development task, so that no step trains
    on it), with a line in ``notes`` saying how many records were left out."""
    import lzma

    p = Path(path).expanduser()
    if p.is_dir():
        raise TcalError(f"{p} is a directory; give the samples.jsonl (or .jsonl.xz) a `tcal instruct` run wrote")
    opener = lzma.open if p.suffix == ".xz" else open
    try:
        with opener(p, "rt", encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError, EOFError, lzma.LZMAError) as e:  # EOFError: a truncated .xz
        why = "it ends early: truncated" if isinstance(e, EOFError) else str(e)
        raise TcalError(f"{p} is not a readable samples.jsonl of `tcal instruct` ({why}); give the samples.jsonl "
                        "(or .jsonl.xz) an instruct run wrote") from None
    seen: dict[str, int] = {}  # key -> index of the record kept
    dropped: list[tuple[int, str, int]] = []  # (record, key, the record it repeats), 1-based
    for i, r in enumerate(rows):
        if not isinstance(r, dict) or not all(isinstance(r.get(k), str) for k in ("key", "split", "prompt", "answer")) \
                or r["split"] not in ("train", "dev"):
            raise TcalError(f"{p}: record {i + 1} lacks a key, a train/dev split, a prompt or an answer; give the "
                            "samples.jsonl a `tcal instruct` run wrote")
        if not r["prompt"].strip() or not r["answer"].strip():
            raise TcalError(f"{p}: record {i + 1} ({r['key']}) has an empty {'prompt' if not r['prompt'].strip() else 'answer'}"
                            "; every sample is a prompt and its answer")
        first = seen.get(r["key"])
        if first is None:
            seen[r["key"]] = i
        elif r["split"] == "dev" and rows[first]["split"] == "train":  # a development task is never trained on
            dropped.append((first + 1, r["key"], i + 1))
            seen[r["key"]] = i
        else:
            dropped.append((i + 1, r["key"], first + 1))
    if not rows:
        raise TcalError(f"{p} holds no samples")
    if dropped:
        crossed = sum(1 for a, _, b in dropped if rows[a - 1]["split"] != rows[b - 1]["split"])
        rec, key, other = dropped[0]
        line = (f"{p.name}: {len(dropped)} record(s) repeat a task of another record (the first: record {rec}, task "
                f"{key!r}, as record {other}); each task is read once"
                + (f" ({crossed} in both splits: kept as development tasks only)" if crossed else ""))
        if notes is not None:
            notes.append(line)
        keep = set(seen.values())
        rows = [r for i, r in enumerate(rows) if i in keep]
    return rows


def template_frame(tokenizer) -> tuple[str, str]:
    """(what comes before, what comes after) the user's words in a prompt rendered by the tokenizer's chat template."""
    mark = "\x00tcal-user-turn\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": mark}], tokenize=False,
                                         add_generation_prompt=True)
    head, _, tail = text.partition(mark)
    return head, tail


def check_template(tokenizer, samples: Sequence[dict], source, teacher: str) -> None:
    """Every sample's prompt is framed by this tokenizer's chat template (samples rendered for another teacher's
    template would train the hybrid on turns its teacher never sees)."""
    if not getattr(tokenizer, "chat_template", None):
        raise TcalError(f"{teacher}'s tokenizer has no chat template: instruct samples are for instruct teachers")
    head, tail = template_frame(tokenizer)
    for i, s in enumerate(samples):
        if not (s["prompt"].startswith(head) and s["prompt"].endswith(tail)):
            raise TcalError(f"{source}: the prompt of record {i + 1} ({s['key']}) is not in {teacher}'s chat template; "
                            "the samples were rendered for another teacher: pass that --teacher, or build the set "
                            "anew for this one (without --samples)")


# -- instruct sets on disk ------------------------------------------------------------------------------------------

INSTRUCT_FORMAT = "tcal-instruct-v1"
MANIFEST = "manifest.json"


def is_instruct_set(path) -> bool:
    """Whether ``path`` is a directory written by :func:`save_instruct_set`."""
    try:
        p = Path(path).expanduser()
        return (p / MANIFEST).is_file() and json.loads((p / MANIFEST).read_text()).get("format") == INSTRUCT_FORMAT
    except (OSError, ValueError, TypeError):
        return False


def split_tasks(tasks: Sequence[CodeTask], dev: int) -> tuple[list[CodeTask], list[CodeTask]]:
    """(training tasks, development tasks): the ``dev`` tasks of lowest sha256(key) are held out, the rest train,
    each part in its original order. The development tasks pick a run's best checkpoint, so no step trains on them."""
    ranked = sorted(range(len(tasks)), key=lambda i: hashlib.sha256(tasks[i].key.encode()).hexdigest())
    held = set(ranked[:max(0, dev)])
    return [t for i, t in enumerate(tasks) if i not in held], [t for i, t in enumerate(tasks) if i in held]


def save_instruct_set(out, ids: torch.Tensor, mask: torch.Tensor, manifest: dict,
                      dev: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """``ids`` / ``mask`` (N, T) as ``ids.npy`` (uint32) / ``mask.npy`` (bool), the development windows as
    ``dev_ids.npy`` / ``dev_mask.npy``, and the manifest, into the existing directory ``out`` (the caller writes it
    atomically)."""
    out = Path(out)
    np.save(out / "ids.npy", ids.cpu().numpy().astype(np.uint32))
    np.save(out / "mask.npy", mask.cpu().numpy().astype(bool))
    if dev is not None:
        np.save(out / "dev_ids.npy", dev[0].cpu().numpy().astype(np.uint32))
        np.save(out / "dev_mask.npy", dev[1].cpu().numpy().astype(bool))
    n, t = ids.shape
    (out / MANIFEST).write_text(json.dumps({
        "format": INSTRUCT_FORMAT, "windows": int(n), "seq_len": int(t), "tokens": int(n * t),
        "loss_tokens": int(mask.sum()), "dev_windows": 0 if dev is None else int(dev[0].shape[0]),
        **manifest}, indent=2) + "\n")


def load_instruct_dev(path) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The development windows of an instruct set (ids (N, T) long, mask (N, T) bool), or None where it has none."""
    p = Path(path).expanduser()
    if not (p / "dev_ids.npy").is_file():
        return None
    try:
        ids, mask = np.load(p / "dev_ids.npy"), np.load(p / "dev_mask.npy")
    except (OSError, ValueError) as e:
        raise TcalError(f"{p}: its development windows are not readable ({e}); rebuild it with `tcal instruct`") from None
    if ids.shape != mask.shape or ids.ndim != 2:
        raise TcalError(f"{p}: dev_ids {ids.shape} and dev_mask {mask.shape} differ; rebuild it with `tcal instruct`")
    return torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(mask.astype(bool))


def load_instruct_set(path) -> tuple[np.ndarray, np.ndarray, dict]:
    """(ids (N, T) uint32, mask (N, T) bool, manifest) of an instruct set, memory-mapped."""
    p = Path(path).expanduser()
    try:
        manifest = json.loads((p / MANIFEST).read_text())
        ids = np.load(p / "ids.npy", mmap_mode="r")
        mask = np.load(p / "mask.npy", mmap_mode="r")
    except (OSError, ValueError) as e:
        raise TcalError(f"{p} is not a readable instruct set ({e}); rebuild it with `tcal instruct`") from None
    if ids.ndim != 2 or ids.shape != mask.shape or ids.shape[1] != manifest.get("seq_len"):
        raise TcalError(f"{p}: ids {ids.shape} and mask {mask.shape} do not match the manifest's windows of "
                        f"{manifest.get('seq_len')} tokens; rebuild it with `tcal instruct`")
    return ids, mask, manifest
