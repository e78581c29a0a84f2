"""The model benchmark's harness: fusedist beside its baselines on the same weights, in one
process, as `python -m fusedist.generate` runs it when given a benchmark flag (--baseline,
--profile, --prefill-reps, --compile-backend; or no model: the embedded default beside plain
torch), and as benchmarks/model.py runs it for each of its rows.

    python benchmarks/_model_run.py --config llama-3-8b --random-weights --batch 64 \\
        --context-fill 4000 --baseline torch,torch-compile --profile --json
    torchrun --nproc-per-node 2 benchmarks/_model_run.py --device cpu --baseline torch

It takes fusedist.generate's flags (and checks them there: fusedist.generate.prepare, which
agrees on them with every rank). Baselines run after fusedist: "torch" is the same model in
plain torch ops (F.linear, SDPA, F.rms_norm, torch.distributed), its decode step captured
into the same CUDA graphs; "torch-compile" is that model with the decode step's body under
torch.compile(fullgraph=True, dynamic=False) before capture (its prefill runs eagerly).
Timings per backend (docs/design/model.md has the table): prefill_ms, the median of
--prefill-reps warm prefills of the prompts (synchronized, apart from the generate loop);
ms_per_token, the generate loop; step_ms, graph replays back to back; --profile, one decode
step and one prefill under torch.profiler, and on a GPU the timeline of five steps as
step_ms runs them (timeline_us: wall, busy and idle device time per step). Results to stdout on rank 0 (one JSON object with
--json). On one process a backend's failure is reported in its timings (a failed CUDA-graph
run retried eagerly) and the others still run; the exit status is then 1.
"""

from __future__ import annotations

import gc
import json
import sys
import time

import torch

from fusedist import generate
from fusedist.generate import Progress


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    job = generate.prepare(generate.parse_args(argv))
    args, cfg, src, tok, prompts, dtype, rt = (job.args, job.cfg, job.src, job.tok,
                                                job.prompts, job.dtype, job.rt)
    import fusedist

    rank0 = rt.rank == 0
    prog = Progress(rank0 and not args.quiet)
    # Every rank streams (its collectives), rank 0 prints: the first sequence's text.
    args.stream_text = None
    if tok is not None and not args.json:
        args.stream_text = generate._text_printer(tok) if rank0 else (lambda t: None)
    device = rt.device
    try:
        results = {"fusedist": run_backend("fusedist", args, cfg, src, prompts, rt, dtype,
                                           device, prog, job.max_position)}
        for name in args.baselines:
            results[name] = run_backend(name, args, cfg, src, prompts, rt, dtype, device, prog,
                                        job.max_position)
    finally:
        prog.close()
    if rank0:
        if args.stream_text is not None:
            print(flush=True)            # ends the streamed text's line
        report(args, cfg, rt, dtype, prompts, results, tok)
        # The report stands; a backend's failure is also an error line and exit status 1.
        for line in failures(results):
            print(f"fusedist.generate: {line}", file=sys.stderr, flush=True)
    fusedist.shutdown()
    return 1 if failures(results) else 0


def prefill_flops(cfg, prompt_lens, context: int) -> float:
    """Model FLOPs of prefilling these prompts (2 per multiply-add; causal attention counted
    over the cached context plus the prompt's own triangle; the LM head on one token each)."""
    h, L = cfg.hidden_size, cfg.num_layers
    per_tok = 2.0 * (L * (h * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * h) +
                     sum(cfg.mlp_params(i)[1] for i in range(L)))   # a token's routed experts
    total = 0.0
    for n in prompt_lens:
        attn = 4.0 * L * cfg.q_size * (n * context + n * (n + 1) / 2)
        total += per_tok * n + attn + 2.0 * cfg.vocab_size * h
    return total


