"""Fit the cost model's link files (fusedist/comm/links/<machine>.json) from results files and
print the model's error against every measured point, and its predictions for nodes x GPUs.

    python3 benchmarks/fit_links.py h200            # from results/h200-w2/allreduce.json
    python3 benchmarks/fit_links.py cpu             # from results/cpu-w4/scaling.json
    python3 benchmarks/fit_links.py h200 --check    # errors only, the link file unchanged
    python3 benchmarks/fit_links.py --predict h200x8-ib400 --gpus 8 --nodes 1,2,4,8,16,32,64

Every level is fitted on every other measured size (sorted by size: the 1st, 3rd, ...); the
error table marks each point fitted or held out. Levels the results do not measure keep the
values the link file states, with the source it gives for them (assumed: why).
"""

from __future__ import annotations

import argparse
import math
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fusedist.comm import cost_model as cm  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def _split(points):
    pts = sorted(points)
    return pts[0::2], pts[1::2]


def _fit(points, factor, steps, step_us, source, max_protocols=2, latency="alpha"):
    fit_on, held = _split(points)
    link = cm.fit_link(fit_on, factor=factor, steps=steps, step_us=step_us,
                       max_protocols=max_protocols, latency=latency,
                       source=f"{source}: fitted on {len(fit_on)} sizes, "
                              f"{len(held)} held out")
    return link, {s for s, _ in fit_on}


def fit_h200(path: Path):
    rows = json.loads(path.read_text())["rows"]

    def pts(backend):
        return [(r["bytes"], r["time_us"]) for r in rows
                if r["op"] == "all_reduce" and r["backend"] == backend
                and isinstance(r.get("time_us"), float) and math.isfinite(r["time_us"])]
    out, fitted, measured = {}, {}, {}
    rel = str(path.relative_to(RESULTS.parent.parent))
    # World 2: ring all-reduce factor 2 (p-1)/p = 1 in 2 steps; one-shot (p-1) = 1; two-shot 1.
    for level, backend, steps, step_us in (("intra", "nccl_torch", 2, 0.6),
                                           ("fusedist_one_shot", "fd_one_shot", 0, 0.0),
                                           ("fusedist_two_shot", "fd_two_shot", 0, 0.0)):
        p = pts(backend)
        out[level], fitted[level] = _fit(p, 1.0, steps, step_us, f"{rel} {backend}")
        measured[level] = p
    return out, fitted, measured


def fit_cpu(path: Path):
    """One link for both levels (the emulated nodes share one host's loopback), fitted on the
    flat all-reduce of the intra-node groups (2 ranks), the inter-node groups (2 ranks) and
    the world (4 ranks): t = alpha + steps(p) step + 2(p-1)/p S / bw, least squares on the
    relative error over every other size of each. gloo runs a reduce-scatter as an
    all-reduce, and on 2 cores the levels do not overlap (both stated in the link file)."""
    import torch

    d = json.loads(path.read_text())
    rows = d["rows"]
    rel = str(path.relative_to(RESULTS.parent.parent))
    measured, fitted, eqs, rhs = {}, {}, [], []
    for group in ("intra", "inter", "world"):
        pts = sorted((r["size"], r["time_us"], r["ranks"]) for r in rows
                     if r["group"] == group and r["op"] == "all_reduce" and r["algo"] == "flat"
                     and r["placement"] == "out-of-place")
        measured[group] = pts
        fitted[group] = {s for s, _, _ in pts[0::2]}
        for s, t, p in pts[0::2]:
            factor, steps = cm.bus_factor("all_reduce", p)
            eqs.append([1.0 / t, steps / t, factor * s / t])
            rhs.append(1.0)
    sol = torch.linalg.lstsq(torch.tensor(eqs, dtype=torch.float64),
                             torch.tensor(rhs, dtype=torch.float64)[:, None]).solution[:, 0]
    alpha, step, inv_bw = (max(float(v), 0.0) for v in sol)
    n_fit = sum(len(f) for f in fitted.values())
    n_all = sum(len(p) for p in measured.values())
    link = cm.Link((cm.Protocol(alpha, 1e-3 / inv_bw if inv_bw > 0 else 1e9),), step,
                   f"{rel}: flat all-reduce of the intra, inter and world groups, fitted on "
                   f"{n_fit} points, {n_all - n_fit} held out", reduce_scatter_as_all_reduce=True)
    return {"intra": link, "inter": link}, fitted, measured


