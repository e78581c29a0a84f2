"""Scaling of the collectives over nodes x GPUs per node, with the cost model's prediction
beside every measurement.

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
warm-up, fresh random data per size. Results: benchmarks/results/<machine>-w<N>/scaling.*
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import fusedist  # noqa: E402
from _harness import fmt_bytes, metadata, slowest, time_eager, write_results  # noqa: E402
from fusedist.comm import cost_model, fp8  # noqa: E402
from fusedist.comm.hierarchical import HierarchicalCommunicator  # noqa: E402

CPU_SIZES = "1K,16K,256K,1M,4M"
GPU_SIZES = "4K,64K,1M,16M,64M,256M"
RTOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}


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
    b = y.contiguous().view(torch.uint8).cpu().long()
    return int(b.sum()), int((b * torch.arange(b.numel()) % 1000003).sum())


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
    for si, nbytes in enumerate(parse_size(s) for s in args.sizes.split(",")):
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
            # of the sum (two_shot), so 2^-3 of the sum of |inputs| covers both.
            bound = absum * 2.0 ** -3 + atol

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
    meta = metadata(W)
    meta.update({"nodes": N, "ranks_per_node": G, "dtype": str(dtype),
                 "machine_file": f"fusedist/comm/links/{hc.machine_name}.json",
                 "emulated_nodes": bool(args.emulate_nodes), "block_size": args.block_size})
    if rt.rank == 0:
        if os.environ.get("FUSEDIST_NETNS_LINK"):   # launchers/netns_nodes.sh's shaped link
            meta["netns_link"] = os.environ["FUSEDIST_NETNS_LINK"]
        stem = f"scaling-{args.tag}" if args.tag else "scaling"
        paths = write_results(stem, meta, b.rows, markdown(b.rows, N, G),
                              plot=lambda p: plot(b.rows, p))
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


def plot(rows, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    keys = sorted({(r["group"], r["op"], r["algo"]) for r in rows
                   if r["placement"] == "out-of-place"})
    for k in keys:
        pts = sorted((r["size"], r["busbw_GBps"]) for r in rows
                     if (r["group"], r["op"], r["algo"]) == k and r["placement"] == "out-of-place")
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label="/".join(k))
    ax.set_xscale("log", base=2)
    ax.set_xlabel("bytes")
    ax.set_ylabel("busbw GB/s")
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


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
    a = ap.parse_args(argv)
    if a.sizes is None:
        a.sizes = GPU_SIZES if torch.cuda.is_available() else CPU_SIZES
    run(a)


if __name__ == "__main__":
    main()
