"""`tcal recover` (tcal.recipes.recover): per init convert + distil, tokens-to-target table, resume."""
import argparse
import json

import pytest
import torch

from tcal.recipes.recover import RecoverConfig, jsonable, replot, run
from tcal.train.checkpoint import partial_dir
from tcal.train.curve import read_curve
from tcal.utils.command_config import add_dataclass_args, from_args
from tcal.utils.errors import TcalError

SEQ, BATCH = 16, 4
TPS = SEQ * BATCH


pytestmark = pytest.mark.usefixtures("tmp_cache")


def test_recover_end_to_end(assets, tmp_path):
    out = tmp_path / "rec"
    cfg = RecoverConfig(teacher=str(assets / "teacher"), keep="0,2", inits="copy,taylor", tokens=8 * TPS,
                        data=str(assets / "train.npy"), out=str(out), calib=str(assets / "train.npy"),
                        calib_window=16, calib_windows=4, align_steps=3, eval=str(assets / "eval.npy"),
                        eval_window=32, eval_windows=2, seq_len=SEQ, batch_size=BATCH, lr=3e-3, eval_every=4 * TPS,
                        eval_early=1, kl_chunk=32, progress=False, stop_after_tokens=4 * TPS)
    rep = run(cfg)  # pauses in the first run
    assert rep["status"] == "paused" and not out.exists()
    cfg.stop_after_tokens, cfg.resume = 0, True
    summary = run(cfg)
    assert summary["status"] == "done"
    for f in ("recovery.png", "recovery.md", "recovery.json", "report.md", "tcal_config.json",
              "copy/curve.csv", "taylor/curve.csv", "taylor/model.safetensors"):
        assert (out / f).exists(), f
    assert not partial_dir(out).exists()
    copy_c, taylor_c = read_curve(out / "copy" / "curve.csv"), read_curve(out / "taylor" / "curve.csv")
    assert [r["tokens"] for r in copy_c] == [r["tokens"] for r in taylor_c] == [0, 2 * TPS, 4 * TPS, 8 * TPS]
    assert copy_c[0]["eval_ppl"] != taylor_c[0]["eval_ppl"]  # the inits differ
    table = json.loads((out / "recovery.json").read_text())["table"]
    assert [t["name"] for t in table["targets"]][-1] == "copy final PPL"
    assert "taylor" in table["targets"][0]["ratio"]
    runs = json.loads((out / "recovery.json").read_text())["runs"]
    assert runs["copy"]["calib"] is None  # the resolved calibration settings of each init, not the preset's name
    assert runs["taylor"]["calib"]["align"]["steps"] == 3 and runs["taylor"]["calib"]["kl"]["steps"] == 40
    (out / "recovery.png").unlink()  # the results on disk are enough to redraw the plot
    assert replot(out) == str(out / "recovery.png") and (out / "recovery.png").stat().st_size > 0
    with pytest.raises(TcalError, match="recovery.json not found"):
        replot(tmp_path)


def test_recover_resume_reuses_the_saved_conversion(assets, tmp_path, monkeypatch):
    import tcal.conversion.convert
    import tcal.train.trainer

    def cfg_for(out, keep_init=False):
        return RecoverConfig(teacher=str(assets / "teacher"), keep="0,2", inits="taylor", tokens=2 * TPS,
                             data=str(assets / "train.npy"), out=str(out), calib=str(assets / "train.npy"),
                             calib_window=16, calib_windows=4, align_steps=3, eval=str(assets / "eval.npy"),
                             eval_window=32, eval_windows=2, seq_len=SEQ, batch_size=BATCH, eval_every=TPS,
                             kl_chunk=32, progress=False, keep_init=keep_init)

    whole = run(cfg_for(tmp_path / "whole"))
    out = tmp_path / "killed"

    def killed(*args, **kwargs):
        raise RuntimeError("killed before the first checkpoint")

    real_distill = tcal.train.trainer.distill  # recover.run imports it when it starts
    monkeypatch.setattr(tcal.train.trainer, "distill", killed)
    with pytest.raises(RuntimeError, match="killed"):
        run(cfg_for(out, keep_init=True))
    assert (partial_dir(out) / "taylor.converted" / "model.safetensors").is_file()
    monkeypatch.setattr(tcal.train.trainer, "distill", real_distill)
    monkeypatch.setattr(tcal.conversion.convert, "convert_with_record",
                        lambda *a, **k: pytest.fail("calibrated again on resume"))
    cfg = cfg_for(out, keep_init=True)
    cfg.resume = True
    resumed = run(cfg)
    assert resumed["status"] == "done" and not (out / "taylor.converted").exists()
    # --keep-init: the weights before training stay, loadable, and differ from the trained ones
    from tcal.train.checkpoint import load_model

    init, trained = load_model(out / "taylor-init"), load_model(out / "taylor")
    diffs = [float((a - b).abs().max()) for (n, a), (_, b) in zip(init.state_dict().items(), trained.state_dict().items())
             if ".self_attn." in n]
    assert max(diffs) > 0 and not (tmp_path / "whole" / "taylor-init").exists()
    for key in ("zero_shot_ppl", "final_ppl"):  # the saved conversion is the same model, trained the same way
        assert resumed["runs"]["taylor"][key] == pytest.approx(whole["runs"]["taylor"][key], rel=1e-5)