def run_backend(backend, args, cfg, src, prompts, rt, dtype, device, prog, max_position):
    """One backend's run; on one process a failure is reported in the result (and a failed
    CUDA-graph run is retried eagerly) so the other backends still run."""
    if rt.world_size > 1:
        return _run_backend(backend, args, cfg, src, prompts, rt, dtype, device, prog,
                            max_position, None)
    import traceback
    try:
        return _run_backend(backend, args, cfg, src, prompts, rt, dtype, device, prog,
                            max_position, None)
    except Exception as e:  # noqa: BLE001 - reported in the JSON, the run goes on
        prog.close()
        print(f"[{backend}] failed: {traceback.format_exc()}", file=sys.stderr, flush=True)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if args.no_graphs or device.type != "cuda":
            return {"error": f"{type(e).__name__}: {e}"}
        try:
            out = _run_backend(backend, args, cfg, src, prompts, rt, dtype, device, prog,
                               max_position, False)
        except Exception as e2:  # noqa: BLE001
            print(f"[{backend}] eager retry failed: {traceback.format_exc()}", file=sys.stderr)
            return {"error": f"{type(e).__name__}: {e}", "eager_error": f"{e2}"}
        out["graph_error"] = f"{type(e).__name__}: {e}"
        return out


def _round(d: dict) -> dict:
    return {k: (round(v, 1) if isinstance(v, float) else v) for k, v in d.items()}


