"""Bad inputs across fusedist, as a user would make them: a table of cases over the layers, the
model and the runner, the CLI, FP8 checkpoints and collectives, LLM and the distributed paths
(ranks that disagree, peers that go away). Each case says what a good answer is: an error of
the named types whose message holds the given phrases (the argument and the fix), or a result
that passes a check. Each outcome is one of

    clear    the expected error, or a correct result
    unclear  another exception, or one whose message lacks a phrase (a user sees internals)
    silent   no error where one was due, or a wrong result
    crash    the process died (a signal, an abort), or the CLI ended in a traceback
    hang     no answer within the case's time (a multi-rank case: 60 s)

Run under pytest (one test per case, each asserting "clear"), or as a script for the counts:

    python tests/test_bad_inputs.py              # every case; counts per area and outcome
    python tests/test_bad_inputs.py --area llm -v

Multi-rank cases run in processes forked from one driver process (tests/test_bad_inputs.py
--dist-driver, which imports fusedist once and runs nothing before it forks): 2 ranks over
gloo each, their rendezvous a TCP store that the test process holds on a port bound for it,
killed at the case's deadline.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for p in (str(ROOT), str(HERE), str(HERE / "models")):
    if p not in sys.path:
        sys.path.insert(0, p)

OUTCOMES = ("clear", "unclear", "silent", "crash", "hang")
DIST_DEADLINE_S = 60          # a multi-rank case that takes longer has hung
LOCAL_DEADLINE_S = 120        # the same for a one-process case (SIGALRM)


# ---- expectations --------------------------------------------------------------------------
@dataclass
class Raises:
    """An error of one of `types` (names of classes: "ValueError", "fusedist.PeerLostError"),
    its message holding every phrase (case-insensitive)."""
    types: tuple
    phrases: tuple = ()

    def judge(self, exc: Optional[BaseException], result=None) -> tuple[str, str]:
        if exc is None:
            return "silent", f"returned {result!r:.120} without an error"
        if not _is_instance(exc, self.types):
            return "unclear", f"{type(exc).__name__}: {str(exc)[:300]}"
        msg = str(exc).lower()
        missing = [p for p in self.phrases if p.lower() not in msg]
        if missing:
            return "unclear", f"message lacks {missing}: {str(exc)[:300]}"
        return "clear", f"{type(exc).__name__}: {str(exc)[:160]}"


@dataclass
class Returns:
    """No error, and check(result) is true (default: anything)."""
    check: Callable = lambda r: True
    what: str = "a correct result"

    def judge(self, exc: Optional[BaseException], result=None) -> tuple[str, str]:
        if exc is not None:
            return "unclear", f"{type(exc).__name__}: {str(exc)[:300]}"
        try:
            ok = self.check(result)
        except Exception as e:  # noqa: BLE001 - a check that cannot read the result
            return "silent", f"the result does not check ({type(e).__name__}: {e})"
        return ("clear", "ok") if ok else ("silent", f"not {self.what}: {result!r:.200}")


def _is_instance(exc, names) -> bool:
    import fusedist

    for n in names:
        cls = eval(n, {"fusedist": fusedist, **__builtins__} if isinstance(__builtins__, dict)
                   else {"fusedist": fusedist, **vars(__builtins__)})
        if isinstance(exc, cls):
            return True
    return False


@dataclass
class Exits:
    """A rank that ends its process on purpose (the peer the others lose)."""

    def judge(self, exc, result=None):
        if exc is not None:
            return "unclear", f"{type(exc).__name__}: {str(exc)[:300]}"
        return "clear", "exited"


VALUE = ("ValueError",)
TYPE_OR_VALUE = ("ValueError", "TypeError")
MISMATCH = ("fusedist.CollectiveMismatchError",)
PEER_LOST = ("fusedist.PeerLostError",)


@dataclass
class Case:
    area: str
    name: str
    run: Callable = None           # one-process cases: run() -> result
    expect: object = None          # Raises / Returns, or per rank for multi-rank cases
    needs_rt: bool = False         # a world-1 gloo runtime around run()
    ranks: int = 0                 # > 0: a multi-rank case; run(rank, world) in each rank
    per_rank: Optional[list] = None   # multi-rank: an expectation per rank (else `expect`)
    init: bool = True              # multi-rank: fusedist.init() before run(rank)


CASES: list[Case] = []


def case(area, name, expect, needs_rt=False, **kw):
    def reg(fn):
        CASES.append(Case(area, name, fn, expect, needs_rt=needs_rt, **kw))
        return fn
    return reg


# ---- fixtures: tiny checkpoints, written once per run ----------------------------------------
_FIX: dict = {}


def fixtures() -> dict:
    """Checkpoint directories the cases read (written on first use into a temporary dir)."""
    if _FIX:
        return _FIX
    import torch
    from safetensors.torch import load_file, save_file

    from hf_tiny import make_checkpoint, write_fp8_checkpoint

    base = Path(os.environ.get("FUSEDIST_BAD_INPUT_DIR") or tempfile.mkdtemp(prefix="fdbad"))
    _FIX["dir"] = str(base)
    llama = str(base / "llama3")
    if not (Path(llama) / "config.json").exists():
        make_checkpoint("llama3", llama, seed=3)
        from test_llm import write_tokenizer
        write_tokenizer(llama)
    _FIX["llama"] = llama
    fp8src = str(base / "fp8src")
    if not (Path(fp8src) / "config.json").exists():
        make_checkpoint("llama_fp8", fp8src, seed=4)
    _FIX["fp8src"] = fp8src
    proj = "model.layers.1.self_attn.o_proj"

    def put(name, fn):
        def edit(t):
            t[name] = fn(t[name])
        return edit

    def byte(value):
        def f(w):
            b = w.view(torch.uint8).clone()
            b.view(-1)[5] = value
            return b.view(torch.float8_e4m3fn)
        return f

    def scale(value):
        def f(s):
            s = s.clone()
            s.view(-1)[0] = value
            return s
        return f

    variants = {
        "fp8_ok": ("fp8", "block", None),
        "fp8_nan_scale": ("fp8", "block", put(proj + ".weight_scale_inv", scale(math.nan))),
        "fp8_inf_scale": ("fp8", "block", put(proj + ".weight_scale_inv", scale(math.inf))),
        "fp8_neg_scale": ("fp8", "block", put(proj + ".weight_scale_inv", scale(-1.0))),
        "fp8_byte_7f": ("fp8", "block", put(proj + ".weight", byte(0x7F))),
        "fp8_byte_ff": ("fp8", "block", put(proj + ".weight", byte(0xFF))),
        "ct_nan_scale": ("compressed-tensors", "channel",
                         put("model.layers.0.mlp.down_proj.weight_scale", scale(math.nan))),
        "ct_inf_scale": ("compressed-tensors", "channel",
                         put("model.layers.0.mlp.down_proj.weight_scale", scale(-math.inf))),
        "ct_byte_7f": ("compressed-tensors", "channel",
                       put("model.layers.0.mlp.up_proj.weight", byte(0x7F))),
        "ct_tensor_nan": ("compressed-tensors", "tensor",
                          put("model.layers.0.self_attn.q_proj.weight_scale", scale(math.nan))),
    }
    for name, (method, layout, edit) in variants.items():
        d = str(base / name)
        if not (Path(d) / "config.json").exists():
            write_fp8_checkpoint(fp8src, d, method, layout, edit=edit)
        _FIX[name] = d
    # A floating checkpoint with a NaN weight and one with an inf norm weight.
    for name, tensor, value in (("bf16_nan", "model.layers.0.mlp.up_proj.weight", math.nan),
                                ("bf16_inf", "model.layers.1.input_layernorm.weight",
                                 math.inf)):
        d = base / name
        if not (d / "config.json").exists():
            d.mkdir(parents=True, exist_ok=True)
            t = load_file(os.path.join(llama, "model.safetensors"))
            t[tensor] = t[tensor].clone()
            t[tensor].view(-1)[3] = value
            save_file(t, str(d / "model.safetensors"))
            for f in ("config.json",):
                (d / f).write_text((Path(llama) / f).read_text())
        _FIX[name] = str(d)
    # Llama with attention_bias: q/k/v and o_proj biases (transformers' layout).
    bias = str(base / "llama_bias")
    if not (Path(bias) / "config.json").exists():
        _write_bias_checkpoint(bias)
    _FIX["llama_bias"] = bias
    # A truncated tokenizer_config.json (the chat template lost with it).
    trunc = base / "trunc_tok"
    if not (trunc / "config.json").exists():
        trunc.mkdir(parents=True, exist_ok=True)
        for f in os.listdir(llama):
            src = Path(llama) / f
            if f == "tokenizer_config.json":
                text = src.read_text()
                (trunc / f).write_text(text[:len(text) // 2])
            else:
                os.symlink(src, trunc / f)
    _FIX["trunc_tok"] = str(trunc)
    # A chat template that raises on its own (roles must alternate).
    strict = base / "strict_chat"
    if not (strict / "config.json").exists():
        strict.mkdir(parents=True, exist_ok=True)
        for f in os.listdir(llama):
            if not f.startswith("tokenizer") and f != "special_tokens_map.json":
                os.symlink(Path(llama) / f, strict / f)
        from test_llm import write_tokenizer
        write_tokenizer(str(strict), chat_template=(
            "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
            "{{ raise_exception('Conversation roles must alternate user/assistant/user/"
            "assistant/...') }}{% endif %}<s> {{ m['role'] }} {{ m['content'] }} <|end|> "
            "{% endfor %}{% if add_generation_prompt %}<s> assistant {% endif %}"))
    _FIX["strict_chat"] = str(strict)
    return _FIX


def _write_bias_checkpoint(path: str) -> None:
    import torch
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   num_hidden_layers=2, max_position_embeddings=256,
                                   attention_bias=True, rms_norm_eps=1e-6)
    torch.manual_seed(5)
    m = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("_proj.bias"):
                p.copy_(torch.randn_like(p) * 0.3)
    m.save_pretrained(path)


# ---- helpers the cases share ------------------------------------------------------------------
def _llm(**kw):
    from fusedist.models import LLM

    kw.setdefault("max_batch", 2)
    kw.setdefault("max_seq_len", 64)
    if "model" not in kw and "config" not in kw:
        kw.setdefault("random_weights", True)
        kw["config"] = "tiny"
    return LLM(kw.pop("model", None), **kw)


def _with_llm(fn, **kw):
    llm = _llm(**kw)
    try:
        return fn(llm)
    finally:
        llm.close()


def _runner(**kw):
    import torch

    import fusedist
    from fusedist.models import LlamaConfig, Runner, build_model
    from fusedist.models.llama import RandomWeights

    cfg = LlamaConfig.named("tiny")
    m = build_model(cfg, RandomWeights(cfg, seed=1), group=fusedist.get_runtime().tp,
                    dtype=torch.float32, device="cpu", max_position=256)
    kw.setdefault("max_batch", 2)
    kw.setdefault("max_seq_len", 64)
    return Runner(m, **kw)


def _ids_ok(n):
    return lambda r: all(isinstance(t, int) for t in r.ids) and len(r.ids) == n


def _cli(argv):
    """fusedist.generate's main(argv) in this process: (exit status, stdout, stderr)."""
    from fusedist import generate

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = generate.main(argv)
        except SystemExit as e:
            if isinstance(e.code, str):
                print(e.code, file=err)
                code = 1
            else:
                code = e.code or 0
    return code, out.getvalue(), err.getvalue()


