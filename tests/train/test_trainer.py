"""The distillation trainer on a tiny random Llama teacher (CPU, no downloads): token accounting,
checkpoints, and resume = uninterrupted, bit for bit."""
import dataclasses
import json
import math

import pytest
import torch
from helpers import distill_data

from tcal.train.checkpoint import checkpoint_dir, has_checkpoint, load_model, partial_dir
from tcal.train.curve import CURVE_FIELDS, curve_csv, read_curve
from tcal.train.options import TrainOptions, changed_settings, check_train_options
from tcal.train.trainer import Trainer, distill
from tcal.utils.errors import TcalError

SEQ, BATCH = 16, 4
TPS = SEQ * BATCH


pytestmark = pytest.mark.usefixtures("tmp_cache")


def options(**over):
    kw = dict(eval="eval.npy", eval_window=32, eval_windows=2, seq_len=SEQ, batch_size=BATCH, lr=3e-3,
              eval_every=4 * TPS, eval_early=0, save_every=8 * TPS, kl_chunk=24, progress=False, device="cpu")
    kw.update(over)
    return TrainOptions(**kw)


def curve_without_time(rows):
    """Rows without the wall-clock column; NaN (no training loss yet at step 0) as None so rows compare."""
    return [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items() if k != "elapsed_s"}
            for r in rows]


def run(assets, partial, cfg, tokens=24 * TPS, student="fresh", **kw):
    train, eval_ids = distill_data(assets)
    if student == "fresh":
        student = load_model(assets / "hybrid")
    return distill(student, load_model(assets / "teacher"), cfg, tokens=tokens, train_tokens=train,
                   eval_ids=eval_ids, partial=partial, **kw)


