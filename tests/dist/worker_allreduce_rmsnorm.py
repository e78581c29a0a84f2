"""all_reduce_add_rmsnorm checks on every rank (CPU/gloo or one GPU per rank)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _checks import (assert_identical_across_ranks, check, emulated, main,  # noqa: E402
                     rmsnorm_reference, skip)

import torch  # noqa: E402

import fusedist  # noqa: E402
from tolerances import TOL_EPILOGUE, count_bad  # noqa: E402

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SHAPES = ((1, 4096), (7, 8192), (19, 1000), (128, 8192), (3, 16384))
EPS = 1e-6


def reference(rt, tokens, hidden, dtype, seed):
    """float64 reference with the op's roundings: round(all_reduce), round(+ residual)."""
    return rmsnorm_reference(rt.tp, tokens, hidden, dtype, rt.device, seed, EPS)


def kernel_applies(rt, tokens, hidden, dtype) -> bool:
    """Where the fused kernel must run (stated here, not asked of the library): symmetric
    memory, rows of whole 16-byte vectors, at most 2048 of them, within one-shot capacity."""
    comm = fusedist.get_communicator()
    per = 16 // dtype.itemsize
    return (comm.symm is not None and hidden % per == 0 and hidden // per <= 2048 and
            tokens * hidden * dtype.itemsize <= comm.capacity("one_shot", dtype))


def fused_modes(rt):
    """None (auto) everywhere; on GPU groups with symmetric memory also True (the kernel
    forced) and False (the unfused path)."""
    if rt.device.type != "cuda" or fusedist.get_communicator().symm is None:
        return (None,)
    return (None, True, False)


@check
@emulated
def fused_matches_reference(rt, seed):
    modes = fused_modes(rt)
    if True in modes:
        assert kernel_applies(rt, 1, 4096, torch.bfloat16), "the fused kernel never applies"
    for fused in modes:
        for dtype in DTYPES:
            for tokens, hidden in SHAPES:
                x, res, w, h_ref, y_ref = reference(rt, tokens, hidden, dtype,
                                                    (seed, fused, str(dtype), tokens, hidden))
                if fused and not kernel_applies(rt, tokens, hidden, dtype):
                    try:
                        fusedist.all_reduce_add_rmsnorm(x, res, w, EPS, fused=True)
                    except ValueError as e:
                        assert "fused=True" in str(e), str(e)
                    else:
                        raise AssertionError(f"fused=True accepted {tokens}x{hidden} {dtype}")
                    continue
                normed, new_res = fusedist.all_reduce_add_rmsnorm(x, res, w, EPS, fused=fused)
                what = f"fused={fused} {dtype} {tokens}x{hidden}"
                assert new_res.shape == x.shape and normed.dtype == dtype, what
                bad = count_bad(new_res, h_ref, dtype, TOL_EPILOGUE)
                assert bad == 0, f"{what}: residual has {bad} wrong elements"
                bad = count_bad(normed, y_ref, dtype, TOL_EPILOGUE)
                assert bad == 0, f"{what}: normed has {bad} wrong elements"
                assert_identical_across_ranks(rt, normed, what)


@check
@emulated
def fp8_output(rt, seed):
    fp8 = getattr(torch, "float8_e4m3fn", None)
    if fp8 is None:
        skip("this torch has no float8_e4m3fn")
    # fused=False: the all-reduce, then add_rmsnorm's kernel writes the e4m3 rows and scales.
    for fused, dtype in ((f, d) for f in fused_modes(rt) for d in (torch.bfloat16, torch.float16)):
        for tokens, hidden in ((1, 4096), (33, 8192)):
            x, res, w, h_ref, y_ref = reference(rt, tokens, hidden, dtype,
                                                (seed, "fp8", str(dtype), tokens))
            q, new_res, scale = fusedist.all_reduce_add_rmsnorm(x, res, w, EPS, out_dtype=fp8,
                                                                fused=fused)
            assert q.dtype == fp8 and scale.shape == (tokens,), (q.dtype, scale.shape)
            exp_scale = y_ref.abs().amax(-1) / 448.0
            assert torch.allclose(scale.double(), exp_scale, rtol=2e-2), "fp8 scales"
            deq = q.double() * scale.double().unsqueeze(-1)
            # e4m3 keeps 3 mantissa bits: relative step 2^-3, so half a step is 6.25%.
            err = (deq - y_ref).abs() <= 0.07 * y_ref.abs() + scale.double().unsqueeze(-1) * 2**-6
            assert bool(err.all()), f"fp8 {dtype} {tokens}: {int((~err).sum())} bad elements"
            assert count_bad(new_res, h_ref, dtype, TOL_EPILOGUE) == 0


@check
@emulated
def bad_inputs(rt, seed):
    dev, dt = rt.device, torch.float32
    x = torch.zeros(2, 64, device=dev, dtype=dt)
    for kwargs, match in (
        (dict(residual=torch.zeros(2, 65, device=dev)), "residual has shape"),
        (dict(weight=torch.zeros(63, device=dev)), "weight must be"),
        (dict(eps=-1.0), "eps must be"),
        (dict(out_dtype=torch.int8), "out_dtype must be"),
    ):
        args = dict(x=x, residual=torch.zeros_like(x), weight=torch.ones(64, device=dev),
                    eps=1e-6)
        args.update(kwargs)
        try:
            fusedist.all_reduce_add_rmsnorm(**args)
        except (ValueError, TypeError) as e:
            assert match in str(e), (match, str(e))
        else:
            raise AssertionError(f"no error for {match}")


if __name__ == "__main__":
    main()
