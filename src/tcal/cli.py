"""`tcal` command line: the command table over :mod:`tcal.recipes`.

Every subcommand maps its flags onto its recipe's config dataclass and calls the recipe's
``run``; a command group (``tcal airgap pack|stage|check``) is a recipe module whose ``COMMANDS`` table names its
subcommands the same way. Bad input is one line ``tcal: error: ...`` and exit status 2, never a traceback.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import warnings

from tcal.utils.command_config import add_dataclass_args, from_args
from tcal.utils.errors import TcalError, TcalWarning

# name -> help; the command is the recipe module tcal.recipes.<name>, its config the class <Name>Config there
COMMANDS = {
    "convert": "convert a teacher into a hybrid and save it",
    "eval": "held-out perplexity, long-context retrieval or lm-evaluation-harness tasks of a hybrid or teacher",
    "stats": "teacher attention statistics per layer and head, with heat maps",
    "ablate": "every init strategy on the same layers and data: held-out PPL table, plot",
    "pool": "tokenise packaged real text into a distillation token pool",
    "instruct": "instruct-format distillation data: code tasks in the teacher's chat template with its own answers",
    "distill": "distil a hybrid against its frozen teacher's logits",
    "recover": "per init: convert, distil on the same data/budget, tabulate tokens to recovery targets",
    "export": "export a hybrid to the Qwen3.5 layout: a transformers checkpoint (vLLM, SGLang) or a llama.cpp GGUF",
    "bench": "prefill and decode speed of a hybrid against its teacher by context length: tables, plot",
}

# name -> (recipe module with a COMMANDS table {subcommand: (config class, run, help)}, help)
GROUPS = {
    "airgap": ("tcal.recipes.airgap", "staging tcal for a GPU machine without network: pack (where there is network), "
                                      "stage and check (on the GPU machine); docs/airgap.md"),
}

# `tcal eval MODEL`, `tcal distill HYBRID`, `tcal stats TEACHER`, `tcal bench MODEL`, `tcal export HYBRID`: the first positional
# fills this field.
POSITIONAL = {"eval": "model", "distill": "hybrid", "stats": "teacher", "bench": "model", "export": "hybrid"}


def recipe(name: str, sub: str | None = None):
    """(config class, run function) of a command, or of a group's subcommand ``sub``."""
    if name in GROUPS:
        cls, run, _ = importlib.import_module(GROUPS[name][0]).COMMANDS[sub]
        return cls, run
    mod = importlib.import_module(f"tcal.recipes.{name}")
    return getattr(mod, f"{name.capitalize()}Config"), mod.run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tcal",
        description="Convert Transformer LMs into hybrid attention / Gated DeltaNet models (Taylor-Calibrate).",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_text in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name in POSITIONAL:
            field = POSITIONAL[name]
            p.add_argument("positional", nargs="?", metavar=field.upper(), help=f"same as --{field}")
        add_dataclass_args(p, recipe(name)[0])
    for name, (module, help_text) in GROUPS.items():
        group = sub.add_parser(name, help=help_text, description=help_text).add_subparsers(
            dest="subcommand", metavar="SUBCOMMAND", required=True)
        for sub_name, (cls, _, sub_help) in importlib.import_module(module).COMMANDS.items():
            add_dataclass_args(group.add_parser(sub_name, help=sub_help, description=sub_help), cls)
    return parser


def _positional(ns: argparse.Namespace, cls) -> None:
    """The first positional fills its field; given as the flag too, both must name the same thing."""
    field = POSITIONAL[ns.command]
    flag = getattr(ns, field)
    if flag != cls.__dataclass_fields__[field].default and flag != ns.positional:
        raise TcalError(f"{field.upper()} is given twice, as {ns.positional} and as --{field} {flag}; give it once")
    setattr(ns, field, ns.positional)


def _format_warning(message, category, filename, lineno, line=None, _default=warnings.formatwarning):
    # tcal's own warnings are messages for the user: one line, without the source line that raised them
    if issubclass(category, TcalWarning):
        return f"tcal: warning: {message}\n"
    return _default(message, category, filename, lineno, line)


def main(argv: list[str] | None = None) -> int:
    warnings.formatwarning = _format_warning
    parser = build_parser()
    ns = parser.parse_args(argv)
    # under torchrun, rank 0 logs; the other ranks only warn
    quiet = os.environ.get("RANK", "0") not in ("", "0")
    logging.basicConfig(level=logging.DEBUG if ns.verbose else logging.WARNING if quiet else logging.INFO,
                        format="%(message)s")
    if ns.command is None:
        parser.print_help()
        return 0
    cls, run = recipe(ns.command, getattr(ns, "subcommand", None))
    try:
        if getattr(ns, "positional", None):
            _positional(ns, cls)
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # weight-loading bars on every load; tcal shows its own progress
        cfg = from_args(cls, ns)
        if isinstance(getattr(cfg, "seed", None), int):  # every command's --seed: one rule, before any work
            from tcal.utils.flags import check_seed

            check_seed(cfg.seed)
        run(cfg)
    except TcalError as err:
        print(f"tcal: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # a file or disk problem no check foresaw: still one line, never a traceback
        where = f" ({err.filename})" if err.filename else ""
        print(f"tcal: error: {err.strerror or err}{where}; check the paths, their permissions and free disk space",
              file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        hint = " (rerun with --resume to continue from the last checkpoint)" if ns.command in ("distill", "recover") else ""
        print(f"tcal: interrupted{hint}", file=sys.stderr)
        return 130
    finally:
        from tcal.utils.atomic import release_locks

        release_locks()  # the output is another run's to write now
    return 0


if __name__ == "__main__":
    sys.exit(main())