def fit_cpu_netns(path: Path):
    """Two namespaces joined by a tc-shaped veth (launchers/netns_nodes.sh): intra fitted on
    the intra-node group's all-reduce (every other size; latency per step); inter keeps the
    bandwidth tc sets (the link file's) and fits only its step latency on the inter-node
    groups' all-reduce (every other size): no delay was shaped, so it is not known."""
    d = json.loads(path.read_text())
    rows = d["rows"]
    rel = str(path.relative_to(RESULTS.parent.parent))
    measured, fitted, out = {}, {}, {}
    for group in ("intra", "inter"):
        pts = sorted((r["size"], r["time_us"], r["ranks"]) for r in rows
                     if r["group"] == group and r["op"] == "all_reduce" and r["algo"] == "flat"
                     and r["placement"] == "out-of-place")
        measured[group], fitted[group] = pts, {s for s, _, _ in pts[0::2]}
    factor, steps = cm.bus_factor("all_reduce", measured["intra"][0][2])
    link = cm.fit_link([(s, t) for s, t, _ in measured["intra"][0::2]], factor=factor,
                       steps=steps, max_protocols=1, latency="step",
                       source=f"{rel} intra all_reduce: fitted on "
                              f"{len(fitted['intra'])} sizes, "
                              f"{len(measured['intra']) - len(fitted['intra'])} held out")
    out["intra"] = cm.Link(link.protocols, link.step_us, link.source,
                           reduce_scatter_as_all_reduce=True)
    m = cm.Machine.load("cpu-netns")
    inter = m.link("inter")
    gbps = inter.protocols[0].gbps
    factor, steps = cm.bus_factor("all_reduce", measured["inter"][0][2])
    est = sorted((t - factor * s / (gbps * 1e3)) / steps for s, t, _ in measured["inter"][0::2])
    step = max(est[len(est) // 2], 0.0)
    out["inter"] = cm.Link(inter.protocols, step,
                           f"tc: {gbps * 1e3:g} MB/s per rank (the 200 Mbit/s link shared by 2 "
                           f"ranks); step latency fitted on {len(fitted['inter'])} sizes of "
                           f"{rel} inter all_reduce", reduce_scatter_as_all_reduce=True)
    return out, fitted, measured


def error_table(m: cm.Machine, fitted, measured, gpus: int) -> str:
    lines = ["| level | size | measured us | model us | error | point |", "|---|---|---|---|---|---|"]
    for level, pts in measured.items():
        link = m.link(level if level in m.links else "inter")
        for pt in sorted(pts):
            s, t = pt[0], pt[1]
            if len(pt) == 3:   # (size, time, ranks): the cpu fits' groups
                nodes = {"intra": 1, "inter": pt[2], "world": 2}[level]
                pred = cm.flat(m, "all_reduce", nodes, pt[2] // nodes, s)
            elif level.startswith("fusedist_one_shot"):
                pred = link.time_us((gpus - 1) * s, 0)
            elif level.startswith("fusedist_two_shot"):
                pred = link.time_us(2 * (gpus - 1) / gpus * s, 0)
            else:
                factor, steps = cm.bus_factor("all_reduce", gpus)
                pred = link.time_us(factor * s, steps)
            lines.append(f"| {level} | {s} | {t:.2f} | {pred:.2f} | "
                         f"{100 * cm.relative_error(pred, t):+.1f}% | "
                         f"{'fitted' if s in fitted[level] else 'held out'} |")
    return "\n".join(lines)


def prediction_table(m: cm.Machine, gpus: int, nodes, sizes) -> str:
    head = "| nodes x GPUs | " + " | ".join(
        f"{_fmt(s)} flat us | {_fmt(s)} best us (algo)" for s in sizes) + " | 1 GB flat busbw GB/s |"
    lines = [head, "|" + "---|" * (2 * len(sizes) + 2)]
    for n in nodes:
        cells = []
        for s in sizes:
            f = cm.predict(m, "all_reduce", n, gpus, s, "flat")[0]
            b, how = cm.predict(m, "all_reduce", n, gpus, s)
            cells.append(f"{f:.1f} | {b:.1f} ({how})")
        p = n * gpus
        t = cm.predict(m, "all_reduce", n, gpus, 1 << 30, "flat")[0]
        busbw = (1 << 30) / (t * 1e3) * 2 * (p - 1) / p if p > 1 else 0.0
        lines.append(f"| {n} x {gpus} | " + " | ".join(cells) + f" | {busbw:.0f} |")
    return "\n".join(lines)


def decode_table(m: cm.Machine, gpus: int, nodes) -> str:
    """The Llama-3-8B decode step (32 layers, hidden 4096, bf16) predicted from the TP-1 step
    measured in results/h200-w1/model.json, at batch 1 and 64."""
    rows = json.loads((RESULTS / "h200-w1" / "model.json").read_text())["rows"]
    steps = {r["batch"]: r["step_ms"] * 1e3 for r in rows if r["backend"] == "fusedist"}
    lines = ["| nodes x GPUs | batch | TP-1 step us (measured) | compute us | all-reduce us "
             "(algo) | 64 all-reduces us | step us |", "|---|---|---|---|---|---|---|"]
    for n in nodes:
        for batch, t1 in sorted(steps.items()):
            d = cm.decode_step_us(m, n, gpus, step_us_tp1=t1, layers=32, hidden=4096,
                                  batch=batch)
            lines.append(f"| {n} x {gpus} | {batch} | {t1:.0f} | {d['compute_us']:.1f} | "
                         f"{d['all_reduce_us']:.1f} ({d['algo']}) | {d['comm_us']:.0f} | "
                         f"{d['total_us']:.0f} |")
    return "\n".join(lines)


def _fmt(n: int) -> str:
    for unit, k in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= k:
            return f"{n // k} {unit}"
    return f"{n} B"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("machine", nargs="?", choices=("h200", "cpu", "cpu-netns"))
    ap.add_argument("--check", action="store_true", help="print errors, keep the link file")
    ap.add_argument("--predict", help="a link file's machine name: print predictions")
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--nodes", default="1,2,4,8,16,32,64")
    a = ap.parse_args(argv)
    if a.predict:
        m = cm.Machine.load(a.predict)
        nodes = [int(n) for n in a.nodes.split(",")]
        print(prediction_table(m, a.gpus, nodes, (4 << 10, 256 << 10, 16 << 20, 256 << 20)))
        print()
        print(decode_table(m, a.gpus, nodes))
        return 0
    if a.machine is None:
        ap.error("name a machine to fit (h200, cpu) or --predict NAME")
    if a.machine == "h200":
        src, gpus, links = RESULTS / "h200-w2" / "allreduce.json", 2, fit_h200
    elif a.machine == "cpu":
        src, gpus, links = RESULTS / "cpu-w4" / "scaling.json", 2, fit_cpu
    else:
        src, gpus, links = RESULTS / "cpu-w4" / "scaling-netns-200mbit.json", 2, fit_cpu_netns
    fitted_links, fitted, measured = links(src)
    path = cm.LINKS_DIR / f"{a.machine}.json"
    d = json.loads(path.read_text())
    if not a.check:
        for level, link in fitted_links.items():
            d["links"][level] = link.to_dict()
        path.write_text(json.dumps(d, indent=1) + "\n")
        print(f"wrote {path}")
    m = cm.Machine.load(path)
    print(error_table(m, fitted, measured, gpus))
    return 0


if __name__ == "__main__":
    sys.exit(main())
