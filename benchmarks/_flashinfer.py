"""FlashInfer as an optional same-run baseline of the attention benchmarks (attention.py,
attention_prefill.py): loading it, its paged-KV page table, and the check of its output.

Layout: fusedist's caches, K and V each [num_pages, page_size, kv_heads, head_dim], are
FlashInfer's "NHD" paged layout with separate K and V tensors, passed as the tuple (k, v); no
copy. Its page table is CSR where fusedist's is dense: sequence b's pages are
indices[indptr[b]:indptr[b + 1]] (the first ceil(len / page_size) entries of block_table row
b) and last_page_len[b] tokens of its last page are used.

FlashInfer compiles each kernel module just in time at its first plan() (10-25 s; the cache
lives under $FLASHINFER_WORKSPACE_BASE/.cache/flashinfer). It turns programmatic dependent
launch (PDL) on by default from sm90 on; the benchmarks pass that default explicitly and
record it. Offline install: docs/benchmarks.md ("FlashInfer")."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

# The CUDA-core decode kernel serves these query heads per kv head only (the tensor-core
# wrapper takes any).
CUDA_CORE_GROUPS = (1, 2, 3, 4, 8)
# One float workspace serves every wrapper of a process: the calls are stream-ordered, as a
# model's layers share one (FlashInfer recommends 128 MB; 256 MB leaves room for batch 256).
WORKSPACE_BYTES = 256 << 20
# FlashInfer's output against fusedist's, element by element: |fi - fd| <= RTOL |fd| +
# ATOL rms(fd): tests/tolerances.py's GEMM_ELEM for bf16 (two bf16 kernels, each a few output
# roundings and a bf16 P away from the exact value). A misconfigured baseline (wrong layout,
# page table or scale) misses by orders of magnitude.
RTOL, ATOL = 1.6e-2, 3.2e-2

_STATE: dict = {}


def load(enabled: bool = True):
    """(the flashinfer module or None, a note): None when disabled or when the import fails
    (the note says why)."""
    if not enabled:
        return None, "not timed (--no-flashinfer)"
    if "mod" not in _STATE:
        try:
            import flashinfer

            _STATE["mod"] = flashinfer
            _STATE["note"] = f"flashinfer {getattr(flashinfer, '__version__', '?')}"
        except Exception as e:  # noqa: BLE001 - any import failure means: no FlashInfer rows
            _STATE["mod"] = None
            _STATE["note"] = (f"not timed: import flashinfer failed ({type(e).__name__}: "
                              f"{str(e)[:160]})")
    return _STATE["mod"], _STATE["note"]


def pdl(device) -> bool:
    """FlashInfer's own default for enable_pdl: on from compute capability 9.0."""
    return torch.cuda.get_device_capability(device)[0] >= 9


def workspace(device) -> torch.Tensor:
    """The process's float workspace (zeroed once, as FlashInfer asks)."""
    key = ("ws", str(device))
    if key not in _STATE:
        _STATE[key] = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    return _STATE[key]


def csr(block_table: torch.Tensor, seq_lens: Sequence[int], page_size: int
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashInfer's (indptr, indices, last_page_len), int32 on block_table's device, for the
    sequences of a fusedist block table [B, max_pages] with host lengths seq_lens (>= 1)."""
    counts = [-(-int(n) // page_size) for n in seq_lens]
    if any(n < 1 for n in seq_lens) or max(counts) > block_table.shape[1]:
        raise ValueError(f"csr: lengths {list(seq_lens)[:4]}... need 1 to "
                         f"{block_table.shape[1] * page_size} tokens")
    dev = block_table.device
    indptr = torch.tensor([0] + counts, dtype=torch.int64).cumsum(0).to(torch.int32)
    indices = torch.cat([block_table[b, :c] for b, c in enumerate(counts)]).to(torch.int32)
    last = torch.tensor([int(n) - (c - 1) * page_size for n, c in zip(seq_lens, counts)],
                        dtype=torch.int32)
    return indptr.to(dev), indices.contiguous(), last.to(dev)


def why(e: BaseException) -> str:
    """A short reason for a FlashInfer failure: for a failed JIT build the first compiler error
    line (the whole ninja output is printed once by the caller), else the exception."""
    text = str(e)
    if is_build_failure(e):
        lines = [ln.strip() for ln in text.splitlines() if "error" in ln.lower()]
        return "JIT build failed: " + (lines[0] if lines else text.splitlines()[0])[:200]
    return f"{type(e).__name__}: {text[:160]}"


def is_build_failure(e: BaseException) -> bool:
    """A JIT build that failed: it fails again for every shape of the same module."""
    return "Ninja build failed" in str(e)


def check(out: torch.Tensor, ref: torch.Tensor) -> tuple[bool, float]:
    """(within tolerance, the largest error as a fraction of its tolerance): out against ref
    elementwise (RTOL, ATOL above); a non-finite element fails (fraction inf)."""
    o, r = out.double(), ref.double()
    if not bool(torch.isfinite(o).all()):
        return False, float("inf")
    tol = RTOL * r.abs() + ATOL * r.pow(2).mean().sqrt().clamp_min(1e-30)
    frac = float(((o - r).abs() / tol).max()) if o.numel() else 0.0
    return frac <= 1.0, frac


# Attention against an fp32 reference, one head vector at a time: ||out - ref|| / ||ref|| <=
# ROW_REL (tests/ops/test_attention.py's bad_rows for bf16: a flash-style kernel rounds P to
# bf16 before P @ V, an error relative to the row's magnitude; over thousands of keys the
# output shrinks and an elementwise bound scaled by its rms no longer fits any backend).
ROW_REL = 1e-2


def check_rows(out: torch.Tensor, ref: torch.Tensor) -> tuple[bool, float]:
    """(every head vector within ROW_REL, the worst one's error as a fraction of it); out and
    ref [.., head_dim]; a non-finite element fails (fraction inf)."""
    o, r = out.double().flatten(0, -2), ref.double().flatten(0, -2)
    if not bool(torch.isfinite(o).all()):
        return False, float("inf")
    err = (o - r).norm(dim=-1) / r.norm(dim=-1).clamp_min(1e-30)
    frac = float(err.max() / ROW_REL) if o.numel() else 0.0
    return frac <= 1.0, frac


def check_note(ok: bool, frac: float) -> str:
    return f"ok ({frac:.2f} of tol)" if ok else f"WRONG ({frac:.3g} x tol)"


def meta(fi, device: Optional[torch.device] = None) -> dict:
    """What the results record of FlashInfer: its version (None when not timed) and PDL."""
    if fi is None:
        return {"flashinfer": None, "flashinfer_pdl": None}
    return {"flashinfer": getattr(fi, "__version__", "?"),
            "flashinfer_pdl": pdl(device) if device is not None else None}