def _run_backend(backend, args, cfg, src, prompts, rt, dtype, device, prog, max_position,
                 graphs):
    from statistics import median

    from fusedist.models import Runner, build_model

    compiled = backend == "torch-compile"
    longest = args.context_fill + max(len(p) for p in prompts) + args.max_new_tokens
    prog.note(f"[{backend}] building {cfg.name or 'model'} ({cfg.num_params() / 1e6:.1f} M params, "
              f"{dtype}, tp {rt.tp.size}) on {device}")
    t0 = time.perf_counter()
    model = build_model(cfg, src, backend="torch" if backend.startswith("torch") else backend,
                        group=rt.tp, dtype=dtype, device=device,
                        max_position=max_position, progress=prog.stage(f"[{backend}] loading"),
                        quantize=args.quantize, ep=getattr(args, "ep", False) and
                        backend == "fusedist")
    load_s = time.perf_counter() - t0
    budget = None if args.kv_budget_gb is None else int(args.kv_budget_gb * 2**30)
    runner = Runner(model, max_batch=len(prompts), max_seq_len=longest, page_size=args.page_size,
                    kv_budget_bytes=budget,
                    cuda_graphs=False if args.no_graphs else graphs,
                    prefill_chunk=args.prefill_chunk, compile_decode=compiled,
                    compile_backend=args.compile_backend,
                    prefill_graph_tokens=args.prefill_graph_tokens,
                    kv_dtype=generate._kv_dtype(args) if backend == "fusedist" else None)
    sp = args.defaults.sampling(greedy=True if args.greedy else None,
                                temperature=args.temperature, top_k=args.top_k,
                                top_p=args.top_p, seed=args.seed)
    eos = () if args.ignore_eos or args.random_weights else args.defaults.eos_token_ids
    try:
        # Warm-up outside the timed run, at the timed run's shapes: graph capture (and the
        # decode step's compilation), and the first calls of cuBLAS / cuDNN SDPA / the
        # allocator at the prompt's length (a first 4K-token SDPA call plans for hundreds of
        # ms). Its prefill and (with 2 or more new tokens) one decode step fit the cache the
        # timed run needs, so every request that fits the model runs.
        prog.note(f"[{backend}] warm-up" + (" (compiling the decode step)" if compiled else ""))
        t0 = time.perf_counter()
        runner.generate(prompts, min(2, args.max_new_tokens), sp, context_fill=args.context_fill)
        warm_s = time.perf_counter() - t0
        prefill = runner.time_prefill(prompts, start=args.context_fill, reps=args.prefill_reps)
        streamed = backend == "fusedist" and args.stream_text is not None
        if streamed:
            res = generate._stream(runner, prompts, args.max_new_tokens, sp, eos, args.context_fill,
                          args.stream_text)
        else:
            res = runner.generate(prompts, args.max_new_tokens, sp, eos_ids=eos,
                                  context_fill=args.context_fill,
                                  progress=prog.stage(f"[{backend}] decoding"))
        prog.close()
        prefill_ms = median(prefill)
        flops = prefill_flops(cfg, [len(p) for p in prompts], args.context_fill)
        out = {"ids": res.ids, "load_s": round(load_s, 3), "warmup_s": round(warm_s, 3),
               "prefill_ms": round(prefill_ms, 3),
               "prefill_ms_reps": [round(t, 3) for t in prefill],
               "generate_prefill_ms": round(res.prefill_ms, 3),
               "ms_per_token": round(res.ms_per_step, 4),
               "tokens_per_s": round(res.tokens_per_s, 2),
               "decode_steps": res.steps, "cuda_graphs": bool(res.timings.get("graphs")),
               "streamed": streamed,
               "decode": "torch.compile" if compiled else "eager ops", "prefill": "eager",
               "prefill_tflops_per_gpu": round(flops / rt.tp.size / (prefill_ms / 1e3) / 1e12,
                                               2),
               "kv_cache_gib": round(runner.kv_bytes / 2**30, 3),
               "kv_dtype": str(getattr(runner, "kv_dtype", dtype)).replace("torch.", "")}
        if compiled:
            out["compile_s"] = round(runner.compile_s.get(res.timings["bucket"], 0.0), 1)
            out["compile_backend"] = args.compile_backend
        out["step_ms"] = round(runner.time_step(len(prompts)), 4)
        if backend != "fusedist":
            from fusedist.models.llama.baseline import decode_path_choices
            out["decode_attention"] = sorted({f"batch {k[0]}, cache {k[1]}: {v}"
                                              for k, v in decode_path_choices.items()})
        if args.profile:
            for key, what in (("profile_us", lambda: runner.profile_step(len(prompts))),
                              ("prefill_profile_us",
                               lambda: runner.profile_prefill(prompts, start=args.context_fill))):
                try:
                    out[key] = _round(what())
                except Exception as e:  # noqa: BLE001 - the timings stand without it
                    out[key.replace("_us", "_error")] = f"{type(e).__name__}: {e}"
            if device.type == "cuda":   # the step's bubbles: the steps of time_step, profiled
                try:
                    tl = runner.profile_timeline(len(prompts))
                    out["timeline_us"] = {k: (round(v, 2) if isinstance(v, float) else v)
                                          for k, v in tl.items() if k != "gaps"}
                    out["timeline_gaps_us"] = [[round(g[0], 2), g[1], g[2]] for g in tl["gaps"]]
                except Exception as e:  # noqa: BLE001 - the timings stand without it
                    out["timeline_error"] = f"{type(e).__name__}: {e}"
        if getattr(model, "ep", False):
            out["ep"] = True
            model.close()   # the expert-parallel Buffers (collective)
    finally:
        del runner, model
        if compiled:
            torch._dynamo.reset()   # its compiled code holds the model's weights
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def failures(results: dict) -> list[str]:
    """One line per failure the backends' results record (a failed run, a CUDA-graph decode
    that fell back to eager, a failed --profile); empty when every backend did all it was
    asked."""
    out = []
    for name, r in results.items():
        if "error" in r:
            out.append(f"{name} failed: {r['error']}" +
                       (f" (eager retry: {r['eager_error']})" if "eager_error" in r else ""))
        if "graph_error" in r:
            out.append(f"{name}: CUDA-graph decode failed, ran eagerly instead: "
                       f"{r['graph_error']}")
        for key in ("profile_error", "prefill_profile_error", "timeline_error"):
            if key in r:
                out.append(f"{name}: --profile failed ({key}): {r[key]}")
    return out


def speedups(results: dict) -> dict:
    """{baseline: {"per_token", "per_step", "prefill": baseline time / fusedist time}} for every
    baseline that ran beside a fusedist run that did not fail."""
    fd = results.get("fusedist", {})
    out = {}
    if "error" in fd:
        return out
    for name, r in results.items():
        if name == "fusedist" or "error" in r:
            continue
        out[name] = {k: round(r[key] / fd[key], 3) for k, key in
                     (("per_token", "ms_per_token"), ("per_step", "step_ms"),
                      ("prefill", "prefill_ms"))}
    return out


