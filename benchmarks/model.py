"""Decode and prefill of the Llama-3-8B shape (random weights, bf16) through the model
harness (benchmarks/_model_run.py: what `python -m fusedist.generate --baseline ...` runs),
fusedist beside its baselines in the same process; with --moe, the mixtures of experts
(MOE_RUNS: Qwen3-30B-A3B bf16 and FP8, Mixtral-8x7B FP8).

    python benchmarks/model.py                      # batch 1 (4K prompt) and batch 64 (4K context)
    python benchmarks/model.py --rows 1:4096:0:64   # batch:prompt_len:context_fill:new_tokens
    python benchmarks/model.py --baselines torch    # without the compiled anchor
    python benchmarks/model.py --quantize fp8       # FP8 projections (fusedist and baselines)
    python benchmarks/model.py --ttft               # time to first token: 1 / 128 / 4K tokens
                                                    # behind 0 / 4000 cached, prefill graphs on
    python benchmarks/model.py --quantize fp8 --baselines torch   # FP8, both default rows
    python benchmarks/model.py --quantize fp8 --kv-dtype fp8 --baselines torch  # + FP8 KV cache
    python benchmarks/model.py --moe                # MOE_RUNS, each with the default rows
    python benchmarks/model.py --config qwen3-30b-a3b --quantize fp8   # one of them

Baselines (--baselines, default torch,torch-compile): "torch", the same model in plain torch
ops with its decode step in the same CUDA graphs; "torch-compile", that decode step under
torch.compile(fullgraph=True, dynamic=False) before capture (prefill eager). Per row and
backend: prefill ms (the median of 3 warm, synchronized prefills) and model TFLOP/s per GPU,
ms per decode step (step_ms: graph replays back to back; ms/token: the generate loop, sampling
included), tokens/s, fusedist's speedup per step over each baseline, and the kernel-time
breakdown of one decode step and of one prefill. Targets (one H200, TP 1): batch 1 <= 3.7 ms
per step, batch 64 <= 11.0 ms, prefill of 4K tokens >= 550 TFLOP/s; with FP8 projection weights
batch 1 <= 2.1 ms, batch 64 <= 10.0 ms (FP8_TARGETS). Writes
results/<gpu>-w<tp>/model.{json,md} (FUSEDIST_RESULTS_DIR replaces benchmarks/results); each
row's time_us is its step time, so benchmarks/compare.py --fusedist fusedist compares files.
--merge adds this run's rows to the file's rows of other specs (one command per row).
--quantize (fusedist.generate --quantize: fp8, fp8-tensor, fp8-block) runs every backend with
FP8 projection weights quantized at load; its rows name the weight format ("weights") and go to
model-<quantize>.{json,md}. Memory of the batch-64 row (4048-token context, bf16 KV cache) per
backend, one after the other in one process: FP8 weights ~8.5 GiB (bf16 ~15.0), KV cache 31.6
GiB, activations ~4.3 GiB (fusedist.generate.memory_estimate; the torch baseline's static cache
is as large), well within an H200's 141 GB.
--config names a shipped shape (fusedist.models.llama.NAMED); another config than llama-3-8b
writes model-<config>[-<quantize>].{json,md}. --moe runs MOE_RUNS one after the other, each
with the default rows (batch 1 over a 4K prompt, batch 64 behind 4000 cached tokens) beside
torch and torch.compile, into its own file; its targets (MOE_TARGETS, one H200, TP 1): step
ms at batch 1 Qwen3-30B-A3B bf16 <= 2.0, FP8 <= 1.4, Mixtral-8x7B FP8 <= 3.4, each >= 1.5x
torch.compile ("target_vs_compile"); batch 64 Qwen3-30B-A3B FP8 <= 9.0. The MoE weights
random-initialized, quantized at load and compiled three times a row take minutes: --moe's
rows time out after MOE_TIMEOUT seconds (--timeout overrides it). Memory, one backend at a
time: Qwen3-30B-A3B 61 GB bf16 / 31 GB FP8, Mixtral-8x7B 47 GB FP8, plus the batch-64 KV cache
(25 GB / 34 GB).
--ttft: rows of batch 1, prompts of 1, 128 and 4096 tokens behind 0 and 4000 cached tokens,
beside the torch baseline, fusedist with --prefill-graph-tokens (fusedist.generate's default
512, every row; 0 replays nothing); a table of prefill ms (the first token's forward: the median of 3 warm prefills,
host included) and fusedist's ratio, to model-ttft[-<quantize>].{json,md}. Target: 128 tokens
behind 4000 <= 6 ms and >= 1.5x torch.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import (RESULTS, ROOT, machine_dir, metadata, reproduce_command,  # noqa: E402
                      write_results)

HARNESS = Path(__file__).resolve().parent / "_model_run.py"
TARGETS = {1: 3.7, 64: 11.0}          # ms per decode step by batch, bf16 weights
FP8_TARGETS = {1: 2.1, 64: 10.0}      # the same, FP8 projection weights (--quantize fp8*)
# The mixtures of experts: (config, FP8 weights) -> ms per decode step by batch; at batch 1
# also fusedist's speedup over torch.compile of the same model (MOE_VS_COMPILE).
MOE_TARGETS = {("qwen3-30b-a3b", False): {1: 2.0}, ("qwen3-30b-a3b", True): {1: 1.4, 64: 9.0},
               ("mixtral-8x7b", True): {1: 3.4}}
MOE_VS_COMPILE = 1.5
MOE_RUNS = [("qwen3-30b-a3b", "none"), ("qwen3-30b-a3b", "fp8"), ("mixtral-8x7b", "fp8")]
MOE_TIMEOUT = 1800
DEFAULT_CONFIG = "llama-3-8b"
TTFT_ROWS = ["1:1:0:2", "1:128:0:2", "1:4096:0:2", "1:1:4000:2", "1:128:4000:2", "1:4096:4000:2"]
TTFT_TARGET = {"ms": 6.0, "vs_torch": 1.5}   # 128 tokens behind 4000
PREFILL_TARGET = 550.0
CLASSES = ("gemm", "attention", "communication", "other")


def run_row(cfg, batch, prompt_len, fill, new, tp, baselines, timeout, compile_backend,
            quantize="none", prefill_graph_tokens=512, kv_dtype="auto"):
    cmd = [sys.executable, "-P", str(HARNESS), "--config", cfg, "--random-weights",
           "--batch", str(batch), "--prompt-len", str(prompt_len), "--context-fill", str(fill),
           "--max-new-tokens", str(new), "--baseline", baselines, "--profile", "--json",
           "--quiet"] + (["--compile-backend", compile_backend] if compile_backend != "inductor"
                         else []) + (["--quantize", quantize] if quantize != "none" else []) + \
        ["--prefill-graph-tokens", str(prefill_graph_tokens)] + \
        (["--kv-dtype", kv_dtype] if kv_dtype != "auto" else [])
    if tp > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(tp)] + \
              cmd[2:]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                           filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))))
    out = report_of(cmd, p)
    if p.returncode != 0:
        print(p.stderr[-4000:], flush=True)
    return " ".join([f"benchmarks/{HARNESS.name}"] + cmd[cmd.index(str(HARNESS)) + 1:]), out


def report_of(cmd, p: subprocess.CompletedProcess) -> dict:
    """The JSON report of a generate run. Exit status 1 with a report: a backend failed (its
    timings say how, and its row records it); without one, or any other status, the run failed
    as a whole (RuntimeError with its stderr)."""
    out = None
    lines = p.stdout.strip().splitlines()
    if p.returncode in (0, 1) and lines:
        try:
            out = json.loads(lines[-1])
        except ValueError:
            out = None
    if not isinstance(out, dict) or "timings" not in out:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit status {p.returncode}):\n"
                           f"{p.stderr[-3000:]}")
    return out


def targets(quantize: str = "none", config: str = DEFAULT_CONFIG) -> dict:
    """The step-time targets (ms by batch) of `config` with the weights --quantize names."""
    if config != DEFAULT_CONFIG:
        return MOE_TARGETS.get((config, quantize != "none"), {})
    return TARGETS if quantize == "none" else FP8_TARGETS


def rows_of(spec: tuple, cmd: str, out: dict, quantize: str = "none",
            config: str = DEFAULT_CONFIG) -> list[dict]:
    """One result row per backend of one generate run (its targets: targets(quantize,
    config); a mixture of experts' batch-1 fusedist row also target_vs_compile)."""
    b, L, fill, new = spec
    t = out["timings"]
    bases = [k for k in t if k != "fusedist"]
    fd = t.get("fusedist", {})
    rows = []
    for backend, r in t.items():
        row = {"batch": b, "prompt_len": L, "context_fill": fill, "new_tokens": new,
               "context": fill + L + new, "backend": backend, "command": cmd,
               "weights": out.get("weights")}
        if "error" in r:
            rows.append({**row, "status": "failed", **r})
            continue
        prof, pre = r.get("profile_us", {}), r.get("prefill_profile_us", {})
        row.update({
            "time_us": round(r["step_ms"] * 1e3, 1),
            "speedup_vs": {k: round(t[k]["step_ms"] / r["step_ms"], 3) for k in bases
                           if "step_ms" in t[k]} if backend == "fusedist" else {},
            "fusedist_speedup": round(r["step_ms"] / fd["step_ms"], 3)
            if backend != "fusedist" and "step_ms" in fd else None,
            "target_step_ms": targets(quantize, config).get(b) if backend == "fusedist"
            else None,
            "target_vs_compile": MOE_VS_COMPILE if backend == "fusedist" and b == 1 and
            (config, quantize != "none") in MOE_TARGETS else None,
            **{k: v for k, v in r.items() if k not in ("profile_us", "prefill_profile_us")},
            "profile_us": {k: v for k, v in prof.items() if k != "top"},
            "top_kernels_us": prof.get("top"),
            "prefill_profile_us": {k: v for k, v in pre.items() if k != "top"},
            "prefill_top_kernels_us": pre.get("top")})
        # The plain-torch speedup under its long-standing name.
        row["speedup_vs_torch"] = round(t["torch"]["step_ms"] / r["step_ms"], 3) \
            if "step_ms" in t.get("torch", {}) else None
        rows.append(row)
    return rows


def _ms(us) -> str:
    return "-" if us is None else f"{us / 1e3:.2f}"


def _bubbles(t) -> str:
    """The step's idle device time: the profiled steps' wall minus the time a kernel runs."""
    return "-" if not t else f"{t['bubble_us']} ({t['bubble_pct']:.1f}%)"


def markdown(rows: list[dict], bases: list[str]) -> str:
    step = ["| batch | context | backend | prefill ms | prefill TFLOP/s/GPU | step ms | ms/token "
            "| tokens/s | " + " | ".join(f"fusedist vs {b}" for b in bases) +
            " | target step ms | decode GEMM / attn / comm / other us | step bubbles us (%) |",
            "|---" * (11 + len(bases)) + "|"]
    pre = ["| batch | context | backend | prefill ms | kernels ms | GEMM / attn / comm / other ms "
           "| kernels | top kernels (ms) |", "|---" * 8 + "|"]
    for r in rows:
        ctx = f"{r['context_fill'] + r['prompt_len']}+{r['new_tokens']}"
        if r.get("status") == "failed":
            step.append(f"| {r['batch']} | {ctx} | {r['backend']} | failed: "
                        f"{str(r.get('error'))[:80]} |")
            continue
        sv = r["speedup_vs"]
        prof, p = r["profile_us"], r["prefill_profile_us"]
        step.append(
            f"| {r['batch']} | {ctx} | {r['backend']} | {r['prefill_ms']} | "
            f"{r['prefill_tflops_per_gpu']} | {r['step_ms']} | {r['ms_per_token']} | "
            f"{r['tokens_per_s']} | " + " | ".join(str(sv.get(b, "")) for b in bases) +
            f" | {r['target_step_ms'] or ''} | "
            + " / ".join(str(prof.get(k, "-")) for k in CLASSES) + " | "
            + _bubbles(r.get("timeline_us")) + " |")
        top = "; ".join(f"{n[:60]} {v / 1e3:.2f}" for n, v in (r["prefill_top_kernels_us"]
                                                              or [])[:3])
        pre.append(f"| {r['batch']} | {ctx} | {r['backend']} | {r['prefill_ms']} | "
                   f"{_ms(p.get('total'))} | "
                   + " / ".join(_ms(p.get(k)) for k in CLASSES) +
                   f" | {p.get('kernels', '-')} | {top} |")
    return "\n".join(step) + "\n\nPrefill, one profiled prefill per backend (kernel time; " \
        "on a GPU, prefill ms minus kernels ms is host time and launch gaps):\n\n" + "\n".join(pre)


SPEC = ("batch", "prompt_len", "context_fill", "new_tokens")


def stem(quantize: str = "none", ttft: bool = False, kv_dtype: str = "auto",
         config: str = DEFAULT_CONFIG) -> str:
    """The results file's stem: model, model-<quantize> for FP8 runs; model-ttft[-<quantize>]
    for the --ttft rows; -kv<dtype> with --kv-dtype (fusedist's KV cache); a config other than
    llama-3-8b after "model" (model-qwen3-30b-a3b-fp8)."""
    base = "model-ttft" if ttft else "model"
    base = base if config == DEFAULT_CONFIG else f"{base}-{config}"
    base = base if quantize == "none" else f"{base}-{quantize}"
    return base if kv_dtype == "auto" else f"{base}-kv{kv_dtype}"


def ttft_markdown(rows: list[dict]) -> str:
    """Time to first token per (prompt, cached tokens): each backend's prefill ms and
    fusedist's ratio to each baseline."""
    by = {}
    for r in rows:
        if r.get("status") != "failed":
            by.setdefault((r["prompt_len"], r["context_fill"]), {})[r["backend"]] = r
    bases = sorted({b for v in by.values() for b in v if b != "fusedist"})
    out = ["| prompt tokens | cached | fusedist ms | " + " | ".join(f"{b} ms" for b in bases) +
           " | " + " | ".join(f"fusedist vs {b}" for b in bases) + " | prefill graphs |",
           "|---" * (4 + 2 * len(bases)) + "|"]
    for (L, fill), v in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        fd = v.get("fusedist", {}).get("prefill_ms")
        ms = [v.get(b, {}).get("prefill_ms") for b in bases]
        ratio = [f"{m / fd:.2f}x" if m and fd else "-" for m in ms]
        out.append(f"| {L} | {fill} | {fd if fd is not None else '-'} | "
                   + " | ".join(str(m) if m is not None else "-" for m in ms) + " | "
                   + " | ".join(ratio) + f" | {v.get('fusedist', {}).get('prefill_graphs', '-')} |")
    return "\n".join(out)


def merged(rows: list[dict], meta: dict, quantize: str = "none", ttft: bool = False,
           kv_dtype: str = "auto", config: str = DEFAULT_CONFIG) -> list[dict]:
    """rows added to the current results file's rows of other specs (--merge): rows of one
    commit, measured by several commands (one row per command keeps each within a time
    limit). meta's command and reproduce name every command."""
    path = Path(os.environ.get("FUSEDIST_RESULTS_DIR") or RESULTS) / machine_dir(meta) / \
        f"{stem(quantize, ttft, kv_dtype, config)}.json"
    if not path.is_file():
        return rows
    doc = json.loads(path.read_text())
    old = doc.get("meta", {})
    if old.get("commit") != meta["commit"]:
        raise SystemExit(f"benchmarks/model.py --merge: {path} holds rows of commit "
                         f"{old.get('commit')}, this run is {meta['commit']}; merge rows of one "
                         "commit (or run without --merge)")
    new = {tuple(r[k] for k in SPEC) for r in rows}
    keep = [r for r in doc.get("rows", []) if tuple(r.get(k) for k in SPEC) not in new]
    meta["command"] = f"{old['command']} && {meta['command']}"
    meta["reproduce"] = f"{old.get('reproduce', old['command'])} && {reproduce_command(meta)}"
    return keep + rows


def plot(rows: list[dict], path, config: str = DEFAULT_CONFIG) -> None:
    """Step time per backend and batch, stacked by kernel class where the row was profiled
    (GEMM, attention, communication, other; the rest of the step, launch gaps included, on
    top): one panel per (batch, context)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({(r["batch"], r["context"]) for r in rows})
    fig, axes = plt.subplots(1, len(keys), figsize=(max(6.5, 4.2 * len(keys)), 3.8), squeeze=False)
    colors = {"gemm": "#4c72b0", "attention": "#dd8452", "communication": "#55a868",
              "other": "#8172b3", "rest": "#c7c7c7"}
    for ax, (b, ctx) in zip(axes[0], keys):
        rs = [r for r in rows if (r["batch"], r["context"]) == (b, ctx) and r.get("step_ms")]
        for i, r in enumerate(rs):
            prof, bottom = r.get("profile_us") or {}, 0.0
            for cls in CLASSES:
                v = prof.get(cls, 0.0) / 1e3
                ax.bar(i, v, bottom=bottom, color=colors[cls], label=cls if i == 0 else None)
                bottom += v
            ax.bar(i, max(r["step_ms"] - bottom, 0.0), bottom=bottom, color=colors["rest"],
                   label="rest of the step" if i == 0 else None)
            ax.text(i, r["step_ms"], f"{r['step_ms']:.2f}", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(rs)), [r["backend"] for r in rs], fontsize=8)
        ax.set_title(f"batch {b}, context {ctx}", fontsize=9)
        ax.set_ylabel("ms per decode step")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=7, loc="lower center", ncol=len(labels))
    w = {f"{r['weights'].get('format', '?')} ({r['weights'].get('scales', '?')})"
         for r in rows if isinstance(r.get("weights"), dict)}
    name = "Llama-3-8B" if config == DEFAULT_CONFIG else config
    fig.suptitle(f"{name} shape, TP 1" + (f", {', '.join(sorted(w))} weights" if w else "") +
                 ":\none decode step (CUDA graphs) and its kernel time", fontsize=9)
    fig.tight_layout(rect=(0, 0.07, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=DEFAULT_CONFIG,
                    help="a shipped shape: llama-3-8b (default), qwen3-30b-a3b, mixtral-8x7b, "
                    "...")
    ap.add_argument("--rows", nargs="*", default=["1:4096:0:64", "64:16:4000:32"])
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--baselines", default="torch,torch-compile",
                    help="fusedist.generate --baseline: comma-separated torch, torch-compile")
    ap.add_argument("--compile-backend", default="inductor",
                    help="torch.compile backend of the torch-compile baseline")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per row (compiling the "
                    "8B decode step for torch-compile takes minutes)")
    ap.add_argument("--quantize", default="none",
                    choices=("none", "fp8", "fp8-channel", "fp8-tensor", "fp8-block"),
                    help="fusedist.generate --quantize: FP8 projection weights for every backend")
    ap.add_argument("--plot-only", metavar="JSON",
                    help="redraw the plot of a results file (results/<gpu>-w<N>/model*.json) "
                         "beside it, without running anything")
    ap.add_argument("--ttft", action="store_true",
                    help="the time-to-first-token rows (TTFT_ROWS) beside torch, to model-ttft")
    ap.add_argument("--prefill-graph-tokens", type=int, default=None, metavar="N",
                    help="fusedist.generate --prefill-graph-tokens (default 512, its default; 0: "
                    "eager prefill)")
    ap.add_argument("--kv-dtype", default="auto", choices=("auto", "fp8"),
                    help="fusedist.generate --kv-dtype: fusedist's KV cache (results to "
                    "<stem>-kvfp8)")
    ap.add_argument("--moe", action="store_true",
                    help="the mixture-of-experts runs (MOE_RUNS: qwen3-30b-a3b bf16 and fp8, "
                    "mixtral-8x7b fp8), each with --rows, to its own results file")
    ap.add_argument("--merge", action="store_true",
                    help="keep the results file's rows of other specs (same commit): one "
                    "command per row, one file")
    args = ap.parse_args()
    if args.plot_only:
        src = Path(args.plot_only)
        doc = json.loads(src.read_text())
        plot(doc["rows"], src.with_suffix(".png"), doc.get("meta", {}).get("config",
                                                                          DEFAULT_CONFIG))
        print(f"wrote {src.with_suffix('.png')}")
        return
    graphs = args.prefill_graph_tokens
    if args.ttft:
        if args.rows == ap.get_default("rows"):
            args.rows = TTFT_ROWS
        if args.baselines == ap.get_default("baselines"):
            args.baselines = "torch"   # torch-compile's prefill is the eager torch one
    graphs = 512 if graphs is None else graphs   # fusedist.generate's default
    bases = [b.strip() for b in args.baselines.split(",") if b.strip() and b.strip() != "none"]
    if not args.moe:
        run_set(args, args.config, args.quantize, bases, graphs)
        return
    if args.timeout == ap.get_default("timeout"):
        args.timeout = MOE_TIMEOUT
    for config, quantize in MOE_RUNS:
        run_set(args, config, quantize, bases, graphs)


def target_text(quantize: str, config: str) -> str:
    """The results' line of targets for `config` with `quantize` weights."""
    goal = targets(quantize, config)
    steps = ", ".join(f"batch {b} <= {ms}" for b, ms in sorted(goal.items()))
    if not goal:
        return f"No targets for {config} with these weights."
    if config == DEFAULT_CONFIG:
        return (f"Targets: step ms at {steps}; prefill of 4K tokens >= {PREFILL_TARGET} "
                "TFLOP/s.")
    return (f"Targets: step ms at {steps} (one H200, TP 1); at batch 1 fusedist >= "
            f"{MOE_VS_COMPILE}x torch.compile of the same model.")


def run_set(args, config: str, quantize: str, bases: list, graphs: int) -> None:
    """args.rows of one (config, weights), into one results file."""
    rows = []
    for spec in args.rows:
        b, L, fill, new = map(int, spec.split(":"))
        try:
            cmd, out = run_row(config, b, L, fill, new, args.tp, args.baselines,
                               args.timeout, args.compile_backend, quantize, graphs,
                               args.kv_dtype)
        except Exception as e:  # noqa: BLE001 - a failing row is reported, the others still run
            print(f"{config} {quantize} row {spec}: {e}", flush=True)
            continue
        got = rows_of((b, L, fill, new), cmd, out, quantize, config)
        rows += got
        print(f"{config} {quantize} row {spec}: ids equal across backends: "
              f"{out.get('ids_match')}", flush=True)
        print(markdown(got, bases), flush=True)
        print(json.dumps({k: v.get("profile_us", {}).get("top") for k, v in
                          out["timings"].items()}), flush=True)
    meta = metadata(args.tp)
    meta["config"] = config
    meta["quantize"] = quantize
    meta["prefill_graph_tokens"] = graphs
    meta["kv_dtype"] = args.kv_dtype
    if args.merge:
        rows = merged(rows, meta, quantize, args.ttft, args.kv_dtype, config)
    if args.ttft:
        for r in rows:
            if r["backend"] == "fusedist":
                r["prefill_graphs"] = graphs
        text = ttft_markdown(rows) + (
            f"\n\nprefill ms: the first token's forward, the median of 3 warm prefills (host "
            f"included); fusedist with --prefill-graph-tokens {graphs}. Target: 128 tokens "
            f"behind 4000 <= {TTFT_TARGET['ms']} ms and >= {TTFT_TARGET['vs_torch']}x torch.")
        print(text, flush=True)
        for p in write_results(stem(quantize, True, args.kv_dtype, config), meta, rows, text):
            print(f"wrote {p}")
        return
    text = markdown(rows, bases) + "\n\n" + target_text(quantize, config) + (
        " prefill ms: the median of 3 warm prefills; torch-compile's prefill runs eagerly.")
    print(text, flush=True)
    for p in write_results(stem(quantize, kv_dtype=args.kv_dtype, config=config), meta, rows,
                           text, plot=lambda path: plot(rows, path, config)):
        print(f"wrote {p}")


if __name__ == "__main__":
    main()
