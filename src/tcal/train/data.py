"""A distillation run's training data: checked before any model loads (no evaluation text in it, an instruct set read
at its own window length) and read as token streams (:mod:`tcal.data.streams`), with the answer mask of an instruct
set and the second stream of ``--mix-data``."""
from __future__ import annotations

from pathlib import Path


def check_training_data(cfg, extra_eval=()) -> None:
    """--data and --mix-data hold no evaluation text: neither --eval's nor the ``extra_eval`` texts the curve's tasks
    read (a pool or an instruct set was checked when it was built)."""
    from tcal.data.corpora import check_disjoint
    from tcal.data.overlap import check_no_eval_text

    check_instruct_data(cfg)
    for spec in (cfg.data, cfg.mix_data) if cfg.mix_data.strip() else (cfg.data,):
        for evaluated in (cfg.eval, *extra_eval):
            check_disjoint(spec, evaluated)
        check_no_eval_text(spec, [cfg.eval, *extra_eval], role="training data")


def check_instruct_data(cfg) -> None:
    """An instruct set is read at its own window length, as --data only (before any model loads)."""
    import json

    from tcal.data.instruct import MANIFEST, is_instruct_set
    from tcal.utils.errors import TcalError

    if cfg.mix_data.strip() and is_instruct_set(cfg.mix_data):
        raise TcalError(f"--mix-data {cfg.mix_data} is an instruct set (tcal instruct); --mix-data takes raw text to "
                        "mix beside one (a token pool, a .npy file or a corpus): give the instruct set as --data")
    if is_instruct_set(cfg.data):
        seq_len = json.loads((Path(cfg.data).expanduser() / MANIFEST).read_text()).get("seq_len")
        if seq_len != cfg.seq_len:
            raise TcalError(f"--data {cfg.data} is an instruct set of {seq_len}-token windows: use --seq-len {seq_len}")


def training_streams(cfg, tokenizer):
    """(tokens, answer mask or None, --mix-data's tokens or None, what was read) of a run's training data; an
    instruct set (tcal instruct) must be read at its own window length."""
    from tcal.data.streams import load_token_stream, load_training_data
    from tcal.utils.errors import TcalError

    tokens, mask, info = load_training_data(cfg.data, tokenizer)
    if mask is not None and cfg.seq_len != info["seq_len"]:
        raise TcalError(f"--data {cfg.data} is an instruct set of {info['seq_len']}-token windows: "
                        f"use --seq-len {info['seq_len']}")
    if mask is not None and cfg.recall_frac > 0 and not cfg.mix_data.strip():
        raise TcalError("--recall-frac copies spans into raw text and --data is an instruct set, whose windows are "
                        "whole answers: give the raw text as --mix-data, or drop --recall-frac")
    mix = None
    if cfg.mix_data.strip():
        mix, mix_info = load_token_stream(cfg.mix_data, tokenizer)
        info = {**info, "mix": {**mix_info, "frac": cfg.mix_frac}}
    return tokens, mask, mix, info
