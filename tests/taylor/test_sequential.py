"""Sequential (student-forced) Phase 2, the residual-stream target, lazy per-layer capture and the
early stopping of Phase 2 (its learning-rate schedule: tests/utils/test_schedule.py)."""

import pytest
import torch
from helpers import gdn_state, tiny_teacher

from tcal.conversion.surgery import build_hybrid
from tcal.taylor.capture import capture_layer_input, capture_teacher_io
from tcal.taylor.phase2 import AlignConfig
from tcal.taylor.pipeline import PHASE1_SEQUENCES, calibrate, prepare, student_layer_io
from tcal.utils.errors import TcalError

CFG = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=4, max_position_embeddings=128)


def ids(n=4, t=12, seed=0):
    return torch.randint(0, CFG["vocab_size"], (n, t), generator=torch.Generator().manual_seed(seed))


def test_capture_stops_early_and_keeps_the_residual_stream():
    teacher = tiny_teacher("llama", **CFG)
    x = ids()
    seen = []
    handle = teacher.model.layers[3].register_forward_pre_hook(lambda *a: seen.append(1))
    io = capture_teacher_io(teacher, x, [0, 1], with_resid=True)
    handle.remove()
    assert not seen  # nothing above the last requested layer ran
    full = teacher(input_ids=x, output_hidden_states=True).hidden_states
    torch.testing.assert_close(io[1].resid, full[1])  # the residual stream entering layer 1
    torch.testing.assert_close(io[1].x, teacher.model.layers[1].input_layernorm(full[1]))
    resid, xs = capture_layer_input(teacher, x, 2, batch_size=3)  # two batches, stopped at layer 2's norm
    torch.testing.assert_close(resid, full[2])
    torch.testing.assert_close(xs, teacher.model.layers[2].input_layernorm(full[2]))


def test_student_inputs_equal_the_teachers_below_the_first_converted_layer_and_drift_above():
    teacher = tiny_teacher("llama", **CFG)
    x = ids()
    hybrid = build_hybrid(teacher, [0, 1])  # layers 2 and 3 converted
    cal = prepare(teacher, x, [2, 3], statistics=False)
    first = student_layer_io(hybrid, cal, 2, "attn")
    torch.testing.assert_close(first.x, cal.captured[2].x)  # only teacher layers below
    assert torch.equal(first.out, cal.captured[2].out)
    res = student_layer_io(hybrid, cal, 2, "residual")
    torch.testing.assert_close(res.out, cal.captured[2].out)  # no drift yet: the residual target is the attention output
    above = student_layer_io(hybrid, cal, 3, "residual")
    drift = (above.x - cal.captured[3].x).abs().max()
    assert drift > 1e-3  # layer 2 is a GDN layer now: layer 3 sees other inputs
    t_io = capture_teacher_io(teacher, x, [3], with_resid=True, with_ctx=False)[3]
    s_resid, _ = capture_layer_input(hybrid, x, 3)
    torch.testing.assert_close(above.out, t_io.resid + t_io.out - s_resid)


def test_sequential_fits_each_layer_on_the_hybrids_own_inputs():
    teacher = tiny_teacher("llama", **CFG)
    x = ids(6)
    align = AlignConfig(steps=4, lr_qkv=3e-3, lr_gate=3e-2, inputs="student")
    hybrid = build_hybrid(teacher, [0])
    rec = calibrate(hybrid, teacher, x, phase2=True, align=align)["phase2"]
    assert sorted(rec) == [1, 2, 3] and all(r["inputs"] == "student" and r["steps_run"] == 4 for r in rec.values())
    # the same fit by hand: layer 3's data is read from the hybrid after layers 1 and 2 were fitted
    local = build_hybrid(teacher, [0])
    rec_local = calibrate(local, teacher, x, phase2=True, align=AlignConfig(steps=4, lr_qkv=3e-3, lr_gate=3e-2))["phase2"]
    assert rec[1]["train_loss"] == pytest.approx(rec_local[1]["train_loss"], rel=1e-5)  # layer 1: same inputs
    assert rec[3]["train_loss"] != pytest.approx(rec_local[3]["train_loss"], rel=1e-3)  # layer 3: the hybrid's


def test_lazy_capture_gives_the_layer_local_fit_of_the_eager_one():
    teacher = tiny_teacher("llama", **CFG)
    x = ids(6)
    align = AlignConfig(steps=3)
    eager, lazy = build_hybrid(teacher, [0, 2]), build_hybrid(teacher, [0, 2])
    calibrate(eager, teacher, prepare(teacher, x, [1, 3], lazy=False), phase1="exact", phase2=True, align=align)
    cal = prepare(teacher, x, [1, 3], lazy=True)
    assert cal.lazy and cal.captured == {} and sorted(cal.phase1_captured) == [1, 3]
    calibrate(lazy, teacher, cal, phase1="exact", phase2=True, align=align)
    a, b = gdn_state(eager), gdn_state(lazy)
    for k in a:  # rows and order are the same; only when the activations are taken differs
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)
    assert cal.record()["phase1_sequences"] == min(PHASE1_SEQUENCES, 4)