@dataclass
class CliExit:
    """The CLI ends with exit status `code` and one stderr line holding every phrase; without
    phrases and with code 0: a report (check(stdout))."""
    phrases: tuple = ()
    code: int = 1
    check: Callable = None

    def judge(self, exc, result=None):
        if exc is not None:
            return "crash", (f"traceback: {type(exc).__name__}: {str(exc)[:300]}")
        code, out, err = result
        if code != self.code:
            if code == 0:
                return "silent", f"exit 0; stdout {out[-200:]!r}"
            return "unclear", f"exit {code}; stderr {err[-300:]!r}"
        if self.code == 0:
            if self.check is not None and not self.check(out):
                return "silent", f"stdout fails its check: {out[-300:]!r}"
            return "clear", "ok"
        lines = [ln for ln in err.strip().splitlines() if ln.startswith("fusedist.generate")
                 or ln.startswith("python -m fusedist.generate: error:")]   # argparse's
        if not lines:
            return "unclear", f"no 'fusedist.generate:' line on stderr: {err[-300:]!r}"
        text = "\n".join(lines).lower()
        missing = [p for p in self.phrases if p.lower() not in text]
        if missing:
            return "unclear", f"stderr lacks {missing}: {lines[-1][:300]}"
        return "clear", lines[-1][:160]


def _raises_in_rank(exc_type_names, *phrases):
    return Raises(tuple(exc_type_names), phrases)


# =============================================================================================
# layers: ops and nn modules, one process
# =============================================================================================
def _t(*shape, dtype=None):
    import torch
    return torch.randn(*shape, dtype=dtype or torch.float32)


@case("layers", "all_reduce: list instead of tensor", Raises(("TypeError",), ("x",)),
      needs_rt=True)
def _():
    import fusedist
    return fusedist.all_reduce([1.0, 2.0])


@case("layers", "all_reduce: int64 tensor", Raises(TYPE_OR_VALUE, ("dtype",)), needs_rt=True)
def _():
    import torch

    import fusedist
    return fusedist.all_reduce(torch.ones(4, dtype=torch.int64))


@case("layers", "all_reduce: non-contiguous", Raises(VALUE, ("contiguous",)), needs_rt=True)
def _():
    import fusedist
    return fusedist.all_reduce(_t(4, 6).t())


@case("layers", "all_reduce: out of another shape", Raises(VALUE, ("out",)), needs_rt=True)
def _():
    import fusedist
    return fusedist.all_reduce(_t(4), out=_t(5))


@case("layers", "all_reduce: algo typo", Raises(VALUE, ("algo",)), needs_rt=True)
def _():
    import fusedist
    return fusedist.all_reduce(_t(4), algo="oneshot")


@case("layers", "add_rmsnorm: eps 0", Raises(VALUE, ("eps",)), needs_rt=True)
def _():
    import fusedist
    return fusedist.add_rmsnorm(_t(2, 8), _t(2, 8), _t(8), 0.0)


@case("layers", "add_rmsnorm: weight of another hidden", Raises(VALUE, ("weight",)),
      needs_rt=True)
def _():
    import fusedist
    return fusedist.add_rmsnorm(_t(2, 8), _t(2, 8), _t(7), 1e-6)


@case("layers", "all_reduce_add_rmsnorm: residual of another shape",
      Raises(VALUE, ("residual",)), needs_rt=True)
def _():
    import fusedist
    return fusedist.all_reduce_add_rmsnorm(_t(2, 8), _t(3, 8), _t(8), 1e-6)


@case("layers", "silu_mul: odd last dim", Raises(VALUE, ("silu_mul",)), needs_rt=True)
def _():
    import fusedist
    return fusedist.silu_mul(_t(2, 7))


@case("layers", "gemm: inner sizes differ", Raises(VALUE, ("gemm",)), needs_rt=True)
def _():
    import fusedist
    return fusedist.gemm(_t(3, 8), _t(9, 4))


@case("layers", "PagedKVCache: numpy sizes accepted",
      Returns(lambda c: c.num_pages == 4 and c.k_buffer.shape[0] == 2))
def _():
    import numpy as np

    from fusedist.nn import PagedKVCache
    return PagedKVCache(np.int64(2), np.int64(2), np.int64(8), np.int64(4), page_size=np.int32(4))


@case("layers", "PagedKVCache: page_size 0", Raises(VALUE, ("page_size",)))
def _():
    from fusedist.nn import PagedKVCache
    return PagedKVCache(2, 2, 8, 4, page_size=0)


@case("layers", "BlockTable: numpy max_batch accepted", Returns())
def _():
    import numpy as np

    from fusedist.nn import BlockTable, PagedKVCache
    c = PagedKVCache(1, 1, 8, 8, page_size=4)
    t = BlockTable(c.allocator, c.page_size, max_batch=np.int64(2),
                   max_pages_per_seq=np.int64(4))
    t.add("a")
    return t.append("a", np.int64(3))


@case("layers", "TPAttention: numpy sizes accepted", Returns(), needs_rt=True)
def _():
    import numpy as np

    from fusedist.nn import TPAttention
    return TPAttention(np.int64(64), np.int64(4), np.int64(2))


@case("layers", "TPAttention: linear RoPE factor 0", Raises(VALUE, ("factor",)), needs_rt=True)
def _():
    from fusedist.nn import TPAttention
    return TPAttention(64, 4, 2, rope_scaling={"rope_type": "linear", "factor": 0.0},
                       max_position=32)


@case("layers", "TPAttention: llama3 RoPE factor -2", Raises(VALUE, ("factor",)),
      needs_rt=True)
def _():
    from fusedist.nn import TPAttention
    return TPAttention(64, 4, 2, max_position=32, rope_scaling={
        "rope_type": "llama3", "factor": -2.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16})


def _attn_setup(dtype=None):
    import torch

    from fusedist.nn import TPAttention
    a = TPAttention(64, 4, 2, max_position=64, dtype=torch.float32)
    for p in (a.qkv_weight, a.o_weight):
        p.copy_(torch.randn_like(p) * 0.1)
    cache = a.make_cache(1, 8, page_size=4)
    return a, cache


