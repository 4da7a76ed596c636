"""Long-context retrieval, RULER-style, generated locally: can the model still find what is in its context?

Tasks (the templates and scoring follow RULER, Hsieh et al. 2024):

    single            one needle "One of the special magic numbers for KEY is: VALUE." in real text
    single-words      the same with a word as the value
    single-uuids      the same with a UUID as the value
    single-noise      the same needle in RULER's repeated noise sentences instead of real text
    multikey          one needle among three distractor needles with other keys
    multivalue        four values for the same key; all four must be recalled
    multiquery        four keys asked at once; all four values must be recalled
    vt                variable tracking: a chain of five assignments; every variable of the chain
    cwe               common-word extraction: the 10 most frequent words of a list

Scoring: the fraction of the expected answers that occur (case-insensitive substring) in the
greedy output, averaged over the samples (RULER's ``string_match_all``). The output has RULER's
room (``GEN_TOKENS``: 128 tokens for the needle tasks) and a row stops early once it holds all its
answers, which no later token can change. Prompts are built to the requested number of tokens
(prompt + that room) by the model's own tokenizer, needles are spread over depths 0..1, and every
random choice comes from ``seed``: the teacher and any hybrid of it see the very same prompts.
"""
from __future__ import annotations

import math
import random
import string
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from tcal.data.corpora import as_corpus
from tcal.engines.tcal_generate import fast_path, generate_greedy
from tcal.utils.errors import TcalError

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
PROMPT = ("Some special magic {kind} are hidden within the following text. Make sure to memorize it. "
          "I will quiz you about the {kind} afterwards.\n{context}\n"
          "What are all the special magic {kind} for {query} mentioned in the provided text? "
          "The special magic {kind} for {query} mentioned in the provided text are")
NEEDLE = "One of the special magic {kind} for {key} is: {value}."
VT_PROMPT = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
             "Question: Find all variables that are assigned the value {value} in the text above. "
             "Answer: According to the chain(s) of variable assignment in the text above, {n} variables are "
             "assigned the value {value}, they are:")
CWE_PROMPT = ("Below is a numbered list of words. In these words, some appear more often than others. Memorize "
              "the ones that appear most often.\n{context}\nQuestion: What are the 10 most common words in the "
              "above list? Answer: The top 10 words that appear most often in the list are:")
WORDS = ("apple river candle planet garden mirror silver thunder basket lantern meadow pillow rocket saddle "
         "tunnel violin walnut anchor blanket cactus dolphin feather glacier harbor island jigsaw kettle lemon "
         "marble needle orchid parrot quartz ribbon spider tiger umbrella velvet window yacht zebra bridge "
         "castle desert engine forest guitar helmet jacket kitten ladder magnet nectar oyster pepper").split()
# RULER's tokens_to_generate per task kind. A tighter budget scores the answer's style, not the retrieval: a
# model that opens with a list or a sentence ("the following: 1. The special magic number for ...") is cut off
# before the value.
GEN_TOKENS = {"niah": 128, "vt": 30, "cwe": 120}


@dataclass(frozen=True)
class Task:
    kind: str  # "niah" | "vt" | "cwe"
    values: str = "numbers"  # numbers | words | uuids
    haystack: str = "text"  # text | noise
    keys: int = 1  # needles with distinct keys in the context
    values_per_key: int = 1
    queries: int = 1


TASKS = {
    "single": Task("niah"),
    "single-words": Task("niah", values="words"),
    "single-uuids": Task("niah", values="uuids"),
    "single-noise": Task("niah", haystack="noise"),
    "multikey": Task("niah", keys=4),
    "multivalue": Task("niah", values_per_key=4),
    "multiquery": Task("niah", keys=4, queries=4),
    "vt": Task("vt", haystack="noise"),
    "cwe": Task("cwe", haystack="noise"),  # its "haystack" is the count of rare words
}


@dataclass
class Sample:
    prompt: str
    answers: list[str]
    depth: float  # where the (first) needle sits, 0 = start of the context, 1 = end
    max_new_tokens: int


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise TcalError(f"unknown retrieval task {name!r}; known tasks: {', '.join(TASKS)}")
    return TASKS[name]


