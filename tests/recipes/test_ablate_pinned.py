"""`tcal ablate` keeps its numbers: a tiny ablation (two held-out domains, the five kinds of init step, a task
column) scores what tests/fixtures/ablate_tiny.json holds, as the command wrote it when the file was made. A change
to how ablate assembles its tasks, reads its flags or scores perplexity must leave every number of the table as it
was; a change that means to move them rewrites the file (``TCAL_PIN=1`` writes it) and says why."""
import json
import os
import random
from pathlib import Path

import pytest
from helpers import run

PIN = Path(__file__).resolve().parents[1] / "fixtures" / "ablate_tiny.json"


def _table(res: dict) -> dict:
    """The numbers of an ablation, its domains by position (their paths are the test's temporary ones)."""
    domains = res["evaluation"]["domains"]
    return {"teacher": [res["teacher_ppl_by_domain"][d] for d in domains],
            "teacher_scores": res.get("teacher_scores"),
            "rows": {r["init"]: {"ppl": [r["ppl_by_domain"][d] for d in domains], "heldout_fit": r["heldout_fit"],
                                 "copy_over_init": r["copy_over_init"], "scores": r.get("scores")}
                     for r in res["rows"]},
            "keep": res["keep"], "windows": res["evaluation"]["windows"]}


def test_a_tiny_ablation_scores_what_it_always_scored(workspace, capsys):
    from conftest import WORDS

    rng = random.Random(1)
    (workspace / "eval2.txt").write_text(" ".join(rng.choice(WORDS) for _ in range(1500)))
    out = workspace / "ab"
    code, errors, err = run(capsys, "ablate", "--teacher", workspace / "teacher", "--keep", "0,2", "--inits",
                            "copy,zero-gate,phase1,phase2,taylor", "--calib", workspace / "calib.txt",
                            "--calib-window", "32", "--calib-windows", "8", "--align-steps", "3", "--kl-steps", "2",
                            "--eval", f"{workspace / 'eval.txt'},{workspace / 'eval2.txt'}", "--eval-window", "32",
                            "--eval-windows", "3", "--tasks", "single:2@200", "--haystack", workspace / "eval2.txt",
                            "--device", "cpu", "--no-progress", "--out", out)
    assert code == 0, err
    got = _table(json.loads((out / "ablation.json").read_text()))
    if os.environ.get("TCAL_PIN"):
        PIN.write_text(json.dumps(got, indent=1) + "\n")
    want = json.loads(PIN.read_text())
    assert got.keys() == want.keys() and got["rows"].keys() == want["rows"].keys()
    assert (got["keep"], got["windows"], got["teacher_scores"]) == (want["keep"], want["windows"],
                                                                     want["teacher_scores"])
    assert got["teacher"] == pytest.approx(want["teacher"], rel=1e-6)
    for init, row in want["rows"].items():
        mine = got["rows"][init]
        # the trained inits' few float32 steps carry rounding the one-thread runs of one machine do not have
        assert mine["ppl"] == pytest.approx(row["ppl"], rel=1e-4), init
        assert (mine["heldout_fit"] is None) == (row["heldout_fit"] is None), init
        if row["heldout_fit"] is not None:
            assert mine["heldout_fit"] == pytest.approx(row["heldout_fit"], rel=1e-4, abs=1e-6), init
        assert mine["copy_over_init"] == pytest.approx(row["copy_over_init"], rel=1e-4), init
        assert mine["scores"] == row["scores"], init
