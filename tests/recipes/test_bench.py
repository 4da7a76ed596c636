"""`tcal bench` end to end on CPU: a tiny shape and a saved tiny hybrid, every requested row x context
in bench.json, the tables in bench.md, the plot; bad input is one line and exit 2, before any model
is built."""
import json

import pytest
from helpers import tiny_teacher

import tcal
from tcal.cli import main
from tcal.models.shapes import SHAPES

SMOKE = ("--num-layers", 2, "--keep", 0, "--decode-tokens", 4, "--reps", 1, "--dtype", "float32", "--device", "cpu",
         "--no-progress")
PNG = b"\x89PNG"


def run(*argv):
    return main([str(a) for a in argv])


def errors_of(capsys, *argv):
    code = run(*argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, [line for line in err.splitlines() if line.startswith("tcal: error: ")]


def test_bench_a_shape_writes_json_tables_and_plot(tmp_path, capsys):
    out = tmp_path / "bench"
    rows = ["teacher-eager", "hybrid-eager", "teacher-fast", "hybrid-fast", "generate"]
    assert run("bench", "smollm2-135m", *SMOKE, "--contexts", "16,32", "--rows", ",".join(rows),
               "--batch-sizes", "2", "--batch-context", 32, "--out", out) == 0
    printed = capsys.readouterr().out
    assert "decode ms/token" in printed and f"wrote {out}" in printed
    assert {p.name for p in out.iterdir()} >= {"bench.json", "bench.md", "bench.png", "tcal_config.json"}
    res = json.loads((out / "bench.json").read_text())
    assert [(r["model"], r["context"]) for r in res["rows"]] == [(n, c) for c in (16, 32) for n in rows]
    assert not [r for r in res["rows"] + res["batched"] if "error" in r]
    for r in res["rows"]:
        keys = ("hf_tok_s", "fast_tok_s") if r["model"] == "generate" else ("decode_ms", "prefill_tok_s", "cache_mb")
        assert all(r[k] > 0 for k in keys), r
    assert [(r["model"], r["batch"]) for r in res["batched"]] == [("teacher-fast", 2), ("hybrid-fast", 2)]
    assert res["settings"]["contexts"] == [16, 32] and res["settings"]["rows"] == rows
    assert set(res["environment"]) >= {"torch", "transformers", "device"}
    assert res["model"]["attention_layers"] == [0] and res["model"]["num_layers"] == 2
    assert res["weight_read_floor"]["teacher_ms"] > 0 and res["weight_read_floor"]["hybrid_ms"] > 0
    assert res["check"] is None
    md = (out / "bench.md").read_text()
    for section in ("## Decode (ms / token)", "## Prefill (tokens / s)", "## Cache size (MB)",
                    "## End-to-end generation", "## Batched decode at 32 tokens", "## Weight-read floor"):
        assert section in md, section
    assert "assumption of peak bandwidth" in md and "| hybrid-fast |" in md and "| 16 | 32 |" in md
    assert (out / "bench.png").read_bytes()[:4] == PNG
    assert json.loads((out / "tcal_config.json").read_text())["stage"] == "bench"


def test_the_rows_are_one_registry_and_help_lists_every_row():
    from tcal.cli import build_parser
    from tcal.engines.rows import BENCH_ROWS
    from tcal.evaluate.speed import ROWS
    from tcal.export.gguf import FILE_TYPES, QUANTISED
    from tcal.recipes.bench import GGUF_TYPES
    from tcal.recipes.bench import ROWS as HELP_ROWS

    # bench writes its GGUFs itself; the 4-bit types need llama.cpp's quantiser (tcal export)
    assert HELP_ROWS == tuple(BENCH_ROWS) and GGUF_TYPES == tuple(t for t in FILE_TYPES if t not in QUANTISED)
    assert ROWS == tuple(n for n, r in BENCH_ROWS.items() if r.reads == "tcal")  # speed measures the tcal engine's
    help_text = " ".join(build_parser()._subparsers._group_actions[0].choices["bench"].format_help().split())
    assert all(f"{name} (" in help_text for name in BENCH_ROWS)


def test_bench_llama_cpp_rows_of_a_saved_hybrid(tmp_path, capsys):
    from helpers import target_hybrid

    hybrid, _ = target_hybrid("llama")
    hybrid.save_pretrained(tmp_path / "hybrid")
    out = tmp_path / "bench"
    assert run("bench", tmp_path / "hybrid", "--contexts", "16,32", "--rows", "teacher-llama.cpp,hybrid-llama.cpp",
               "--decode-tokens", 4, "--reps", 1, "--threads", 1, "--device", "cpu", "--no-progress", "--out",
               out) == 0
    res = json.loads((out / "bench.json").read_text())
    assert [(r["model"], r["context"]) for r in res["rows"]] == [(n, c) for n in ("teacher-llama.cpp",
                                                                                 "hybrid-llama.cpp") for c in (16, 32)]
    assert all(r["decode_ms"] > 0 and r["prefill_tok_s"] > 0 and r["engine"] == "llama.cpp" for r in res["rows"])
    md = (out / "bench.md").read_text()
    assert "## llama.cpp: hybrid against teacher" in md and "KV bound" in md and "| hybrid-llama.cpp |" in md


def timed_rows(monkeypatch) -> list:
    """Record every row the bench starts timing (speed.measure_row and the rows of exports)."""
    from tcal.evaluate import speed
    from tcal.recipes import bench

    started = []
    measure_row, export_rows = speed.measure_row, bench._export_rows
    monkeypatch.setattr(speed, "measure_row", lambda name, *a, **k: started.append(name) or measure_row(name, *a, **k))
    monkeypatch.setattr(bench, "_export_rows", lambda cfg, p, name, m: started.append(name) or export_rows(cfg, p, name, m))
    return started


def test_a_row_the_hybrid_cannot_run_is_refused_before_any_row_is_timed(tmp_path, capsys, monkeypatch):
    started = timed_rows(monkeypatch)
    # a native hybrid whose write gate has a bias: only its weights say llama.cpp's layout cannot hold it
    native = tcal.convert(tiny_teacher("llama"), keep=[0, 2], init="copy", target="native")
    with __import__("torch").no_grad():
        native.model.layers[1].self_attn.b_proj.bias.fill_(0.5)
    native.save_pretrained(tmp_path / "native")
    code, errors = errors_of(capsys, "bench", tmp_path / "native", "--contexts", "16", "--rows",
                             "hybrid-eager,teacher-llama.cpp,hybrid-llama.cpp", "--decode-tokens", 2, "--reps", 1,
                             "--device", "cpu", "--no-progress", "--out", tmp_path / "b2")
    assert code == 2 and len(errors) == 1, errors
    assert "row hybrid-llama.cpp cannot run" in errors[0] and "b_proj.bias" in errors[0]
    assert "drop hybrid-llama.cpp from --rows" in errors[0]
    # a Gemma 3 hybrid (native: the layout holds no Gemma layers): refused from its config, before it loads
    gemma = tcal.convert(tiny_teacher("gemma3"), keep=[0, 3], init="copy")  # layer 3 is global
    assert gemma.config.target == "native"
    gemma.save_pretrained(tmp_path / "gemma")
    code, errors = errors_of(capsys, "bench", tmp_path / "gemma", "--contexts", "16", "--rows",
                             "hybrid-eager,hybrid-fast,hybrid-llama.cpp", "--decode-tokens", 2, "--reps", 1,
                             "--device", "cpu", "--no-progress", "--out", tmp_path / "b3")
    assert code == 2 and len(errors) == 1, errors
    assert "row hybrid-llama.cpp cannot run" in errors[0] and "'gemma3_text'" in errors[0]
    assert "runs where tcal is imported" in errors[0] and "--target" not in errors[0]  # no advice in a circle
    code, errors = errors_of(capsys, "bench", tmp_path / "gemma", "--contexts", "16", "--rows", "teacher-llama.cpp",
                             "--device", "cpu", "--out", tmp_path / "b3")
    assert code == 2 and "row teacher-llama.cpp cannot run" in errors[0] and "not 'gemma3_text'" in errors[0]
    assert started == [] and not (tmp_path / "b2").exists() and not (tmp_path / "b3").exists()
    # the rows that can run still run
    assert run("bench", tmp_path / "gemma", "--contexts", "16", "--rows", "hybrid-eager", "--decode-tokens", 2,
               "--reps", 1, "--device", "cpu", "--no-progress", "--out", tmp_path / "b4") == 0
    assert started == ["hybrid-eager"]


def test_keep_is_refused_for_a_saved_hybrid(tmp_path, capsys):
    tcal.convert(tiny_teacher(), keep=[0, 2], init="copy").save_pretrained(tmp_path / "hybrid")
    for keep in ("0,1", "uniform:25%"):  # the shapes' default too: given, it is not the hybrid's
        code, errors = errors_of(capsys, "bench", tmp_path / "hybrid", "--keep", keep, "--rows", "hybrid-eager",
                                 "--contexts", 16, "--device", "cpu", "--out", tmp_path / "b")
        assert code == 2 and len(errors) == 1, errors
        assert "the saved hybrid" in errors[0] and "attention at [0, 2]" in errors[0] and "drop --keep" in errors[0]
    assert not (tmp_path / "b").exists()
    # a shape without --keep takes uniform:25%, and the settings say so
    out = tmp_path / "s"
    assert run("bench", "smollm2-135m", "--num-layers", 4, "--contexts", 16, "--rows", "hybrid-eager",
               "--decode-tokens", 2, "--reps", 1, "--dtype", "float32", "--device", "cpu", "--no-progress",
               "--out", out) == 0
    res = json.loads((out / "bench.json").read_text())
    assert res["settings"]["keep"] == "uniform:25%" and res["model"]["attention_layers"] == [0]


def test_bench_a_saved_hybrid_with_check(tmp_path, capsys):
    hybrid = tcal.convert(tiny_teacher("qwen2"), keep=[0, 2], init="copy")
    hybrid.save_pretrained(tmp_path / "hybrid")
    out = tmp_path / "bench"
    assert run("bench", tmp_path / "hybrid", "--contexts", 16, "--rows", "teacher-eager,hybrid-fast,generate",
               "--decode-tokens", 4, "--reps", 1, "--dtype", "float32", "--device", "cpu", "--check",
               "--no-progress", "--out", out) == 0
    res = json.loads((out / "bench.json").read_text())
    assert res["model"]["kind"] == "hybrid" and res["model"]["attention_layers"] == [0, 2]
    assert res["model"]["family"] == "qwen2" and "random weights at the hybrid's base" in res["model"]["weights"]
    assert [(r["model"], r["context"]) for r in res["rows"]] == [("teacher-eager", 16), ("hybrid-fast", 16),
                                                                ("generate", 16)]
    assert not [r for r in res["rows"] if "error" in r]
    gen = res["rows"][2]
    assert gen["same_tokens"]  # fp32: FastDecoder.generate gives HF generate's greedy tokens
    assert res["check"]["static+graph"]["argmax_agree_with_fp32"] == "65/65"
    md = (out / "bench.md").read_text()
    assert "random weights at the hybrid's base (teacher) config" in md and "## Check: hybrid FastDecoder" in md


@pytest.mark.parametrize("argv, message", [
    (("--rows", "teacher-eager,hybrid-slow"), "unknown row 'hybrid-slow' in --rows; choose from teacher-eager, "
                                              "teacher-compiled, hybrid-eager, teacher-fast, hybrid-fast, generate"),
    (("--contexts", "0,16"), "--contexts must be at least 1 token, got 0"),
    (("--contexts", "2k"), "--contexts must be whole numbers like 2048,8192, got '2k'"),
    (("--contexts", ","), "--contexts is empty"),
    (("--batch-sizes", "max"), "--batch-sizes max searches free GPU memory: it needs CUDA"),
    (("--batch-sizes", "1,lots"), "--batch-sizes must be whole numbers like 1,8,32 or max, got 'lots'"),
    (("--rows", "teacher-compiled"), "row teacher-compiled (transformers' compiled StaticCache decode) needs CUDA"),
    (("--contexts", "16384"), "--contexts 16384 is beyond smollm2-135m's max_position_embeddings 8192"),
    (("--rows", "hybrid-fast", "--batch-sizes", "1", "--batch-context", "9000"),
     "--batch-context 9000 is beyond smollm2-135m's max_position_embeddings 8192"),
    (("--rows", "hybrid-eager", "--batch-sizes", "1"), "--batch-sizes measures the fast rows"),
    (("--keep", "ar:1"), "a shape has random weights, so layers cannot be scored on text"),
    (("--keep", "0,5"), "--keep layer 5 does not exist: smollm2-135m has 2 layers"),
    (("--decode-tokens", "0"), "--decode-tokens must be at least 1"),
])
def test_bad_settings_are_one_line_errors(tmp_path, capsys, argv, message):
    out = tmp_path / "bench"
    code, errors = errors_of(capsys, "bench", "smollm2-135m", "--num-layers", 2, "--device", "cpu", "--out", out,
                             "--contexts", 16, *argv)  # a later flag wins
    assert code == 2 and len(errors) == 1 and message in errors[0], errors
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == []  # nothing left behind


def test_bad_models_are_one_line_errors(tmp_path, capsys, workspace):
    out = tmp_path / "bench"
    (tmp_path / "empty").mkdir()
    hybrid = tmp_path / "hybrid"
    tcal.convert(tiny_teacher(), keep=[0], init="copy").save_pretrained(hybrid)
    for model, extra, message in [
        ("gpt-9", (), f"--model 'gpt-9' is neither a shape ({', '.join(SHAPES)}) nor a directory"),
        (workspace / "teacher", (), "is not a saved tcal hybrid (config.json model_type 'llama', not 'tcal_hybrid')"),
        (tmp_path / "empty", (), "is not a saved tcal hybrid (no readable config.json)"),
        (hybrid, ("--num-layers", 2), "a saved hybrid"),
        (hybrid, ("--contexts", 1024), "--contexts 1024 is beyond"),  # the tiny teacher's 512 positions
    ]:
        code, errors = errors_of(capsys, "bench", model, "--device", "cpu", "--out", out, *extra)
        assert code == 2 and len(errors) == 1 and message in errors[0], (model, errors)
        assert not out.exists()


def test_bench_refuses_an_output_directory_holding_the_users_files(tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    code, errors = errors_of(capsys, "bench", "smollm2-135m", *SMOKE, "--contexts", 16, "--out", out)
    assert code == 2 and "holds files tcal did not write" in errors[0]
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


def test_a_failing_cell_is_recorded_and_the_others_go_on(tmp_path, capsys, monkeypatch):
    from tcal.evaluate import speed

    def boom(*a, **k):
        raise RuntimeError("no kernel for this shape")

    monkeypatch.setattr(speed, "measure_fast", boom)
    monkeypatch.setattr(speed, "check", boom)
    out = tmp_path / "bench"
    assert run("bench", "smollm2-135m", *SMOKE, "--contexts", 16, "--rows", "hybrid-eager,hybrid-fast", "--check",
               "--out", out) == 0
    assert "hybrid-fast @ 16 tokens: RuntimeError: no kernel for this shape" in capsys.readouterr().err
    res = json.loads((out / "bench.json").read_text())
    eager, fast = res["rows"]
    assert "error" not in eager and eager["decode_ms"] > 0
    assert fast == {"model": "hybrid-fast", "context": 16, "error": "RuntimeError: no kernel for this shape"}
    assert res["check"]["error"] == "RuntimeError: no kernel for this shape"
    md = (out / "bench.md").read_text()
    assert "| hybrid-fast | error |" in md and "## Errors" in md and "Failed: RuntimeError" in md
