"""The one Taylor-Calibrate chain: statistics and Phase 1 on the training rows only, Phase 2 trained on
them, the held-out rows only picking Phase 2's best state; and the inits that run it."""
import json

import pytest
import torch
from helpers import gdn_state, tiny_teacher

from tcal.conversion.convert import convert_with_record
from tcal.conversion.surgery import build_hybrid
from tcal.taylor.capture import capture_teacher_io
from tcal.taylor.phase2 import AlignConfig
from tcal.taylor.pipeline import Calibration, calibrate, prepare, split_calibration
from tcal.taylor.statistics import collect_stats
from tcal.utils.errors import TcalError

CFG = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=3, max_position_embeddings=128)


def calib_ids(n=4, t=12, seed=0):
    return torch.randint(0, CFG["vocab_size"], (n, t), generator=torch.Generator().manual_seed(seed))


def test_split_calibration():
    with pytest.raises(TcalError, match="held-out"):
        split_calibration(1, 0.25)
    assert split_calibration(4, 0.25) == (slice(0, 3), slice(3, 4))
    assert split_calibration(5, 0.4) == (slice(0, 3), slice(3, 5))
    assert split_calibration(1, 0.0) == (slice(0, 1), slice(0, 0))


def test_prepare_captures_all_rows_and_takes_statistics_on_the_training_rows():
    teacher = tiny_teacher("llama", **CFG)
    ids = calib_ids()
    cal = prepare(teacher, ids, [0, 2], heldout_frac=0.25)
    assert isinstance(cal, Calibration) and (cal.train_rows, cal.heldout_rows) == (slice(0, 3), slice(3, 4))
    assert sorted(cal.captured) == [0, 2] and cal.captured[0].num_sequences == 4 and cal.captured[0].ctx is not None
    ref = capture_teacher_io(teacher, ids, [0, 2])
    for i in (0, 2):
        torch.testing.assert_close(cal.captured[i].x, ref[i].x)
        assert cal.train()[i].num_sequences == 3 and cal.heldout()[i].num_sequences == 1
        torch.testing.assert_close(cal.heldout()[i].out, ref[i].out[3:])
    train_only = collect_stats(teacher, ids[:3], [0, 2], progress=False)
    assert cal.stats[0] == train_only[0] and cal.stats[2] == train_only[2]
    assert cal.stats[0] != collect_stats(teacher, ids, [0], progress=False)[0]  # the held-out row is left out
    assert cal.record() == {"sequences": 4, "tokens_per_sequence": 12, "train_sequences": 3, "heldout_sequences": 1}
    bare = prepare(teacher, ids[0], [1], statistics=False, heldout_frac=0.0)  # one sequence as a 1-D tensor
    assert bare.stats is None and bare.captured[1].ctx is None and bare.ids.shape == (1, 12)
    with pytest.raises(TcalError, match="calibration tokens"):
        prepare(teacher, None, [1])


def test_heldout_rows_reach_neither_statistics_nor_phase1_nor_phase2_training():
    teacher = tiny_teacher("qwen2", **CFG)
    a_ids = calib_ids()
    b_ids = a_ids.clone()
    b_ids[3] = calib_ids(1, 12, seed=99)[0]  # only the held-out row differs
    runs = []
    for ids in (a_ids, b_ids):
        hybrid = build_hybrid(teacher, [1])
        rec = calibrate(hybrid, teacher, ids, phase1="exact")
        runs.append((gdn_state(hybrid), rec))
    (sa, ra), (sb, rb) = runs
    assert all(torch.equal(sa[k], sb[k]) for k in sa)  # Phase 1 did not see row 3
    assert ra["statistics"] == rb["statistics"]
    no_time = lambda r: {k: v for k, v in r.items() if k != "wall_s"}  # noqa: E731
    assert all(no_time(ra["phase1"][i]) == no_time(rb["phase1"][i]) for i in (0, 2))
    align = AlignConfig(steps=5, lr_qkv=3e-3, lr_gate=3e-2)
    recs = []
    for ids in (a_ids, b_ids):
        recs.append(calibrate(build_hybrid(teacher, [1]), teacher, ids, phase1="exact-silent", phase2=True,
                              align=align)["phase2"])
    for i in (0, 2):  # the same training: identical losses; only the held-out curve may differ
        assert recs[0][i]["train_loss"] == recs[1][i]["train_loss"]
        assert recs[0][i]["train_tokens"] == 3 * 12 and recs[0][i]["heldout_tokens"] == 12
        assert recs[0][i]["heldout_curve"] != recs[1][i]["heldout_curve"]


def test_a_prepared_calibration_is_shared_and_gives_the_same_result():
    teacher = tiny_teacher("llama", **CFG)
    ids = calib_ids()
    align = AlignConfig(steps=3)
    direct = build_hybrid(teacher, [1])
    rec = calibrate(direct, teacher, ids, phase1="exact", phase2=True, align=align)
    cal = prepare(teacher, ids, [0, 2], heldout_frac=align.heldout_frac)
    shared = build_hybrid(teacher, [1])
    rec2 = calibrate(shared, teacher, cal, phase1="exact", phase2=True, align=align)
    sa, sb = gdn_state(direct), gdn_state(shared)
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert rec2["calibration"] == rec["calibration"] and set(rec2) == {"calibration", "statistics", "phase1", "phase2"}


