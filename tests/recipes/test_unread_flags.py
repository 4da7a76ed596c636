"""Flags a run does not read are refused, never ignored, with one wording in every command (tcal.utils.flags): the
tasks, inits and settings that read a flag declare it once. Each check runs before anything else could fail: were a
flag not refused, the run would stop on another error (a missing path) and the message would not match."""
import pytest
from helpers import one_error

UNREAD = "is read by {} only, and this run is {}: drop {}"


def convert(ws, *extra):
    return ("convert", "--teacher", ws / "teacher", "--keep", "0,2", "--eval", "none", "--device", "cpu", "--out",
            ws / "out", *extra)


@pytest.mark.parametrize("extra, flag, reader", [
    (("--kl-steps", "3"), "--kl-steps", "the inits with a KL stage (taylor)"),
    (("--align-steps", "2"), "--align-steps", "the inits with Phase 2 ("),
    (("--calib-budget", "xl"), "--calib-budget", "the calibrated inits ("),
    (("--calib-window", "64"), "--calib-window", "the calibrated inits ("),
    (("--kl-data", "calib"), "--kl-data", "the inits with a KL stage (taylor)"),
    (("--kl-windows", "4"), "--kl-windows", "the KL stage on chat windows (--kl-data chat:CODE)"),
    (("--kl-recall-frac", "0.5"), "--kl-recall-frac", "the inits with a KL stage (taylor)"),
])
def test_convert_refuses_the_calibration_flags_of_an_init_without_that_stage(workspace, capsys, extra, flag, reader):
    err = one_error(capsys, f"{flag} is read by {reader}", *convert(workspace, "--init", "copy", *extra))
    assert err.endswith(f"only, and this run is --init copy --keep 0,2 --eval none: drop {flag}")
    assert not (workspace / "out").exists()


@pytest.mark.parametrize("extra, flag, reader", [
    (("--kl-data", "calib", "--kl-windows", "4"), "--kl-windows", "the KL stage on chat windows (--kl-data chat:CODE)"),
    (("--kl-recall-span", "64"), "--kl-recall-span", "the KL stage's recall mix"),
    (("--init", "phase1", "--align-steps", "5"), "--align-steps", "the inits with Phase 2"),
    (("--init", "phase2", "--kl-steps", "5"), "--kl-steps", "the inits with a KL stage"),
])
def test_convert_refuses_flags_that_only_matter_beside_another(workspace, capsys, extra, flag, reader):
    one_error(capsys, f"{flag} is read by {reader}", *convert(workspace, *extra))


TASK_FLAGS = [
    (("--haystack", "sotu:eval2"), "--haystack", "niah"),
    (("--problems", "p.jsonl"), "--problems", "humaneval"),
    (("--timeout", "-5"), "--timeout", "humaneval"),
    (("--memory-mb", "2048"), "--memory-mb", "humaneval"),
    (("--prompt-style", "chat"), "--prompt-style", "humaneval"),
    (("--allow-code-execution",), "--allow-code-execution", "humaneval"),
]


@pytest.mark.parametrize("extra, flag, reader", TASK_FLAGS + [(("--mix-frac", "0.5"), "--mix-frac", "--mix-data"),
                                                              (("--recall-span", "8"), "--recall-span",
                                                               "--recall-frac above 0"),
                                                              (("--schedule", "constant", "--min-lr-ratio", "0.5"),
                                                               "--min-lr-ratio", "--schedule cosine")])
def test_distill_refuses_task_and_training_flags_no_part_of_the_run_reads(workspace, capsys, extra, flag, reader):
    one_error(capsys, UNREAD.format(reader, "tcal distill with no task", flag), "distill", workspace / "no-hybrid",
              "--teacher", workspace / "teacher", "--data", workspace / "missing.npy", "--out", workspace / "out",
              *extra)