def test_lazy_capture_takes_the_layers_asked_for_next_in_one_pass(monkeypatch):
    import tcal.taylor.pipeline as pipeline
    from tcal.taylor.pipeline import pass_sizes

    # 4 layers, at most 3 per pass: two passes of two, not three and one
    assert pass_sizes(4, per_layer_bytes=10, budget=30) == [2, 2]
    assert pass_sizes(4, per_layer_bytes=10, budget=40) == [4]
    assert pass_sizes(7, per_layer_bytes=10, budget=30) == [3, 2, 2]
    assert pass_sizes(3, per_layer_bytes=10, budget=5) == [1, 1, 1]  # always at least the layer asked for
    teacher = tiny_teacher("qwen2", **CFG)
    x = ids(6)
    ref = capture_teacher_io(teacher, x, [0, 1, 2, 3], with_ctx=False)
    per_layer = 2 * x.numel() * CFG["hidden_size"] * 4
    for budget, passes in ((10 * per_layer, 1), (2 * per_layer, 2), (1, 4)):
        monkeypatch.setattr(pipeline, "LAZY_GROUP_BYTES", budget)
        cal = prepare(teacher, x, [0, 1, 2, 3], statistics=False, lazy=True)
        order = [0, 1, 2, 3]
        for n, i in enumerate(order):
            io = cal.layer_io(i, then=order[n + 1:])
            torch.testing.assert_close(io.x, ref[i].x)
            torch.testing.assert_close(io.out, ref[i].out)
        assert cal.passes == passes and cal.pending == {}  # each grouped layer handed out once, then dropped
        again = cal.layer_io(2)  # asked for twice: captured again, not lost
        torch.testing.assert_close(again.out, ref[2].out)
        assert cal.passes == passes + 1


def test_lazy_passes_keep_their_planned_sizes_when_the_budget_changes(monkeypatch):
    import tcal.taylor.pipeline as pipeline
    from tcal.taylor.pipeline import pass_sizes

    assert pass_sizes(21, per_layer_bytes=10, budget=100) == [7, 7, 7]
    assert pass_sizes(7, per_layer_bytes=10, budget=30) == [3, 2, 2]
    assert pass_sizes(3, per_layer_bytes=10, budget=5) == [1, 1, 1]
    teacher = tiny_teacher("qwen2", **{**CFG, "num_hidden_layers": 6})
    x = ids(2)
    per_layer = 2 * x.numel() * CFG["hidden_size"] * 4
    order = list(range(6))

    def groups(budgets):
        seen = iter(budgets)
        monkeypatch.setattr(pipeline, "group_bytes_for", lambda device: next(seen))
        cal = prepare(teacher, x, order, statistics=False, lazy=True)
        out, todo = [], list(order)
        while todo:
            got = cal.layer_ios(todo[0], then=todo[1:])
            out.append(sorted(got))
            todo = [i for i in todo if i not in got]
        return out

    # two per pass first; a budget grown by the time of the second pass (the first group's memory given
    # back) keeps the plan of equal passes, not 2 then 4 (two shapes for Phase 2 side by side)
    assert groups([2 * per_layer, 10 * per_layer, 10 * per_layer]) == [[0, 1], [2, 3], [4, 5]]
    # a budget shrunk below the plan re-plans what is left in equal shares
    assert groups([3 * per_layer, per_layer, per_layer, per_layer, per_layer]) == [[0, 1, 2], [3], [4], [5]]
    assert groups([3 * per_layer, 2 * per_layer, 2 * per_layer]) == [[0, 1, 2], [3, 4], [5]]


def test_lazy_grouped_calibration_equals_one_pass_per_layer(monkeypatch):
    import tcal.taylor.pipeline as pipeline

    teacher = tiny_teacher("llama", **CFG)
    x = ids(6)
    align = AlignConfig(steps=3)
    states = []
    for budget in (1, 1 << 30):
        monkeypatch.setattr(pipeline, "LAZY_GROUP_BYTES", budget)
        hybrid = build_hybrid(teacher, [0])
        cal = prepare(teacher, x, [1, 2, 3], lazy=True)
        calibrate(hybrid, teacher, cal, phase1="exact-silent", phase2=True, align=align)
        states.append((gdn_state(hybrid), cal.passes))
    (a, pa), (b, pb) = states
    assert (pa, pb) == (3, 1)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_align_config_refuses_bad_settings():
    for bad, message in ((dict(schedule="linear"), "align schedule must be one of constant, cosine, got 'linear'"),
                         (dict(warmup_steps=-1), "align warmup_steps must be >= 0, got -1"),
                         (dict(patience=0), "align patience must be >= 1"),
                         (dict(inputs="oracle"), "align inputs must be 'teacher' or 'student', got 'oracle'"),
                         (dict(target="logits"), "align target must be 'attn' or 'residual', got 'logits'"),
                         (dict(target="residual"), "the residual-stream target .* needs inputs='student'"),
                         (dict(heldout_max_sequences=0), "heldout_max_sequences must be >= 1, got 0")):
        with pytest.raises(TcalError, match=message):
            AlignConfig(**bad)
    AlignConfig(inputs="student", target="residual")


def test_patience_stops_a_layer_that_no_longer_improves_on_held_out():
    teacher = tiny_teacher("llama", **CFG)
    x = ids(6)
    # a learning rate this large makes the held-out fit worse at once: patience 2 ends the layer early
    align = AlignConfig(steps=50, lr_qkv=5.0, lr_gate=5.0, patience=2)
    rec = calibrate(build_hybrid(teacher, [0]), teacher, x, phase2=True, align=align)["phase2"]
    stopped = [r for r in rec.values() if r["steps_run"] < 50]
    assert stopped and all(len(r["heldout_curve"]) >= 2 for r in stopped)
    for r in stopped:  # it stopped after two evaluations in a row without a new best
        assert r["steps_run"] - r["best_step"] == 2
