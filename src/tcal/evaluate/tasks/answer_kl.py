"""answer_kl: the KL to the teacher on the answers of an instruct set's development tasks (``tcal instruct``; the
instruct set is the command's ``--data``). ``tcal distill`` and ``tcal recover`` score it at every curve point
whenever ``--data`` holds development tasks (:meth:`AnswerKL.implied`), and keep the checkpoint of lowest answer_kl
as OUT/best (:attr:`~tcal.evaluate.task.Task.picks_best`): the development tasks are held out of training, so they
can pick a checkpoint where the evaluation's own problems must not.
"""
from __future__ import annotations

from tcal.evaluate.task import Task
from tcal.utils.errors import TcalError

BATCH = 8  # development windows per forward


class AnswerKL(Task):
    name = "answer_kl"
    summary = ("KL(teacher || model) on the answers of the instruct set --data's development tasks; picks a "
               "distillation's best checkpoint (tcal distill, tcal recover)")
    options = ("data",)
    text = False  # token ids
    needs_teacher = True
    picks_best = True

    def __init__(self, specs, options):
        super().__init__(specs, options)
        self.dev = self.teacher = None

    @classmethod
    def implied(cls, opts) -> bool:
        """Whether ``--data`` is an instruct set with development tasks: then every curve point scores answer_kl."""
        from tcal.data.instruct import is_instruct_set, load_instruct_dev

        return is_instruct_set(opts.data) and load_instruct_dev(opts.data) is not None

    def check(self) -> None:
        from tcal.data.instruct import is_instruct_set, load_instruct_dev

        self.dev = load_instruct_dev(self.opts.data) if is_instruct_set(self.opts.data) else None
        if self.dev is None:
            raise TcalError(f"answer_kl scores the answers of an instruct set's development tasks, and --data "
                            f"{self.opts.data or '(none)'} holds none (tcal instruct writes them); drop answer_kl "
                            "from --tasks")

    def prepare(self, model, tokenizer, teacher=None) -> None:
        if teacher is None:
            raise TcalError("answer_kl compares a model with its teacher: it scores in tcal distill and tcal recover")
        self.teacher = teacher

    def probes(self):
        from tcal.modules.distill_loss import mean_kl

        ids, mask = self.dev
        return {"answer_kl": lambda model: mean_kl(model, self.teacher, ids, BATCH, mask=mask)}

    def heading(self, column: str) -> str:
        return "development answer KL"

    def describe(self) -> str:
        return (f"answer_kl (KL(teacher || student) on the answers of the development tasks of {self.opts.data}, "
                "which pick OUT/best)")


TASK = AnswerKL
