"""tcal.evaluate.speed on CPU: every row returns its numbers (positive, finite), a failing cell is
recorded instead of raised, the fast path generates the eager path's greedy tokens, and the
largest-batch search backs off on out of memory (its GPU calls stubbed)."""
import math

import pytest
import torch

import tcal
from tcal.evaluate import speed
from tcal.models.fast import StaticHybridCache
from tcal.models.shapes import random_model
from tcal.utils.errors import TcalError

CTX, NEW = 32, 4
PREFILL_KEYS = {"prefill_s", "prefill_tok_s", "prefill_peak_gb", "cache_mb", "decode_ms", "decode_tok_s"}


@pytest.fixture(scope="module")
def models():
    teacher = random_model("smollm2-135m", num_layers=2, attn_implementation="sdpa")
    return {"teacher": teacher, "hybrid": tcal.convert(teacher, keep=[0], init="copy").eval()}


def positive(row, keys):
    bad = {k: row[k] for k in keys if not (isinstance(row[k], (int, float)) and math.isfinite(row[k]) and row[k] > 0)}
    assert not bad, bad


@pytest.mark.parametrize("name", ["teacher-eager", "hybrid-eager", "teacher-fast", "hybrid-fast"])
def test_prefill_decode_rows(models, name):
    model = models["teacher" if name.startswith("teacher") else "hybrid"]
    row = speed.measure_row(name, model, CTX, decode_tokens=NEW, reps=1)
    assert "error" not in row, row
    assert (row["model"], row["context"]) == (name, CTX) and PREFILL_KEYS <= set(row)
    positive(row, PREFILL_KEYS - {"prefill_peak_gb"})  # peak memory is a CUDA number
    assert row["prefill_peak_gb"] is None
    assert row["decode_tok_s"] == pytest.approx(1e3 / row["decode_ms"])
    if name.endswith("fast"):
        assert row["graphs"] is False  # no CUDA graphs on CPU


def test_compiled_row_runs_hf_generate_on_a_static_cache(models):
    # on CPU transformers does not compile; the timing arithmetic and the StaticCache plumbing are what runs
    row = speed.measure_row("teacher-compiled", models["teacher"], 16, decode_tokens=NEW, compiled_cache_len=64)
    assert "error" not in row, row
    positive(row, ["decode_ms", "decode_tok_s", "first_call_s"])
    assert row["max_cache_len"] == 64


def test_fast_cache_is_the_static_cache(models):
    row = speed.measure_fast(models["hybrid"], CTX, NEW, 1)
    want = StaticHybridCache(models["hybrid"], 1, CTX + NEW + 16).nbytes()
    assert row["cache_mb"] == pytest.approx(want / 2**20)


@pytest.mark.parametrize("which", ["teacher", "hybrid"])
def test_generate_row_fast_matches_hf_greedy_tokens(models, which):
    row = speed.measure_generate(models[which], CTX, NEW, 1)
    positive(row, ["hf_s", "hf_tok_s", "fast_s", "fast_tok_s", "speedup"])
    assert row["new_tokens"] == NEW and row["speedup"] == pytest.approx(row["fast_tok_s"] / row["hf_tok_s"])
    assert row["same_tokens"] and row["first_diff"] is None  # fp32: FastDecoder is the eager model's greedy path


def test_generate_leaves_the_models_generation_config_alone(models):
    model = models["hybrid"]
    before = model.generation_config.to_dict()
    speed.measure_generate(model, 16, 2, 1)
    assert model.generation_config.to_dict() == before


