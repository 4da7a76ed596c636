"""lm-evaluation-harness tasks (:mod:`tcal.evaluate.tasks.lm_eval.harness`, ``pip install 'tcal[eval]'``) on the loaded model:
the offline local tasks ``tcal_lastword`` and ``tcal_cloze`` (built from ``--lm-eval-data``), or any harness task as
``lm-eval/NAME`` (hub datasets need network). ``:N`` is the samples per task, the first N. ``tcal eval`` writes
lm_eval.json (every number the harness reports, its task configs), lm_eval_samples.json (every request and response)
and lm_eval.md; finished tasks are kept in ``OUT.partial/``.
"""
from __future__ import annotations

from tcal.evaluate.task import Option, Progress, Task
from tcal.utils.errors import TcalError

# tcal.evaluate.tasks.lm_eval.harness.LOCAL_TASKS, named here for the registry without the harness (tests/evaluate/test_harness.py)
LOCAL = ("tcal_lastword", "tcal_cloze")
PREFIX = "lm-eval/"


def spelled(name: str) -> str:
    """How ``--tasks`` spells a harness task given by its bare name (a local task is its own name)."""
    return name if name in LOCAL else PREFIX + name


class LmEval(Task):
    name = "lm-eval"
    aliases = LOCAL
    summary = (f"lm-evaluation-harness: the offline local tasks {', '.join(LOCAL)} (from --lm-eval-data), or any "
               f"harness task as {PREFIX}NAME (pip install 'tcal[eval]'; `lm-eval ls tasks` lists them; hub datasets "
               "need network)")
    usage = f"{', '.join(n + ':N' for n in LOCAL)}, {PREFIX}NAME:N"
    counts = "the first N samples per task, default all"
    options = (
        Option("seed", 0, "seed of every random choice in the local tasks' passages", eval_only=True),
        Option("batch_size", None, "requests run together (default 4)", kind=int, eval_only=True),
        Option("lm_eval_data", "shakespeare:eval", "held-out text the local tasks are built from (an evaluation split "
                                                   "that nothing else reads)", eval_only=True),
    )
    curve = False

    @classmethod
    def accepts(cls, name: str) -> bool:
        return name in LOCAL or (name.startswith(PREFIX) and len(name) > len(PREFIX))

    def __init__(self, specs, options):
        super().__init__(specs, options)
        self.names = [s.name[len(PREFIX):] if s.name.startswith(PREFIX) else s.name for s in self.specs]
        limits = {s.count for s in self.specs}
        if len(limits) > 1:
            raise TcalError("the harness runs every task with one sample count: give the lm-eval tasks the same :N "
                            f"(got {', '.join(map(str, self.specs))})")
        self.limit = limits.pop()
        self.plan = None

    def check(self) -> None:
        from tcal.evaluate.tasks.lm_eval.harness import plan

        if self.opts.batch_size is not None and self.opts.batch_size < 1:
            raise TcalError(f"--batch-size must be at least 1, got {self.opts.batch_size}")
        self.plan = plan(self.names, limit=self.limit, source=self.opts.lm_eval_data, seed=self.opts.seed)

    def texts(self) -> list[str]:
        return [self.opts.lm_eval_data] if any(n in LOCAL for n in self.names) else []

    @property
    def state(self):
        return "lm_eval.json", "tasks", dict

    def run(self, model, tokenizer, progress: Progress) -> dict:
        import logging

        from tcal.evaluate.tasks.lm_eval.harness import harness_lm, run_task

        o, plan = self.opts, self.plan
        if not logging.getLogger().isEnabledFor(logging.DEBUG):
            logging.getLogger("lm_eval").setLevel(logging.WARNING)  # its INFO lines drown the table (-v shows them)
        settings = {"model": o.model, "lm_eval_limit": self.limit, "lm_eval_data": o.lm_eval_data, "seed": o.seed,
                    "dtype": o.dtype, "lm_eval": plan.tasks,
                    # a finished task is reused only for the same text: the file behind --lm-eval-data may change
                    "lm_eval_data_sha256": next((spec["metadata"]["source_sha256"] for spec in plan.specs.values()
                                                 if isinstance(spec, dict)), None)}
        state = progress.resume(settings)
        state.setdefault("tasks", {})
        lm = None
        for task in plan.tasks:
            if task in state["tasks"]:
                continue
            lm = lm or harness_lm(model, tokenizer, batch_size=o.batch_size or 4)
            res = state["tasks"][task] = run_task(lm, plan, task)
            got = ", ".join(f"{r['metric']} {r['value']:.4g}" for r in res["rows"] if r["value"] is not None)
            progress.save(f"{task}: {got} ({res['seconds']:.0f} s)")
        done = [state["tasks"][t] for t in plan.tasks]
        return {"settings": state["settings"], "done": done}

    def report(self, result: dict, title: str) -> dict[str, object]:
        done = result["done"]
        rows = [r for d in done for r in d["rows"]]
        return {
            "lm_eval.json": {"settings": result["settings"], "rows": rows, "lm_eval_version": done[0]["lm_eval_version"],
                             "tasks": {d["task"]: {k: d[k] for k in ("results", "configs", "versions", "n-samples",
                                                                     "seconds")} for d in done}},
            "lm_eval_samples.json": {d["task"]: d["samples"] for d in done},
            "lm_eval.md": self.markdown(done, title)}

    def headline(self, result: dict, files: dict) -> str:
        return files["lm_eval.md"]

    def markdown(self, done: list[dict], title: str) -> str:
        secs = sum(d["seconds"] for d in done)
        limit = f"the first {self.limit}" if self.limit else "all"
        local = [t for t in self.plan.tasks if t in LOCAL]
        lines = [f"# lm-evaluation-harness: {title}", "",
                 f"- lm_eval {done[0]['lm_eval_version']}, each task's own prompt and few-shot setting; samples per "
                 f"task: {limit}"]
        if local:
            lines.append(f"- local tasks ({', '.join(local)}) built offline from `{self.opts.lm_eval_data}`, seed "
                         f"{self.opts.seed}: held-out text that no calibration, perplexity or training run reads")
        lines += [f"- wall time {secs:.0f} s (the harness's runs, model loading excluded)", "",
                  "| task | metric | value | stderr | samples |", "|---|---|---:|---:|---:|"]
        for d in done:
            for r in d["rows"]:
                metric = r["metric"] if r["filter"] in ("none", "") else f"{r['metric']} ({r['filter']})"
                lines.append(f"| {r['task']} | {metric} | {_fmt(r['value'])} | {_fmt(r['stderr'])} | "
                             f"{r['samples'] if r['samples'] is not None else '-'} |")
        return "\n".join(lines) + "\n"


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.4f}"


TASK = LmEval
