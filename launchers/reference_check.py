"""fusedist's CPU reference path, checked: every public op that runs on CPU tensors, over the
ranks of this launch (gloo), against a float64 computation of the same maths on every rank.

This is a correctness run, not a benchmark: on CPU fusedist runs plain torch over gloo (the
path the CPU tests and the model's CPU mode use), so no speed is reported. Fresh random inputs
every run; odd sizes (not multiples of the vector width or the world size).

    python3 -m torch.distributed.run --nproc-per-node 2 launchers/reference_check.py
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist

import fusedist
import fusedist.nn

# Tolerances against float64: float32 results carry a few fp32 roundings; fusedist.gemm takes
# bf16/fp16 only, so its bf16 output carries one bf16 rounding (2^-9 relative) of an fp32 sum.
RTOL, ATOL = 1e-5, 1e-6
GEMM_REL = 1e-5
GEMM_REL_BF16 = 1e-2


def close(out: torch.Tensor, ref: torch.Tensor) -> tuple[bool, str]:
    o, r = out.double(), ref.double()
    bad = int((~(((o - r).abs() <= ATOL + RTOL * r.abs()) & torch.isfinite(o))).sum())
    err = float((o - r).abs().max()) if o.numel() else 0.0
    return bad == 0, f"{bad} of {o.numel()} elements outside rtol {RTOL:g}, max abs err {err:.1e}"


def rel(out: torch.Tensor, ref: torch.Tensor, bound: float = GEMM_REL) -> tuple[bool, str]:
    o, r = out.double(), ref.double()
    e = float((o - r).norm() / r.norm()) if r.numel() else 0.0
    ok = bool(torch.isfinite(o).all()) and e < bound
    return ok, f"relative Frobenius error {e:.1e}"


def gathered(t: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's t (same shape everywhere), float64."""
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return [o.double() for o in out]


def main() -> int:
    rt = fusedist.init()
    W, r = rt.world.size, rt.world.rank
    gen = torch.Generator().manual_seed(int(time.time_ns()) % (1 << 31) + r)
    rand = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    rows: list[tuple[str, str, bool, str]] = []

    def check(op: str, shape: str, fn):
        try:
            ok, detail = fn()
        except Exception as e:  # a failure is a row, not a crash: every op gets its line
            if isinstance(e, TypeError) and "must be CUDA tensors" in str(e):
                ok, detail = None, "no CPU path in this build (GPU only)"
            else:
                ok, detail = False, f"{type(e).__name__}: {str(e)[:90]}"
        flags = [None] * W
        dist.all_gather_object(flags, (ok, detail))
        bad = [f"rank {i}: {d}" for i, (o, d) in enumerate(flags) if o is False]
        state = "FAILED" if bad else "checked ok" if ok else "skipped"
        rows.append((op, shape, state, bad[0] if bad else flags[0][1]))

    for n in (1, 1000, 4099, 65537):
        def ar(n=n):
            x = rand(n)
            return close(fusedist.all_reduce(x), sum(gathered(x)))
        check("all_reduce", f"{n}", ar)

    for tokens, hidden in ((1, 4096), (7, 1000)):
        def arn(tokens=tokens, hidden=hidden):
            x, res, w = rand(tokens, hidden), rand(tokens, hidden), rand(hidden)
            dist.broadcast(res, 0)
            dist.broadcast(w, 0)
            normed, new_res = fusedist.all_reduce_add_rmsnorm(x, res, w, 1e-6)
            h = sum(gathered(x)) + res.double()
            ref = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
            ok1, d1 = close(new_res, h)
            ok2, d2 = close(normed, ref)
            return ok1 and ok2, d2
        check("all_reduce_add_rmsnorm", f"{tokens} x {hidden}", arn)

    m, k, n = 37, 96, 200  # per-rank K / rows; world-sized shards of odd row counts
    def gar():
        x, w = rand(m, k), rand(k, n)
        ref = sum(a @ b for a, b in zip(gathered(x), gathered(w)))
        return rel(fusedist.gemm_ar(x, w), ref)
    check("gemm_ar", f"{m} x {n} x {k}/rank", gar)

    def ag():
        x, w = rand(m, k), rand(k, n)
        dist.broadcast(w, 0)
        return rel(fusedist.ag_gemm(x, w), torch.cat(gathered(x)) @ w.double())
    check("ag_gemm", f"{W} x {m} x {n} x {k}", ag)

    def rs():
        x, w = rand(W * m, k), rand(k, n)
        full = sum(a @ b for a, b in zip(gathered(x), gathered(w)))
        return rel(fusedist.gemm_rs(x, w), full[r * m:(r + 1) * m])
    check("gemm_rs", f"{W * m} x {n} x {k}/rank", rs)

    def linears():
        d_in, d_hid = 64, 160
        a, b = rand(d_hid, d_in), rand(d_in, d_hid)
        x = rand(5, d_in)
        for t in (a, b, x):
            dist.broadcast(t, 0)
        col = fusedist.nn.ColumnParallelLinear.from_full(a)
        row = fusedist.nn.RowParallelLinear.from_full(b)
        y = row(col(x))
        return rel(y, (x.double() @ a.double().t()) @ b.double().t())
    check("Column + RowParallelLinear", "5 x 64 -> 160 -> 64", linears)

    def gemm():
        x, w = rand(33, 72).bfloat16(), rand(72, 40).bfloat16()
        return rel(fusedist.gemm(x, w), x.double() @ w.double(), GEMM_REL_BF16)
    check("gemm (bf16)", "33 x 40 x 72", gemm)

    ok = all(row[2] != "FAILED" for row in rows)
    if r == 0:
        print(f"\nfusedist CPU reference path: {W} processes over gloo, float32 inputs checked "
              "against float64 on every rank.\nCorrectness, not speed: on CPU fusedist runs "
              "plain torch; its kernels need NVIDIA GPUs (sm_90a for the fused ones).\n")
        print("| op | shape | result | detail |\n|---|---|---|---|")
        for op, shape, state, detail in rows:
            print(f"| {op} | {shape} | {state} | {detail} |")
        counts = {s: sum(row[2] == s for row in rows) for s in ("checked ok", "FAILED", "skipped")}
        print("\n" + ", ".join(f"{v} {k}" for k, v in counts.items() if v))
    fusedist.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
