"""`tcal distill` (tcal.recipes.distill) end to end on a tiny random Llama teacher (CPU, no downloads)."""
import argparse
import json
import math

import pytest
import torch
from safetensors.torch import load_file

from tcal.recipes.distill import DistillConfig, run
from tcal.train.checkpoint import load_model, partial_dir, start_partial
from tcal.train.curve import read_curve
from tcal.utils.command_config import add_dataclass_args, from_args
from tcal.utils.errors import TcalError

VOCAB = 97
SEQ, BATCH = 16, 4
TPS = SEQ * BATCH


pytestmark = pytest.mark.usefixtures("tmp_cache")


def make_cfg(assets, out, **over):
    kw = dict(hybrid=str(assets / "hybrid"), teacher=str(assets / "teacher"), data=str(assets / "train.npy"),
              eval=str(assets / "eval.npy"), eval_window=32, eval_windows=2, tokens=24 * TPS, seq_len=SEQ,
              batch_size=BATCH, lr=3e-3, eval_every=4 * TPS, eval_early=0, save_every=8 * TPS, kl_chunk=24,
              out=str(out), progress=False)
    kw.update(over)
    return DistillConfig(**kw)


def curve_without_time(path):
    """Rows without the wall-clock column; NaN (no training loss yet at step 0) as None so rows compare."""
    return [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items() if k != "elapsed_s"}
            for r in read_curve(path)]


def weights(path):
    return load_file(str(path / "model.safetensors"))


def test_loss_decreases_and_outputs(assets, tmp_path):
    out = tmp_path / "run"
    rep = run(make_cfg(assets, out, tokens=32 * TPS, eval_every=8 * TPS, schedule="constant"))
    rows = read_curve(out / "curve.csv")
    assert [r["step"] for r in rows] == [0, 8, 16, 24, 32]
    losses = [r["train_loss"] for r in rows[1:]]
    assert math.isnan(rows[0]["train_loss"])
    assert losses[-1] < 0.8 * losses[0], losses
    assert rep["status"] == "done" and rep["final_ppl"] == rows[-1]["eval_ppl"]
    # final output: safetensors model, curve, plot, reports; no resume state; partial dir gone
    names = {p.name for p in out.iterdir()}
    assert {"model.safetensors", "config.json", "curve.csv", "curve.png", "report.json", "report.md",
            "tcal_config.json"} <= names
    assert not any(p.suffix in (".pt", ".bin", ".pth") for p in out.rglob("*")) and not (out / "resume").exists()
    assert not partial_dir(out).exists()
    cfg = json.loads((out / "tcal_config.json").read_text())
    assert cfg["stage"] == "distill" and cfg["resolved"]["tokens_per_step"] == TPS
    # only the GDN layers trained: kept attention layers and everything else bit-identical
    before, after = weights(assets / "hybrid"), weights(out)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(k.startswith(("model.layers.1.self_attn.", "model.layers.3.self_attn.")) for k in changed)
    reloaded = load_model(out)
    assert type(reloaded).__name__ == "HybridForCausalLM"


class Killed(Exception):
    pass