def test_a_failing_cell_is_recorded_not_raised(models, monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("kernel exploded\nsecond line")

    def oom(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(speed, "measure_fast", boom)
    assert speed.measure_row("hybrid-fast", models["hybrid"], CTX)["error"] == "RuntimeError: kernel exploded"
    monkeypatch.setattr(speed, "measure_eager", oom)
    assert speed.measure_row("teacher-eager", models["teacher"], CTX) == {
        "model": "teacher-eager", "context": CTX, "error": "out of memory"}
    with pytest.raises(TcalError, match="unknown row 'hybrid-slow'; choose from teacher-eager"):
        speed.measure_row("hybrid-slow", models["hybrid"], CTX)


def test_batched_decode(models):
    row = speed.measure_batched(models["hybrid"], CTX, 3, NEW)
    assert (row["batch"], row["context"]) == (3, CTX)
    positive(row, ["step_ms", "decode_tok_s", "cache_gb"])
    assert row["decode_tok_s"] == pytest.approx(3 * 1e3 / row["step_ms"])


def test_sequence_bytes_is_one_sequence_of_the_batched_cache(models):
    hybrid = models["hybrid"]
    per = speed.sequence_bytes(hybrid, CTX, NEW)
    assert StaticHybridCache(hybrid, 5, CTX + NEW + 16).nbytes() == 5 * per["cache"]
    assert per["logits"] == hybrid.config.vocab_size * (4 + 4)  # fp32 model: its logits and an fp32 copy
    assert per["total"] == per["cache"] + per["logits"] + per["attention"]


def test_max_batch_needs_cuda(models):
    with pytest.raises(TcalError, match="needs a model on CUDA"):
        speed.max_batch(models["hybrid"], CTX)


def test_max_batch_backs_off_by_ten_percent_on_out_of_memory(models, monkeypatch):
    # the GPU side stubbed: 100 sequences' worth of free memory after the margin, and 70 fit
    per = 2**20
    free = (100 * per + 2 * 2**30) / 0.94
    tried = []

    def batched(model, ctx, b, n, **kw):
        tried.append(b)
        if b > 70:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return {"batch": b, "context": ctx, "step_ms": 1.0, "decode_tok_s": b * 1e3, "cache_gb": 0.0,
                "peak_gb": 1.0, "graphs": True}

    monkeypatch.setattr(speed, "model_device", lambda m: torch.device("cuda"))
    monkeypatch.setattr(speed, "_free", lambda d: None)
    monkeypatch.setattr(speed, "sequence_bytes", lambda m, c, n: {"total": per})
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (int(free) + 1, 80 * 2**30))
    monkeypatch.setattr(speed, "measure_batched", batched)
    row = speed.max_batch(models["hybrid"], CTX)
    assert row["estimated_batch"] == 100 and tried == [100, 90, 81, 72, 64] and row["batch"] == 64
    assert [a["batch"] for a in row["attempts"]] == [100, 90, 81, 72] and row["decode_tok_s"] == 64e3

    tried.clear()
    monkeypatch.setattr(speed, "sequence_bytes", lambda m, c, n: {"total": 10 * per})  # 10 estimated, none fits
    monkeypatch.setattr(speed, "measure_batched", lambda m, c, b, n, **kw: batched(m, c, b + 70, n))
    row = speed.max_batch(models["hybrid"], CTX, tries=6)
    assert tried == [80, 79, 78, 77, 76, 75]  # 10, 9, 8, 7, 6, 5: at most six tries
    assert row["batch"] is None and row["error"] == "out of memory at every batch tried (10, 9, 8, 7, 6, 5)"


def test_check_compares_fast_eager_and_fp32(models):
    seen = []
    res = speed.check(models["hybrid"], 16, 3, progress=lambda name, r: seen.append(name))
    variants = ["static+graph", "+packed+fla-fused", "+compiled norms (default)"]
    assert seen == variants and res["steps"] == 3
    for name in variants:
        assert res[name]["argmax_agree_with_fp32"] == "4/4" and res[name]["free_running_first_diff_vs_eager"] is None
        assert res[name]["decode_vs_fp32_max"] < 1e-4


def test_profile_and_floor(models):
    res = speed.profile(models["hybrid"], 16, top=3)
    assert set(res) == {"prefill", "decode"} and res["decode"]["wall_ms"] > 0 and "Name" in res["decode"]["table"]
    t = models["teacher"]
    assert speed.weight_read_floor_ms(t) == pytest.approx(
        sum(p.numel() * p.element_size() for p in t.parameters()) / 4.3e12 * 1e3)
    assert set(speed.environment("cpu")) >= {"torch", "transformers", "device"}