# ---------------------------------------------------------------------------------------------
# token accounting
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("micro", [0, 2])
def test_token_accounting_counts_every_trained_token(assets, tmp_path, micro):
    student = load_model(assets / "hybrid")
    teacher = load_model(assets / "teacher")
    seen = {"student": 0, "teacher": 0}

    def counter(name):
        def hook(module, args, kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            if student.training:  # evaluation forwards do not count
                seen[name] += ids.numel()
        return hook

    student.model.register_forward_pre_hook(counter("student"), with_kwargs=True)
    teacher.model.register_forward_pre_hook(counter("teacher"), with_kwargs=True)
    budget = 10 * TPS + 5  # not a whole number of steps: rounded up to 11 steps
    train, eval_ids = distill_data(assets)
    partial = tmp_path / "acc.partial"
    rep, trained = distill(student, teacher, options(micro_batch=micro, eval_every=3 * TPS), tokens=budget,
                           train_tokens=train, eval_ids=eval_ids, partial=partial)
    assert trained is student and not trained.training
    assert rep["status"] == "done"
    assert rep["steps"] == 11 and rep["tokens"] == 11 * TPS == seen["student"] == seen["teacher"]
    assert rep["tokens"] >= budget
    rows = read_curve(partial / "curve.csv")  # the trainer writes its curve into the partial directory
    assert [r["tokens"] for r in rows] == [r["step"] * TPS for r in rows]
    assert [r["step"] for r in rows] == [0, 3, 6, 9, 11]
    assert list(rows[0]) == list(CURVE_FIELDS)
    assert curve_without_time(rows) == curve_without_time(rep["curve"])
    assert not (tmp_path / "acc").exists()  # the final output directory is the recipe's business


# ---------------------------------------------------------------------------------------------
# resume = uninterrupted, bit for bit
# ---------------------------------------------------------------------------------------------


class Killed(Exception):
    pass


def test_resume_after_kill_gives_the_same_curve_and_weights(assets, tmp_path):
    straight, a = run(assets, tmp_path / "straight.partial", options())

    killed = tmp_path / "killed.partial"

    def kill(step, tokens):
        if step == 13:  # after the checkpoint at step 8 and the evaluations at 4, 8, 12
            raise Killed

    with pytest.raises(Killed):
        run(assets, killed, options(), callback=kill)
    ckpt = checkpoint_dir(killed)
    assert ckpt == killed / "checkpoint" and (ckpt / "model.safetensors").is_file()
    state = json.loads((ckpt / "resume" / "state.json").read_text())
    assert state["step"] == 8 and state["tokens"] == 8 * TPS
    assert state["scheduler"]["next_step"] == 8 and state["scheduler"]["total_steps"] == 24
    with pytest.raises(TcalError, match=r"settings changed \(lr\)"):
        run(assets, killed, options(lr=1e-3), student=None)
    rep, b = run(assets, killed, options(), student=None)  # the student comes from the checkpoint
    assert rep["segments"] == 2 and rep["status"] == "done"
    assert curve_without_time(rep["curve"]) == curve_without_time(straight["curve"])
    assert curve_without_time(read_curve(killed / "curve.csv")) == curve_without_time(straight["curve"])
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_pause_and_resume_gives_the_same_curve(assets, tmp_path):
    cfg = dict(schedule="cosine", micro_batch=2)
    straight, a = run(assets, tmp_path / "straight.partial", options(**cfg))
    paused = tmp_path / "paused.partial"
    rep, _ = run(assets, paused, options(**cfg, stop_after_tokens=10 * TPS))
    assert rep["status"] == "paused" and rep["tokens"] == 10 * TPS and checkpoint_dir(paused) is not None
    # the pause limit is free to change between sessions
    rep, b = run(assets, paused, options(**cfg), student=None)
    assert rep["status"] == "done" and rep["tokens"] == 24 * TPS
    assert curve_without_time(rep["curve"]) == curve_without_time(straight["curve"])
    sa, sb = a.state_dict(), b.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_trainer_state_dict_round_trip_and_step(assets):
    train, eval_ids = distill_data(assets)
    t = Trainer(load_model(assets / "hybrid"), load_model(assets / "teacher"), options(), tokens=3 * TPS,
                train_tokens=train, eval_ids=eval_ids)
    assert t.total_steps == 3 and t.tokens_per_step == TPS
    assert all(n.startswith(("model.layers.1.self_attn.", "model.layers.3.self_attn.")) for n, _ in t.params)
    loss = t.step()
    assert math.isfinite(loss) and t.step_count == 1
    t.add_eval_point()
    st = t.state_dict()
    assert st["step"] == 1 and st["tokens"] == TPS and len(st["curve"]) == 1 and st["loss_count"] == 0
    json.dumps(st)
    t2 = Trainer(load_model(assets / "hybrid"), load_model(assets / "teacher"), options(), tokens=3 * TPS,
                 train_tokens=train, eval_ids=eval_ids)
    t2.load_state_dict(st)
    assert (t2.step_count, t2.curve, t2.segments) == (1, st["curve"], st["segments"] + 1)
    assert math.isfinite(t.evaluate()) and t.report("done")["steps"] == 1


def test_trainer_steps_on_the_recall_mix(assets):
    """The trainer's batch is the sampler's batch with the recall mix, so a run with it trains on other tokens."""
    train, eval_ids = distill_data(assets)
    batches = {}
    for frac in (0.0, 1.0):
        t = Trainer(load_model(assets / "hybrid"), load_model(assets / "teacher"),
                    options(recall_frac=frac, recall_span=4), tokens=3 * TPS, train_tokens=train, eval_ids=eval_ids)
        seen = []
        forward = t.hidden_t
        t.hidden_t = lambda ids: (seen.append(ids.clone()), forward(ids))[1]
        t.step()
        batches[frac] = torch.cat(seen)
    plain, mixed = batches[0.0], batches[1.0]
    assert torch.equal(plain[:, :-4], mixed[:, :-4]) and not torch.equal(plain[:, -4:], mixed[:, -4:])
    assert all(any(torch.equal(m[-4:], m[i:i + 4]) for i in range(SEQ - 8 + 1)) for m in mixed)


def test_trainer_windows_start_with_the_prefix(assets):
    """A tokenizer that puts a BOS before every text (Gemma) has it start every training window too."""
    train, eval_ids = distill_data(assets)
    t = Trainer(load_model(assets / "hybrid"), load_model(assets / "teacher"), options(), tokens=3 * TPS,
                train_tokens=train, eval_ids=eval_ids, prefix=(5,))
    seen = []
    forward = t.hidden_t
    t.hidden_t = lambda ids: (seen.append(ids.clone()), forward(ids))[1]
    t.step()
    ids = torch.cat(seen)
    assert ids.shape[1] == SEQ and bool((ids[:, 0] == 5).all()) and t.n_windows == len(train) // (SEQ - 1)
    with pytest.raises(TcalError, match="leaves no room"):
        Trainer(load_model(assets / "hybrid"), load_model(assets / "teacher"), options(), tokens=3 * TPS,
                train_tokens=train, eval_ids=eval_ids, prefix=tuple(range(SEQ)))


def test_no_student_and_no_checkpoint_is_an_error(assets, tmp_path):
    with pytest.raises(TcalError, match="no student model given"):
        run(assets, tmp_path / "x.partial", options(), student=None)


# ---------------------------------------------------------------------------------------------
# settings, checkpoints and the curve file
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("over, tokens, message", [
    ({}, 0, "--tokens must be positive"),
    ({"seq_len": 1}, 10, "--seq-len must be at least 2"),
    ({"micro_batch": 3}, 10, "--micro-batch 3 must divide --batch-size 4"),
    ({"ce_weight": 1.5}, 10, "--ce-weight must be in"),
    ({"lr": float("nan")}, 10, "--lr must be a finite number"),
    ({"lr": 0.0}, 10, "--lr must be positive"),
    ({"schedule": "linear"}, 10, "unknown --schedule"),
    ({"train": "some"}, 10, "unknown --train"),
    ({"precision": "fp8"}, 10, "unknown --precision"),
    ({"recall_frac": 1.5}, 10, "--recall-frac must be in"),
    ({"recall_frac": 0.5, "recall_span": 9}, 10, "--recall-span must be between 1 and half of --seq-len"),
    ({"recall_frac": 0.5, "recall_span": 0}, 10, "--recall-span must be between 1"),
    ({"eval_early": -1}, 10, "--eval-early must be >= 0"),
])
def test_check_train_options(over, tokens, message):
    with pytest.raises(TcalError, match=message):
        check_train_options(options(**over), tokens)


def test_changed_settings_ignores_the_free_ones():
    saved = dataclasses.asdict(options())
    assert changed_settings(saved, dataclasses.asdict(options(progress=True, stop_after_tokens=5, device="cuda"))) == []
    assert changed_settings(saved, dataclasses.asdict(options(lr=1.0, seed=3))) == ["lr", "seed"]
    assert changed_settings({"a": 1}, {"a": 1, "b": 2}) == ["b"]


def test_checkpoint_dirs(tmp_path):
    out = tmp_path / "run"
    assert partial_dir(out) == tmp_path / "run.partial" and not has_checkpoint(out)
    old = partial_dir(out) / ".checkpoint.old-123" / "resume"
    old.mkdir(parents=True)
    assert not has_checkpoint(out)
    (old / "state.json").write_text("{}")  # killed between atomic_dir's two renames: the old one counts
    assert has_checkpoint(out) and checkpoint_dir(partial_dir(out)) == old.parent


def test_curve_csv_round_trip(tmp_path):
    rows = [{"tokens": 0, "step": 0, "eval_ppl": 90.5, "train_loss": float("nan"), "lr": 0.1, "elapsed_s": 0.0},
            {"tokens": 64, "step": 1, "eval_ppl": 80.25, "train_loss": 4.5, "lr": 0.2, "elapsed_s": 1.5}]
    (tmp_path / "c.csv").write_text(curve_csv(rows))
    back = read_curve(tmp_path / "c.csv")
    assert curve_without_time(back) == curve_without_time(rows) and back[1]["elapsed_s"] == 1.5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_distill_on_cuda_bf16_trains_and_resumes(assets, tmp_path):
    # The GPU path: bf16 autocast, GDN through fla or (where fla's backward is refused) chunked PyTorch.
    partial = tmp_path / "gpu.partial"
    cfg = dict(eval_every=8 * TPS, schedule="constant", device="cuda")
    rep, _ = run(assets, partial, options(**cfg, stop_after_tokens=16 * TPS), tokens=32 * TPS)
    assert rep["status"] == "paused"
    rep, _ = run(assets, partial, options(**cfg), tokens=32 * TPS, student=None)
    rows = read_curve(partial / "curve.csv")
    assert rep["status"] == "done" and rep["precision"] == "bf16 autocast" and rep["segments"] == 2
    assert [r["step"] for r in rows] == [0, 8, 16, 24, 32]
    assert rows[-1]["train_loss"] < 0.8 * rows[1]["train_loss"]
    assert rep["peak_memory"]["kind"].startswith("cuda") and rep["peak_memory"]["bytes"] > 0


def test_every_curve_point_says_where_its_time_went(assets, tmp_path):
    """Each curve point's seconds per probe (a probe's own parts too), its PPL, the best-model and checkpoint writes
    after it, and the training since the point before; each session's first step apart from the steady steps."""
    from tcal.report.distill_report import timing_table
    from tcal.train.curve import timing_csv

    def probe(model):
        probe.last_seconds = {"generate": 0.5, "score": 0.25}
        return 1.0

    killed = tmp_path / "t.partial"

    def kill(step, tokens):
        if step == 10:  # after the checkpoint at step 8
            raise Killed

    with pytest.raises(Killed):
        run(assets, killed, options(), callback=kill, probes={"fake": probe}, best_by="fake")
    rep, _ = run(assets, killed, options(), student=None, probes={"fake": probe}, best_by="fake")
    timing = rep["timing"]
    assert [t["tokens"] for t in timing] == [r["tokens"] for r in rep["curve"]] == [0, 4 * TPS, 8 * TPS, 12 * TPS,
                                                                                     16 * TPS, 20 * TPS, 24 * TPS]
    assert all({"ppl", "fake", "fake_generate", "fake_score", "point", "train"} <= set(t) for t in timing)
    assert timing[0]["fake_generate"] == 0.5 and timing[0]["train"] == 0 and timing[0]["train_tokens_per_s"] is None
    assert timing[0]["best_write"] > 0  # the first point is the best so far: its weights were written
    # the save at step 16 (that of step 8 is in the checkpoint it wrote, which holds the rows before its own write)
    assert "checkpoint_write" in timing[4] and "checkpoint_write" not in timing[3]
    assert all(t["point"] >= t["ppl"] + t["fake"] for t in timing)
    assert timing[1]["train_tokens_per_s"] > 0
    speed = rep["train_speed"]
    assert len(speed["first_step_s"]) == 2  # one per session: the killed one and the resumed one
    assert speed["steady_steps"] == 24 - 2 and speed["steady_tokens_per_s"] > 0
    assert {"ppl", "fake", "fake_generate"} <= set(rep["teacher_seconds"])
    csv_text = (killed / "timing.csv").read_text()
    assert csv_text == timing_csv(timing) and csv_text.startswith("tokens,step,point,ppl,")
    md = "\n".join(timing_table(rep))
    assert "Training: first step of each session (compiling)" in md and "| tokens | " in md
