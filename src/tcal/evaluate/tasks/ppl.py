"""Held-out perplexity (:mod:`tcal.evaluate.likelihood`): ``--tasks ppl:64@512`` is the first 64 non-overlapping
windows of 512 tokens (the defaults, the full protocol) of ``tcal eval``'s text ``--data``. ``tcal eval`` prints the
report, and with ``--out`` writes it too (ppl.json: the number and its protocol; ppl.md).

Every other command scores perplexity through this task too: ``--eval D1,D2 --eval-window W --eval-windows N`` is
``ppl:N@W`` on each held-out domain (:func:`tcal.evaluate.plan.held_out`), which ``tcal convert`` reports for the
teacher and the hybrid, ``tcal ablate`` for every row and ``tcal distill`` and ``tcal recover`` at every curve point
(its windows are the curve's ``eval_ppl``). So it is no ``--tasks`` item of those commands.
"""
from __future__ import annotations

import json
import time

from tcal.evaluate.task import Progress, Task
from tcal.utils.errors import TcalError

WINDOW, WINDOWS = 512, 64
BATCH = 4  # windows per forward


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
        self.n_windows = spec.count or WINDOWS
        self.window = spec.lengths[0] if spec.lengths else WINDOW
        # tcal eval's --data is one text; the other commands hand their --eval domains as a list
        data = self.opts.data
        self.domains = [data] if isinstance(data, str) else list(data)
        self.corpus = self.tokenizer = None
        self.corpora, self.ids = {}, {}

    def check(self) -> None:
        from tcal.data.corpora import as_corpus
        from tcal.data.streams import is_token_file

        if self.window < 2:
            raise TcalError(f"ppl's window must be at least 2 tokens, got {self.window} (ppl@{self.window})")
        # a missing path or a binary file, before the model loads
        self.corpora = {d: None if is_token_file(d) else as_corpus(d) for d in self.domains}
        self.corpus = self.corpora[self.domains[0]]

    def check_eval(self) -> None:
        if len(self.domains) != 1:
            raise TcalError(f"tcal eval scores the perplexity of one text, got {len(self.domains)}")

    def texts(self) -> list[str]:
        return list(self.domains)

    def prepare(self, model, tokenizer, teacher=None) -> None:
        self.tokenizer = tokenizer

    def windows(self, domain: str | None = None):
        """One domain's token windows ([N, W]; the first domain's by default), cut once (a corpus, a mixture, a
        token pool or a .npy file)."""
        from tcal.data.streams import eval_windows_for

        domain = domain or self.domains[0]
        if domain not in self.ids:
            self.ids[domain] = eval_windows_for(domain, self.tokenizer, self.window, self.n_windows)[0]
        return self.ids[domain]

    # -- curve points, ablation rows, conversions -----------------------------------------------------------------

    def score(self, model, domain: str | None = None, *, progress: bool = False) -> float:
        """The perplexity of ``model`` on one domain's windows (the first domain's: the curve's ``eval_ppl``)."""
        from tcal.evaluate.likelihood import window_ppl

        domain = domain or self.domains[0]
        return window_ppl(model, self.windows(domain), batch_size=BATCH, progress=progress,
                          desc=f"perplexity {domain}")

    def measure(self, model) -> dict:
        """Every domain's perplexity: ``ppl`` (the first domain's), ``ppl_by_domain`` and the seconds it took."""
        t0 = time.perf_counter()
        by = {d: self.score(model, d, progress=self.opts.progress) for d in self.domains}
        return {"ppl": by[self.domains[0]], "ppl_by_domain": by, "seconds": time.perf_counter() - t0}

    def reports(self, model, tokenizer, *, kept_as=None) -> dict[str, dict]:
        """Every domain's perplexity with its protocol (:func:`~tcal.evaluate.likelihood.perplexity_report`).

        ``kept_as``: what the model is (:func:`~tcal.evaluate.score_cache.model_identity`) where it never changes
        (a teacher): each report is kept in tcal's cache under it, how the model runs and the windows' tokens, and
        read back by the next run (``cached: true`` in the report); None scores every time."""
        from tcal.evaluate.likelihood import perplexity_report
        from tcal.evaluate.score_cache import cached, ids_digest, run_identity

        self.tokenizer = tokenizer

        def report(d):
            return perplexity_report(model, tokenizer, self.windows(d) if self.corpora[d] is None else self.corpora[d],
                                     window=self.window, windows=self.n_windows, batch_size=BATCH,
                                     progress=self.opts.progress)

        if kept_as is None:
            return {d: report(d) for d in self.domains}
        out = {}
        for d in self.domains:
            key = {"model": kept_as, "run": run_identity(model), "data": d, "tokens": ids_digest(self.windows(d)),
                   "window": self.window, "windows": self.n_windows, "batch": BATCH}
            value, hit = cached("ppl", key, lambda: report(d))
            out[d] = {**value, "cached": hit}
        return out

    def describe(self) -> str:
        return (f"held-out perplexity of {', '.join(self.domains)}: the first {self.n_windows} non-overlapping "
                f"windows of {self.window} tokens")

    # -- tcal eval ------------------------------------------------------------------------------------------------

    @property
    def state(self):
        return None

    def run(self, model, tokenizer, progress: Progress) -> dict:
        return self.reports(model, tokenizer)[self.domains[0]]

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
                f"{self.opts.data} ({self.n_windows} x {self.window} tokens)")


TASK = Perplexity
