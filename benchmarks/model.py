"""Decode and prefill of the Llama-3-8B shape (random weights, bf16) through
`python -m fusedist.generate`, fusedist beside its plain-torch baseline in the same process.

    python benchmarks/model.py                      # batch 1 (4K prompt) and batch 64 (4K context)
    python benchmarks/model.py --rows 1:4096:0:64   # batch:prompt_len:context_fill:new_tokens

Per row: prefill ms and model TFLOP/s per GPU, ms per decode step (step_ms: graph replays
back to back; ms/token: the generate loop, sampling included), tokens/s, the speedup over
torch, and the kernel-time breakdown of one step. Targets (one H200, TP 1): batch 1 <= 3.7 ms
per step, batch 64 <= 11.0 ms, prefill of 4K tokens >= 550 TFLOP/s. Writes
results/<gpu>-w<tp>/model.{json,md} (FUSEDIST_RESULTS_DIR replaces benchmarks/results).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import ROOT, metadata, write_results  # noqa: E402

TARGETS = {1: 3.7, 64: 11.0}
PREFILL_TARGET = 550.0


def run_row(cfg, batch, prompt_len, fill, new, tp, timeout):
    cmd = [sys.executable, "-P", "-m", "fusedist.generate", "--config", cfg, "--random-weights",
           "--batch", str(batch), "--prompt-len", str(prompt_len), "--context-fill", str(fill),
           "--max-new-tokens", str(new), "--baseline", "torch", "--profile", "--json", "--quiet"]
    if tp > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(tp)] + \
              cmd[2:3] + ["fusedist.generate"] + cmd[4:]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{p.stderr[-3000:]}")
    out = json.loads(p.stdout.splitlines()[-1])
    if any(k in r for r in out["timings"].values() for k in ("error", "graph_error",
                                                            "profile_error")):
        print(p.stderr[-4000:], flush=True)
    return " ".join(cmd[cmd.index("fusedist.generate") - 1:]), out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="llama-3-8b")
    ap.add_argument("--rows", nargs="*", default=["1:4096:0:64", "64:16:4000:32"])
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--timeout", type=int, default=300)
    args = ap.parse_args()
    rows, md = [], ["| batch | context | backend | prefill ms | prefill TFLOP/s/GPU | step ms | "
                    "ms/token | tokens/s | speedup | target step ms | "
                    "GEMM / attn / comm / other us |",
                    "|---|---|---|---|---|---|---|---|---|---|---|"]
    for spec in args.rows:
        b, L, fill, new = map(int, spec.split(":"))
        try:
            cmd, out = run_row(args.config, b, L, fill, new, args.tp, args.timeout)
        except Exception as e:  # noqa: BLE001 - a failing row is reported, the others still run
            print(f"row {spec}: {e}", flush=True)
            continue
        t = out["timings"]
        for backend, r in t.items():
            if "error" in r:
                print(f"row {spec} {backend}: {r}", flush=True)
                md.append(f"| {b} | {fill + L}+{new} | {backend} | failed: {r['error'][:80]} |")
                continue
            prof = r.get("profile_us", {})
            row = {"batch": b, "prompt_len": L, "context_fill": fill, "new_tokens": new,
                   "context": fill + L + new, "backend": backend, "command": cmd,
                   "speedup_vs_torch": round(t["torch"]["step_ms"] / r["step_ms"], 3)
                   if "step_ms" in t.get("torch", {}) else None,
                   "target_step_ms": TARGETS.get(b) if backend == "fusedist" else None,
                   **{k: v for k, v in r.items() if k != "profile_us"},
                   "profile_us": {k: v for k, v in prof.items() if k != "top"},
                   "top_kernels_us": prof.get("top")}
            rows.append(row)
            br = " / ".join(str(prof.get(k, "-")) for k in ("gemm", "attention",
                                                             "communication", "other"))
            md.append(f"| {b} | {fill + L}+{new} | {backend} | {r['prefill_ms']} | "
                      f"{r['prefill_tflops_per_gpu']} | {r['step_ms']} | {r['ms_per_token']} | "
                      f"{r['tokens_per_s']} | {row['speedup_vs_torch']} | "
                      f"{row['target_step_ms'] or ''} | {br} |")
        print(f"row {spec}: ids equal across backends: {out.get('torch_ids_match')}", flush=True)
        print("\n".join(md[-len(t):]), flush=True)
        print(json.dumps({k: v.get("profile_us", {}).get("top") for k, v in t.items()}),
              flush=True)
    meta = metadata(args.tp)
    meta["config"] = args.config
    text = "\n".join(md) + (f"\n\nTargets: step ms at batch 1 <= {TARGETS[1]}, batch 64 <= "
                            f"{TARGETS[64]}; prefill of 4K tokens >= {PREFILL_TARGET} TFLOP/s.")
    print(text, flush=True)
    for p in write_results("model", meta, rows, text):
        print(f"wrote {p}")


if __name__ == "__main__":
    main()