def test_recover_config_maps_to_cli_flags_and_checks_arguments(tmp_path):
    p = argparse.ArgumentParser()
    add_dataclass_args(p, RecoverConfig)
    cfg = from_args(RecoverConfig, p.parse_args(["--inits", "copy,taylor", "--keep", "0,4"]))
    assert cfg.schedule == "constant" and cfg.inits == "copy,taylor" and cfg.calib == "auto"
    assert (cfg.calib_window, cfg.calib_windows, cfg.eval_every) == (512, 32, 500_000)
    for over, message in (({"keep": "uniform:2"}, "takes the kept layers as a list like 0,4,8"),
                          ({"inits": "copy,copy"}, "lists an init twice"),
                          ({"calib": "wiki:eval"}, "overlaps|contains the evaluation"),
                          ({"calib": "shakespeare:calib+wiki:eval"}, "overlaps|contains the evaluation")):
        kw = dict(data="shakespeare:calib", out=str(tmp_path / "r"), progress=False, **over)
        with pytest.raises(TcalError, match=message):
            run(RecoverConfig(**kw))
    assert not partial_dir(tmp_path / "r").exists()


def test_jsonable():
    out = jsonable({1: (torch.ones(2), float("nan")), "big": torch.zeros(100), "x": object, "n": None})
    assert out["1"] == [[1.0, 1.0], "nan"] and out["big"] == "tensor(100,)" and out["n"] is None
    json.dumps(out, allow_nan=False)


def test_the_teachers_probe_scores_are_computed_once_for_every_init_and_resume(assets, tmp_path, monkeypatch):
    """Before: every init (and every call after a pause) scored the teacher again on every curve probe, which on a
    GPU cost as much as a curve point; now teacher_scores.json holds them for the whole experiment."""
    import tcal.train.probes

    calls = {"teacher": 0, "student": 0}

    def probe(model):
        calls["student" if hasattr(model, "gdn_modules") else "teacher"] += 1
        return 0.5

    monkeypatch.setattr(tcal.train.probes, "curve_probes", lambda tasks, tok, teacher: {"fake": probe})
    out = tmp_path / "rec"
    cfg = RecoverConfig(teacher=str(assets / "teacher"), keep="0,2", inits="copy,taylor",
                        tokens=4 * TPS, data=str(assets / "train.npy"), out=str(out), calib=str(assets / "train.npy"),
                        calib_window=16, calib_windows=4, align_steps=2, kl_steps=0, eval=str(assets / "eval.npy"),
                        eval_window=32, eval_windows=2, seq_len=SEQ, batch_size=BATCH, lr=3e-3, eval_every=2 * TPS,
                        eval_early=0, kl_chunk=32, progress=False, stop_after_tokens=2 * TPS, save_every=2 * TPS)
    assert run(cfg)["status"] == "paused"
    assert calls["teacher"] == 1 and (partial_dir(out) / "teacher_scores.json").is_file()
    cfg.stop_after_tokens, cfg.resume = 0, True
    summary = run(cfg)
    assert summary["status"] == "done" and calls["teacher"] == 1  # the resumed call and the second init read it back
    assert calls["student"] == 2 * 3  # 0, 2 and 4 x TPS of each init
    for init in ("copy", "taylor"):
        r = summary["runs"][init]
        assert r["teacher_probes"] == {"fake": 0.5}
        assert [t["tokens"] for t in r["timing"]] == [0, 2 * TPS, 4 * TPS] and "fake" in r["timing"][0]
        assert r["train_speed"]["steady_tokens_per_s"] > 0
    assert summary["runs"]["taylor"]["teacher_seconds"].get("read_back")
    report = (out / "report.md").read_text()
    assert "first step s | steady tokens/s" in report and "## Where taylor's time went" in report
    assert (out / "copy" / "timing.csv").is_file() and not (out / "teacher_scores.json").exists()
