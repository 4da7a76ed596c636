"""Zero-shot conversions of a code teacher side by side: which layers stay attention, and what the calibration
reads, judged by the answers the hybrid writes.

For the teacher (default `qwen2.5-coder-0.5b`), 50 % converted with `taylor`:

1. Layer scores on calibration-side text, each the teacher's loss with one attention layer removed at a time:
   `ar` (code:calib windows), `answers` (the reference answers of 48 chat-format code tasks of code:calib, the
   `answer:K` policy's score; `answers8` the same on 8 tasks) and `niah` (needle answers, the `niah:K` policy's).
2. Keep sets: uniform, the top half of each score, and `answers+niah` (the six best of niah, then of answers).
3. Variants (`--keeps`): each keep set at the reference budget (the CPU default: 4 x 256 tokens of
   code:calib+wiki:calib, Phase 2 300 steps, KL stage up to 40 steps); then (`--budgets`), on the keep set of lowest
   development answer KL, a KL stage on chat-format windows with the loss on the answers (`chat`: 16 packed windows
   of 512 tokens of code:calib tasks with their reference answers, 4 more held out) and that with Phase 2 on 16 x 256
   calibration tokens in minibatches of 4 (`p2+chat`).
4. For each: code:eval PPL (8 x 512), wiki:eval PPL (4 x 512), the answer KL to the teacher on 64 chat tasks from the
   end of code:calib (a development set: no calibration step reads them), HumanEval pass@1 (164 problems) and
   passkey retrieval (one needle in sotu:eval, 10 prompts per length).

    python bench/coder_sweep.py --out runs/coder-sweep                    # a GPU: about 10 minutes
    python bench/coder_sweep.py --out /tmp/s --humaneval 2 --quick        # a smoke test on the CPU

Writes OUT/results.json (every variant, as it finishes), OUT/scores.json and OUT/humaneval-<variant>.json.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

from tcal.conversion.convert import calibration_ids, convert_with_record
from tcal.conversion.select import SelectionConfig, answer_nll, niah_scores, removal_scores, validation_windows
from tcal.data.instruct import chat_windows, code_tasks
from tcal.data.teachers import load_teacher
from tcal.data.tokens import token_windows
from tcal.evaluate import window_ppl
from tcal.evaluate.sandbox import Limits
from tcal.evaluate.tasks.humaneval.problems import (
    build_prompt,
    generate_tcal,
    load_problems,
    pass_at_1,
    prompt_style,
    score,
)
from tcal.evaluate.tasks.niah.ruler import retrieval_probes
from tcal.taylor.kl_stage import kl_stage, mean_kl
from tcal.taylor.stage_config import AlignConfig, KLConfig
from tcal.utils.atomic import write_json

CALIB = "code:calib+wiki:calib"


def top(scores, k, largest=True):
    order = sorted(range(len(scores)), key=lambda i: -scores[i] if largest else scores[i])
    return sorted(order[:k])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--teacher", default="qwen2.5-coder-0.5b")
    ap.add_argument("--out", required=True)
    ap.add_argument("--humaneval", type=int, default=164, help="HumanEval problems (the first N)")
    ap.add_argument("--keeps", default="uniform,answers,answers+niah")
    ap.add_argument("--budget-keep", default="best", help="keep set of the budget variants: a name, or best (lowest "
                                                           "development answer KL at the reference budget)")
    ap.add_argument("--p2-windows", type=int, default=16)
    ap.add_argument("--chat-windows", type=int, default=16)
    ap.add_argument("--budgets", default="chat,p2+chat")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--passkey", default="1024,4096,8192", help="passkey lengths (single needle in sotu:eval)")
    ap.add_argument("--passkey-samples", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="a smoke test: few steps, few windows")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.time()
    teacher, tok = load_teacher(args.teacher, device=dev)
    teacher.eval()
    L = teacher.config.num_hidden_layers
    k = L // 2
    print(f"teacher loaded in {time.time() - t0:.0f} s", flush=True)

    q = args.quick
    tasks = code_tasks("code:calib")
    calib_tasks, dev_tasks = tasks[:400], tasks[-(8 if args.quick else 64):]
    dev_ids, dev_mask = chat_windows(tok, dev_tasks, 512)
    val = token_windows("code:eval", tok, window=512, n_windows=2 if q else 8)
    wiki = token_windows("wiki:eval", tok, window=512, n_windows=1 if q else 4)
    problems = load_problems(limit=args.humaneval)
    style = prompt_style(tok)
    prompts = [build_prompt(p, tok, style) for p in problems]
    lengths = [int(x) for x in args.passkey.split(",") if x.strip()]
    passkey = retrieval_probes(tok, lengths, args.passkey_samples, batch_size=16 if dev == "cuda" else 2)

    def measure(model, name) -> dict:
        t = time.time()
        r = {"code_ppl": window_ppl(model, val, batch_size=4, progress=False),
             "wiki_ppl": window_ppl(model, wiki, batch_size=4, progress=False),
             "dev_answer_nll": answer_nll(model, dev_ids, dev_mask)}
        if model is not teacher:
            r["dev_answer_kl"] = mean_kl(model, teacher, dev_ids, 8, mask=dev_mask)
        comps = generate_tcal(model, tok, prompts, style, batch_size=len(prompts) if dev == "cuda" else 8)
        res = score(problems, comps, style, limits=Limits(), workers=args.workers, allow_code_execution=True)
        r["pass@1"], r["passed"] = pass_at_1(res), sum(x.passed for x in res)
        r.update({name: probe(model) for name, probe in passkey.items()})
        write_json(out / f"humaneval-{name}.json", [dataclasses.asdict(x) for x in res])
        r["measure_s"] = time.time() - t
        return r

    results = {}
    rfile = out / "results.json"

    def record(name, r):
        results[name] = r
        write_json(rfile, results)
        print(name, json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()
                                if k not in ("keep",)}), flush=True)

    record("teacher", measure(teacher, "teacher"))

    # 1. scores
    sfile = out / "scores.json"
    scores = json.loads(sfile.read_text()) if sfile.exists() else {}
    t = time.time()
    if "ar" not in scores:
        w = validation_windows(tok, SelectionConfig(data="code:calib", window=512, val_windows=2 if q else 8))
        scores["ar"] = removal_scores(teacher, lambda: window_ppl(teacher, w, batch_size=4, progress=False),
                                      desc="ar", progress=False)
    if "answers" not in scores:
        a_ids, a_mask = chat_windows(tok, calib_tasks[:8 if q else 48], 512)
        scores["answers"] = removal_scores(teacher, lambda: answer_nll(teacher, a_ids, a_mask), desc="answers",
                                           progress=False)
    if "answers8" not in scores:  # what a CPU can afford: how much of the 48-task ranking do 8 tasks give?
        a_ids, a_mask = chat_windows(tok, calib_tasks[:8], 512)
        scores["answers8"] = removal_scores(teacher, lambda: answer_nll(teacher, a_ids, a_mask), desc="answers8",
                                            progress=False)
    if "niah" not in scores:
        cfg = SelectionConfig(niah_samples=2 if q else 8, niah_length=512 if q else 2048)
        scores["niah"] = niah_scores(teacher, tok, cfg, progress=False)
    scores["seconds"] = time.time() - t
    write_json(sfile, scores)
    keeps = {"uniform": list(range(0, L, 2)), "ar": top(scores["ar"], k), "answers": top(scores["answers"], k),
             "niah": top(scores["niah"], k), "answers8": top(scores["answers8"], k)}
    niah_first = top(scores["niah"], k // 2)
    rest = [i for i in sorted(range(L), key=lambda i: -scores["answers"][i]) if i not in niah_first]
    keeps["answers+niah"] = sorted(niah_first + rest[:k - len(niah_first)])
    print("keep sets", json.dumps(keeps), flush=True)

    ref_align = AlignConfig(steps=10 if q else 300)
    ref_kl = KLConfig(steps=4 if q else 40, batch_size=3)

    def run(name, keep, *, windows=4, align=ref_align, chat=0):
        t = time.time()
        ids = calibration_ids(CALIB, tok, 256, windows)
        init = "taylor-exact-silent" if chat else "taylor"
        conv = convert_with_record(teacher, keep, init, calib_ids=ids, align=align,
                                   **({} if chat else {"kl": ref_kl}), share_weights=True)
        hybrid, rec = conv.hybrid, {"keep": keep, "calib_windows": windows, "chat_windows": chat}
        if chat:
            c_ids, c_mask = chat_windows(tok, calib_tasks, 512)
            c_ids, c_mask = c_ids[:chat + max(2, chat // 4)], c_mask[:chat + max(2, chat // 4)]
            rec["kl"] = {k: v for k, v in kl_stage(hybrid, teacher, c_ids[:chat], c_ids[chat:], ref_kl,
                                                   train_mask=c_mask[:chat], heldout_mask=c_mask[chat:]).items()
                         if k in ("steps_run", "best_step", "heldout_kl_before", "heldout_kl", "wall_s")}
        else:
            d = conv.record["detail"].get("kl") or {}
            rec["kl"] = {k: d.get(k) for k in ("steps_run", "best_step", "heldout_kl_before", "heldout_kl", "wall_s")}
        rec["convert_s"] = time.time() - t
        rec.update(measure(hybrid, name))
        record(name, rec)
        del hybrid, conv
        if dev == "cuda":
            torch.cuda.empty_cache()

    for name in args.keeps.split(","):
        run(f"{name}/reference", keeps[name])
    ref = {n: r for n, r in results.items() if n.endswith("/reference")}
    bk = (min(ref, key=lambda n: ref[n]["dev_answer_kl"]).split("/")[0] if args.budget_keep == "best"
          else args.budget_keep)
    p2 = AlignConfig(steps=10 if q else 300, batch_size=4)
    for b in [x for x in args.budgets.split(",") if x]:
        run(f"{bk}/{b}", keeps[bk], windows=(4 if q else args.p2_windows) if "p2" in b else 4,
            align=p2 if "p2" in b else ref_align, chat=(2 if q else args.chat_windows) if "chat" in b else 0)
    print(f"done in {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
