"""Held-out perplexity (:mod:`tcal.evaluate.likelihood`) of the text ``--data``: ``--tasks ppl:64@512`` is the first
64 non-overlapping windows of 512 tokens (the defaults, the full protocol). ``tcal eval`` prints the report, and
with ``--out`` writes it too (ppl.json: the number and its protocol; ppl.md); training curves and ablation rows score
perplexity on ``--eval`` already, so it is no curve task.
"""
from __future__ import annotations

import json

from tcal.evaluate.task import Progress, Task
from tcal.utils.errors import TcalError

WINDOW, WINDOWS = 512, 64


class Perplexity(Task):
    name = "ppl"
    summary = "held-out perplexity of --data (@L tokens per window, default 512; tcal eval's default task)"
    title = "perplexity"
    counts = "the first N non-overlapping windows, default 64"
    takes_lengths = True
    options = ("data",)
    curve = False
    text = False  # a token file needs no tokenizer; text without one is the loader's error
    prints = True

    def __init__(self, specs, options):
        super().__init__(specs, options)
        if len(self.specs) > 1 or len(self.specs[0].lengths) > 1:
            raise TcalError(f"ppl takes one window length and is named once in --tasks, got "
                            f"{', '.join(map(str, self.specs))}")
        spec = self.specs[0]
        self.windows = spec.count or WINDOWS
        self.window = spec.lengths[0] if spec.lengths else WINDOW
        self.corpus = None

    def check(self) -> None:
        from tcal.data.corpora import as_corpus

        if self.window < 2:
            raise TcalError(f"ppl's window must be at least 2 tokens, got {self.window} (ppl@{self.window})")
        self.corpus = as_corpus(self.opts.data)  # a missing path or a binary file, before the model loads

    def texts(self) -> list[str]:
        return [self.opts.data]

    @property
    def state(self):
        return None

    def run(self, model, tokenizer, progress: Progress) -> dict:
        from tcal.evaluate import perplexity_report

        return perplexity_report(model, tokenizer, self.corpus, window=self.window, windows=self.windows,
                                 progress=self.opts.progress)

    def report(self, result: dict, title: str) -> dict[str, object]:
        lines = [f"# Perplexity: {title}", "",
                 f"- **PPL {result['ppl']:.3f}** (mean NLL {result['nll']:.4f} nats over {result['tokens']:,} predicted "
                 "tokens)",
                 f"- data: {self.opts.data} ({result.get('data')}, sha256 {result.get('data_hash')}...), the first "
                 f"{result['windows']} non-overlapping windows of {result['window']} tokens",
                 f"- model: {self.opts.model}, {result.get('dtype')} on {result.get('device')}; "
                 f"{result.get('seconds', 0):.1f} s", ""]
        return {"ppl.json": result, "ppl.md": "\n".join(lines)}

    def headline(self, result: dict, files: dict) -> str:
        return (json.dumps(result, indent=2, default=str) + "\n" + f"{self.opts.model}: PPL {result['ppl']:.3f} on "
                f"{self.opts.data} ({self.windows} x {self.window} tokens)")


TASK = Perplexity