def test_calibrate_refuses_inconsistent_requests():
    teacher = tiny_teacher("llama", **CFG)
    ids = calib_ids()
    hybrid = build_hybrid(teacher, [1])
    with pytest.raises(TcalError, match="unknown Phase 1 variant 'magic'"):
        calibrate(hybrid, teacher, ids, phase1="magic")
    with pytest.raises(TcalError, match=r"Phase 1 options \(zero_wa\) given, but this init runs no Phase 1"):
        calibrate(hybrid, teacher, ids, phase2=True, zero_wa=True)
    cal = prepare(teacher, ids, [0], heldout_frac=0.25)
    with pytest.raises(TcalError, match="no teacher activations for GDN layer 2"):
        calibrate(hybrid, teacher, cal, phase1="exact")
    cal = prepare(teacher, ids, [0, 2], heldout_frac=0.5)
    with pytest.raises(TcalError, match="another held-out fraction"):
        calibrate(hybrid, teacher, cal, phase2=True)
    cal = prepare(teacher, ids, [0, 2], statistics=False)
    with pytest.raises(TcalError, match="Phase 1 needs teacher statistics"):
        calibrate(hybrid, teacher, cal, phase1="exact")


def test_calibrated_inits_run_their_stages_and_records_are_json():
    teacher = tiny_teacher("llama", **CFG)
    ids = calib_ids()
    with pytest.raises(TcalError, match="calib_ids"):
        convert_with_record(teacher, [1], "taylor")  # neither tokens nor a tokenizer
    rec = convert_with_record(teacher, [1], "taylor-exact", calib_ids=ids, align=AlignConfig(steps=3)).record
    detail = rec["detail"]
    assert set(detail) == {"calibration", "statistics", "phase1", "phase2"}
    assert detail["phase1"][0]["variant"] == "exact" and detail["phase2"][2]["steps_run"] == 3
    json.dumps(rec, allow_nan=False)  # the record goes into reports as JSON
    assert rec["calibration"] == {"data": "calib_ids", "sequences": 4, "tokens_per_sequence": 12}
    detail = convert_with_record(teacher, [1], "phase2", calib_ids=ids,
                                 align=AlignConfig(steps=2, heldout_frac=0.0)).record["detail"]
    assert set(detail) == {"calibration", "phase2"} and detail["phase2"][0]["heldout_tokens"] == 0
    json.dumps(detail, allow_nan=False)
    detail = convert_with_record(teacher, [1], "phase1", calib_ids=ids, zero_wa=True).record["detail"]
    assert set(detail) == {"calibration", "statistics", "phase1"}
    assert detail["phase1"][0]["variant"] == "reference" and detail["phase1"][0]["options"]["zero_wa"] is True
    rec = calibrate(build_hybrid(teacher, [1]), teacher, ids, phase1="exact", zero_wa=False)
    assert rec["phase1"][0]["options"]["zero_wa"] is False
    silent = convert_with_record(teacher, [1], "taylor-exact-silent", calib_ids=ids, align=AlignConfig(steps=1))
    assert silent.record["detail"]["phase1"][2]["variant"] == "exact-silent"


def test_gradient_stages_run_compiled_when_asked_and_by_device_otherwise(monkeypatch):
    # Phase 2 and the KL stage reach the compiled chunked path through compile_training; CPU's default is eager.
    import tcal.ops.dispatch as dispatch
    from tcal.taylor.kl_stage import KLConfig

    calls = []

    def counting():
        def run(*args, **kw):
            calls.append(args[0].shape)
            return dispatch.chunk_gated_delta_rule_torch(*args, **kw)
        return run

    monkeypatch.delenv("TCAL_GDN_COMPILE", raising=False)
    monkeypatch.setattr(dispatch, "_COMPILE", dict(dispatch.COMPILE_DEFAULTS))
    monkeypatch.setattr(dispatch, "_compiled_chunk", counting)
    teacher = tiny_teacher("llama", **CFG)
    ids = calib_ids(n=6)
    kl = KLConfig(steps=2, batch_size=2, eval_every=1)
    align = AlignConfig(steps=2)
    records = []
    for compile in (None, True):
        hybrid = build_hybrid(teacher, [0])
        before = len(calls)
        records.append(calibrate(hybrid, teacher, ids, phase2=True, align=align, kl=kl, compile=compile))
        records[-1]["compiled_calls"] = len(calls) - before
    assert records[0]["compiled_calls"] == 0  # CPU: eager
    assert records[1]["compiled_calls"] >= 2 * 2 * 2  # 2 GDN layers x (2 Phase-2 + 2 KL steps)
    assert not dispatch._COMPILE["on"]  # the setting is put back
    assert dispatch.compile_by_default("cpu") is False


def test_calibration_compiles_by_default_only_short_windows(monkeypatch):
    import tcal.ops as ops
    from tcal.taylor import pipeline

    monkeypatch.setattr(ops, "compile_by_default", lambda device: True)  # a GPU where fla cannot train
    assert pipeline.compile_calibration("cuda", 512)
    assert pipeline.compile_calibration("cuda", pipeline.COMPILE_MAX_WINDOW)
    assert not pipeline.compile_calibration("cuda", 4096)
    monkeypatch.setattr(ops, "compile_by_default", lambda device: False)
    assert not pipeline.compile_calibration("cpu", 512)
