"""Retrieval: RULER-style needle-in-a-haystack tasks (:mod:`tcal.evaluate.tasks.niah.ruler`) at context lengths.

``--tasks niah`` is all nine tasks; ``single@1024,4096`` one of them at two lengths; ``passkey`` is ``single`` (one
number hidden in real text). ``:N`` is the prompts per length (default 8), ``@L`` the context lengths (default
512,1024,2048,4096). A curve point or an ablation row scores each (task, length) as a column ``single@1024``, on
prompts built once; ``tcal eval`` writes niah.json (every prompt's answers and output), niah.md (accuracy and its
95 % interval per cell) and niah.png (score by needle depth and length).
"""
from __future__ import annotations

from tcal.evaluate.task import Option, Progress, Task
from tcal.utils.errors import TcalError

# tcal.evaluate.tasks.niah.ruler.TASKS, named here for the registry without torch (tests/evaluate/test_niah.py: they agree)
RETRIEVAL = ("single", "single-words", "single-uuids", "single-noise", "multikey", "multivalue", "multiquery", "vt",
             "cwe")
ALIASES = {"passkey": "single"}
LENGTHS = (512, 1024, 2048, 4096)
SAMPLES = 8


class Niah(Task):
    name = "niah"
    aliases = (*RETRIEVAL, *ALIASES)
    summary = ("RULER-style retrieval at context lengths (default @512,1024,2048,4096): niah is all nine tasks, or "
               "name them; passkey = single (--haystack, --seed, --max-new-tokens)")
    title = "the retrieval tasks"
    counts = "prompts per length, default 8"
    takes_lengths = True
    options = (
        Option("seed", 0, "seed of every random choice in its prompts", eval_only=True),
        Option("haystack", "sotu:eval", "real text the needles hide in (used for nothing else)"),
        Option("batch_size", None, "prompts run together (default 4)", kind=int, eval_only=True),
        Option("max_new_tokens", None, "the answer's room in tokens (default RULER's: 128 for the needle tasks, 30 "
                                       "for vt, 120 for cwe); prompts shrink by it", kind=int, eval_only=True),
    )

    def __init__(self, specs, options):
        super().__init__(specs, options)
        # (task, prompts, lengths) per spec, `niah` spread over every task
        self.entries = [(ALIASES.get(name, name), s.count or SAMPLES, s.lengths or LENGTHS)
                        for s in self.specs for name in (RETRIEVAL if s.name == "niah" else (s.name,))]
        self.tokenizer = None
        self._probes = None

    @property
    def tasks(self) -> list[str]:
        return list(dict.fromkeys(t for t, _, _ in self.entries))

    @property
    def lengths(self) -> list[int]:
        return list(dict.fromkeys(n for _, _, lengths in self.entries for n in lengths))

    @property
    def cells(self) -> list[tuple[str, int]]:
        asked = {(t, n) for t, _, lengths in self.entries for n in lengths}
        return [(t, n) for t in self.tasks for n in self.lengths if (t, n) in asked]

    def check(self) -> None:
        from tcal.data.corpora import as_corpus

        cells = [f"{t}@{n}" for t, _, lengths in self.entries for n in lengths]
        twice = next((c for c in cells if cells.count(c) > 1), None)
        if twice:
            raise TcalError(f"{twice} is asked for twice in --tasks; name each task at each length once")
        if min(self.lengths) < 16:
            raise TcalError(f"retrieval context lengths must be at least 16 tokens, got {min(self.lengths)}")
        for name in ("batch_size", "max_new_tokens"):
            value = getattr(self.opts, name)
            if value is not None and value < 1:
                raise TcalError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
        as_corpus(self.opts.haystack)  # a missing file or binary text, before any model loads

    def texts(self) -> list[str]:
        from tcal.evaluate.tasks.niah.ruler import TASKS

        return [self.opts.haystack] if any(TASKS[t].haystack == "text" for t in self.tasks) else []

    def prepare(self, model, tokenizer, teacher=None) -> None:
        from tcal.evaluate.tasks.niah.ruler import check_lengths

        check_lengths(model, self.lengths)
        self.tokenizer = tokenizer

    # -- curve points, ablation rows -----------------------------------------------------------------------------

    def probes(self):
        from tcal.evaluate.tasks.niah.ruler import retrieval_probes

        if self._probes is None:  # the prompts are built once: every point scores the same ones
            self._probes = {}
            for task, samples, lengths in self.entries:
                self._probes.update(retrieval_probes(self.tokenizer, lengths, samples, task=task, seed=self.opts.seed,
                                                     haystack=self.opts.haystack,
                                                     batch_size=self.opts.batch_size or 4,
                                                     max_new_tokens=self.opts.max_new_tokens))
        return self._probes

    def describe(self) -> str:
        parts = []
        for task, samples, _ in self.entries:
            parts.append(f"passkey retrieval (one needle in {self.opts.haystack}, {samples} prompts per length, "
                         "greedy; the same prompts at every point)" if task == "single" else
                         f"{task} retrieval (RULER-style, {samples} prompts per length, greedy; the same prompts at "
                         "every point)")
        return "; ".join(dict.fromkeys(parts))

    # -- tcal eval ------------------------------------------------------------------------------------------------

    @property
    def samples(self) -> int:
        counts = {n for _, n, _ in self.entries}
        if len(counts) > 1:
            raise TcalError(f"tcal eval writes one retrieval table, with one prompt count per cell: give the retrieval "
                            f"tasks the same :N (got {', '.join(map(str, sorted(counts)))})")
        return counts.pop()

    def check_eval(self) -> None:
        _ = self.samples

    @property
    def state(self):
        return "niah.json", "cells", dict

    def settings(self) -> dict:
        o = self.opts
        return {"model": o.model, "lengths": ",".join(map(str, self.lengths)), "samples": self.samples, "seed": o.seed,
                "haystack": o.haystack, "max_new_tokens": o.max_new_tokens}

    def run(self, model, tokenizer, progress: Progress) -> dict:
        from tcal.evaluate.tasks.niah.ruler import niah_cell

        o = self.opts
        state = progress.resume(self.settings())
        state.setdefault("cells", {})
        for task, n in self.cells:
            key = f"{task}@{n}"
            if key in state["cells"]:
                continue
            cell = niah_cell(model, tokenizer, task=task, length=n, samples=self.samples, seed=o.seed,
                             haystack=o.haystack, batch_size=o.batch_size or 4, progress=o.progress,
                             max_new_tokens=o.max_new_tokens)
            state["cells"][key] = cell
            progress.save(f"{task} @ {n} tokens: {cell['accuracy']:.2f} ({cell['seconds']:.0f} s)")
        cells = [state["cells"][f"{t}@{n}"] for t, n in self.cells]
        return {"settings": state["settings"], "tasks": self.tasks, "lengths": self.lengths, "cells": cells}

    def report(self, result: dict, title: str) -> dict[str, object]:
        cells = result["cells"]
        return {"niah.json": result, "niah.md": self.markdown(result, title),
                "niah.png": lambda path: heat_map(cells, path, title=title)}

    def headline(self, result: dict, files: dict) -> str:
        return files["niah.md"]

    def markdown(self, result: dict, title: str) -> str:
        from tcal.evaluate.tasks.niah.ruler import accuracy_interval

        s, cells, lengths = result["settings"], result["cells"], result["lengths"]
        # from the samples, so cells a resumed run kept from before intervals were stored read the same
        acc = {(c["task"], c["length"]): (c["accuracy"], accuracy_interval([x["score"] for x in c["samples"]]))
               for c in cells}
        secs = sum(c["seconds"] for c in cells)
        # every cell has its room: a partial run from before rooms were stored has other settings and starts over
        room = ", ".join(f"{t} {r}" for t, r in {c["task"]: c["max_new_tokens"] for c in cells}.items())
        lines = [f"# Retrieval: {title}", "",
                 f"- {s['samples']} prompts per task and length, needle depths spread over 0..1, seed {s['seed']}; "
                 f"greedy decoding; score = fraction of expected answers found in the output (RULER string_match_all)",
                 f"- room for the answer, in new tokens (a row stops once it holds all its answers): {room}",
                 f"- haystack (real-text tasks): `{s['haystack']}`, used for no calibration or training",
                 f"- in brackets: the 95 % interval (Wilson) over the {s['samples']} prompts; read a difference "
                 "between cells, or against a target, against these widths",
                 f"- wall time {secs:.0f} s", "",
                 "| task | " + " | ".join(f"{n:,}" for n in lengths) + " |",
                 "|---|" + "---:|" * len(lengths)]
        lines += [f"| {t} | " + " | ".join(f"{acc[(t, n)][0]:.2f} ({acc[(t, n)][1][0]:.2f}-{acc[(t, n)][1][1]:.2f})"
                                            if (t, n) in acc else "-" for n in lengths) + " |"
                  for t in result["tasks"]]
        return "\n".join(lines) + "\n"