def _prefill_meta(T, seq_lens_host=None, seq_lens=None):
    import torch

    from fusedist.nn import AttentionMetadata
    pages = -(-T // 4)
    return AttentionMetadata("prefill", torch.arange(pages, dtype=torch.int32)[None],
                             torch.tensor([T if seq_lens is None else seq_lens],
                                          dtype=torch.int32),
                             torch.arange(T), cu_seqlens_q=torch.tensor([0, T],
                                                                        dtype=torch.int32),
                             max_q_len=T, seq_lens_host=seq_lens_host or [T],
                             cu_seqlens_q_host=[0, T])


@case("layers", "TPAttention: seq_lens_host disagrees with seq_lens",
      Raises(VALUE, ("seq_lens_host", "seq_lens")), needs_rt=True)
def _():
    import torch
    a, cache = _attn_setup()
    return a(torch.randn(5, 64), torch.arange(5), cache, 0, _prefill_meta(5, [7]))


@case("layers", "TPAttention: bf16 x into a float32 module", Raises(TYPE_OR_VALUE, ("dtype",)),
      needs_rt=True)
def _():
    import torch
    a, cache = _attn_setup()
    return a(torch.randn(5, 64, dtype=torch.bfloat16), torch.arange(5), cache, 0,
             _prefill_meta(5))


@case("layers", "ColumnParallelLinear: float64 x into a float32 module",
      Raises(TYPE_OR_VALUE, ("dtype",)), needs_rt=True)
def _():
    import torch

    from fusedist.nn import ColumnParallelLinear
    m = ColumnParallelLinear.from_full(torch.randn(16, 8))
    return m(torch.randn(3, 8, dtype=torch.float64))


@case("layers", "RowParallelLinear: bf16 x into a float32 module",
      Raises(TYPE_OR_VALUE, ("dtype",)), needs_rt=True)
def _():
    import torch

    from fusedist.nn import RowParallelLinear
    m = RowParallelLinear.from_full(torch.randn(16, 8))
    return m(torch.randn(3, 8, dtype=torch.bfloat16))


@case("layers", "AttentionMetadata: mode typo", Raises(VALUE, ("mode",)))
def _():
    import torch

    from fusedist.nn import AttentionMetadata
    return AttentionMetadata("decoding", torch.zeros(1, 1, dtype=torch.int32),
                             torch.ones(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int64))


@case("layers", "sample: NaN logits row", Raises(VALUE, ("nan",)))
def _():
    import torch

    from fusedist.models import SamplingParams, sample
    lg = torch.randn(2, 16)
    lg[1] = float("nan")
    return sample(lg, SamplingParams(), None)


@case("layers", "sample: NaN logits row, sampled", Raises(VALUE, ("nan",)))
def _():
    import torch

    from fusedist.models import SamplingParams, sample
    lg = torch.randn(2, 16)
    lg[0, 3] = float("nan")
    return sample(lg, SamplingParams(greedy=False, temperature=0.7, seed=1),
                  torch.Generator().manual_seed(1))


@case("layers", "SamplingParams: greedy='false'", Raises(TYPE_OR_VALUE, ("greedy",)))
def _():
    from fusedist.models import SamplingParams
    return SamplingParams(greedy="false")


@case("layers", "SamplingParams: numpy top_k accepted", Returns(lambda p: p.top_k == 5))
def _():
    import numpy as np

    from fusedist.models import SamplingParams
    return SamplingParams(greedy=False, top_k=np.int64(5))


@case("layers", "torch.compile of all_reduce as the group's first use",
      Returns(lambda r: bool(r)), needs_rt=True)
def _():
    import torch

    import fusedist
    rt = fusedist.get_runtime()
    rt.tp._communicator = None            # no communicator yet: the compiled call makes it
    f = torch.compile(lambda t: fusedist.all_reduce(t) + 1, fullgraph=True, backend="eager")
    x = torch.randn(6)
    return torch.equal(f(x), x + 1)


@case("layers", "torch.compile of all_reduce_add_rmsnorm as the group's first use",
      Returns(lambda r: bool(r)), needs_rt=True)
def _():
    import torch

    import fusedist
    rt = fusedist.get_runtime()
    rt.tp._communicator = None
    f = torch.compile(lambda a, b, w: fusedist.all_reduce_add_rmsnorm(a, b, w, 1e-6),
                      fullgraph=True, backend="eager")
    a, b, w = torch.randn(3, 16), torch.randn(3, 16), torch.rand(16) + 0.5
    n, r = f(a, b, w)
    h = a + b
    ref = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    return torch.allclose(n, ref, atol=1e-5) and torch.allclose(r, h)


# =============================================================================================
# model: config, weights, build_model, Runner
# =============================================================================================
@case("model", "LlamaConfig: numpy sizes accepted", Returns(lambda c: c.vocab_size == 32))
def _():
    import numpy as np

    from fusedist.models import LlamaConfig
    return LlamaConfig(vocab_size=np.int64(32), hidden_size=np.int64(64),
                       intermediate_size=np.int64(96), num_layers=np.int64(2),
                       num_heads=np.int64(4), num_kv_heads=np.int64(2))


@case("model", "LlamaConfig: hidden_size 0", Raises(VALUE, ("hidden_size",)))
def _():
    from fusedist.models import LlamaConfig
    return LlamaConfig(vocab_size=32, hidden_size=0, intermediate_size=96, num_layers=2,
                       num_heads=4, num_kv_heads=2)


@case("model", "config.json: rope factor 0 (linear)", Raises(VALUE, ("rope_scaling", "linear")))
def _():
    from fusedist.models import LlamaConfig
    d = json.loads((Path(fixtures()["llama"]) / "config.json").read_text())
    d["rope_scaling"] = {"rope_type": "linear", "factor": 0}
    return LlamaConfig.from_hf_config(d)


@case("model", "config.json: llama3 factor -1", Raises(VALUE, ("factor",)))
def _():
    from fusedist.models import LlamaConfig
    d = json.loads((Path(fixtures()["llama"]) / "config.json").read_text())
    d["rope_scaling"] = dict(d.get("rope_scaling") or {}, rope_type="llama3", factor=-1.0,
                             low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=32)
    return LlamaConfig.from_hf_config(d)


@case("model", "Llama attention_bias: q/k/v and o_proj biases applied",
      Returns(lambda r: r, "HF's greedy ids"), needs_rt=True)
def _():
    import torch

    from fusedist.models import LlamaConfig, Runner, SamplingParams, build_model
    from fusedist.models.llama import open_weights
    from hf_tiny import hf_greedy, load_hf
    d = fixtures()["llama_bias"]
    cfg = LlamaConfig.from_dir(d)
    m = build_model(cfg, open_weights(d, cfg, None), dtype=torch.float32, device="cpu")
    with Runner(m, max_batch=1, max_seq_len=32) as r:
        ids = r.generate([[5, 9, 17, 3]], 8, SamplingParams()).ids[0]
    return ids == hf_greedy(load_hf(d), [5, 9, 17, 3], 8)


@case("model", "Runner: page_size 0", Raises(VALUE, ("page_size",)), needs_rt=True)
def _():
    return _runner(page_size=0)


@case("model", "Runner: prefill_chunk 0", Raises(VALUE, ("prefill_chunk",)), needs_rt=True)
def _():
    return _runner(prefill_chunk=0)


@case("model", "Runner: prefill_chunk -4", Raises(VALUE, ("prefill_chunk",)), needs_rt=True)
def _():
    return _runner(prefill_chunk=-4)


@case("model", "Runner: max_batch 2.5", Raises(TYPE_OR_VALUE, ("max_batch",)), needs_rt=True)
def _():
    return _runner(max_batch=2.5)


@case("model", "Runner: numpy max_batch accepted", Returns(lambda r: r.max_rows == 2),
      needs_rt=True)
def _():
    import numpy as np
    return _runner(max_batch=np.int64(2), max_seq_len=np.int64(32))


@case("model", "Runner: generate with numpy ids",
      Returns(lambda r: len(r.ids) == 1 and len(r.ids[0]) == 2 and
              all(type(t) is int for t in r.ids[0])), needs_rt=True)
def _():
    import numpy as np
    with _runner() as r:
        return r.generate([np.array([3, 4, 5])], np.int64(2))


@case("model", "Runner: generate after close", Raises(("RuntimeError",), ("closed",)),
      needs_rt=True)
def _():
    r = _runner()
    r.close()
    return r.generate([[1, 2]], 2)


@case("model", "Runner: stream and generate interleaved", Returns(lambda r: r),
      needs_rt=True)
def _():
    """A generate() while a stream is open: an error at once, or both right."""
    from fusedist.models import SamplingParams
    with _runner() as r:
        want_s = r.generate([[1, 2, 3]], 4, SamplingParams()).ids[0]
        want_g = r.generate([[7, 8]], 4, SamplingParams()).ids[0]
        s = r.stream([[1, 2, 3]], 4, SamplingParams())
        got = [next(s)[0]]
        try:
            g = r.generate([[7, 8]], 4, SamplingParams()).ids[0]
        except RuntimeError as e:
            return "stream" in str(e) and "open" in str(e)
        got += [t[0] for t in s]
        return got == want_s and g == want_g


@case("model", "Runner: NaN weights make NaN logits", Raises(("ValueError", "RuntimeError"),
                                                             ("nan",)), needs_rt=True)
def _():
    import torch
    with _runner() as r:
        with torch.no_grad():
            r.model.layers[0].mlp.down.fill_(float("nan"))
        return r.generate([[1, 2, 3]], 3).ids


@case("model", "build_model: attention_bias checkpoint loads", Returns(), needs_rt=True)
def _():
    import torch

    from fusedist.models import LlamaConfig, build_model
    from fusedist.models.llama import open_weights
    d = fixtures()["llama_bias"]
    cfg = LlamaConfig.from_dir(d)
    return build_model(cfg, open_weights(d, cfg, None), dtype=torch.float32, device="cpu")


@case("model", "bf16 checkpoint with a NaN weight", Raises(VALUE, ("up_proj", "nan")),
      needs_rt=True)
def _():
    import torch

    from fusedist.models import LlamaConfig, build_model
    from fusedist.models.llama import open_weights
    d = fixtures()["bf16_nan"]
    cfg = LlamaConfig.from_dir(d)
    return build_model(cfg, open_weights(d, cfg, None), dtype=torch.float32, device="cpu")


@case("model", "checkpoint with an inf norm weight", Raises(VALUE, ("input_layernorm", "inf")),
      needs_rt=True)
def _():
    import torch

    from fusedist.models import LlamaConfig, build_model
    from fusedist.models.llama import open_weights
    d = fixtures()["bf16_inf"]
    cfg = LlamaConfig.from_dir(d)
    return build_model(cfg, open_weights(d, cfg, None), dtype=torch.float32, device="cpu")


# =============================================================================================
# FP8: checkpoints and collectives
# =============================================================================================
def _fp8_load(name):
    import torch

    from fusedist.models import LlamaConfig, build_model
    from fusedist.models.llama import open_weights
    d = fixtures()[name]
    cfg = LlamaConfig.from_dir(d)
    return build_model(cfg, open_weights(d, cfg, None), dtype=torch.float32, device="cpu")


for _name, _tensor, _what in (
        ("fp8_nan_scale", "o_proj.weight_scale_inv", "nan"),
        ("fp8_inf_scale", "o_proj.weight_scale_inv", "inf"),
        ("fp8_neg_scale", "o_proj.weight_scale_inv", "negative"),
        ("fp8_byte_7f", "o_proj.weight", "nan"),
        ("fp8_byte_ff", "o_proj.weight", "nan"),
        ("ct_nan_scale", "down_proj.weight_scale", "nan"),
        ("ct_inf_scale", "down_proj.weight_scale", "inf"),
        ("ct_byte_7f", "up_proj.weight", "nan"),
        ("ct_tensor_nan", "q_proj.weight_scale", "nan")):
    case("fp8", f"checkpoint {_name}: rejected at load naming {_tensor}",
         Raises(VALUE, (_tensor, _what)), needs_rt=True)(
        lambda _n=_name: _fp8_load(_n))
    case("fp8", f"LLM of {_name}: rejected naming {_tensor}", Raises(VALUE, (_tensor, _what)))(
        lambda _n=_name: _with_llm(lambda l: l.generate([1, 2], 2), model=fixtures()[_n]))
    case("cli", f"generate --model {_name}: one line naming {_tensor}",
         CliExit((_tensor, _what)))(
        lambda _n=_name: _cli(["--model", fixtures()[_n], "--prompt-ids", "1,2,3",
                               "--max-new-tokens", "2", "--device", "cpu", "--json",
                               "--quiet"]))


@case("fp8", "checkpoint fp8_ok loads", Returns(), needs_rt=True)
def _():
    return _fp8_load("fp8_ok")


def _fp8_replay(xs, block=128, algo="two_shot", fmt="e3m4"):
    """fp8_all_reduce of xs (one per rank) replayed in one process."""
    from fusedist.comm import fp8 as f8
    ref = getattr(f8, "all_reduce_reference", None)
    if ref is not None:
        return ref(xs, block_size=block, algo=algo, fmt=fmt)
    sys.path.insert(0, str(HERE / "dist"))
    from worker_fp8_comm import replay_all_reduce
    return replay_all_reduce(xs, block, algo, fmt)


def _outliers(r, n=4096, every=512, scale=1000.0):
    import torch
    g = torch.Generator().manual_seed(100 + r)
    x = torch.randn(n, generator=g)
    x[::every] *= scale
    return x


@case("fp8", "fp8_all_reduce: ordinary channels beside 1000x outliers stay within the bound",
      Returns(lambda r: r <= 0.04, "error <= 4e-2 on the ordinary channels"))
def _():
    import torch

    from fusedist.comm import fp8 as f8
    xs = [_outliers(r) for r in range(4)]
    y = _fp8_replay(xs)
    ref = sum(x.double() for x in xs)
    keep = torch.ones(4096, dtype=torch.bool)
    keep[::512] = False
    return ((y.double() - ref)[keep].norm() / ref[keep].norm()).item()


@case("fp8", "fp8_all_reduce: cancelling partial sums stay within the bound",
      Returns(lambda r: r <= 0.04, "error <= 4e-2 against the sum"))
def _():
    import torch

    from fusedist.comm import fp8 as f8
    g = torch.Generator().manual_seed(7)
    a = torch.randn(4096, generator=g)
    xs = [a, -a + 0.01 * torch.randn(4096, generator=g)]
    y = _fp8_replay(xs)
    ref = sum(x.double() for x in xs)
    return ((y.double() - ref).norm() / ref.norm()).item()


@case("fp8", "fp8_all_reduce: block_size 0", Raises(VALUE, ("block_size",)), needs_rt=True)
def _():
    import fusedist
    return fusedist.fp8_all_reduce(_t(8), block_size=0)


@case("fp8", "fp8_all_reduce: fmt e5m2", Raises(VALUE, ("fmt",)), needs_rt=True)
def _():
    import fusedist
    return fusedist.fp8_all_reduce(_t(8), fmt="e5m2")


@case("fp8", "Fp8Communicator: numpy block_size accepted", Returns(), needs_rt=True)
def _():
    import numpy as np

    import fusedist
    return fusedist.Fp8Communicator(block_size=np.int64(64)).all_reduce(_t(100))


@case("fp8", "LLM quantize typo", Raises(VALUE, ("quantize",)))
def _():
    return _with_llm(lambda l: None, quantize="fp9")


# =============================================================================================
# LLM
# =============================================================================================
def _llm_case(name, expect, fn, **kw):
    case("llm", name, expect)(lambda: _with_llm(fn, **kw))


_llm_case("generate: numpy int ids accepted", Returns(_ids_ok(2)),
          lambda l: l.generate([__import__("numpy").int64(3), __import__("numpy").int64(4)], 2))
_llm_case("generate: a numpy array prompt accepted", Returns(_ids_ok(2)),
          lambda l: l.generate(__import__("numpy").array([3, 4, 5]), 2))
_llm_case("generate: numpy max_new_tokens accepted", Returns(_ids_ok(2)),
          lambda l: l.generate([3, 4], __import__("numpy").int64(2)))
_llm_case("generate: float ids", Raises(TYPE_OR_VALUE, ("token id", "float")),
          lambda l: l.generate([3.0, 4.0], 2))
_llm_case("generate: bare int prompt", Raises(TYPE_OR_VALUE, ("prompt",)),
          lambda l: l.generate(5, 2))
_llm_case("generate: bool ids", Raises(TYPE_OR_VALUE, ("bool",)),
          lambda l: l.generate([True, False], 2))
_llm_case("generate: list of bare ints in a batch", Raises(TYPE_OR_VALUE, ("prompts[1]",)),
          lambda l: l.generate([[1, 2], 3], 2))
_llm_case("generate: empty prompt", Raises(TYPE_OR_VALUE, ("empty",)),
          lambda l: l.generate([], 2))
_llm_case("generate: token id past the vocabulary", Raises(VALUE, ("vocab",)),
          lambda l: l.generate([1, 10 ** 6], 2))
_llm_case("generate: negative token id", Raises(VALUE, ("vocab",)),
          lambda l: l.generate([1, -3], 2))
_llm_case("generate: greedy='false'", Raises(TYPE_OR_VALUE, ("greedy",)),
          lambda l: l.generate([1, 2], 2, greedy="false"))
_llm_case("generate: max_new_tokens 0", Raises(VALUE, ("max_new_tokens",)),
          lambda l: l.generate([1, 2], 0))
_llm_case("generate: max_new_tokens 2.0", Raises(TYPE_OR_VALUE, ("max_new_tokens",)),
          lambda l: l.generate([1, 2], 2.0))
_llm_case("generate: temperature -1", Raises(VALUE, ("temperature",)),
          lambda l: l.generate([1, 2], 2, temperature=-1.0))
_llm_case("generate: top_p 0", Raises(VALUE, ("top_p",)),
          lambda l: l.generate([1, 2], 2, top_p=0.0))
_llm_case("generate: seed 'a'", Raises(TYPE_OR_VALUE, ("seed",)),
          lambda l: l.generate([1, 2], 2, seed="a"))
_llm_case("generate: eos_ids a bare int", Raises(TYPE_OR_VALUE, ("eos_ids",)),
          lambda l: l.generate([1, 2], 2, eos_ids=3))
_llm_case("generate: batch past max_batch speaks of LLM",
          Raises(VALUE, ("max_batch", "LLM")), lambda l: l.generate([[1], [2], [3]], 2))
_llm_case("generate: batch past max_batch does not speak of the Runner",
          Returns(lambda r: "runner" not in r.lower()),
          lambda l: _message_of(lambda: l.generate([[1], [2], [3]], 2)))
_llm_case("generate: too long speaks of LLM's max_seq_len",
          Raises(VALUE, ("max_seq_len", "LLM")), lambda l: l.generate([1, 2], 100))
_llm_case("generate: too long does not speak of the Runner",
          Returns(lambda r: "runner" not in r.lower()),
          lambda l: _message_of(lambda: l.generate([1, 2], 100)))
_llm_case("stream: too long raised at the call", Raises(VALUE, ("max_seq_len",)),
          lambda l: l.stream([1, 2], 100))
_llm_case("encode without a tokenizer", Raises(VALUE, ("tokenizer",)),
          lambda l: l.encode("hi"))
_llm_case("chat_prompt without a tokenizer", Raises(VALUE, ("tokenizer",)),
          lambda l: l.chat_prompt([{"role": "user", "content": "hi"}]))
_llm_case("generate: str prompt without a tokenizer", Raises(VALUE, ("tokenizer",)),
          lambda l: l.generate("hello", 2))


def _message_of(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return str(e)
    return "no error"


@case("llm", "generate after close()", Raises(("RuntimeError",), ("closed",)))
def _():
    llm = _llm()
    llm.close()
    return llm.generate([1, 2], 2)


@case("llm", "stream after close()", Raises(("RuntimeError",), ("closed",)))
def _():
    llm = _llm()
    llm.close()
    return list(llm.stream([1, 2], 2))


@case("llm", "generate after the with block", Raises(("RuntimeError",), ("closed",)))
def _():
    with _llm() as llm:
        pass
    return llm.generate([1, 2], 2)


@case("llm", "close() twice", Returns())
def _():
    llm = _llm()
    llm.close()
    return llm.close()


@case("llm", "two streams consumed interleaved", Returns(lambda r: r))
def _():
    def body(llm):
        a = llm.generate([1, 2, 3], 4, greedy=True, eos_ids=()).ids
        b = llm.generate([7, 8], 4, greedy=True, eos_ids=()).ids
        s1 = llm.stream([1, 2, 3], 4, greedy=True, eos_ids=())
        got1 = [next(s1).id]
        try:
            s2 = llm.stream([7, 8], 4, greedy=True, eos_ids=())
            got2 = [next(s2).id]
        except RuntimeError as e:
            return "stream" in str(e)
        got1.append(next(s1).id)
        got2 += [t.id for t in s2]
        got1 += [t.id for t in s1]
        return got1 == a and got2 == b
    return _with_llm(body)


@case("llm", "generate while a stream is open", Returns(lambda r: r))
def _():
    def body(llm):
        a = llm.generate([1, 2, 3], 4, greedy=True, eos_ids=()).ids
        b = llm.generate([7, 8], 4, greedy=True, eos_ids=()).ids
        s1 = llm.stream([1, 2, 3], 4, greedy=True, eos_ids=())
        got1 = [next(s1).id]
        try:
            g = llm.generate([7, 8], 4, greedy=True, eos_ids=()).ids
        except RuntimeError as e:
            return "stream" in str(e)
        got1 += [t.id for t in s1]
        return got1 == a and g == b
    return _with_llm(body)


@case("llm", "a stream closed early frees the LLM", Returns(_ids_ok(3)))
def _():
    def body(llm):
        s = llm.stream([1, 2, 3], 6, greedy=True, eos_ids=())
        next(s)
        s.close()
        return llm.generate([4, 5], 3, greedy=True, eos_ids=())
    return _with_llm(body)


for _kw, _phrase in ((dict(max_batch=2.5), "max_batch"), (dict(max_batch=0), "max_batch"),
                     (dict(max_batch="2"), "max_batch"), (dict(page_size=0), "page_size"),
                     (dict(page_size=-16), "page_size"), (dict(max_seq_len=0), "max_seq_len"),
                     (dict(max_seq_len=1e9), "max_seq_len"), (dict(tp_size=0), "tp_size"),
                     (dict(tp_size=3), "tp_size"), (dict(random_weights="yes"), "random_weights"),
                     (dict(dtype="float8"), "dtype"), (dict(prefill_graph_tokens=-1),
                                                       "prefill_graph_tokens"),
                     (dict(cuda_graphs="no"), "cuda_graphs"), (dict(weights_seed=1.5),
                                                               "weights_seed"),
                     (dict(kv_dtype="fp8"), "kv_dtype")):
    case("llm", f"LLM({', '.join(f'{k}={v!r}' for k, v in _kw.items())})",
         Raises(TYPE_OR_VALUE, (_phrase,)))(lambda _kw=_kw: _with_llm(lambda l: None, **_kw))


@case("llm", "LLM(dtype='bf16') accepted", Returns(lambda r: str(r) == "torch.bfloat16"))
def _():
    return _with_llm(lambda l: l.dtype, dtype="bf16")


@case("llm", "LLM(numpy max_batch) accepted", Returns(lambda r: r == 4))
def _():
    import numpy as np
    return _with_llm(lambda l: l.runner.max_rows, max_batch=np.int64(3))


@case("llm", "LLM(model and config)", Raises(VALUE, ("model", "config")))
def _():
    return _llm(model=fixtures()["llama"], config="tiny")


@case("llm", "LLM(missing directory)", Raises(("ValueError", "FileNotFoundError"),
                                               ("config.json",)))
def _():
    return _llm(model="/nonexistent/ckpt")


@case("llm", "chat_prompt: empty conversation", Raises(VALUE, ("messages",)))
def _():
    return _with_llm(lambda l: l.chat_prompt([]), model=fixtures()["llama"])


@case("llm", "chat_prompt: roles that do not alternate (the template raises)",
      Raises(VALUE, ("chat template", "alternate")))
def _():
    return _with_llm(lambda l: l.chat_prompt([{"role": "user", "content": "a"},
                                              {"role": "user", "content": "b"}]),
                     model=fixtures()["strict_chat"])


@case("llm", "chat_prompt: a message without content", Raises(TYPE_OR_VALUE, ("content",)))
def _():
    return _with_llm(lambda l: l.chat_prompt([{"role": "user"}]), model=fixtures()["llama"])


@case("llm", "truncated tokenizer_config.json", Raises(VALUE, ("tokenizer_config.json",)))
def _():
    return _with_llm(lambda l: l.chat_prompt([{"role": "user", "content": "w1"}]),
                     model=fixtures()["trunc_tok"])


@case("llm", "a checkpoint's chat template round trip", Returns(lambda r: len(r) > 3))
def _():
    return _with_llm(lambda l: l.chat_prompt([{"role": "user", "content": "w1 w2"}]),
                     model=fixtures()["llama"])


# =============================================================================================
# CLI: python -m fusedist.generate (main() in this process)
# =============================================================================================
def _cli_case(name, argv, expect):
    case("cli", name, expect)(lambda: _cli(list(argv) + ["--device", "cpu", "--quiet"]))


_cli_case("--dtype bf16 accepted", ["--max-new-tokens", "2", "--prompt-len", "3", "--dtype",
                                    "bf16", "--json", "--baseline", "none"],
          CliExit(code=0, check=lambda o: json.loads(o.splitlines()[-1])["dtype"] == "bfloat16"))
_cli_case("--dtype fp16 accepted", ["--max-new-tokens", "2", "--prompt-len", "3", "--dtype",
                                    "fp16", "--json", "--baseline", "none"],
          CliExit(code=0, check=lambda o: json.loads(o.splitlines()[-1])["dtype"] == "float16"))
_cli_case("--tp 0", ["--tp", "0"], CliExit(("--tp",)))
_cli_case("--tp 3 at world 1", ["--tp", "3"], CliExit(("--tp",)))
_cli_case("--page-size 0", ["--page-size", "0"], CliExit(("--page-size",)))
_cli_case("--prefill-chunk 0", ["--prefill-chunk", "0"], CliExit(("--prefill-chunk",)))
_cli_case("--max-new-tokens 0", ["--max-new-tokens", "0"], CliExit(("--max-new-tokens",)))
_cli_case("--batch 0", ["--batch", "0"], CliExit(("--batch",)))
_cli_case("--temperature nan", ["--temperature", "nan"], CliExit(("--temperature",)))
_cli_case("--top-p 1.5", ["--top-p", "1.5"], CliExit(("--top-p",)))
_cli_case("--prompt-ids with letters", ["--prompt-ids", "1,a,3"], CliExit(("--prompt-ids",)))
_cli_case("--prompt-ids past the vocabulary", ["--prompt-ids", "1,99999"],
          CliExit(("prompt ids",)))
_cli_case("--prompt without a tokenizer", ["--prompt", "hello"], CliExit(("--prompt",)))
_cli_case("--config unknown", ["--config", "llama-9", "--random-weights"],
          CliExit(("llama-9",)))
_cli_case("--config without --random-weights", ["--config", "tiny"],
          CliExit(("--random-weights",)))
_cli_case("--model not a directory", ["--model", "/nonexistent"], CliExit(("--model",)))
_cli_case("--baseline typo", ["--baseline", "torchh"], CliExit(("--baseline",)))
_cli_case("--kv-budget-gb -1", ["--kv-budget-gb", "-1"], CliExit(("--kv-budget-gb",)))
_cli_case("--quantize fp8 on the tiny config runs",
          ["--quantize", "fp8", "--max-new-tokens", "2", "--prompt-len", "3", "--json",
           "--baseline", "none"],
          CliExit(code=0, check=lambda o: json.loads(o.splitlines()[-1])["weights"]["format"]
                  == "fp8"))
_cli_case("positions past the model", ["--max-new-tokens", "4000", "--prompt-len", "100"],
          CliExit(("max_position",)))


@case("cli", "generate --model of a NaN bf16 checkpoint", CliExit(("up_proj", "nan")))
def _():
    return _cli(["--model", fixtures()["bf16_nan"], "--prompt-ids", "1,2,3",
                 "--max-new-tokens", "2", "--device", "cpu", "--json", "--quiet"])


@case("cli", "generate --model with attention_bias runs", CliExit(code=0))
def _():
    return _cli(["--model", fixtures()["llama_bias"], "--prompt-ids", "1,2,3",
                 "--max-new-tokens", "2", "--device", "cpu", "--json", "--quiet"])


@case("cli", "generate --chat with a truncated tokenizer_config.json",
      CliExit(("tokenizer_config.json",)))
def _():
    return _cli(["--model", fixtures()["trunc_tok"], "--chat", "w1", "--max-new-tokens", "2",
                 "--device", "cpu", "--json", "--quiet"])


# =============================================================================================
# distributed: 2 ranks over gloo, forked from the driver
# =============================================================================================
def dist_case(name, expect, per_rank=None, init=True, ranks=2):
    def reg(fn):
        CASES.append(Case("dist", name, fn, expect, ranks=ranks, per_rank=per_rank, init=init))
        return fn
    return reg


def _cli_env(rank, world, port):
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)})


