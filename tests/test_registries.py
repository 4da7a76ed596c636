"""Every registered task, family and engine, read from its registry, checked for what it promises: a module added
to tcal/evaluate/tasks/ or tcal/families/, or an engine added to ENGINES, is checked here without an edit. The
built-ins are listed once, here (BUILT_INS); every other test reads the registries."""
import dataclasses
import pkgutil

import pytest
from helpers import tiny_keep, tiny_teacher

from tcal import engines, families
from tcal.evaluate import tasks as T
from tcal.evaluate.task import TaskSpec
from tcal.utils.errors import TcalError

# what tcal ships; more may be registered
BUILT_INS = {
    "tasks": {"ppl", "niah", "humaneval", "lm-eval", "answer_kl"},
    "families": {"gemma3", "llama", "mistral", "phi3", "qwen2", "qwen3"},
    "engines": {"tcal", "transformers", "vllm", "sglang", "llama.cpp"},
}
COMMANDS = ("eval", "ablate", "distill", "recover")  # the commands that evaluate


def test_the_built_ins_are_registered():
    assert BUILT_INS["tasks"] <= set(T.TASKS) and BUILT_INS["families"] <= set(families.FAMILIES)
    assert BUILT_INS["engines"] <= set(engines.ENGINES)


def _help(command: str) -> str:
    from tcal.cli import build_parser

    sub = build_parser()._subparsers._group_actions[0].choices[command]
    return " ".join(sub.format_help().split())


def spelling(task) -> str:
    """A name ``--tasks`` runs the task by (the harness answers to its tasks' names, not its own)."""
    return next(n for n in (task.name, *task.aliases) if task.accepts(n))


# -- tasks --------------------------------------------------------------------------------------------------------------

def test_every_task_module_is_registered_once():
    modules = {m.name for m in pkgutil.iter_modules(T.__path__)}
    found = {t.__module__.split(".")[3] for t in T.TASKS.values() if t.__module__.startswith(T.__name__ + ".")}
    assert found == modules  # one task per module or package of tcal/evaluate/tasks/
    names = [n for t in T.TASKS.values() for n in (t.name, *t.aliases)]
    assert len(names) == len(set(names))


@pytest.mark.parametrize("task", T.TASKS.values(), ids=lambda t: t.name)
def test_every_task_says_what_it_is_and_is_listed(task):
    assert task.name and task.summary and T.TASKS[task.name] is task
    assert all(T.find(a) is task for a in task.aliases) and T.find(spelling(task)) is task
    assert (task.usage or task.name) in T.listing()
    if task.picks_best:
        assert task.curve, "a task whose column picks the best checkpoint scores curve points"


@pytest.mark.parametrize("task", T.TASKS.values(), ids=lambda t: t.name)
def test_every_task_flag_is_a_flag_of_the_commands_that_run_it(task):
    for o in task.flags():
        flag = "--" + o.name.replace("_", "-")
        for command in COMMANDS:
            runs_it = command == "eval" or (task.curve and not o.eval_only)
            if runs_it:
                assert f"{flag} " in _help(command) and f"{task.name}: " in _help(command), (command, flag)
            elif not any(o.name in (x.name for x in t.flags()) and t.curve and not x.eval_only
                         for t in T.TASKS.values() for x in t.flags()):
                assert f"{flag} " not in _help(command), (command, flag)


@pytest.mark.parametrize("task", T.TASKS.values(), ids=lambda t: t.name)
def test_every_task_builds_from_its_name_and_runs_code_only_behind_the_gate(task):
    name = spelling(task)
    built = T.build([TaskSpec(name)], T.options())
    assert [type(t) for t in built] == [task] and built[0].specs == [TaskSpec(name)]
    if task.runs_code:
        with pytest.raises(TcalError, match="add --allow-code-execution"):
            T.check_code_execution(built, False)
    T.check_code_execution(built, True) if task.runs_code else T.check_code_execution(built, False)
    if not task.counts:
        with pytest.raises(TcalError, match="takes no count"):
            T.build([TaskSpec(name, 3)], T.options())
    if not task.takes_lengths:
        with pytest.raises(TcalError, match="takes no context length"):
            T.build([TaskSpec(name, None, (64,))], T.options())


@pytest.mark.parametrize("task", T.TASKS.values(), ids=lambda t: t.name)
def test_every_task_flag_given_to_a_run_without_the_task_is_refused(task, tmp_path, capsys):
    from helpers import one_error

    ppl = T.find("ppl")
    flags = [o for o in task.flags() if o.name not in ppl.option_names()]
    if task is ppl or not flags:
        pytest.skip(f"{task.name} declares no flag the ppl task does not read")
    o = flags[0]
    value = "--no-" + o.name.replace("_", "-") if o.type is bool else None
    given = [value] if value else ["--" + o.name.replace("_", "-"),
                                   str(o.choices[-1] if o.choices and o.choices[-1] != o.default else
                                       {int: 7, float: 0.5, str: "x"}[o.type])]
    one_error(capsys, f"--{o.name.replace('_', '-')} is read by", "eval", tmp_path / "m", "--tasks", "ppl", *given,
              "--out", tmp_path / "o")


# -- families -----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fam", families.FAMILIES.values(), ids=str)
def test_every_family_keeps_layers_of_its_tiny_model_and_rules_on_them_the_same_everywhere(fam):
    import tcal
    from tcal.conversion.target import layout_blocker

    teacher = tiny_teacher(fam.name)
    keep = tiny_keep(fam.name)
    assert keep and all(0 <= i < teacher.config.num_hidden_layers for i in keep)
    why = layout_blocker(teacher.config, keep)
    assert (why is None) == (fam.layout and fam.layout_blocker(teacher.config, keep) is None)
    hybrid = tcal.convert(teacher, keep=keep, init="copy")  # --target auto
    assert hybrid.config.target == ("qwen3_5" if why is None else "native")
    if why is not None:
        assert "\n" not in why
        with pytest.raises(TcalError, match="--target qwen3_5: "):
            tcal.convert(teacher, keep=keep, init="copy", target="qwen3_5")


# -- engines ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("engine", engines.ENGINES.values(), ids=lambda e: e.key)
def test_every_engine_says_what_it_reads_and_how_it_is_checked(engine):
    assert engine.key and engine.name and engine.checked and engines.get(engine.key) is engine
    assert (engine.rule is None) == (engine.serve is None) == engine.uses_model
    assert engine.uses_model or engine.reads in ("hf", "gguf")
    if engine.generates:
        assert engine.opens and engine.key in engines.GENERATING and f"{engine.key} (" in _help("eval")
        if engine.uses_model:
            assert engine.runner.locate("any/model") is None


def test_every_bench_row_names_an_engine_that_runs_it():
    from tcal.engines.rows import BENCH_ROWS

    for row in BENCH_ROWS.values():
        engine = engines.get(row.engine)
        assert engine.runner is not None and type(engine.runner).bench is not engines.Runner.bench, row.name
        assert dataclasses.replace(row).reads == engine.reads