def heat_map(cells: list[dict], path, *, title: str = "", bins: int = 5) -> str:
    """Per task, a heat map of retrieval score by needle depth (rows) and context length (columns)."""
    import math

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    tasks = list(dict.fromkeys(c["task"] for c in cells))
    lengths = sorted({c["length"] for c in cells})
    fig = Figure(figsize=(3.2 * len(tasks) + 1, 3.4))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(tasks), squeeze=False)[0]
    for ax, task in zip(axes, tasks):
        grid = [[math.nan] * len(lengths) for _ in range(bins)]
        for c in (c for c in cells if c["task"] == task):
            sums, counts = [0.0] * bins, [0] * bins
            for s in c["samples"]:
                b = min(int(s["depth"] * bins), bins - 1)
                sums[b] += s["score"]
                counts[b] += 1
            for b in range(bins):
                if counts[b]:
                    grid[b][lengths.index(c["length"])] = sums[b] / counts[b]
        im = ax.imshow(grid, aspect="auto", cmap="RdYlGn", vmin=0.0, vmax=1.0, interpolation="nearest")
        ax.set_title(task, fontsize=9)
        ax.set_xticks(range(len(lengths)))
        ax.set_xticklabels([f"{n // 1024}K" if n >= 1024 else str(n) for n in lengths], fontsize=7)
        ax.set_yticks(range(bins))
        ax.set_yticklabels([f"{(b + 0.5) / bins:.0%}" for b in range(bins)], fontsize=7)
        ax.set_xlabel("context length")
        ax.set_ylabel("needle depth")
    fig.colorbar(im, ax=list(axes), fraction=0.03, pad=0.02, label="score")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=110)
    return str(path)


TASK = Niah