def _cli_rank(rank, world, port, argv):
    _cli_env(rank, world, port)
    return _cli(argv)


@dataclass
class AllCli:
    """Every rank's CLI ends with exit 1 and a line holding the phrases."""
    phrases: tuple

    def judge(self, exc, result=None):
        return CliExit(self.phrases).judge(exc, result)


_TINY = ["--config", "tiny", "--random-weights", "--max-new-tokens", "2", "--device", "cpu",
         "--json", "--quiet", "--baseline", "none"]


@dist_case("CLI: ranks given different --quantize", AllCli(("--quantize",)), init=False)
def _(rank, world, port):
    return _cli_rank(rank, world, port, _TINY + (["--quantize", "fp8"] if rank == 0 else []))


@dist_case("CLI: ranks given different --max-new-tokens", AllCli(("--max-new-tokens",)),
           init=False)
def _(rank, world, port):
    return _cli_rank(rank, world, port, _TINY + ["--max-new-tokens", str(2 + rank)])


@dist_case("CLI: rank 1 rejects its own --page-size", AllCli(("--page-size",)), init=False)
def _(rank, world, port):
    return _cli_rank(rank, world, port, _TINY + (["--page-size", "0"] if rank == 1 else []))


@dist_case("CLI: rank 0 rejects its own --batch", AllCli(("--batch",)), init=False)
def _(rank, world, port):
    return _cli_rank(rank, world, port, _TINY + (["--batch", "-1"] if rank == 0 else []))