def report(args, cfg, rt, dtype, prompts, results, tok):
    fd = results["fusedist"]
    summary = {"model": args.model or args.config, "tp": rt.tp.size,
               "ep": getattr(args, "ep", False), "world": rt.world_size,
               "device": str(rt.device.type), "dtype": str(dtype).replace("torch.", ""),
               "weights": generate.weight_format(getattr(args, "quant", None), dtype),
               "batch": len(prompts), "prompt_len": len(prompts[0]), "prompt_ids": prompts[0],
               "context_fill": args.context_fill, "max_new_tokens": args.max_new_tokens,
               "baselines": list(args.baselines), "ids": fd.get("ids"),
               "timings": {k: {kk: vv for kk, vv in v.items() if kk != "ids"}
                           for k, v in results.items()}}
    if rt.device.type == "cuda":
        summary["gpu"] = torch.cuda.get_device_name(rt.device)
    if tok is not None and "ids" in fd:
        summary["text"] = [tok.decode(ids) for ids in fd["ids"]]
    sp = speedups(results)
    if sp:
        summary["speedups"] = sp
        summary["ids_match"] = {k: results[k]["ids"] == fd["ids"] for k in sp}
    if "torch" in sp:   # the plain-torch baseline's figures under their long-standing names
        summary["torch_ids_match"] = summary["ids_match"]["torch"]
        summary["speedup"] = sp["torch"]["per_token"]
        summary["step_speedup"] = sp["torch"]["per_step"]
    if args.json:
        print(json.dumps(summary), flush=True)
        return
    generate.print_run_header(summary, cfg, args, rt.tp.size)
    if "text" in summary and not fd.get("streamed"):
        print(f"text: {summary['text'][0]!r}")
    elif "ids" in fd:
        print(f"ids[0]: {fd['ids'][0]}")
    cols = ("prefill ms", "ms/token", "step ms", "tokens/s", "prefill TFLOP/s/GPU")
    keys = ("prefill_ms", "ms_per_token", "step_ms", "tokens_per_s", "prefill_tflops_per_gpu")
    w = max(len(n) for n in results) + 2
    print(f"{'backend':<{w}}" + "".join(f"{c:>21}" for c in cols))
    for name, r in results.items():
        if "error" in r:
            print(f"{name:<{w}}failed: {r['error']}")
            continue
        print(f"{name:<{w}}" + "".join(f"{r[k]:>21}" for k in keys))
    print(f"prefill ms: the median of {args.prefill_reps} warm prefills of the prompts")
    if fd.get("streamed"):
        print("fusedist streamed its text: its ms/token includes reading each token back and "
              "decoding it (--json times the loop without)")
    if "compile_s" in results.get("torch-compile", {}):
        print(f"torch-compile: decode step under torch.compile ({args.compile_backend}; its "
              f"first, compiling call {results['torch-compile']['compile_s']} s), prefill eager")
    if sp and rt.device.type == "cpu":
        print("CPU: fusedist ran its reference path (plain torch, fp32 accumulation, gloo), which "
              "checks correctness, not speed; speed is measured on GPUs. Same ids as "
              + ", ".join(f"{k}: {v}" for k, v in summary["ids_match"].items()))
    for name, v in (sp.items() if rt.device.type != "cpu" else ()):
        print(f"speedup over {name}: {v['per_token']}x per token (generate loop), "
              f"{v['per_step']}x per step (graph replays), {v['prefill']}x prefill; same ids: "
              f"{summary['ids_match'][name]}")
    classes = ("gemm", "attention", "communication", "other", "total")
    for name, r in results.items():
        for key, what in (("profile_us", "decode step"), ("prefill_profile_us", "prefill")):
            if key in r:
                p = r[key]
                print(f"{name} {what}, kernel time (us): " +
                      ", ".join(f"{k} {p[k]}" for k in classes) +
                      (f"; {p['kernels']} kernels, {p['wall_us']} us wall (profiled)"
                       if key == "prefill_profile_us" else ""))
        if "timeline_us" in r:
            t = r["timeline_us"]
            print(f"{name} decode step timeline ({'graph replays' if t['graphs'] else 'eager'}): "
                  f"{t['wall_us']} us wall, {t['busy_us']} us with a kernel running, "
                  f"{t['bubble_us']} us idle ({t['bubble_pct']}%), {t['kernels']} kernels")


if __name__ == "__main__":
    sys.exit(main())