def score(output: str, answers: Sequence[str]) -> float:
    """RULER's string_match_all: the fraction of ``answers`` found (case-insensitive) in ``output``."""
    if not answers:
        raise TcalError("a sample needs at least one expected answer")
    out = output.lower()
    return sum(a.lower() in out for a in answers) / len(answers)


def accuracy_interval(scores: Sequence[float], z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval (95 % for z = 1.96) of the mean of per-prompt ``scores`` in [0, 1]: exact for
    0/1 scores, an approximation that treats the mean as a proportion for recall scores. With 20 prompts one
    needle moves the accuracy by 0.05 and 18 of 20 spans about 0.70-0.97: targets read against it, not the mean."""
    n = len(scores)
    if n == 0:
        raise TcalError("an accuracy interval needs at least one scored prompt")
    p = sum(scores) / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def _value(rng: random.Random, kind: str) -> str:
    if kind == "numbers":
        return str(rng.randint(1_000_000, 9_999_999))
    if kind == "words":
        return f"{rng.choice(WORDS)}-{rng.choice(WORDS)}"
    return str(uuid.UUID(int=rng.getrandbits(128)))


def _key(rng: random.Random) -> str:
    return f"{rng.choice(WORDS)}-{rng.choice(WORDS)}"


def haystack_units(task: Task, documents: Sequence[str]) -> list[str]:
    """The sentences (or list lines) a context is made of, in a fixed order."""
    if task.haystack == "noise":
        return [s.strip() + "." for s in NOISE.split(".") if s.strip()]
    units = [s.strip() + "." for d in documents for s in d.replace("\n", " ").split(". ") if len(s.strip()) > 3]
    if not units:
        raise TcalError("the haystack corpus has no sentences; pass another --haystack")
    return units


def _fill(units: Sequence[str], n: int, offset: int) -> list[str]:
    """``n`` haystack units from ``offset`` on, cycling (noise repeats; real text wraps around)."""
    return [units[(offset + i) % len(units)] for i in range(n)]


def _insert(hay: list[str], needles: list[tuple[float, str]]) -> str:
    hay = list(hay)
    for depth, needle in sorted(needles, reverse=True):  # from the back, so earlier positions hold
        hay.insert(round(depth * len(hay)), needle)
    return " ".join(hay)


def _build(task: Task, rng: random.Random, depth: float, hay: list[str]) -> tuple[str, list[str]]:
    """(prompt, answers) for one sample whose haystack is ``hay``."""
    kind = task.values
    if task.kind == "vt":
        value, names = str(rng.randint(10_000, 99_999)), ["".join(rng.choices(string.ascii_uppercase, k=5))
                                                           for _ in range(5)]
        chain = [f"VAR {names[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:])]
        depths = sorted(rng.random() for _ in chain)
        depths[0] = depth
        context = _insert(hay, list(zip(sorted(depths), chain)))
        return VT_PROMPT.format(context=context, value=value, n=len(names)), names
    if task.kind == "cwe":
        common = rng.sample(WORDS, 10)
        rare = [w for w in WORDS if w not in common]
        # each common word clearly more frequent than any rare one, however long the list grows
        reps = max(3, 2 * -(-len(hay) // len(rare)) + 1)
        items = [w for w in common for _ in range(reps)] + [rng.choice(rare) for _ in range(len(hay))]
        rng.shuffle(items)
        context = "\n".join(f"{i + 1}. {w}" for i, w in enumerate(items))
        return CWE_PROMPT.format(context=context), common
    keys = [_key(rng) for _ in range(task.keys)]
    values = {k: [_value(rng, task.values) for _ in range(task.values_per_key)] for k in keys}
    needles, queried = [], keys[: task.queries]
    for k in keys:
        for v in values[k]:
            needles.append((depth if not needles else rng.random(), NEEDLE.format(kind=kind, key=k, value=v)))
    query = ", ".join(queried[:-1]) + (" and " if len(queried) > 1 else "") + queried[-1]
    answers = [v for k in queried for v in values[k]]
    prompt = PROMPT.format(kind=kind, context=_insert(hay, needles), query=query)
    return prompt, answers


def answer_room(task_name: str, max_new_tokens: int | None = None) -> int:
    """The new tokens an answer to ``task_name`` gets: ``max_new_tokens``, or RULER's for the task."""
    new = GEN_TOKENS[get_task(task_name).kind] if max_new_tokens is None else int(max_new_tokens)
    if new < 1:
        raise TcalError(f"max_new_tokens must be at least 1, got {new}")
    return new


def make_samples(task_name: str, tokenizer, length: int, samples: int, *, seed: int = 0,
                 documents: Sequence[str] = (), max_new_tokens: int | None = None) -> list[Sample]:
    """``samples`` prompts of at most ``length`` tokens each (prompt + ``max_new_tokens``, by default
    RULER's ``GEN_TOKENS`` for the task), needles at depths spread evenly over 0..1. The haystack is
    sized by bisection on the tokenised prompt."""
    task = get_task(task_name)
    if samples < 1:
        raise TcalError(f"samples must be at least 1, got {samples}")
    new = answer_room(task_name, max_new_tokens)
    units = haystack_units(task, documents)
    out = []
    for i in range(samples):
        depth = i / (samples - 1) if samples > 1 else 0.5
        offset = random.Random(f"{seed}:{task_name}:{length}:{i}:offset").randrange(len(units))

        def build(n):
            rng = random.Random(f"{seed}:{task_name}:{length}:{i}")  # same needles whatever the haystack size
            return _build(task, rng, depth, _fill(units, n, offset))

        def size(n):
            return len(tokenizer(build(n)[0], add_special_tokens=False)["input_ids"]) + new

        lo, hi = 0, 1
        while size(hi) <= length:
            lo, hi = hi, hi * 2
            if task.haystack != "noise" and hi > 4 * len(units) + 8:
                raise TcalError(f"the haystack text has too few sentences ({len(units)}) for {length}-token "
                                "prompts; use a longer --haystack corpus or shorter context lengths (@L in --tasks)")
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if size(mid) <= length else (lo, mid)
        if lo == 0 and size(0) > length:
            raise TcalError(f"length {length} is too short for the {task_name} prompt and its {new}-token answer room; "
                            "use a longer context length (@L in --tasks) or a smaller --max-new-tokens")
        prompt, answers = build(lo)
        out.append(Sample(prompt, answers, depth, new))
    return out


def check_lengths(model, lengths: Sequence[int]) -> list[int]:
    lengths = [int(n) for n in lengths]
    if not lengths:
        raise TcalError("no context lengths given; e.g. lengths=[512, 1024]")
    limit = getattr(model.config, "max_position_embeddings", None)
    too_long = [n for n in lengths if limit and n > limit]
    if too_long:
        raise TcalError(f"length {too_long[0]} is beyond the model's position limit {limit}; use lengths <= {limit}")
    if any(n < 16 for n in lengths):
        raise TcalError(f"lengths must be at least 16 tokens, got {min(lengths)}")
    return lengths


def haystack_documents(task: str, haystack) -> Sequence[str]:
    """The real-text documents ``task`` hides its needles in (none for the noise-haystack tasks)."""
    return as_corpus(haystack).documents if get_task(task).haystack == "text" else ()


# prompts of one length generated together on the fast path (the GPU): a curve point's passkey prompts in one batch
FAST_BATCH = 32


def answer(model, tokenizer, items: Sequence[Sample], *, batch_size: int = 4, progress: bool = False,
           desc: str = "generate") -> list[str]:
    """The greedy outputs for ``items``, each with its sample's room, stopped once it holds its answers."""
    # a row stops once its output holds every answer it is scored on: ``score`` is a substring test, so no later
    # token can change the row's score, and most rows of a model that retrieves stop after the value instead of
    # running out RULER's 128 tokens
    if fast_path(model):  # tcal's static cache: every prompt of a length in one batch
        batch_size = max(batch_size, FAST_BATCH)
    return generate_greedy(model, tokenizer, [s.prompt for s in items], max(s.max_new_tokens for s in items),
                           batch_size=batch_size, progress=progress, desc=desc,
                           done=lambda i, text: score(text, items[i].answers) == 1.0)


def niah_details(model, tokenizer, *, task: str = "single", length: int, samples: int, seed: int = 0,
                 haystack="sotu:eval", batch_size: int = 4, progress: bool = False,
                 max_new_tokens: int | None = None) -> list[dict]:
    """Every sample of one (task, length): depth, expected answers, output, score."""
    check_lengths(model, [length])
    items = make_samples(task, tokenizer, length, samples, seed=seed, documents=haystack_documents(task, haystack),
                         max_new_tokens=max_new_tokens)
    outputs = answer(model, tokenizer, items, batch_size=batch_size, progress=progress, desc=f"{task} @ {length}")
    return [{"depth": s.depth, "answers": s.answers, "output": o, "score": score(o, s.answers)}
            for s, o in zip(items, outputs)]


def niah_cell(model, tokenizer, *, task: str, length: int, samples: int, seed: int = 0, haystack="sotu:eval",
              batch_size: int = 4, progress: bool = False, max_new_tokens: int | None = None) -> dict:
    """One (task, length) cell as the retrieval reports store it: accuracy, wall time, every sample."""
    t0 = time.perf_counter()
    rows = niah_details(model, tokenizer, task=task, length=length, samples=samples, seed=seed, haystack=haystack,
                        batch_size=batch_size, progress=progress, max_new_tokens=max_new_tokens)
    scores = [r["score"] for r in rows]
    return {"task": task, "length": length, "max_new_tokens": answer_room(task, max_new_tokens),
            "accuracy": sum(scores) / len(rows),
            "interval": list(accuracy_interval(scores)), "seconds": time.perf_counter() - t0, "samples": rows}


def retrieval_probes(tokenizer, lengths: Sequence[int], samples: int, *, task: str = "single", seed: int = 0,
                     haystack="sotu:eval", batch_size: int = 4,
                     max_new_tokens: int | None = None) -> dict[str, Callable[[torch.nn.Module], float]]:
    """``{"<task>@<length>": model -> accuracy}``: the prompts built once, scored on any model of this
    tokenizer (a training curve scores the same prompts at every point; ``niah`` gives the same numbers)."""
    if tokenizer is None:
        raise TcalError("retrieval tasks read and write text: pass the model's tokenizer")
    if samples < 1:
        raise TcalError(f"samples must be at least 1, got {samples}")
    docs = haystack_documents(task, haystack)

    def probe(items: list[Sample]) -> Callable[[torch.nn.Module], float]:
        def accuracy(model) -> float:
            outs = answer(model, tokenizer, items, batch_size=batch_size)
            return sum(score(o, s.answers) for s, o in zip(items, outs)) / len(items)
        return accuracy

    return {f"{task}@{n}": probe(make_samples(task, tokenizer, int(n), samples, seed=seed, documents=docs,
                                              max_new_tokens=max_new_tokens))
            for n in lengths}


def niah(model, tokenizer, lengths: Sequence[int], samples: int = 8, seed: int = 0, task: str = "single", *,
         haystack="sotu:eval", batch_size: int = 4, progress: bool = False,
         max_new_tokens: int | None = None) -> dict[int, float]:
    """Accuracy of ``task`` at each context length: ``{length: mean score over samples}``.

    ``haystack``: the real text the needles hide in (default ``sotu:eval``, held-out State of the
    Union addresses; any corpus spec). The same seed gives the same prompts for any model with the
    same tokenizer. ``max_new_tokens``: the answer's room (default RULER's, ``GEN_TOKENS``); the
    prompt shrinks by it, so a different room gives different prompts.
    """
    if tokenizer is None:
        raise TcalError("retrieval tasks read and write text: pass the model's tokenizer")
    get_task(task)
    if samples < 1:
        raise TcalError(f"samples must be at least 1, got {samples}")
    result = {}
    for n in tqdm(check_lengths(model, lengths), desc=f"niah {task}", disable=not progress, unit="length"):
        result[n] = niah_cell(model, tokenizer, task=task, length=n, samples=samples, seed=seed, haystack=haystack,
                              batch_size=batch_size, max_new_tokens=max_new_tokens)["accuracy"]
    return result