@dist_case("CLI: ranks given different --prompt-ids", AllCli(("--prompt-ids",)), init=False)
def _(rank, world, port):
    return _cli_rank(rank, world, port, _TINY + ["--prompt-ids", "1,2" if rank else "3,4"])


@dist_case("CLI: TP group spanning nodes", CliExit(code=0), init=False)
def _(rank, world, port):
    os.environ["FUSEDIST_NODE_ID"] = f"node{rank}"
    return _cli_rank(rank, world, port, _TINY)


def _llm_ranks(rank, kw_of_rank):
    from fusedist.models import LLM
    kw = dict(config="tiny", random_weights=True, max_batch=2, max_seq_len=64)
    kw.update(kw_of_rank(rank))
    with LLM(**kw) as llm:
        return llm.generate([1, 2, 3], 2, greedy=True).ids


for _field, _vals in (("quantize", ("fp8", "none")), ("max_batch", (2, 4)),
                      ("dtype", ("float32", "bfloat16")), ("page_size", (16, 8)),
                      ("max_seq_len", (64, 32)), ("weights_seed", (0, 1)),
                      ("config", ("tiny", "llama-3-8b"))):
    dist_case(f"LLM: ranks given different {_field}", Raises(MISMATCH + VALUE, (_field,)))(
        lambda rank, world, port, _f=_field, _v=_vals: _llm_ranks(
            rank, lambda r: {_f: _v[r]}))


@dist_case("LLM: rank 1 rejects its own page_size", Raises(MISMATCH + VALUE, ("page_size",)))
def _(rank, world, port):
    return _llm_ranks(rank, lambda r: {"page_size": 0} if r == 1 else {})


@dist_case("LLM: rank 0 rejects its own max_batch (before init)",
           Raises(MISMATCH + VALUE + ("TypeError",), ("max_batch",)), init=False)
def _(rank, world, port):
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)})
    return _llm_ranks(rank, lambda r: {"max_batch": 2.5} if r == 0 else {})


def _llm_gen(rank, fn):
    from fusedist.models import LLM
    with LLM(config="tiny", random_weights=True, max_batch=2, max_seq_len=64) as llm:
        return fn(llm, rank)


@dist_case("LLM.generate: a prompt bad on rank 1 only",
           Raises(MISMATCH + TYPE_OR_VALUE, ("prompt",)))
def _(rank, world, port):
    return _llm_gen(rank, lambda l, r: l.generate([1, 2.5] if r else [1, 2], 2).ids)


@dist_case("LLM.generate: ranks given different greedy",
           Raises(("fusedist.RequestMismatchError",), ("greedy",)))
def _(rank, world, port):
    return _llm_gen(rank, lambda l, r: l.generate([1, 2], 2, greedy=bool(r),
                                                  temperature=0.7).ids)


@dist_case("LLM.generate: rank 1 closed its LLM", None,
           per_rank=[Raises(PEER_LOST + MISMATCH, ("rank 1",)),
                     Raises(("RuntimeError",), ("closed",))])
def _(rank, world, port):
    def body(l, r):
        if r == 1:
            l.close()
        return l.generate([1, 2], 2).ids
    return _llm_gen(rank, body)


@dist_case("c10d fusedist backend: SUM on one rank, MAX on the other",
           Raises(MISMATCH, ("max", "sum")), init=False)
