"""Serving under load: fusedist's continuous-batching engine (fusedist.models.AsyncEngine, the
loop `python -m fusedist.serve` runs, without the HTTP layer) fed by an open-loop client.

    python benchmarks/serve.py                  # GPU: Llama-3-8B shape, FP8 weights, the sweep
    python benchmarks/serve.py --quick          # fewer rates and requests
    python benchmarks/serve.py --config tiny    # the CPU smoke test (the default on a CPU)

Workloads (each row one workload at one rate):
  random   Poisson arrivals at each rate of --rates (requests/s; "inf": all at once), prompt and
           output lengths drawn from lognormal distributions around --prompt-len / --output-len
           (sigma --len-sigma, clipped to the context);
  prefix   the same arrivals, every prompt one of --prefixes shared prefixes of --prefix-len
           tokens followed by its own suffix: the prefix cache's hit rate and what it buys;
  batch64  64 requests at once of 1024 prompt tokens and 256 new ones (the target below);
  ttft     a --prefix-len prompt alone cold, then another with the same prefix and a new
           64-token suffix: time to first token warm / cold.
Columns: output tokens/s over the run, requests/s, TTFT p50 / p99, inter-token latency (ITL)
p50 / p99 (the gaps between consecutive tokens of a request, as the client sees them), end to end
p50, prefix hit rate, preemptions. The steady-state row ("step") compares the engine's decode
step at --step-batch sequences (scheduling, tables, graph replay, sampling, detokenization) with
the static Runner's generate loop at the same batch (ms/step, sampling included) and with the
bare graph replay (Runner.time_step); "step_overlap" is the same with the engine's overlap on
(each decode step launched before the previous one's tokens reach the host: the engine's
default on GPUs, used by the load workloads too; --no-overlap turns it off there). The
"step_sampled" workload (not in the default set) is the same with every row sampled
(temperature 0.8, top-p 0.95): the sampler's share of the engine's step.

Targets (one H200, Llama-3-8B shape, FP8 weights, TP 1): the engine's step within 10% of the
static step; batch64 >= 5000 output tokens/s with ITL p99 <= 15 ms; ttft warm <= 0.3 x cold.
Results: benchmarks/results/<gpu>-w<tp>/serve.{json,md} (FUSEDIST_RESULTS_DIR replaces
benchmarks/results).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import metadata, write_results  # noqa: E402

import torch  # noqa: E402

TARGETS = {"step_ratio": 1.10, "batch64_tok_s": 5000.0, "batch64_itl_p99_ms": 15.0,
           "ttft_ratio": 0.30}


def pct(xs, q):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(q / 100 * len(xs)) - 1))]


def lognormal(rng, mean, sigma, lo, hi):
    mu = math.log(max(mean, 1)) - sigma * sigma / 2
    return int(min(hi, max(lo, round(rng.lognormvariate(mu, sigma)))))


async def run_load(ae, reqs, rate, seed):
    """reqs: [(prompt ids, GenerationParams)]; Poisson arrivals at `rate` (inf: at once).
    Returns per request (arrival, [token times]) and the wall time of the run."""
    rng = random.Random(seed)
    t0 = time.perf_counter()
    out = [None] * len(reqs)

    async def one(i, delay):
        await asyncio.sleep(delay)
        start = time.perf_counter()
        times = []
        async for o in ae.stream(reqs[i][0], reqs[i][1]):
            now = time.perf_counter()
            times += [now] * sum(len(c.ids) for c in o.choices)
        out[i] = (start, times)

    t, tasks = 0.0, []
    for i in range(len(reqs)):
        tasks.append(asyncio.create_task(one(i, t)))
        if math.isfinite(rate):
            t += rng.expovariate(rate)
    await asyncio.gather(*tasks)
    return out, time.perf_counter() - t0


def summarize(name, rate, res, wall, eng, before) -> dict:
    ttft = [(ts[0] - a) * 1e3 for a, ts in res if ts]
    itl = [(b - a) * 1e3 for _, ts in res for a, b in zip(ts, ts[1:])]
    e2e = [(ts[-1] - a) * 1e3 for a, ts in res if ts]
    toks = sum(len(ts) for _, ts in res)
    q = eng.pool.query_tokens - before["q"]
    h = eng.pool.hit_tokens - before["h"]
    return {"op": "serve", "workload": name, "rate": rate, "requests": len(res),
            "output_tokens": toks, "tok_s": round(toks / wall, 1),
            "req_s": round(len(res) / wall, 2),
            "ttft_p50_ms": round(pct(ttft, 50), 2), "ttft_p99_ms": round(pct(ttft, 99), 2),
            "itl_p50_ms": round(pct(itl, 50), 3), "itl_p99_ms": round(pct(itl, 99), 3),
            "e2e_p50_ms": round(pct(e2e, 50), 1), "hit_rate": round(h / q, 3) if q else 0.0,
            "preemptions": eng.stats.preemptions - before["p"], "time_us": round(wall * 1e6)}


def snapshot(eng) -> dict:
    return {"q": eng.pool.query_tokens, "h": eng.pool.hit_tokens, "p": eng.stats.preemptions}


def step_rows(llm, eng, B, prompt_len, new, vocab, seed, sampled: bool = False) -> list:
    """The engine's steady-state decode step at B sequences beside the static Runner's:
    without overlap ("step") and with it ("step_overlap": each decode step launched before
    the previous one's tokens reach the host), one window each over the same sequences.
    sampled: every sequence samples (temperature 0.8, top-p 0.95; rows "step_sampled",
    "step_sampled_overlap"; the static Runner's step stays greedy)."""
    from fusedist.models import GenerationParams, Runner

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(4, vocab, (prompt_len,), generator=g).tolist() for _ in range(B)]
    steps = max(4, min(32, (new - 8) // 2))
    # both windows (3 warm-up steps and `steps` timed, twice) decode every sequence, whatever
    # it decoded while the others prefilled
    sp = GenerationParams(max_tokens=new + 2 * (3 + steps),
                          temperature=0.8 if sampled else 0,
                          top_p=0.95 if sampled else 1.0, seed=seed if sampled else None,
                          ignore_eos=True)
    for p in prompts:
        eng.add_request(None, p, sp)
    while eng.waiting or eng._inbox or any(len(s.ids) - s.computed > 1 for s in eng.running):
        eng.step()
    sync = (lambda: torch.cuda.synchronize()) if eng.device.type == "cuda" else (lambda: None)
    engine_ms = {}
    keep = eng.overlap
    for overlap in (False, True):
        eng.overlap = overlap
        for _ in range(3):
            eng.step()
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            eng.step()
        sync()
        engine_ms[overlap] = (time.perf_counter() - t0) * 1e3 / steps
        if len(eng.running) != B:
            raise RuntimeError(f"serve.py: {B - len(eng.running)} of the {B} sequences ended "
                               "inside the step window")
    eng.overlap = keep
    replay_ms = eng.runner.time_step(B, iters=steps)
    while eng.has_work():
        eng.step()
    with Runner(llm.model, max_batch=B, max_seq_len=prompt_len + new + 1,
                page_size=eng.page_size) as r:
        r.generate(prompts, 8)                          # warm-up (captures)
        static_ms = r.generate(prompts, new).ms_per_step
    name = "step_sampled" if sampled else "step"
    return [{"op": "serve", "workload": name + ("_overlap" if overlap else ""), "batch": B,
             "engine_step_ms": round(ms, 3), "static_step_ms": round(static_ms, 3),
             "replay_ms": round(replay_ms, 3), "ratio": round(ms / static_ms, 3),
             "time_us": round(ms * 1e3, 1)} for overlap, ms in engine_ms.items()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=None, help="shipped shape (random weights); default "
                    "llama-3-8b on a GPU, tiny on a CPU")
    ap.add_argument("--model", default=None, help="a checkpoint directory instead")
    ap.add_argument("--quantize", default=None, help="default fp8 on a GPU, none on a CPU")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rates", default=None, help="requests/s, comma-separated; inf: at once")
    ap.add_argument("--num-requests", type=int, default=None)
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--output-len", type=int, default=None)
    ap.add_argument("--len-sigma", type=float, default=0.5)
    ap.add_argument("--prefix-len", type=int, default=None)
    ap.add_argument("--prefixes", type=int, default=4)
    ap.add_argument("--max-seqs", type=int, default=None)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--step-batch", type=int, default=None)
    ap.add_argument("--workloads", default="step,random,prefix,batch64,ttft")
    ap.add_argument("--seed", type=int, default=0)
    ov = ap.add_mutually_exclusive_group()
    ov.add_argument("--overlap", dest="overlap", action="store_true", default=None,
                    help="the engine's overlap for the load workloads (default on GPUs; the "
                         "step workload measures both)")
    ov.add_argument("--no-overlap", dest="overlap", action="store_false")
    args = ap.parse_args()

    import fusedist
    from fusedist.models import LLM, AsyncEngine, Engine, GenerationParams

    gpu = torch.cuda.is_available()
    if args.config is None and args.model is None:
        args.config = "llama-3-8b" if gpu else "tiny"
    if args.quantize is None:
        args.quantize = "fp8" if gpu and args.model is None else "none"
    small = not gpu
    d = dict(rates="1,4,16,inf" if args.quick else "1,2,4,8,16,32,inf",
             num_requests=64 if args.quick else 256, prompt_len=512, output_len=128,
             prefix_len=2048, max_seqs=64, max_model_len=4096, step_batch=64)
    if small:     # the CPU smoke test: the tiny model, a handful of requests
        d.update(rates="4,inf", num_requests=8, prompt_len=24, output_len=8, prefix_len=48,
                 max_seqs=4, max_model_len=160, step_batch=4)
    for k, v in d.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    rates = [float(r) for r in args.rates.split(",")]
    work = args.workloads.split(",")

    llm = LLM(args.model, config=args.config, random_weights=args.model is None,
              quantize=args.quantize, max_batch=1, max_seq_len=args.max_model_len,
              cuda_graphs=False, prefill_graph_tokens=0)
    rt = fusedist.get_runtime()
    vocab = llm.cfg.vocab_size
    eng = Engine.from_llm(llm, max_seqs=args.max_seqs, max_num_batched_tokens=2048
                          if gpu else 64, max_waiting=None, overlap=args.overlap)
    rows = []
    leader = rt.tp.rank == 0

    def show(row):
        if leader:
            print(" ".join(f"{k}={v}" for k, v in row.items() if k != "op"), flush=True)
        rows.append(row)

    for w in ("step", "step_sampled"):
        if w in work:
            for row in step_rows(llm, eng, args.step_batch, args.prompt_len, args.output_len,
                                 vocab, args.seed, sampled=w == "step_sampled"):
                show(row)
            eng.pool.reset_cache()
    rng = random.Random(args.seed)

    def rand_ids(n):
        return [rng.randrange(4, vocab) for _ in range(n)]

    ae = AsyncEngine(eng)
    if not ae.leader:
        ae.follow()
        llm.close()
        return
    ae.start()
    ctx = args.max_model_len
    for name in [w for w in work if w in ("random", "prefix")]:
        prefixes = [rand_ids(args.prefix_len) for _ in range(args.prefixes)]
        for rate in rates:
            reqs = []
            for i in range(args.num_requests):
                out = lognormal(rng, args.output_len, args.len_sigma, 1, ctx // 4)
                if name == "random":
                    p = rand_ids(lognormal(rng, args.prompt_len, args.len_sigma, 1,
                                           ctx - out - 1))
                else:
                    p = prefixes[i % len(prefixes)] + rand_ids(
                        lognormal(rng, args.prompt_len // 4 or 1, args.len_sigma, 1,
                                  max(1, ctx - out - args.prefix_len - 1)))
                reqs.append((p, GenerationParams(max_tokens=out, temperature=0.8, seed=i,
                                                 ignore_eos=True)))
            before = snapshot(eng)
            res, wall = asyncio.run(run_load(ae, reqs, rate, args.seed))
            show(summarize(name, rate, res, wall, eng, before))
            eng.pool.reset_cache()
    if "batch64" in work:
        n, pl, ol = (64, 1024, 256) if not small else (8, 32, 16)
        reqs = [(rand_ids(pl), GenerationParams(max_tokens=ol, temperature=0, ignore_eos=True))
                for _ in range(n)]
        warm = [(rand_ids(pl), r[1]) for r in reqs[:4]]
        asyncio.run(run_load(ae, warm, math.inf, 0))           # warm-up (other prompts)
        eng.pool.reset_cache()
        before = snapshot(eng)
        res, wall = asyncio.run(run_load(ae, reqs, math.inf, args.seed))
        row = summarize("batch64", math.inf, res, wall, eng, before)
        row.update(target_tok_s=TARGETS["batch64_tok_s"],
                   target_itl_p99_ms=TARGETS["batch64_itl_p99_ms"])
        show(row)
        eng.pool.reset_cache()
    if "ttft" in work:
        prefix = rand_ids(args.prefix_len)
        sp = GenerationParams(max_tokens=1, temperature=0, ignore_eos=True)
        cold, warm = [], []
        for k in range(3):
            eng.pool.reset_cache()
            a = asyncio.run(run_load(ae, [(rand_ids(args.prefix_len) + rand_ids(64), sp)],
                                     math.inf, 0))[0]
            cold.append((a[0][1][0] - a[0][0]) * 1e3)
            asyncio.run(run_load(ae, [(prefix + rand_ids(64), sp)], math.inf, 0))
            b = asyncio.run(run_load(ae, [(prefix + rand_ids(64), sp)], math.inf, 0))[0]
            warm.append((b[0][1][0] - b[0][0]) * 1e3)
        c, w = sorted(cold)[1], sorted(warm)[1]
        show({"op": "serve", "workload": "ttft", "prefix_len": args.prefix_len,
              "cold_ms": round(c, 2), "warm_ms": round(w, 2), "ratio": round(w / c, 3),
              "target_ratio": TARGETS["ttft_ratio"], "time_us": round(w * 1e3, 1)})
    ae.shutdown()
    meta = metadata(rt.world_size)
    meta.update(model=args.model or args.config, quantize=args.quantize,
                max_seqs=args.max_seqs, max_model_len=args.max_model_len,
                kv_pages=eng.pool.total, page_size=eng.page_size, quick=args.quick)
    cols = ["workload", "rate", "requests", "tok_s", "req_s", "ttft_p50_ms", "ttft_p99_ms",
            "itl_p50_ms", "itl_p99_ms", "e2e_p50_ms", "hit_rate", "preemptions"]
    load = [r for r in rows if r["workload"] in ("random", "prefix", "batch64")]
    md = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    md += ["| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in load]
    for r in rows:
        if r["workload"].startswith("step"):
            what = "with overlap" if r["workload"].endswith("_overlap") else "without overlap"
            if r["workload"].startswith("step_sampled"):
                what += ", every row sampled (temperature 0.8, top-p 0.95)"
            md.append(f"\nDecode step at batch {r['batch']}, {what}: engine "
                      f"{r['engine_step_ms']} ms, static Runner {r['static_step_ms']} ms (ratio "
                      f"{r['ratio']}, target <= {TARGETS['step_ratio']}), graph replay alone "
                      f"{r['replay_ms']} ms.")
        if r["workload"] == "ttft":
            md.append(f"\nTime to first token behind a {r['prefix_len']}-token prefix: cold "
                      f"{r['cold_ms']} ms, cached {r['warm_ms']} ms (ratio {r['ratio']}, "
                      f"target <= {TARGETS['ttft_ratio']}).")
    paths = write_results("serve", meta, rows, "\n".join(md))
    print("wrote", ", ".join(str(p) for p in paths))
    eng.close()
    llm.close()


if __name__ == "__main__":
    main()
