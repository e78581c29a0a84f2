"""Scaling of the collectives, the TP linears and the decode step over nodes x GPUs per node,
with the cost model's prediction beside every measurement.

    # one host acting as 2 nodes of 2 ranks (CPU, gloo)
    torchrun --nproc-per-node 4 benchmarks/scaling.py --emulate-nodes 2
    # real nodes (each rank's node from the launcher / hostname)
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint node0:29500 \\
        benchmarks/scaling.py --sizes 4K,64K,1M,16M,256M

Rows, nccl-tests' columns: size (bytes of the buffer: all-gather's output, reduce-scatter's
input), count (elements), type, redop, placement (out-of-place, in-place), time (us, the
slowest rank's median), algbw = size / time, busbw = algbw x 2(n-1)/n (all-reduce) or (n-1)/n
(all-gather, reduce-scatter), #wrong (elements outside tolerance of a float64 reference built
from every rank's seed, plus every element if the ranks' results differ), then the cost
model's time for the same configuration and its relative error.

Configurations: flat, two-level (hierarchical, chunks from the cost model) and auto over the
world; FP8 all-reduce and all-gather (fusedist.comm.fp8); and the all-reduce on one node's
ranks (intra) and on one rank per node (inter), the points benchmarks/fit_links.py fits the
link levels on. Eager calls timed with perf_counter (the two-level forms run collectives on
several process groups, which CUDA graphs of torch.distributed do not capture), after
warm-up, fresh random data per size.

TP linears (--parts linears) and decode step (--parts decode) run on the first p ranks for
p = 1, 2, 4, ... and the world size, at the shapes of --config (random weights; tiny on CPU,
llama-3-8b on GPUs): ColumnParallelLinear (gather_output) at the MLP's gate/up shape and
RowParallelLinear at down's, strong (global shape fixed) and weak (per-rank shard fixed)
scaling, per row the call, its GEMM alone, its collective alone, the cost model's time for
the collective and its error, efficiency against one rank and #wrong against a float64
reference; the decode step's ms per step beside cost_model.decode_step_us from this run's
TP-1 step, its logits against TP 1's. The plot: busbw vs size per configuration, efficiency
vs ranks. Results: benchmarks/results/<machine>-w<N>/scaling.{json,md,png} (the JSON's
"rows", "linear_rows", "decode_rows").

    torchrun --nproc-per-node 8 benchmarks/scaling.py --parts linears,decode   # llama-3-8b
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from statistics import median

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import fusedist  # noqa: E402
from _harness import fmt_bytes, metadata, slowest, time_eager, write_results  # noqa: E402
from fusedist.comm import cost_model, fp8  # noqa: E402
from fusedist.comm.hierarchical import HierarchicalCommunicator  # noqa: E402
from fusedist.distributed.groups import new_groups  # noqa: E402
from fusedist.models import Runner, SamplingParams, build_model  # noqa: E402
from fusedist.models.llama import LlamaConfig, open_weights  # noqa: E402
from fusedist.models.llama.weights import check_tp  # noqa: E402
from fusedist.nn import ColumnParallelLinear, RowParallelLinear  # noqa: E402
from fusedist.nn.linear import _gather_columns  # noqa: E402

CPU_SIZES = "1K,16K,256K,1M,4M"
GPU_SIZES = "4K,64K,1M,16M,64M,256M"
RTOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}
PARTS = ("collectives", "linears", "decode")
# (CPU, GPU) defaults of the model rows: config, linear tokens, decode batches, cached tokens
MODEL_DEFAULTS = {"config": ("tiny", "llama-3-8b"), "tokens": ("1,32", "1,64,4096"),
                  "batches": ("1,4", "1,64"), "context": (64, 4096)}
# A TP linear's output element is wrong when it is off its float64 reference by more than
# this fraction of the reference's largest magnitude (K-term dot products rounded in dtype).
LINEAR_TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
# A decode logit at TP p is wrong when it is off the same model's TP-1 logit by more than this
# fraction of the largest TP-1 logit (every layer's sums run in another order at TP p).
DECODE_TOL = {torch.float32: 1e-3, torch.float16: 5e-2, torch.bfloat16: 1e-1}
PROMPT_LEN = 8


def parse_size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
    return int(s[:-1] if s[-1:] in "KMG" else s) * mult


def seeded(n, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g, dtype=torch.float32).to(dtype)


def count_wrong(y, ref, dtype, atol) -> int:
    y = y.double().cpu()
    ok = (y - ref).abs() <= atol + RTOL[dtype] * ref.abs()
    return int((~(ok & torch.isfinite(y))).sum())


def digest(y: torch.Tensor) -> tuple:
    """Two integer checksums of y's bytes, formed where y lives (exact integer sums: the same
    on any device; a GEMM's output or a step's logits stay off the host)."""
    b = y.contiguous().view(-1).view(torch.uint8).long()
    return int(b.sum()), int((b * torch.arange(b.numel(), device=b.device) % 1000003).sum())


class Bench:
    def __init__(self, rt, hc, args):
        self.rt, self.hc, self.a = rt, hc, args
        self.rows = []
        self.machine = hc.machine

    def measure(self, *, group, op, algo, nbytes_elems, dtype, placement, run, wrong_of,
                model, redop="sum", size=None, extra=None, same_on_all=True):
        """One row: time run() (the slowest rank's median), wrong_of(result) wrong elements
        (plus every element when results that must be the same on every rank differ)."""
        rt, a = self.rt, self.a
        y = run()
        wrong = wrong_of(y)
        ds = group.all_gather_object(digest(y)) if same_on_all else [0]
        identical = all(d == ds[0] for d in ds)
        if not identical:
            wrong += y.numel()
        t = slowest(time_eager(lambda i: run(), a.ops, a.reps))
        size = size if size is not None else nbytes_elems * dtype.itemsize
        p = group.size if group is not None else 1
        factor = cost_model.bus_factor(op.replace("_fp8", ""), p)[0]
        algbw = size / (t * 1e3)
        pred, chosen = model
        row = {"group": self.group_name(group), "ranks": p, "nodes": self.nodes_of(group),
               "op": op, "algo": algo, "chosen": chosen, "size": size, "count": nbytes_elems,
               "type": str(dtype).replace("torch.", ""), "redop": redop,
               "placement": placement, "time_us": t, "algbw_GBps": algbw,
               "busbw_GBps": algbw * factor, "wrong": wrong, "identical": identical,
               "model_us": pred, "model_err": cost_model.relative_error(pred, t)}
        row.update((extra or (lambda y: {}))(y))
        self.rows.append(row)
        if rt.rank == 0:
            print(f"{row['group']:>6} {op:>15} {algo:>12} {placement:>12} {fmt_bytes(size):>7} "
                  f"{t:10.1f} us  busbw {row['busbw_GBps']:7.3f} GB/s  #wrong {wrong}  model "
                  f"{pred:10.1f} us ({100 * row['model_err']:+.0f}%)", flush=True)

    def group_name(self, g):
        return {self.hc.world.name: "world", self.hc.intra.name: "intra"}.get(
            g.name, "inter") if g is not None else "-"

    def nodes_of(self, g):
        topo = self.rt.topology
        return len({topo.node_ids[r] for r in g.ranks})


def world_sizes(world: int) -> list[int]:
    """The TP sizes of the scaling rows: 1, 2, 4, ... below the world size, and the world."""
    out, p = [], 1
    while p < world:
        out.append(p)
        p *= 2
    return out + [world]


class Scale:
    """The first p ranks as one group for each p of world_sizes(): the groups the TP linears
    and the decode step run on. Every rank takes part in making each group and in gathering
    each measurement; the ranks outside a group wait while its members run."""

    def __init__(self, rt, machine):
        self.rt, self.machine = rt, machine
        self.sizes = world_sizes(rt.world_size)
        self.groups = {}
        for p in self.sizes:
            self.groups[p] = rt.world if p == rt.world_size else new_groups(
                f"scaling{p}-", [tuple(range(p))], rt.world_size, rt.device, rt.topology,
                created=rt.created_groups)

    def shape(self, p: int) -> tuple[int, int]:
        """(nodes, ranks per node) of the first p ranks, as the cost model takes them."""
        ids = [self.rt.topology.node_ids[r] for r in range(p)]
        nodes = len(set(ids))
        return nodes, max(ids.count(i) for i in set(ids))

    def sync(self) -> None:
        if self.rt.device.type == "cuda":
            torch.cuda.synchronize()

    def time_us(self, p: int, fn, ops: int, reps: int) -> float:
        """The slowest member's median us per fn() call on the first p ranks (perf_counter
        around `ops` calls after a warm-up, the group's barrier before each repetition);
        every rank calls it, fn runs on the members only."""
        g, mine = self.groups[p], None
        if g is not None:
            fn()
            self.sync()
            times = []
            for _ in range(reps):
                g.barrier()
                t0 = time.perf_counter()
                for _ in range(ops):
                    fn()
                self.sync()
                times.append((time.perf_counter() - t0) * 1e6 / ops)
            mine = median(times)
        return max(t for t in self.gather(mine) if t is not None)

    def gather(self, obj) -> list:
        out = [None] * self.rt.world_size
        dist.all_gather_object(out, obj)
        return out

    def predict(self, op: str, p: int, nbytes: int) -> tuple[float, str]:
        """The cost model's time of the collective the group's Communicator runs: all-reduce
        at the model's best on one node (fusedist's kernels or NCCL), flat across nodes;
        all-gather flat."""
        nodes, gpus = self.shape(p)
        algo = "auto" if op == "all_reduce" and nodes == 1 else "flat"
        return cost_model.predict(self.machine, op, nodes, gpus, nbytes, algo)


def seeded_on(shape, dtype, seed, device):
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float32, device=device).to(dtype)


def linear_rows(sc: Scale, cfg: LlamaConfig, tokens: list[int], dtype, args) -> list[dict]:
    """ColumnParallelLinear (gather_output=True: the GEMM, then an all-gather of the [M, out]
    output) at the MLP's gate/up shape (hidden -> 2 x intermediate) and RowParallelLinear
    (input_is_parallel=True: the GEMM, then an all-reduce of [M, out]) at down's
    (intermediate -> hidden), no bias, on the first p ranks. strong: the global shape fixed;
    weak: the per-rank shard fixed (the shard at the launched world size), the split dimension
    growing with p. Per row: the call, its local GEMM alone and its collective alone (the
    module's own), the cost model's time for the collective and its error, and #wrong against
    a float64 reference."""
    rt, W = sc.rt, sc.rt.world_size
    h, inter = cfg.hidden_size, cfg.intermediate_size
    rows = []
    for mi, (module, fin, fout) in enumerate((("column", h, 2 * inter), ("row", inter, h))):
        split = fout if module == "column" else fin
        if split % W:
            if rt.rank == 0:
                print(f"linears: {module} skipped: {split} features do not split over {W} "
                      "ranks", flush=True)
            continue
        for scaling in ("strong", "weak"):
            for p in sc.sizes:
                g = sc.groups[p]
                s_fin, s_fout = (fin, fout) if scaling == "strong" else \
                    ((fin, split // W * p) if module == "column" else (split // W * p, fout))
                for ti, M in enumerate(tokens):
                    seed = args.seed + 104729 * mi + 1009 * ti + (0 if scaling == "strong" else p)
                    row = linear_row(sc, g, p, module, s_fin, s_fout, M, dtype, seed, args)
                    row.update({"module": module, "scaling": scaling, "ranks": p,
                                "nodes": sc.shape(p)[0], "tokens": M, "in_features": s_fin,
                                "out_features": s_fout, "type": str(dtype).replace("torch.", "")})
                    rows.append(row)
                    if rt.rank == 0:
                        model = "-" if row["model_us"] is None else \
                            f"{row['model_us']:.1f} us ({100 * row['model_err']:+.0f}%)"
                        print(f"{module:>6} {scaling:>6} p={p} M={M} [{s_fout}x{s_fin}] "
                              f"{row['time_us']:10.1f} us  gemm {row['gemm_us']:.1f}  comm "
                              f"{_opt(row['comm_us'], '.1f')}  model {model}  #wrong "
                              f"{row['wrong']}", flush=True)
    # efficiency against the same (module, scaling, tokens) on one rank
    one = {(r["module"], r["scaling"], r["tokens"]): r["time_us"] for r in rows
           if r["ranks"] == 1}
    for r in rows:
        t1 = one[(r["module"], r["scaling"], r["tokens"])]
        r["efficiency"] = t1 / (r["ranks"] * r["time_us"]) if r["scaling"] == "strong" \
            else t1 / r["time_us"]
    return rows


def linear_row(sc: Scale, g, p, module, fin, fout, M, dtype, seed, args) -> dict:
    """One TP-linear row on the first p ranks (g: their group, None on the other ranks)."""
    dev = sc.rt.device
    wrong = comm_bytes = 0
    identical, calls = True, None
    if g is not None:
        w = seeded_on((fout, fin), dtype, seed, dev)
        x = seeded_on((M, fin), dtype, seed + 1, dev)
        ref = x.double() @ w.double().t()
        if module == "column":
            mod = ColumnParallelLinear.from_full(w, None, gather_output=True, group=g,
                                                 dtype=dtype)
            xin = x
        else:
            mod = RowParallelLinear.from_full(w, None, input_is_parallel=True, group=g,
                                              dtype=dtype)
            xin = x[:, g.rank * mod.in_per_rank:(g.rank + 1) * mod.in_per_rank].contiguous()
        del w
        y = mod(xin)
        atol = LINEAR_TOL[dtype] * float(ref.abs().max())
        ok = ((y.double() - ref).abs() <= atol) & torch.isfinite(y)
        wrong = int((~ok).sum()) if y.shape == ref.shape else ref.numel()
        ds = g.all_gather_object(digest(y))
        identical = all(d == ds[0] for d in ds)
        # the local GEMM's output: the column's shard of [M, out], the row's partial sums
        local = xin @ mod.weight.t()
        buf = torch.empty_like(local)
        calls = {"call": lambda: mod(xin), "gemm": lambda: torch.matmul(xin, mod.weight.t()),
                 "comm": (lambda: _gather_columns(mod.comm, local)) if module == "column"
                 else (lambda: mod.comm.all_reduce(local, out=buf))}
        comm_bytes = M * fout * dtype.itemsize
    times = {k: sc.time_us(p, (lambda k=k: calls[k]()) if calls else None, args.ops, args.reps)
             for k in ("call", "gemm") + (("comm",) if p > 1 else ())}
    info = sc.gather((wrong, identical, comm_bytes) if g is not None else None)
    info = [i for i in info if i is not None]
    wrong = sum(i[0] for i in info) + (0 if all(i[1] for i in info) else M * fout)
    nbytes = info[0][2]
    op = "all_gather" if module == "column" else "all_reduce"
    row = {"time_us": times["call"], "gemm_us": times["gemm"], "comm_us": times.get("comm"),
           "collective": op if p > 1 else "none", "comm_bytes": nbytes if p > 1 else 0,
           "tflops_per_rank": 2.0 * M * fin * fout / p / (times["call"] * 1e6),
           "wrong": wrong, "identical": all(i[1] for i in info),
           "model_us": None, "model_algo": None, "model_err": None,
           "model_call_us": None, "model_call_err": None}
    if p > 1:
        pred, how = sc.predict(op, p, nbytes)
        row.update({"model_us": pred, "model_algo": how,
                    "model_err": cost_model.relative_error(pred, times["comm"]),
                    "model_call_us": times["gemm"] + pred,
                    "model_call_err": cost_model.relative_error(times["gemm"] + pred,
                                                                times["call"])})
    return row


def decode_rows(sc: Scale, cfg: LlamaConfig, batches: list[int], dtype, args) -> list[dict]:
    """The model's decode step (random weights of cfg, fusedist's layers) at TP p on the first
    p ranks: ms per step (Runner.time_step: graph replays back to back on GPUs, eager steps on
    CPUs; the slowest member's) at `args.context` cached tokens per sequence, and the cost
    model's decode step (cost_model.decode_step_us) from this run's TP-1 step. #wrong: logits of
    a prefill of the same prompts off the TP-1 logits by more than DECODE_TOL of their largest
    (rank 0, in every group), plus every logit when the group's ranks differ."""
    rt, dev = sc.rt, sc.rt.device
    src = open_weights(None, cfg, args.seed)
    longest = args.context + PROMPT_LEN + 2
    tp1_logits, tp1_us, rows = {}, {}, []
    for p in sc.sizes:
        try:
            check_tp(cfg, p)
        except ValueError as e:
            if rt.rank == 0:
                print(f"decode: tp {p} skipped: {e}", flush=True)
            continue
        g, runner, model = sc.groups[p], None, None
        if g is not None:
            model = build_model(cfg, src, group=g, dtype=dtype, device=dev,
                                max_position=longest)
            runner = Runner(model, max_batch=max(batches), max_seq_len=longest)
        for b in batches:
            prompts = [[(31 * i + 7 * j + 1) % cfg.vocab_size for j in range(PROMPT_LEN)]
                       for i in range(b)]
            mine = None
            if g is not None:
                runner.generate(prompts, 2, SamplingParams(), context_fill=args.context)
                step_ms = runner.time_step(b, iters=args.reps)
                logits = runner.prefill(prompts).float()
                ds = g.all_gather_object(digest(logits))
                wrong = 0 if all(d == ds[0] for d in ds) else logits.numel()
                if p == 1:
                    tp1_logits[b] = logits
                elif rt.rank == 0:
                    ref = tp1_logits[b]
                    tol = DECODE_TOL[dtype] * float(ref.abs().max())
                    ok = ((logits - ref).abs() <= tol) & torch.isfinite(logits)
                    wrong += int((~ok).sum())
                    rel = float((logits - ref).norm() / ref.norm())
                mine = (step_ms, wrong, rel if p > 1 and rt.rank == 0 else None)
            got = [m for m in sc.gather(mine) if m is not None]
            t_us = max(m[0] for m in got) * 1e3
            if p == 1:
                tp1_us[b] = t_us
            nodes, gpus = sc.shape(p)
            row = {"ranks": p, "nodes": nodes, "batch": b, "context": args.context,
                   "config": cfg.name, "type": str(dtype).replace("torch.", ""),
                   "step_us": t_us, "step_ms": t_us / 1e3, "wrong": sum(m[1] for m in got),
                   "logits_rel_err": got[0][2], "model_us": None, "model_err": None}
            if p > 1 and b in tp1_us:
                pred = cost_model.decode_step_us(
                    sc.machine, nodes, gpus, step_us_tp1=tp1_us[b], layers=cfg.num_layers,
                    hidden=cfg.hidden_size, batch=b, itemsize=dtype.itemsize)
                row.update({"model_us": pred["total_us"],
                            "model_err": cost_model.relative_error(pred["total_us"], t_us),
                            "model_compute_us": pred["compute_us"],
                            "model_comm_us": pred["comm_us"],
                            "model_all_reduce_us": pred["all_reduce_us"],
                            "model_algo": pred["algo"]})
            rows.append(row)
            if rt.rank == 0:
                model_s = "-" if row["model_us"] is None else \
                    f"{row['model_us'] / 1e3:.3f} ms ({100 * row['model_err']:+.0f}%)"
                print(f"decode tp={p} batch={b} {row['step_ms']:.3f} ms/step  model {model_s}  "
                      f"#wrong {row['wrong']}", flush=True)
        if runner is not None:
            runner.close()
        del runner, model
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    for r in rows:
        t1 = tp1_us.get(r["batch"])
        r["efficiency"] = t1 / (r["ranks"] * r["step_us"]) if t1 else None
    return rows


def _opt(v, fmt: str, scale: float = 1.0) -> str:
    return "-" if v is None else format(v * scale, fmt)


def model_markdown(linears: list[dict], decode: list[dict]) -> str:
    out = []
    if linears:
        out += ["## TP linears: strong and weak scaling", "",
                "| module | scaling | ranks | nodes | tokens | weight [out, in] | type | time us | "
                "GEMM us | collective | comm us | model us (algo) | model error | GEMM + model "
                "us | its error | TFLOP/s per rank | efficiency | #wrong |",
                "|---" * 18 + "|"]
        for r in linears:
            out.append(
                f"| {r['module']} | {r['scaling']} | {r['ranks']} | {r['nodes']} | "
                f"{r['tokens']} | [{r['out_features']}, {r['in_features']}] | {r['type']} | "
                f"{r['time_us']:.1f} | {r['gemm_us']:.1f} | {r['collective']} | "
                f"{_opt(r['comm_us'], '.1f')} | {_opt(r['model_us'], '.1f')}"
                f"{'' if r['model_algo'] is None else ' (' + r['model_algo'] + ')'} | "
                f"{_opt(r['model_err'], '+.1f', 100)}{'%' if r['model_err'] is not None else ''} | "
                f"{_opt(r['model_call_us'], '.1f')} | {_opt(r['model_call_err'], '+.1f', 100)}"
                f"{'%' if r['model_call_err'] is not None else ''} | "
                f"{r['tflops_per_rank']:.4f} | {r['efficiency']:.2f} | {r['wrong']} |")
        out.append("")
    if decode:
        out += ["## decode step", "",
                "| config | ranks | nodes | batch | context | type | ms per step | model ms "
                "(all-reduce algo) | model error | efficiency | logits rel. err vs TP 1 | "
                "#wrong |", "|---" * 12 + "|"]
        for r in decode:
            out.append(
                f"| {r['config']} | {r['ranks']} | {r['nodes']} | {r['batch']} | "
                f"{r['context']} | {r['type']} | {r['step_ms']:.3f} | "
                f"{_opt(r['model_us'], '.3f', 1e-3)}"
                f"{' (' + r['model_algo'] + ')' if r.get('model_algo') else ''} | "
                f"{_opt(r['model_err'], '+.1f', 100)}{'%' if r['model_err'] is not None else ''}"
                f" | {_opt(r['efficiency'], '.2f')} | {_opt(r['logits_rel_err'], '.2e')} | "
                f"{r['wrong']} |")
        out.append("")
    return "\n".join(out)


def run(args) -> None:
    if args.emulate_nodes:
        rank = fusedist.detect_launch_env().rank
        world = fusedist.detect_launch_env().world_size
        if world % args.emulate_nodes:
            raise SystemExit(f"scaling.py: --emulate-nodes {args.emulate_nodes} does not divide "
                             f"the world size {world}")
        node = f"node{rank // (world // args.emulate_nodes)}"
        os.environ["FUSEDIST_NODE_ID"] = node
        # NCCL must also see separate hosts to take its network path between them.
        os.environ.setdefault("NCCL_HOSTID", node)
    rt = fusedist.init()
    hc = HierarchicalCommunicator(machine=args.machine)
    dtype = getattr(torch, args.dtype) if args.dtype else (
        torch.bfloat16 if rt.device.type == "cuda" else torch.float32)
    b = Bench(rt, hc, args)
    m, N, G, W = hc.machine, hc.nodes, hc.gpus, rt.world_size
    if rt.rank == 0:
        print(f"scaling: {N} nodes x {G} ranks, {dtype}, machine file {hc.machine_name}",
              flush=True)
    dev = rt.device
    sizes = [parse_size(s) for s in args.sizes.split(",")] if "collectives" in args.parts else []
    for si, nbytes in enumerate(sizes):
        n = max(W, nbytes // dtype.itemsize // W * W)   # a multiple of the world
        seed = args.seed + 7919 * si
        xs = [seeded(n, dtype, seed + r) for r in range(W)]
        x = xs[rt.rank].to(dev)
        ref = sum(v.double() for v in xs)
        absum = sum(v.double().abs() for v in xs)
        atol = float(ref.abs().max()) * 1e-6
        nb = n * dtype.itemsize
        def within(r, tol):
            return lambda y: count_wrong(y, r, dtype, tol)
        for algo in ("flat", "hierarchical", "auto"):
            if algo != "flat" and not (N > 1 and G > 1):
                continue
            pred = cost_model.predict(m, "all_reduce", N, G, nb, algo)
            b.measure(group=hc.world, op="all_reduce", algo=algo, nbytes_elems=n, dtype=dtype,
                      placement="out-of-place", run=lambda: hc.all_reduce(x, algo=algo),
                      wrong_of=within(ref, atol), model=pred)
            buf = torch.empty_like(x)

            def inplace():
                buf.copy_(x)
                return hc.all_reduce(buf, algo=algo, out=buf)
            b.measure(group=hc.world, op="all_reduce", algo=algo, nbytes_elems=n, dtype=dtype,
                      placement="in-place", run=inplace, wrong_of=within(ref, atol), model=pred)
            # all-gather: each rank gives n / W elements (size: the n-element output);
            # reduce-scatter: n elements in, n / W out
            part = x[: n // W]
            gref = torch.cat([v[: n // W].double() for v in xs])
            b.measure(group=hc.world, op="all_gather", algo=algo, nbytes_elems=n, dtype=dtype,
                      placement="out-of-place", run=lambda: hc.all_gather(part, algo=algo),
                      wrong_of=within(gref, 0.0),
                      model=cost_model.predict(m, "all_gather", N, G, nb, algo), redop="none")
            b.measure(group=hc.world, op="reduce_scatter", algo=algo, nbytes_elems=n,
                      dtype=dtype, placement="out-of-place",
                      run=lambda: hc.reduce_scatter(x, algo=algo),
                      wrong_of=within(ref.view(W, -1)[rt.rank], atol), same_on_all=False,
                      model=cost_model.predict(m, "reduce_scatter", N, G, nb, algo))
        if not args.no_fp8:
            # FP8 error bound per element: 2^-4 relative per quantization of each input and
            # of the sum (two_shot), so 2^-3 of the sum of |inputs| covers both; below the
            # normal range (e3m4: 2^-7 of the block's amax) half a subnormal step, at most
            # 2^-12 of the block's amax per quantization: 2^-10 of the largest sum covers it.
            bound = absum * 2.0 ** -3 + float(absum.max()) * 2.0 ** -10 + atol

            def fp8_wrong(y):
                y = y.double().cpu()
                return int(((y - ref).abs() > bound).sum()) + int((~torch.isfinite(y)).sum())

            def rel_err(y):
                return {"rel_err": float((y.double().cpu() - ref).norm() / ref.norm())}
            for falgo in fp8.ALGOS:
                pred = (cost_model.fp8(m, "all_reduce", N, G, nb, dtype.itemsize,
                                       args.block_size, falgo), "fp8")
                b.measure(group=hc.world, op="all_reduce_fp8", algo=falgo, nbytes_elems=n,
                          dtype=dtype, placement="out-of-place",
                          run=lambda: fp8.fp8_all_reduce(x, hc.world, block_size=args.block_size,
                                                         algo=falgo, check=False),
                          wrong_of=fp8_wrong, model=pred, extra=rel_err)
            blk = args.block_size
            fgref = torch.cat([fp8.dequantize(*fp8.quantize(v[: n // W], blk), n // W, blk)
                               .to(dtype).double() for v in xs])
            b.measure(group=hc.world, op="all_gather_fp8", algo="fp8", nbytes_elems=n,
                      dtype=dtype, placement="out-of-place",
                      run=lambda: fp8.fp8_all_gather(x[: n // W], hc.world, block_size=blk,
                                                     check=False),
                      wrong_of=within(fgref, 0.0), redop="none",
                      model=(cost_model.fp8(m, "all_gather", N, G, nb, dtype.itemsize, blk),
                             "fp8"))
        # the link levels alone: one node's ranks, one rank per node
        for g, kind in ((hc.intra, "intra"), (hc.inter, "inter")):
            if g is None or g.size < 2:
                continue
            gref = sum(xs[r].double() for r in g.ranks)
            nodes, gpus = (1, g.size) if kind == "intra" else (g.size, 1)
            pred = (cost_model.flat(m, "all_reduce", nodes, gpus, nb), "flat")

            def on_group(g=g):
                acc = x.to(torch.float32, copy=True)
                torch.distributed.all_reduce(acc, group=g.pg)
                return acc.to(dtype)
            b.measure(group=g, op="all_reduce", algo="flat", nbytes_elems=n, dtype=dtype,
                      placement="out-of-place", run=on_group,
                      wrong_of=within(gref, float(gref.abs().max()) * 1e-6), model=pred)
    lin, dec = [], []
    if "linears" in args.parts or "decode" in args.parts:
        sc = Scale(rt, m)
        cfg = LlamaConfig.named(args.config)
        if "linears" in args.parts:
            lin = linear_rows(sc, cfg, [int(t) for t in args.tokens.split(",")], dtype, args)
        if "decode" in args.parts:
            dec = decode_rows(sc, cfg, [int(t) for t in args.batches.split(",")], dtype, args)
    meta = metadata(W)
    meta.update({"nodes": N, "ranks_per_node": G, "dtype": str(dtype),
                 "machine_file": f"fusedist/comm/links/{hc.machine_name}.json",
                 "emulated_nodes": bool(args.emulate_nodes), "block_size": args.block_size,
                 "parts": args.parts, "config": args.config, "context": args.context})
    if rt.rank == 0:
        if os.environ.get("FUSEDIST_NETNS_LINK"):   # launchers/netns_nodes.sh's shaped link
            meta["netns_link"] = os.environ["FUSEDIST_NETNS_LINK"]
        stem = f"scaling-{args.tag}" if args.tag else "scaling"
        text = (markdown(b.rows, N, G) + "\n\n" if b.rows else "") + model_markdown(lin, dec)
        paths = write_results(stem, meta, b.rows, text, plot=lambda p: plot(b.rows, lin, dec, p),
                              tables={"linear_rows": lin, "decode_rows": dec})
        print("wrote " + ", ".join(str(p) for p in paths), flush=True)
    fusedist.shutdown()


def markdown(rows, N, G) -> str:
    out = [f"## collectives on {N} nodes x {G} ranks", "",
           "| group | op | algo (chosen) | size | count | type | redop | placement | time us | "
           "algbw GB/s | busbw GB/s | #wrong | model us | model error |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['group']} | {r['op']} | {r['algo']} ({r['chosen']}) | "
                   f"{r['size']} | {r['count']} | {r['type']} | {r['redop']} | "
                   f"{r['placement']} | {r['time_us']:.1f} | {r['algbw_GBps']:.4f} | "
                   f"{r['busbw_GBps']:.4f} | {r['wrong']} | {r['model_us']:.1f} | "
                   f"{100 * r['model_err']:+.1f}% |")
    errs = [abs(r["model_err"]) for r in rows]
    out += ["", f"Model error over {len(errs)} rows: median {100 * sorted(errs)[len(errs) // 2]:.1f}%"
            f", worst {100 * max(errs):.1f}%." if errs else ""]
    return "\n".join(out)


def plot(rows, linears, decode, path) -> None:
    """Left: busbw vs size of each collective configuration (out-of-place); right: efficiency
    vs ranks of the TP linears (strong: t1 / (p tp), weak: t1 / tp) and of the decode step
    (strong)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
    keys = sorted({(r["group"], r["op"], r["algo"]) for r in rows
                   if r["placement"] == "out-of-place"})
    for k in keys:
        pts = sorted((r["size"], r["busbw_GBps"]) for r in rows
                     if (r["group"], r["op"], r["algo"]) == k and r["placement"] == "out-of-place")
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label="/".join(k))
    _label(ax, "bytes", "busbw GB/s", "collectives" if keys else "collectives: not run", keys)
    series = {}
    for r in linears:
        series.setdefault(f"{r['module']} {r['scaling']} M={r['tokens']}", []).append(
            (r["ranks"], r["efficiency"]))
    for r in decode:
        if r["efficiency"] is not None:
            series.setdefault(f"decode batch {r['batch']}", []).append(
                (r["ranks"], r["efficiency"]))
    for name, pts in sorted(series.items()):
        pts.sort()
        ax2.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                 linestyle="--" if "weak" in name else "-", label=name)
    _label(ax2, "ranks (TP size)", "efficiency", "TP linears and decode step" if series
           else "TP linears, decode: not run", series)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _label(ax, x: str, y: str, title: str, legend: bool) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xlabel(x)
    ax.set_ylabel(y)
    ax.set_title(title)
    if legend:
        ax.legend(fontsize=6)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", help="comma-separated bytes (K, M, G suffixes); default "
                    f"{CPU_SIZES} on CPU, {GPU_SIZES} on GPUs")
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--reps", type=int, default=10, help="timed repetitions (median)")
    ap.add_argument("--ops", type=int, default=5, help="calls per timed repetition")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--block-size", type=int, default=128, help="FP8 elements per scale")
    ap.add_argument("--no-fp8", action="store_true")
    ap.add_argument("--machine", help="cost model link file (fusedist/comm/links/NAME.json)")
    ap.add_argument("--tag", help="results as scaling-TAG.{json,md} (a setup of the same "
                    "machine and world size, e.g. a shaped link)")
    ap.add_argument("--emulate-nodes", type=int, default=0,
                    help="act as this many nodes on one host (FUSEDIST_NODE_ID per rank)")
    ap.add_argument("--parts", default=",".join(PARTS),
                    help=f"comma-separated, of {', '.join(PARTS)} (default: all)")
    ap.add_argument("--config", help="model config (fusedist.models.llama.NAMED, random "
                    "weights) of the decode step and the TP linears' shapes (its MLP: hidden -> "
                    "2 x intermediate, intermediate -> hidden); default "
                    f"{MODEL_DEFAULTS['config'][0]} on CPU, {MODEL_DEFAULTS['config'][1]} on GPUs")
    ap.add_argument("--tokens", help="comma-separated rows M of the TP linears' input; default "
                    f"{MODEL_DEFAULTS['tokens'][0]} on CPU, {MODEL_DEFAULTS['tokens'][1]} on GPUs")
    ap.add_argument("--batches", help="comma-separated decode batches; default "
                    f"{MODEL_DEFAULTS['batches'][0]} on CPU, {MODEL_DEFAULTS['batches'][1]} on GPUs")
    ap.add_argument("--context", type=int, help="cached tokens per sequence before the timed "
                    f"decode steps; default {MODEL_DEFAULTS['context'][0]} on CPU, "
                    f"{MODEL_DEFAULTS['context'][1]} on GPUs")
    a = ap.parse_args(argv)
    gpu = int(torch.cuda.is_available())
    if a.sizes is None:
        a.sizes = GPU_SIZES if gpu else CPU_SIZES
    for k, v in MODEL_DEFAULTS.items():
        if getattr(a, k) is None:
            setattr(a, k, v[gpu])
    a.parts = [x.strip() for x in a.parts.split(",") if x.strip()]
    bad = [x for x in a.parts if x not in PARTS]
    if bad or not a.parts:
        ap.error(f"--parts: {', '.join(bad) or 'none given'}; choose from {', '.join(PARTS)}")
    run(a)


if __name__ == "__main__":
    main()