def _(rank, world, port):
    import torch
    import torch.distributed as dist
    dist.init_process_group("fusedist", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        x = torch.ones(8) * (rank + 1)
        dist.all_reduce(x, op=dist.ReduceOp.SUM if rank == 0 else dist.ReduceOp.MAX)
        return x.tolist()
    finally:
        import fusedist
        fusedist.shutdown()
        dist.destroy_process_group()


@dist_case("c10d fusedist backend: all_reduce on one rank, broadcast on the other",
           Raises(MISMATCH, ("all_reduce", "broadcast")), init=False)
def _(rank, world, port):
    import torch
    import torch.distributed as dist
    dist.init_process_group("fusedist", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        x = torch.ones(8) * (rank + 1)
        if rank == 0:
            dist.all_reduce(x)
        else:
            dist.broadcast(x, src=0)
        return x.tolist()
    finally:
        import fusedist
        fusedist.shutdown()
        dist.destroy_process_group()


@dist_case("c10d fusedist backend: all_reduce of different sizes",
           Raises(MISMATCH, ("8", "9")), init=False)
def _(rank, world, port):
    import torch
    import torch.distributed as dist
    dist.init_process_group("fusedist", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        x = torch.ones(8 + rank)
        dist.all_reduce(x)
        return x.tolist()
    finally:
        import fusedist
        fusedist.shutdown()
        dist.destroy_process_group()


@dist_case("c10d fusedist backend: a matching SUM stays exact",
           Returns(lambda r: r == [3.0] * 8), init=False)
def _(rank, world, port):
    import torch
    import torch.distributed as dist
    dist.init_process_group("fusedist", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        x = torch.ones(8) * (rank + 1)
        dist.all_reduce(x)
        y = torch.ones(4) * (rank + 1)
        dist.all_reduce(y, op=dist.ReduceOp.MAX)
        assert y.tolist() == [2.0] * 4, y
        return x.tolist()
    finally:
        import fusedist
        fusedist.shutdown()
        dist.destroy_process_group()


@dist_case("HierarchicalCommunicator: all_reduce of different sizes",
           Raises(MISMATCH, ("numel",)))
def _(rank, world, port):
    import torch

    import fusedist
    hc = fusedist.HierarchicalCommunicator()
    return hc.all_reduce(torch.ones(10 + rank)).tolist()


@dist_case("HierarchicalCommunicator: all_reduce of different dtypes",
           Raises(MISMATCH, ("dtype",)))
def _(rank, world, port):
    import torch

    import fusedist
    hc = fusedist.HierarchicalCommunicator()
    return hc.all_reduce(torch.ones(10, dtype=torch.float32 if rank else torch.bfloat16)).tolist()


@dist_case("HierarchicalCommunicator: all_gather of different sizes",
           Raises(MISMATCH, ("numel",)))
def _(rank, world, port):
    import torch

    import fusedist
    hc = fusedist.HierarchicalCommunicator()
    return hc.all_gather(torch.ones(4 + rank)).tolist()


@dist_case("HierarchicalCommunicator: reduce_scatter of different sizes",
           Raises(MISMATCH, ("numel",)))
def _(rank, world, port):
    import torch

    import fusedist
    hc = fusedist.HierarchicalCommunicator()
    return hc.reduce_scatter(torch.ones(4 + 2 * rank)).tolist()


@dist_case("HierarchicalCommunicator: all_reduce on one rank, all_gather on the other",
           Raises(MISMATCH, ("all_reduce", "all_gather")))
def _(rank, world, port):
    import torch

    import fusedist
    hc = fusedist.HierarchicalCommunicator()
    x = torch.ones(8)
    return (hc.all_reduce(x) if rank == 0 else hc.all_gather(x)).tolist()


@dist_case("HierarchicalCommunicator: a matching all_reduce is exact",
           Returns(lambda r: r == [3.0] * 10))
def _(rank, world, port):
    import torch

    import fusedist
    hc = fusedist.HierarchicalCommunicator()
    return hc.all_reduce(torch.ones(10) * (rank + 1)).tolist()


@dist_case("all_reduce after the peer exited cleanly", None,
           per_rank=[Raises(PEER_LOST, ("rank 1",)), Returns()])
def _(rank, world, port):
    import torch

    import fusedist
    fusedist.all_reduce(torch.ones(4))
    if rank == 1:
        fusedist.shutdown()
        return "exited"
    time.sleep(1.0)
    return fusedist.all_reduce(torch.ones(4)).tolist()


@dist_case("all_reduce after the peer's process exited", None,
           per_rank=[Raises(PEER_LOST, ("rank 1",)), Exits()])
def _(rank, world, port):
    import torch

    import fusedist
    fusedist.all_reduce(torch.ones(4))
    if rank == 1:
        os._exit(0)
    time.sleep(1.0)
    return fusedist.all_reduce(torch.ones(4)).tolist()


@dist_case("all_reduce of different sizes", Raises(MISMATCH, ("4", "5")))
def _(rank, world, port):
    import torch

    import fusedist
    return fusedist.all_reduce(torch.ones(4 + rank)).tolist()


@dist_case("all_reduce_add_rmsnorm of different hidden sizes", Raises(MISMATCH, ()))
def _(rank, world, port):
    import torch

    import fusedist
    h = 8 + 8 * rank
    return fusedist.all_reduce_add_rmsnorm(torch.ones(2, h), torch.ones(2, h), torch.ones(h),
                                           1e-6)[0].tolist()


@dist_case("fp8_all_reduce of different block sizes", Raises(MISMATCH, ("block_size",)))
def _(rank, world, port):
    import torch

    import fusedist
    return fusedist.fp8_all_reduce(torch.ones(300), block_size=64 * (rank + 1)).tolist()


@dist_case("Fp8Communicator: ranks given different fmt", Raises(MISMATCH, ("fmt",)))
def _(rank, world, port):
    import fusedist
    return fusedist.Fp8Communicator(fmt="e4m3" if rank else "e3m4").fmt


@dist_case("init: ranks given different tp_size", Raises(MISMATCH + VALUE, ("tp_size",)),
           init=False)
def _(rank, world, port):
    import fusedist
    rt = fusedist.init(backend="gloo", rank=rank, world_size=world, master_addr="127.0.0.1",
                       master_port=port, tp_size=1 + rank)
    try:
        return rt.tp.size
    finally:
        fusedist.shutdown()


@dist_case("Runner.generate: ranks given different max_new_tokens",
           Raises(("fusedist.RequestMismatchError",), ("max_new_tokens",)))
def _(rank, world, port):
    with _runner() as r:
        return r.generate([[1, 2]], 2 + rank).ids


@dist_case("Runner.generate: a request bad on rank 0 only",
           Raises(MISMATCH + VALUE, ("max_new_tokens",)))
def _(rank, world, port):
    with _runner() as r:
        return r.generate([[1, 2]], 0 if rank == 0 else 2).ids


@dist_case("HierarchicalCommunicator: ranks given different algo",
           Raises(MISMATCH, ("algo",)))
def _(rank, world, port):
    import fusedist
    return fusedist.HierarchicalCommunicator(algo="flat" if rank else "auto").algo


# =============================================================================================
# more cases, each area
# =============================================================================================
def _raises_case(area, name, phrases, fn, types=TYPE_OR_VALUE, needs_rt=False):
    case(area, name, Raises(tuple(types), tuple(phrases)), needs_rt=needs_rt)(fn)


# layers
_raises_case("layers", "rmsnorm: eps -1", ("eps",), lambda: __import__("fusedist").rmsnorm(
    _t(2, 8), _t(8), -1.0), needs_rt=True)
_raises_case("layers", "add_rmsnorm: residual of another dtype", ("residual",),
             lambda: __import__("fusedist").add_rmsnorm(
                 _t(2, 8), _t(2, 8).double(), _t(8), 1e-6), needs_rt=True)
_raises_case("layers", "all_reduce: out of another dtype", ("out",),
             lambda: __import__("fusedist").all_reduce(_t(4), out=_t(4).double()),
             needs_rt=True)
_raises_case("layers", "all_reduce: group of the wrong type", ("group",),
             lambda: __import__("fusedist").all_reduce(_t(4), group="tp"), needs_rt=True)
_raises_case("layers", "all_reduce_add_rmsnorm: eps 0", ("eps",),
             lambda: __import__("fusedist").all_reduce_add_rmsnorm(_t(2, 8), _t(2, 8), _t(8),
                                                                    0.0), needs_rt=True)
_raises_case("layers", "PageAllocator: double free", ("page",),
             lambda: (lambda a: (a.free(a.allocate(2)), a.free([0])))(
                 __import__("fusedist.nn", fromlist=["x"]).PageAllocator(4)))
_raises_case("layers", "PageAllocator: more pages than there are", ("pages",),
             lambda: __import__("fusedist.nn", fromlist=["x"]).PageAllocator(4).allocate(5),
             types=("RuntimeError", "ValueError"))
_raises_case("layers", "BlockTable: append past its pages", ("max_pages_per_seq",),
             lambda: (lambda t: (t.add("a"), t.append("a", 100)))(
                 __import__("fusedist.nn", fromlist=["x"]).BlockTable(
                     __import__("fusedist.nn", fromlist=["x"]).PageAllocator(64), 4, 2, 3)))
_raises_case("layers", "BlockTable: unknown sequence", ("add",),
             lambda: __import__("fusedist.nn", fromlist=["x"]).BlockTable(
                 __import__("fusedist.nn", fromlist=["x"]).PageAllocator(4), 4, 2, 2).append(
                 "nope", 1))
_raises_case("layers", "PagedKVCache.layer: index past the layers", ("layer",),
             lambda: __import__("fusedist.nn", fromlist=["x"]).PagedKVCache(2, 1, 8, 2).layer(2))
_raises_case("layers", "PagedKVCache: int8 cache dtype", ("dtype",),
             lambda: __import__("fusedist.nn", fromlist=["x"]).PagedKVCache(
                 2, 1, 8, 2, kv_dtype=__import__("torch").int8))
_raises_case("layers", "slot_mapping: negative position", ("positions",),
             lambda: __import__("fusedist.nn", fromlist=["x"]).slot_mapping([0, 1], [-1], 4))
_raises_case("layers", "TPAttention: heads not divisible by kv heads", ("num_kv_heads",),
             lambda: __import__("fusedist.nn", fromlist=["x"]).TPAttention(64, 4, 3),
             needs_rt=True)
_raises_case("layers", "TPAttention: rope_style typo", ("rope_style",),
             lambda: __import__("fusedist.nn", fromlist=["x"]).TPAttention(
                 64, 4, 2, rope_style="neoX"), needs_rt=True)
_raises_case("layers", "TPAttention: x of the wrong width", ("x must be",),
             lambda: _attn_setup()[0](_t(5, 32), __import__("torch").arange(5),
                                      _attn_setup()[1], 0, _prefill_meta(5)), needs_rt=True)
_raises_case("layers", "TPAttention.load_full: q_w of the wrong shape", ("q_w",),
             lambda: _attn_setup()[0].load_full(_t(32, 64), _t(32, 64), _t(32, 64),
                                                _t(64, 64)), needs_rt=True)
_raises_case("layers", "decode_plan: batch 0", ("batch",),
             lambda: __import__("fusedist").ops.decode_plan(0, 4, 2, 64, 16, 128))
_raises_case("layers", "SamplingParams: temperature nan", ("temperature",),
             lambda: __import__("fusedist.models", fromlist=["x"]).SamplingParams(
                 temperature=float("nan")))
_raises_case("layers", "SamplingParams: top_p 1.5", ("top_p",),
             lambda: __import__("fusedist.models", fromlist=["x"]).SamplingParams(top_p=1.5))
_raises_case("layers", "SamplingParams: top_k 2.5", ("top_k",),
             lambda: __import__("fusedist.models", fromlist=["x"]).SamplingParams(top_k=2.5))
_raises_case("layers", "Communicator: max_bytes 0", ("max_bytes",),
             lambda: __import__("fusedist").Communicator(max_bytes=0), needs_rt=True)
_raises_case("layers", "HierarchicalCommunicator: algo typo", ("algo",),
             lambda: __import__("fusedist").HierarchicalCommunicator(algo="ring"),
             needs_rt=True)
_raises_case("layers", "HierarchicalCommunicator: int tensor", ("dtype",),
             lambda: __import__("fusedist").HierarchicalCommunicator().all_reduce(
                 __import__("torch").ones(4, dtype=__import__("torch").int32)), needs_rt=True)


@case("layers", "Communicator: numpy max_bytes accepted", Returns(), needs_rt=True)
def _():
    import numpy as np

    import fusedist
    return fusedist.Communicator(max_bytes=np.int64(1 << 20)).all_reduce(_t(4))


# model
def _cfg_dict(**kw):
    d = json.loads((Path(fixtures()["llama"]) / "config.json").read_text())
    d.update(kw)
    return d


for _kw, _ph in ((dict(hidden_act="gelu"), "hidden_act"), (dict(mlp_bias=True), "mlp_bias"),
                 (dict(num_key_value_heads=3), "num_key_value_heads"),
                 (dict(vocab_size=0), "vocab_size"), (dict(rms_norm_eps=-1e-6), "rms_norm_eps"),
                 (dict(rope_theta=float("inf")), "rope_theta"),
                 (dict(architectures=["GPT2LMHeadModel"]), "architecture"),
                 (dict(attention_bias="yes"), "attention_bias"),
                 (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "yarn"),
                 (dict(quantization_config={"quant_method": "gptq"}), "quant_method")):
    _raises_case("model", f"config.json: {_kw}", (_ph,),
                 lambda _kw=_kw: __import__("fusedist.models", fromlist=["x"]).LlamaConfig
                 .from_hf_config(_cfg_dict(**_kw)))


_raises_case("model", "LlamaConfig.named: typo", ("llama-3-8",),
             lambda: __import__("fusedist.models", fromlist=["x"]).LlamaConfig.named("llama-3-8"))
_raises_case("model", "build_model: backend typo", ("backend",),
             lambda: __import__("fusedist.models", fromlist=["x"]).build_model(
                 __import__("fusedist.models", fromlist=["x"]).LlamaConfig.named("tiny"), None,
                 backend="torchh"), needs_rt=True)
_raises_case("model", "build_model: quantize typo", ("quantize",),
             lambda: __import__("fusedist.models", fromlist=["x"]).build_model(
                 __import__("fusedist.models", fromlist=["x"]).LlamaConfig.named("tiny"),
                 __import__("fusedist.models.llama", fromlist=["x"]).RandomWeights(
                     __import__("fusedist.models", fromlist=["x"]).LlamaConfig.named("tiny")),
                 quantize="int8"), needs_rt=True)
_raises_case("model", "Runner: kv_dtype int8", ("kv_dtype",),
             lambda: _runner(kv_dtype=__import__("torch").int8), needs_rt=True)
_raises_case("model", "Runner: max_seq_len past the model", ("max_seq_len",),
             lambda: _runner(max_seq_len=10 ** 6), needs_rt=True)
_raises_case("model", "Runner: peer_timeout_s -1", ("peer_timeout_s",),
             lambda: _runner(peer_timeout_s=-1), needs_rt=True)
_raises_case("model", "Runner: compile_decode 'yes'", ("compile_decode",),
             lambda: _runner(compile_decode="yes"), needs_rt=True)
_raises_case("model", "Runner.generate: context_fill -1", ("context_fill",),
             lambda: _runner().generate([[1]], 2, context_fill=-1), needs_rt=True)
_raises_case("model", "Runner.generate: eos_check_every 0", ("eos_check_every",),
             lambda: _runner().generate([[1]], 2, eos_ids=[3], eos_check_every=0),
             needs_rt=True)
_raises_case("model", "Runner.generate: sampling a dict", ("sampling",),
             lambda: _runner().generate([[1]], 2, {"greedy": True}), needs_rt=True)
_raises_case("model", "Runner.generate: prompts a str", ("prompts",),
             lambda: _runner().generate("12", 2), needs_rt=True)
_raises_case("model", "Runner.time_prefill: reps 0", ("reps",),
             lambda: _runner().time_prefill([[1, 2]], reps=0), needs_rt=True)
_raises_case("model", "open_weights: a directory without safetensors", ("safetensors",),
             lambda: __import__("fusedist.models.llama", fromlist=["x"]).SafetensorsWeights(
                 tempfile.mkdtemp()), types=("FileNotFoundError", "ValueError"))
_raises_case("model", "GenerationDefaults: top_p 0 in generation_config.json", ("top_p",),
             lambda: (lambda d: (Path(d, "generation_config.json").write_text('{"top_p": 0}'),
                                 __import__("fusedist.models", fromlist=["x"]).GenerationDefaults
                                 .from_dir(d)))(tempfile.mkdtemp()))
_raises_case("model", "config.json that is not JSON", ("config.json",),
             lambda: (lambda d: (Path(d, "config.json").write_text('{"vocab_size": 3'),
                                 __import__("fusedist.models", fromlist=["x"]).LlamaConfig
                                 .from_dir(d)))(tempfile.mkdtemp()))

# fp8
_raises_case("fp8", "fp8_all_gather: block_size 0", ("block_size",),
             lambda: __import__("fusedist").fp8_all_gather(_t(8), block_size=0), needs_rt=True)
_raises_case("fp8", "fp8_all_reduce: max_error 0", ("max_error",),
             lambda: __import__("fusedist").fp8_all_reduce(_t(8), max_error=0), needs_rt=True)
_raises_case("fp8", "fp8_all_reduce: algo typo", ("algo",),
             lambda: __import__("fusedist").fp8_all_reduce(_t(8), algo="ring"), needs_rt=True)
_raises_case("fp8", "fp8_all_reduce: int tensor", ("dtype",),
             lambda: __import__("fusedist").fp8_all_reduce(
                 __import__("torch").ones(8, dtype=__import__("torch").int64)), needs_rt=True)
_raises_case("fp8", "Fp8Communicator: fmt int8", ("fmt",),
             lambda: __import__("fusedist").Fp8Communicator(fmt="int8"), needs_rt=True)
_raises_case("fp8", "quantize_fp8: NaN weight", ("nan",),
             lambda: __import__("fusedist.nn.quant", fromlist=["x"]).quantize_fp8(
                 __import__("torch").tensor([[1.0, float("nan")]])))
_raises_case("fp8", "quantize_fp8: layout typo", ("layout",),
             lambda: __import__("fusedist.nn.quant", fromlist=["x"]).quantize_fp8(_t(4, 4),
                                                                                  "row"))


@case("fp8", "fp8_all_reduce: 1e5x outliers come back exact", Returns(lambda r: r <= 1e-6))
def _():
    import torch
    xs = [_outliers(r, scale=1e5) for r in range(2)]
    y = _fp8_replay(xs)
    ref = sum(x.double() for x in xs)
    return float((y.double() - ref).norm() / ref.norm())


@case("fp8", "fp8_all_reduce: Gaussian inputs keep e3m4's error", Returns(lambda r: r <= 0.02))
def _():
    import torch
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(4096, generator=g) for _ in range(4)]
    y = _fp8_replay(xs)
    ref = sum(x.double() for x in xs)
    return float((y.double() - ref).norm() / ref.norm())


# llm
_llm_case("generate: temperature nan", Raises(VALUE, ("temperature",)),
          lambda l: l.generate([1, 2], 2, temperature=float("nan")))
_llm_case("generate: top_k -1", Raises(VALUE, ("top_k",)),
          lambda l: l.generate([1, 2], 2, top_k=-1))
_llm_case("generate: top_p 2", Raises(VALUE, ("top_p",)),
          lambda l: l.generate([1, 2], 2, top_p=2.0))
_llm_case("generate: ignore_eos 'no'", Raises(TYPE_OR_VALUE, ("ignore_eos",)),
          lambda l: l.generate([1, 2], 2, ignore_eos="no"))
_llm_case("generate: a list of no prompts", Raises(TYPE_OR_VALUE, ("prompts",)),
          lambda l: l.generate([[]], 2))
_llm_case("generate: a dict prompt", Raises(TYPE_OR_VALUE, ("prompt",)),
          lambda l: l.generate({"ids": [1]}, 2))
_llm_case("generate: None prompt", Raises(TYPE_OR_VALUE, ("prompt",)),
          lambda l: l.generate(None, 2))
_llm_case("generate: eos_ids with a float", Raises(TYPE_OR_VALUE, ("eos_ids",)),
          lambda l: l.generate([1, 2], 2, eos_ids=[2.0]))
_llm_case("generate: a 3-D tensor prompt", Raises(TYPE_OR_VALUE, ("prompt",)),
          lambda l: l.generate(__import__("torch").ones(1, 2, 2, dtype=__import__("torch")
                                                         .long), 2))
_llm_case("generate: two prompts of different lengths", Returns(lambda r: len(r) == 2),
          lambda l: l.generate([[1, 2, 3], [4]], 3))
_llm_case("stream: exhausted stream ends", Returns(lambda r: r == []),
          lambda l: (lambda s: (list(s), list(s))[1])(l.stream([1, 2], 3)))


@case("llm", "LLM(config='nope')", Raises(VALUE, ("nope",)))
def _():
    return _llm(config="nope", random_weights=True)


@case("llm", "LLM(model=123)", Raises(TYPE_OR_VALUE, ("model",)))
def _():
    return _llm(model=123)


@case("llm", "LLM(dtype=torch.int8)", Raises(VALUE, ("dtype",)))
def _():
    import torch
    return _llm(dtype=torch.int8)


@case("llm", "LLM of a directory without config.json", Raises(("ValueError", "FileNotFoundError"),
                                                              ("config.json",)))
def _():
    return _llm(model=tempfile.mkdtemp())


@case("llm", "LLM: encode a non-str", Raises(TYPE_OR_VALUE, ("text",)))
def _():
    return _with_llm(lambda l: l.encode(5), model=fixtures()["llama"])


@case("llm", "LLM: decode floats", Raises(TYPE_OR_VALUE, ("ids",)))
def _():
    return _with_llm(lambda l: l.decode([1.5]), model=fixtures()["llama"])


@case("llm", "LLM: chat messages not a list", Raises(TYPE_OR_VALUE, ("messages",)))
def _():
    return _with_llm(lambda l: l.chat_prompt("hi"), model=fixtures()["llama"])


@case("llm", "LLM: generate text with a tokenizer", Returns(lambda r: isinstance(r.text, str)))
def _():
    return _with_llm(lambda l: l.generate("w1 w2 w3", 3), model=fixtures()["llama"])


# cli
for _argv, _ph in ((["--top-k", "-1"], "--top-k"), (["--prompt-len", "0"], "--prompt-len"),
                   (["--context-fill", "-1"], "--context-fill"),
                   (["--prefill-reps", "0"], "--prefill-reps"),
                   (["--prefill-graph-tokens", "-1"], "--prefill-graph-tokens"),
                   (["--weights-seed", "-1"], "--weights-seed"),
                   (["--prompt-ids", ""], "prompt ids"),
                   (["--chat", "hi"], "--chat"),
                   (["--prompt", "hi", "--prompt-ids", "1,2"], "prompt source"),
                   (["--tp", "2"], "--tp"),
                   (["--batch", "100000", "--context-fill", "2000"], "memory")):
    _cli_case(f"CLI {' '.join(_argv)}", _argv, CliExit((_ph,)))


@case("cli", "CLI --dtype float64 (argparse names it)", CliExit(("--dtype",), code=2))
def _():
    return _cli(["--dtype", "float64", "--device", "cpu"])


@case("cli", "CLI --model with a config.json that is not JSON", CliExit(("config.json",)))
def _():
    d = tempfile.mkdtemp()
    Path(d, "config.json").write_text("{")
    return _cli(["--model", d, "--device", "cpu", "--quiet"])


@case("cli", "CLI --model of a checkpoint missing a tensor", CliExit(("missing",)))
def _():
    from safetensors.torch import load_file, save_file
    d = Path(tempfile.mkdtemp())
    t = load_file(os.path.join(fixtures()["llama"], "model.safetensors"))
    del t["model.norm.weight"]
    save_file(t, str(d / "model.safetensors"))
    (d / "config.json").write_text((Path(fixtures()["llama"]) / "config.json").read_text())
    return _cli(["--model", str(d), "--device", "cpu", "--quiet", "--prompt-ids", "1,2"])


@case("cli", "CLI --prompt text through the checkpoint's tokenizer",
      CliExit(code=0, check=lambda o: "text" in json.loads(o.splitlines()[-1])))
def _():
    return _cli(["--model", fixtures()["llama"], "--prompt", "w1 w2", "--max-new-tokens", "2",
                 "--device", "cpu", "--quiet", "--json"])


# dist
@dist_case("Runner.generate: ranks given different seeds",
           Raises(("fusedist.RequestMismatchError",), ("seed",)))
def _(rank, world, port):
    from fusedist.models import SamplingParams
    with _runner() as r:
        return r.generate([[1, 2]], 2, SamplingParams(greedy=False, temperature=0.5,
                                                      seed=rank)).ids


@dist_case("LLM.generate: ranks given different max_new_tokens",
           Raises(("fusedist.RequestMismatchError",), ("max_new_tokens",)))
def _(rank, world, port):
    return _llm_gen(rank, lambda l, r: l.generate([1, 2], 2 + r).ids)


@dist_case("LLM.stream: a prompt bad on rank 0 only, raised at the call",
           Raises(MISMATCH + TYPE_OR_VALUE, ("prompt",)))
def _(rank, world, port):
    return _llm_gen(rank, lambda l, r: [t.id for t in l.stream([1, True] if r == 0 else [1, 2],
                                                                2)])


@dist_case("LLM: every rank's generate equals TP 1's ids", Returns(lambda r: r is True))
def _(rank, world, port):
    import fusedist
    from fusedist.models import LLM
    with LLM(config="tiny", random_weights=True, max_batch=2, max_seq_len=64) as llm:
        ids = llm.generate([[5, 6, 7], [8, 9]], 4, greedy=True)
        every = fusedist.get_runtime().world.all_gather_object([c.ids for c in ids])
        return all(e == every[0] for e in every)


@dist_case("fp8_all_reduce: a bad argument on rank 1 only",
           Raises(MISMATCH + VALUE, ("block_size",)))
def _(rank, world, port):
    import torch

    import fusedist
    return fusedist.fp8_all_reduce(torch.ones(64), block_size=0 if rank == 1 else 32).tolist()


@dist_case("fp8_all_reduce: 1000x outliers switch to e4m3 on every rank",
           Returns(lambda r: r == "e4m3"))
def _(rank, world, port):
    import torch

    import fusedist
    x = torch.randn(4096, generator=torch.Generator().manual_seed(rank))
    x[::512] *= 1000
    info = {}
    fusedist.fp8_all_reduce(x, info=info)
    return info["path"]


@dist_case("HierarchicalCommunicator: a bad argument on rank 0 only",
           Raises(MISMATCH + VALUE, ("chunks",)))
def _(rank, world, port):
    import torch

    import fusedist
    hc = fusedist.HierarchicalCommunicator()
    return hc.all_reduce(torch.ones(8), chunks=0 if rank == 0 else None).tolist()


@dist_case("init: a rank_error on rank 0 stops both", Raises(MISMATCH, ("rank 0", "bad flag")),
           init=False)
def _(rank, world, port):
    import fusedist
    fusedist.init(backend="gloo", rank=rank, world_size=world, master_addr="127.0.0.1",
                  master_port=port, rank_error="bad flag" if rank == 0 else None)
    fusedist.shutdown()
    return "started"


@case("layers", "init: numpy tp_size accepted", Returns(lambda r: r == 1))
def _():
    import numpy as np

    import fusedist
    _ensure_rt(False)
    rt = fusedist.init(backend="gloo", rank=0, world_size=1, tp_size=np.int64(1))
    try:
        return rt.tp.size
    finally:
        fusedist.shutdown()


@case("layers", "HierarchicalCommunicator: numpy chunks accepted", Returns(), needs_rt=True)
def _():
    import numpy as np

    import fusedist
    return fusedist.HierarchicalCommunicator(chunks=np.int64(2)).all_reduce(_t(8))


@dist_case("CLI at TP 2: a NaN e4m3 code in rank 0's slice only", AllCli(("o_proj.weight", "nan")),
           init=False)
def _(rank, world, port):
    return _cli_rank(rank, world, port, ["--model", fixtures()["fp8_byte_7f"], "--prompt-ids",
                                         "1,2,3", "--max-new-tokens", "2", "--device", "cpu",
                                         "--json", "--quiet"])


@dist_case("LLM at TP 2: a NaN scale in one rank's slice only",
           Raises(MISMATCH + VALUE, ("weight_scale_inv", "nan")))
def _(rank, world, port):
    from fusedist.models import LLM
    with LLM(fixtures()["fp8_nan_scale"], max_batch=1, max_seq_len=32) as llm:
        return llm.generate([1, 2], 2).ids


# ---- running the cases ------------------------------------------------------------------------
def _ensure_rt(on: bool) -> None:
    import fusedist
    if on and not fusedist.is_initialized():
        fusedist.init(backend="gloo", rank=0, world_size=1, local_rank=0, local_world_size=1)
    if not on and fusedist.is_initialized():
        fusedist.shutdown()


class _Alarm(Exception):
    pass


def run_local(c: Case) -> tuple[str, str]:
    """(outcome, detail) of a one-process case."""
    _ensure_rt(c.needs_rt)

    def alarm(*_):
        raise _Alarm()

    old = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(LOCAL_DEADLINE_S)
    exc, result = None, None
    try:
        result = c.run()
    except _Alarm:
        return "hang", f"no answer within {LOCAL_DEADLINE_S} s"
    except BaseException as e:  # noqa: BLE001 - judged below
        exc = e
        if isinstance(e, KeyboardInterrupt):
            raise
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    try:
        import fusedist
        if fusedist.is_initialized() and not c.needs_rt:
            fusedist.shutdown()      # what a case left initialized (an LLM not closed)
    except Exception:  # noqa: BLE001
        pass
    return c.expect.judge(exc, result)


def _rank_main(c: Case, rank: int, world: int, port: int, out_path: str) -> None:
    """A forked rank: run the case, write (kind, type, message / result) to out_path."""
    import torch
    torch.set_num_threads(1)
    report = {"rank": rank}
    try:
        if c.init:
            import fusedist
            fusedist.init(backend="gloo", rank=rank, world_size=world, local_rank=rank,
                          local_world_size=world, master_addr="127.0.0.1", master_port=port,
                          timeout_s=300)
        res = c.run(rank, world, port)
        report.update(kind="return", value=repr(res)[:2000], obj=_jsonable(res))
    except BaseException as e:  # noqa: BLE001 - reported
        report.update(kind="raise", type=f"{type(e).__module__}.{type(e).__qualname__}",
                      message=str(e)[:4000], tb=traceback.format_exc()[-3000:])
    with open(out_path, "w") as f:
        json.dump(report, f)
    os._exit(0)


def _jsonable(v):
    try:
        json.dumps(v)
        return v
    except TypeError:
        return repr(v)


class _Reported(Exception):
    """A rank's exception rebuilt from its report (for isinstance checks by class name)."""


def _rebuild(report: dict) -> BaseException:
    import builtins

    import fusedist
    mod, _, qual = report["type"].rpartition(".")
    cls = getattr(fusedist, qual, None) if mod.startswith("fusedist") else \
        getattr(builtins, qual, None)
    if not (isinstance(cls, type) and issubclass(cls, BaseException)):
        cls = type(qual, (_Reported,), {})
    try:
        e = cls(report["message"])
    except Exception:  # noqa: BLE001
        e = _Reported(report["message"])
    return e


def run_dist(c: Case, port: int) -> tuple[str, str]:
    """(outcome, detail) of a multi-rank case: its ranks forked from this process."""
    tmp = tempfile.mkdtemp(prefix="fdcase")
    pids, paths = [], []
    for r in range(c.ranks):
        path = os.path.join(tmp, f"rank{r}.json")
        paths.append(path)
        pid = os.fork()
        if pid == 0:
            try:
                _rank_main(c, r, c.ranks, port, path)
            finally:
                os._exit(3)
        pids.append(pid)
    deadline = time.monotonic() + DIST_DEADLINE_S
    status = {}
    while len(status) < len(pids) and time.monotonic() < deadline:
        for pid in pids:
            if pid in status:
                continue
            done, st = os.waitpid(pid, os.WNOHANG)
            if done:
                status[pid] = st
        time.sleep(0.05)
    hung = [r for r, pid in enumerate(pids) if pid not in status]
    for pid in pids:
        if pid not in status:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    if hung:
        return "hang", f"ranks {hung} gave no answer within {DIST_DEADLINE_S} s"
    outcomes = []
    for r, (pid, path) in enumerate(zip(pids, paths)):
        st = status[pid]
        expect = c.per_rank[r] if c.per_rank else c.expect
        if isinstance(expect, Exits) and not os.WIFSIGNALED(st) and \
                os.WEXITSTATUS(st) == 0 and not os.path.exists(path):
            outcomes.append(("clear", f"rank {r}: exited"))
            continue
        if os.WIFSIGNALED(st) or not os.path.exists(path):
            sig = os.WTERMSIG(st) if os.WIFSIGNALED(st) else None
            return "crash", f"rank {r} died ({'signal ' + str(sig) if sig else 'no report'})"
        with open(path) as f:
            rep = json.load(f)
        if rep["kind"] == "raise":
            if isinstance(expect, (AllCli, CliExit)):
                outcomes.append(("crash", f"rank {r}: traceback {rep['type']}: "
                                 f"{rep['message'][:300]}"))
                continue
            outcomes.append(expect.judge(_rebuild(rep)))
        else:
            obj = rep.get("obj")
            if isinstance(expect, (AllCli, CliExit)) and isinstance(obj, list):
                obj = tuple(obj)
            outcomes.append(expect.judge(None, obj))
        outcomes[-1] = (outcomes[-1][0], f"rank {r}: {outcomes[-1][1]}")
    worst = max(outcomes, key=lambda o: OUTCOMES.index(o[0]))
    return worst[0], " || ".join(d for _, d in outcomes)


def dist_driver(names: list[str], out: str, ports: list[int]) -> None:
    """Run the named multi-rank cases (forking ranks from this process, which has run no torch
    op), writing {name: [outcome, detail]} to `out`. Case i's ranks meet at the TCP store that
    the calling process holds on ports[i] (TORCHELASTIC_USE_AGENT_STORE: they join it as
    clients, so no rank binds a port)."""
    import fusedist  # noqa: F401 - imported once, before the forks
    fixtures()
    results = {}
    for port, c in zip(ports, (c for c in CASES if c.ranks and c.name in names)):
        results[c.name] = run_dist(c, port)
        with open(out, "w") as f:
            json.dump(results, f)


def run_all_dist(names: list[str]) -> dict:
    """The multi-rank cases in one driver process (python this_file --dist-driver). Each case's
    rendezvous is a TCP store held here on a port the kernel picked (launch.RendezvousStore):
    bound before any rank starts, never guessed free."""
    if not names:
        return {}
    from launch import RendezvousStore
    out = tempfile.mktemp(suffix=".json")
    stores = [RendezvousStore(timeout_s=DIST_DEADLINE_S * 2) for _ in names]
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=str(ROOT), FUSEDIST_BAD_INPUT_DIR=fixtures()["dir"],
               **stores[0].env())
    cmd = [sys.executable, str(Path(__file__)), "--dist-driver", out,
           ",".join(str(s.port) for s in stores), *names]
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True,
                           timeout=DIST_DEADLINE_S * (len(names) + 2))
    finally:
        for st in stores:
            st.close()
    res = json.load(open(out)) if os.path.exists(out) else {}
    for n in names:
        if n not in res:
            res[n] = ("crash", f"the driver ended before this case (exit {p.returncode}): "
                               f"{p.stderr[-500:]}")
    return res


def run_cases(cases: list[Case], verbose: bool = False) -> dict:
    results = {}
    for c in cases:
        if c.ranks:
            continue
        t0 = time.monotonic()
        results[c.name] = run_local(c)
        if verbose:
            print(f"[{results[c.name][0]:>7}] {c.area:6} {c.name} ({time.monotonic() - t0:.1f}s)"
                  f": {results[c.name][1]}", flush=True)
    _ensure_rt(False)
    d = run_all_dist([c.name for c in cases if c.ranks])
    for c in cases:
        if c.name in d:
            results[c.name] = tuple(d[c.name])
            if verbose:
                print(f"[{d[c.name][0]:>7}] {c.area:6} {c.name}: {d[c.name][1]}", flush=True)
    return results


def summary(cases: list[Case], results: dict) -> str:
    areas = sorted({c.area for c in cases})
    lines = [f"{'area':8}" + "".join(f"{o:>9}" for o in OUTCOMES) + f"{'total':>9}"]
    for a in areas + ["all"]:
        got = [results[c.name][0] for c in cases if a in ("all", c.area)]
        lines.append(f"{a:8}" + "".join(f"{got.count(o):>9}" for o in OUTCOMES)
                     + f"{len(got):>9}")
    return "\n".join(lines)


# ---- pytest -------------------------------------------------------------------------------------
try:
    import pytest
except ImportError:   # the driver, run as a script
    pytest = None

if pytest is not None and __name__ != "__main__":
    _names = [c.name for c in CASES]
    assert len(set(_names)) == len(_names), "case names must be unique"

    @pytest.fixture(scope="module")
    def dist_results():
        return run_all_dist([c.name for c in CASES if c.ranks])

    @pytest.mark.timeout(LOCAL_DEADLINE_S + 30)
    @pytest.mark.parametrize("c", [c for c in CASES if not c.ranks], ids=lambda c: c.name)
    def test_one_process(c):
        outcome, detail = run_local(c)
        _ensure_rt(False)
        assert outcome == "clear", f"{c.area}: {c.name}: {outcome}: {detail}"

    @pytest.mark.timeout(DIST_DEADLINE_S * 60)
    @pytest.mark.parametrize("c", [c for c in CASES if c.ranks], ids=lambda c: c.name)
    def test_ranks(c, dist_results):
        outcome, detail = dist_results[c.name]
        assert outcome == "clear", f"{c.area}: {c.name}: {outcome}: {detail}"


if __name__ == "__main__":
    import argparse
    if len(sys.argv) > 1 and sys.argv[1] == "--dist-driver":
        dist_driver(sys.argv[4:], sys.argv[2], [int(x) for x in sys.argv[3].split(",")])
        sys.exit(0)
    ap = argparse.ArgumentParser()
    ap.add_argument("--area")
    ap.add_argument("--name", help="cases whose name holds this text")
    ap.add_argument("-v", action="store_true")
    ap.add_argument("--json", help="write {case: [outcome, detail]} here")
    a = ap.parse_args()
    sel = [c for c in CASES if (not a.area or c.area == a.area) and
           (not a.name or a.name in c.name)]
    res = run_cases(sel, a.v)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    print(summary(sel, res))
    bad = [(c.name, res[c.name]) for c in sel if res[c.name][0] != "clear"]
    for n, (o, d) in bad:
        print(f"  {o:>7}: {n}: {d[:300]}")