@pytest.mark.parametrize("extra, flag, reader", TASK_FLAGS)
def test_ablate_and_recover_refuse_task_flags_no_task_reads(workspace, capsys, extra, flag, reader):
    one_error(capsys, UNREAD.format(reader, "tcal recover with no task", flag), "recover",
              "--teacher", workspace / "teacher", "--keep", "0,2", "--data", workspace / "missing.npy", "--out",
              workspace / "out", *extra)
    one_error(capsys, f"{flag} is read by {reader} only, and this run is tcal ablate --inits ", "ablate",
              "--teacher", workspace / "teacher", "--keep", "0,2", "--eval", workspace / "missing.txt", "--out",
              workspace / "out", *extra)


def test_recover_refuses_calibration_flags_of_inits_it_does_not_run(workspace, capsys):
    one_error(capsys, "--kl-steps is read by the inits with a KL stage (taylor) only, and this run is tcal recover "
              "--inits copy,phase2 with no task: drop --kl-steps", "recover", "--teacher", workspace / "teacher",
              "--keep", "0,2", "--inits", "copy,phase2", "--data", workspace / "missing.npy", "--kl-steps", "3",
              "--out", workspace / "out")


@pytest.mark.parametrize("extra", [("--dev-tasks", "3"), ("--max-tasks", "5"), ("--sources", "code:calib"),
                                   ("--max-new-tokens", "9"), ("--batch-size", "2"), ("--answers", "reference"),
                                   ("--resume",), ("--device", "cpu")])
def test_instruct_samples_refuses_what_only_a_generating_run_reads(tmp_path, capsys, extra):
    samples = tmp_path / "missing.jsonl"
    one_error(capsys, f"{extra[0]} is read by a run that ", "instruct", "--samples", samples, "--out", tmp_path / "o",
              *extra)
    one_error(capsys, f"only, and this run is --samples {samples}: drop {extra[0]}", "instruct", "--samples", samples,
              "--out", tmp_path / "o", *extra)


@pytest.mark.parametrize("extra", [("--max-new-tokens", "9"), ("--batch-size", "2"), ("--resume",)])
def test_instruct_reference_answers_refuse_what_only_the_teachers_answers_read(tmp_path, capsys, extra):
    one_error(capsys, f"{extra[0]} is read by a run that asks the teacher (--answers teacher, without --samples) only, "
              "and this run is --answers reference", "instruct", "--answers", "reference", "--sources",
              "dir:/no/such/dir", "--out", tmp_path / "o", *extra)


def test_eval_refuses_overwrite_where_nothing_is_written_and_a_model_given_twice(workspace, capsys):
    one_error(capsys, "--overwrite is read by a run that writes its report (--out) only, and this run is ppl", "eval",
              workspace / "no-model", "--data", workspace / "eval.txt", "--overwrite")
    one_error(capsys, f"MODEL is given twice, as {workspace / 'no-model'} and as --model other; give it once", "eval",
              workspace / "no-model", "--model", "other")
    one_error(capsys, "HYBRID is given twice", "distill", workspace / "h1", "--hybrid", workspace / "h2")


@pytest.mark.parametrize("argv, message", [
    (("eval", "--tasks", ",,"), "--tasks ',,' names no task"),
    (("eval", "--tasks", " , "), "names no task"),
    (("eval", "--tasks", "list,ppl"), "--tasks list lists the tasks, and names none to run: give it alone"),
    (("distill", "--tasks", "list"), "--tasks list lists the tasks, and names none to run"),
])
def test_tasks_that_name_nothing_to_run_are_one_line(tmp_path, capsys, argv, message):
    one_error(capsys, message, *argv, "--out", tmp_path / "o")


@pytest.mark.parametrize("keep, message", [
    ("auto@sliding", "keep policy auto picks the teacher's own layers and takes no @ scope; give --keep auto alone, "
                     "or a policy such as uniform:25%@sliding"),
    ("auto:3", "keep policy auto takes no count (auto:3)"),
])
def test_keep_auto_misspelt_is_named_as_auto(workspace, capsys, keep, message):
    one_error(capsys, message, "convert", "--teacher", workspace / "teacher", "--keep", keep, "--init", "copy",
              "--eval", "none", "--out", workspace / "out")