def test_resume_after_kill_gives_the_same_curve_and_weights(assets, tmp_path):
    straight = tmp_path / "straight"
    run(make_cfg(assets, straight))

    killed = tmp_path / "killed"

    def kill(step, tokens):
        if step == 13:  # after the checkpoint at step 8 and the evaluations at 4, 8, 12
            raise Killed

    with pytest.raises(Killed):
        run(make_cfg(assets, killed), callback=kill)
    assert not killed.exists() and (partial_dir(killed) / "checkpoint" / "resume" / "state.json").is_file()
    state = json.loads((partial_dir(killed) / "checkpoint" / "resume" / "state.json").read_text())
    assert state["step"] == 8 and state["tokens"] == 8 * TPS
    with pytest.raises(TcalError, match="--resume"):
        run(make_cfg(assets, killed))
    with pytest.raises(TcalError, match="settings changed"):
        run(make_cfg(assets, killed, resume=True, lr=1e-3))
    rep = run(make_cfg(assets, killed, resume=True))
    assert rep["segments"] == 2
    assert curve_without_time(killed / "curve.csv") == curve_without_time(straight / "curve.csv")
    a, b = weights(straight), weights(killed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_pause_and_resume_gives_the_same_curve(assets, tmp_path):
    straight = tmp_path / "straight"
    run(make_cfg(assets, straight, schedule="cosine", micro_batch=2))
    paused = tmp_path / "paused"
    rep = run(make_cfg(assets, paused, schedule="cosine", micro_batch=2, stop_after_tokens=10 * TPS))
    assert rep["status"] == "paused" and rep["tokens"] == 10 * TPS and not paused.exists()
    rep = run(make_cfg(assets, paused, schedule="cosine", micro_batch=2, resume=True))
    assert rep["status"] == "done" and rep["tokens"] == 24 * TPS
    assert curve_without_time(paused / "curve.csv") == curve_without_time(straight / "curve.csv")
    a, b = weights(straight), weights(paused)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_resume_of_a_finished_run_is_a_no_op(assets, tmp_path, capsys):
    out = tmp_path / "done"
    rep = run(make_cfg(assets, out, tokens=4 * TPS))
    again = run(make_cfg(assets, out, tokens=4 * TPS, resume=True))
    assert again["final_ppl"] == rep["final_ppl"] and "already finished" in capsys.readouterr().out


def test_start_partial(tmp_path):
    out = tmp_path / "run"
    work = start_partial(out, resume=False)
    assert work.path == partial_dir(out) and not work.path.exists()  # made at its first write
    work.write_text("curve.csv", "step\n")  # what a run stopped before its first checkpoint leaves: marked tcal's
    assert start_partial(out, resume=False).path == partial_dir(out) and not partial_dir(out).exists()
    # a folder of the user's that happens to have the name, even one holding only a curve.csv: refused, never deleted
    for name in ("notes.txt", "curve.csv"):
        partial_dir(out).mkdir()
        (partial_dir(out) / name).write_text("mine")
        with pytest.raises(TcalError, match="tcal did not write it"):
            start_partial(out, resume=False)
        with pytest.raises(TcalError, match="tcal did not write it"):
            start_partial(out, resume=True)
        assert sorted(p.name for p in partial_dir(out).iterdir()) == [name]
        (partial_dir(out) / name).unlink()
        partial_dir(out).rmdir()


def test_an_unmarked_partial_run_holding_a_checkpoint_is_refused_and_the_users_files_survive(tmp_path):
    """A folder without tcal's mark is refused whatever it holds: before, one holding a checkpoint was adopted by
    --resume and the user's files in checkpoint/ and best/ were removed."""
    out = tmp_path / "run"
    ck = partial_dir(out) / "checkpoint" / "resume"
    ck.mkdir(parents=True)
    (ck / "state.json").write_text(json.dumps({"config": {"lr": 1e-3}}))  # a checkpoint names its run's settings
    (partial_dir(out) / "checkpoint" / "model.safetensors").write_text("weights")
    (partial_dir(out) / "best").mkdir()
    (partial_dir(out) / "best" / "notes.txt").write_text("mine")
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    for resume in (False, True):
        with pytest.raises(TcalError, match="tcal did not write it"):
            start_partial(out, resume=resume, settings={"lr": 1e-3})
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before


def test_distill_config_maps_to_cli_flags():
    p = argparse.ArgumentParser()
    add_dataclass_args(p, DistillConfig)
    cfg = from_args(DistillConfig, p.parse_args(["--hybrid", "h", "--tokens", "5", "--no-progress", "--resume",
                                                 "--schedule", "constant", "--train", "all"]))
    assert (cfg.hybrid, cfg.tokens, cfg.progress, cfg.resume, cfg.schedule, cfg.train) == ("h", 5, False, True,
                                                                                            "constant", "all")
    with pytest.raises(TcalError, match="contains the evaluation"):
        run(DistillConfig(data="wiki", eval="wiki:eval", progress=False))


HAY = ("the committee met in the spring and spoke of the harbor and the roads and the budget . " * 60)


def test_eval_passkey_scores_every_curve_point_and_survives_a_pause(assets, tmp_path):
    """--eval-passkey: every curve point (and the teacher, once) is scored on the same passkey prompts; the scores
    land in curve.csv, report.json, report.md and a third panel of curve.png, and a paused run resumes with them."""
    import shutil

    from helpers import word_tokenizer

    hybrid = tmp_path / "hybrid"  # the tokenizer in the hybrid's directory only: a resumed run reads it there too
    shutil.copytree(assets / "hybrid", hybrid)
    word_tokenizer(sorted(set(HAY.split()))).save_pretrained(hybrid)
    (tmp_path / "hay.txt").write_text(HAY)
    over = dict(hybrid=str(hybrid), eval_passkey="256,384", eval_passkey_samples=2,
                eval_passkey_haystack=str(tmp_path / "hay.txt"), tokens=16 * TPS, eval_every=8 * TPS)
    out = tmp_path / "run"
    rep = run(make_cfg(assets, out, stop_after_tokens=8 * TPS, **over))
    assert rep["status"] == "paused"
    rep = run(make_cfg(assets, out, resume=True, **over))
    assert rep["status"] == "done" and set(rep["teacher_probes"]) == {"single@256", "single@384"}
    rows = read_curve(out / "curve.csv")
    assert [r["step"] for r in rows] == [0, 8, 16]
    assert all(0.0 <= r[n] <= 1.0 for r in rows for n in ("single@256", "single@384"))
    md = (out / "report.md").read_text()
    assert "| training tokens | single@256 | single@384 |" in md and "| teacher |" in md
    assert (out / "curve.png").stat().st_size > 1000 and (out / "tokenizer.json").is_file()


def test_eval_passkey_bad_input(assets, tmp_path):
    with pytest.raises(TcalError, match="--eval-passkey must be whole numbers of tokens like 512,1024"):
        run(make_cfg(assets, tmp_path / "a", eval_passkey="1k"))
    with pytest.raises(TcalError, match="at least 16"):
        run(make_cfg(assets, tmp_path / "b", eval_passkey="8"))
    with pytest.raises(TcalError, match="--eval-passkey-samples"):
        run(make_cfg(assets, tmp_path / "c", eval_passkey="64", eval_passkey_samples=0))
    with pytest.raises(TcalError, match="has a tokenizer"):  # the tiny assets ship token files, no tokenizer
        run(make_cfg(assets, tmp_path / "d", eval_passkey="64"))
    for name in "abcd":
        assert not (tmp_path / name).exists() and not partial_dir(tmp_path / name).exists()


def test_a_run_saved_before_a_setting_existed_resumes_with_its_default():
    from tcal.train.options import changed_settings

    assert changed_settings({"lr": 1.0}, {"lr": 1.0, "eval_passkey": "", "eval_passkey_samples": 10}) == []
    assert changed_settings({"lr": 1.0}, {"lr": 1.0, "eval_passkey": "4096"}) == ["eval_passkey"]
