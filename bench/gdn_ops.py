"""Time the gated delta rule implementations and print a table.

    python bench/gdn_ops.py                      # CPU defaults (B=1, T=1024, H=4, D=64)
    python bench/gdn_ops.py --B 4 --T 4096 --H 16 --D 128 --dtype bfloat16   # GPU, fla vs chunked PyTorch

Times are medians over --reps runs after --warmup runs; on CUDA with device events.
Also reports the relative error of each implementation's output against the fp32 token loop
(on a shorter prefix when the loop would be too slow to run at full length).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from tcal.ops import (
    chunk_gated_delta_rule_torch,
    chunk_scan_gated_delta_rule_torch,
    fla_available,
    fla_backward_ok,
    gated_delta_rule,
    naive_recurrent_gated_delta_rule,
)
from tcal.utils.runtime import resolve_device, resolve_dtype


def make_inputs(B, T, H, D, dtype, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, D, device=device, generator=g), dim=-1).to(dtype)
    k = F.normalize(torch.randn(B, T, H, D, device=device, generator=g), dim=-1).to(dtype)
    v = torch.randn(B, T, H, D, device=device, generator=g).to(dtype)
    gate = -F.softplus(torch.randn(B, T, H, device=device, generator=g)).float() * 0.1
    beta = torch.rand(B, T, H, device=device, generator=g).to(dtype)
    return q, k, v, gate, beta


def timeit(fn, warmup, reps, device):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--B", type=int, default=1)
    p.add_argument("--T", type=int, default=1024)
    p.add_argument("--H", type=int, default=4)
    p.add_argument("--D", type=int, default=64)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    p.add_argument("--impls", default="naive,chunk,fla")
    p.add_argument("--chunk-size", type=int, default=64)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--naive-max-T", type=int, default=4096, help="skip timing the token loop beyond this length")
    p.add_argument("--backward", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--json", help="also write the rows to this JSON file")
    args = p.parse_args(argv)
    device, dtype = torch.device(resolve_device(args.device)), resolve_dtype(args.dtype)
    torch.manual_seed(0)
    if device.type == "cpu":
        torch.set_num_threads(torch.get_num_threads())

    impls = {
        "naive": lambda *x: naive_recurrent_gated_delta_rule(*x, output_final_state=True),
        "chunk": lambda *x: chunk_gated_delta_rule_torch(*x, output_final_state=True, chunk_size=args.chunk_size),
        "scan": lambda *x: chunk_scan_gated_delta_rule_torch(*x, output_final_state=True, chunk_size=args.chunk_size),
    }
    if "compile" in args.impls.split(","):  # torch.compile'd chunked path (static shapes; compiles on first call)
        compiled = torch.compile(chunk_gated_delta_rule_torch, dynamic=False)
        impls["compile"] = lambda *x: compiled(*x, output_final_state=True, chunk_size=args.chunk_size)
    if fla_available() and device.type == "cuda":
        impls["fla"] = lambda *x: gated_delta_rule(*x, output_final_state=True, backend="fla")
    wanted = [i for i in args.impls.split(",") if i in impls]

    # Accuracy vs the fp32 loop on a prefix short enough to run the loop.
    T_ref = min(args.T, 1024)
    ref_in = make_inputs(args.B, T_ref, args.H, args.D, torch.float32, device, seed=1)
    o_ref, _ = naive_recurrent_gated_delta_rule(*ref_in)
    rows = []
    for name in wanted:
        fn = impls[name]
        test_in = [x.to(dtype) if x.dtype != torch.float32 or i in (0, 1, 2) else x for i, x in enumerate(ref_in)]
        with torch.no_grad():
            o, _ = fn(*test_in)
        err = ((o.double() - o_ref.double()).norm() / o_ref.double().norm()).item()
        row = {"impl": name, "B": args.B, "T": args.T, "H": args.H, "D": args.D, "dtype": args.dtype,
               "device": str(device), f"rel_err_vs_loop_T{T_ref}": err}
        if name == "naive" and args.T > args.naive_max_T:
            row["fwd_ms"] = row["fwd_bwd_ms"] = None
            rows.append(row)
            continue
        x = make_inputs(args.B, args.T, args.H, args.D, dtype, device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        with torch.no_grad():
            row["fwd_ms"] = timeit(lambda: fn(*x), args.warmup, args.reps, device)
        if args.backward and name == "fla" and not fla_backward_ok():
            row["fwd_bwd_ms"] = None
            row["note"] = "fla refuses its gated backward on Hopper + Triton < 3.7.1 (fla #640)"
        elif args.backward:
            xg = [t.clone().requires_grad_() for t in x]

            def fwd_bwd():
                o, s = fn(*xg)
                (o.float().sum() + s.sum()).backward()

            reps = 1 if name == "naive" else args.reps
            row["fwd_bwd_ms"] = timeit(fwd_bwd, 1 if name == "naive" else args.warmup, reps, device)
        if device.type == "cuda":
            row["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 2**30
        row["fwd_tokens_per_s"] = args.B * args.T / (row["fwd_ms"] / 1e3)
        rows.append(row)

    print(f"\ngated delta rule, B={args.B} T={args.T} H={args.H} D={args.D} {args.dtype} on {device}"
          f" ({torch.cuda.get_device_name() if device.type == 'cuda' else f'{torch.get_num_threads()} threads'})")
    print(f"{'impl':8} {'fwd ms':>10} {'fwd+bwd ms':>11} {'fwd Mtok/s':>11} {'rel err':>9}")
    for r in rows:
        fmt = lambda v, f: f"{v:{f}}" if v is not None else "skipped"  # noqa: E731
        err = next(v for k, v in r.items() if k.startswith("rel_err"))
        print(f"{r['impl']:8} {fmt(r.get('fwd_ms'), '10.2f'):>10} {fmt(r.get('fwd_bwd_ms'), '11.2f'):>11} "
              f"{fmt(r.get('fwd_tokens_per_s', None) and r['fwd_tokens_per_s'] / 1e6, '11.3f'):>11} {err:9.1e}")
    for r in rows:
        if r.get("note"):
            print(f"note ({r['impl']}): {r['note']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return rows


if __name__ == "__main__":
    main()
