"""What every curve point of a distillation scores beside the held-out perplexity: the run's tasks
(:func:`tcal.train.options.curve_tasks`) as probes, their prompts built once, and the one column that picks the run's
best checkpoint."""
from __future__ import annotations


def curve_probes(tasks, tokenizer, teacher) -> dict:
    """The scorers of every curve point, one per column, from the run's tasks (:func:`tcal.train.options.curve_tasks`):
    prompts built once from the tokenizer, lengths checked against the teacher's position limit."""
    from tcal.utils.errors import TcalError

    texts = [t.name for t in tasks if t.text]
    if texts and tokenizer is None:
        raise TcalError(f"{', '.join(texts)} write{'s' if len(texts) == 1 else ''} and read text, and neither the "
                        "hybrid nor the teacher directory has a tokenizer; save one there or leave "
                        f"{'it' if len(texts) == 1 else 'them'} out of --tasks")
    probes = {}
    for t in tasks:
        t.prepare(teacher, tokenizer, teacher=teacher)
        probes.update(t.probes())
    return probes


def best_column(tasks) -> str | None:
    """The curve column that picks a run's best checkpoint (:attr:`~tcal.evaluate.task.Task.picks_best`), if one of
    ``tasks`` has it (after :meth:`~tcal.evaluate.task.Task.prepare`)."""
    return next((c for t in tasks if t.picks_best for c in t.columns()), None)
