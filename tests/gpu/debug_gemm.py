"""Quick 2-GPU probe: are seeded inputs identical across devices, and is each GEMM path right?"""
import os, sys
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "dist"))
from _harness import fresh  # noqa
import torch, fusedist  # noqa
from tolerances import gemm_rel_err  # noqa
rt = fusedist.init()
dev, W, me = rt.device, rt.tp.size, rt.tp.rank
bf = torch.bfloat16
for shape in [(4096,), (2, 72), (72, 40), (129, 1000)]:
    t = fresh(shape, bf, dev, 123)
    print(f"rank{me} fresh{shape}: sum={t.float().sum().item():.6f} abs={t.float().abs().sum().item():.3f}", flush=True)
x = fresh((2, 72), bf, dev, 1); w = fresh((72, 40), bf, dev, 2)
out = torch.full((2, 40), float("nan"), dtype=bf, device=dev)
torch.matmul(x, w, out=out)
print(f"rank{me} local matmul out=: {gemm_rel_err(out, x.double() @ w.double()):.3g}", flush=True)
print(f"rank{me} local matmul: {gemm_rel_err(x @ w, x.double() @ w.double()):.3g}", flush=True)
xs = [fresh((1, 72), bf, dev, 10 + p) for p in range(W)]
g = torch.empty((W, 72), dtype=bf, device=dev)
fusedist.get_communicator().nccl.all_gather(xs[me], g)
torch.cuda.synchronize()
print(f"rank{me} allgather vs local regen: {(g.float() - torch.cat(xs).float()).abs().max().item()}", flush=True)
y = fusedist.ag_gemm(xs[me], w, engine="unfused")
print(f"rank{me} ag_gemm unfused: {gemm_rel_err(y, torch.cat(xs).double() @ w.double()):.3g}", flush=True)
fusedist.shutdown()
