"""python -m fusedist.generate: generate tokens with a tensor-parallel Llama-family model (dense,
or a mixture of experts: Mixtral, Qwen2-MoE, Qwen3-MoE).

    python -m fusedist.generate --config tiny --random-weights --device cpu   # a CPU smoke run
    torchrun --nproc-per-node 2 -m fusedist.generate --device cpu   # TP 2 over gloo
    torchrun --nproc-per-node 8 -m fusedist.generate --model /ckpt/Meta-Llama-3-70B \\
        --prompt "The capital of France is" --max-new-tokens 64
    python -m fusedist.generate --model /ckpt/Meta-Llama-3-8B --quantize fp8   # FP8 weights
    python -m fusedist.generate                                  # GPU: Llama-3-8B shape, random
                                                                 # weights, beside plain torch

Launched like every fusedist job (torchrun, mpirun, srun: fusedist.init()); --tp defaults to
the launcher's world size, and a tensor-parallel group may span nodes. --ep shards a mixture of
experts' experts over that group (expert parallelism; attention stays tensor-parallel):
num_experts must divide by it. Progress goes to stderr on rank 0; results to stdout on rank 0:
the first sequence's text as it decodes (with a tokenizer), then a report; one JSON object with
--json (ids, text, and the run's prefill_ms, ms_per_token and tokens_per_s).

This module runs the model and reports what it generated. Measuring it beside baselines
(--baseline torch / torch-compile, --profile, --prefill-reps, --compile-backend) is the model
benchmark's harness, benchmarks/_model_run.py of a fusedist checkout (the one this package was
imported from, else the one in the working directory): given one of those flags
(or no model at all: the embedded default runs beside plain torch) this CLI hands the whole run
to it, where it is present, with the same flags (docs/design/model.md describes what it
measures); without it, one line says where to run it.

FP8 weights: an FP8 checkpoint (config.json's quantization_config: quant_method "fp8" with
128 x 128 block or per-tensor scales, or "compressed-tensors" float-quantized) is read as FP8;
--quantize fp8 quantizes a bf16 / fp16 / fp32 checkpoint (or random weights) at load, one scale
per output channel (fp8-tensor, fp8-block: the other layouts). The q/k/v/o, gate/up and down
projections are then e4m3 with float32 scales (the report's "weights" says which format ran).

Input is checked before anything is allocated: the flags, config.json and the checkpoint's
tensors (shapes and dtypes from the safetensors headers), context + prompt + new tokens
against the model's positions, and an estimate of each rank's memory (weights, KV cache,
activations) against the device's free memory (the host's available memory on CPU). Every
rank's verdict is agreed on before any rank goes on: a rank whose flags or checkpoint are
wrong stops every rank (at the rendezvous when its flags are wrong), and ranks given different
flags stop naming each rank's value. A mistake is one line on stderr and exit status 1, as are
errors of the run itself (a tensor holding NaN in the checkpoint, ranks given different
requests, a lost rank, NaN logits).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

QUANTIZE_CHOICES = ("fp8", "fp8-channel", "fp8-tensor", "fp8-block")   # models.llama.QUANTIZE
DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
          "fp16": torch.float16, "float32": torch.float32, "fp32": torch.float32}
BASELINES = ("torch", "torch-compile")


def _find_harness() -> Path:
    """benchmarks/_model_run.py of the checkout this package was imported from, else of the
    checkout in the working directory (an installed fusedist run from a checkout)."""
    here = Path(__file__).resolve().parent.parent / "benchmarks" / "_model_run.py"
    try:
        there = Path.cwd() / "benchmarks" / "_model_run.py"
    except OSError:          # the working directory is gone
        return here
    return there if not here.is_file() and there.is_file() else here


# The flags the model benchmark's harness (_find_harness(): a checkout's benchmarks/, looked up
# when a run asks, so a process that changed its working directory finds that one's) takes.
BENCHMARK_FLAGS = ("--baseline", "--compile-backend", "--profile", "--prefill-reps")
# Flags whose value may differ between ranks (what a rank prints, not what it computes).
RANK_LOCAL_FLAGS = ("json", "quiet")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m fusedist.generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_argument_group("model")
    src.add_argument("--model",
                     help="Hugging Face checkpoint directory (config.json + safetensors)")
    src.add_argument("--config", help="named config: llama-3-8b, llama-3.1-8b, llama-3-70b, "
                     "tiny; mixtures of experts: qwen3-30b-a3b, mixtral-8x7b, tiny-moe")
    src.add_argument("--random-weights", action="store_true", help="seeded random weights")
    src.add_argument("--weights-seed", type=int, default=0)
    src.add_argument("--tp", type=int, help="tensor-parallel size (default: the world size)")
    src.add_argument("--ep", action="store_true",
                     help="expert parallelism: a mixture of experts' experts sharded over the "
                     "tensor-parallel group (num_experts / tp whole experts a rank), attention "
                     "tensor-parallel; the baselines keep tensor-parallel experts")
    src.add_argument("--dtype", default="auto", choices=["auto"] + sorted(DTYPES),
                     help="auto (default): the checkpoint's torch_dtype on GPU (bfloat16 when "
                     "it names float32 or none), float32 on CPU")
    src.add_argument("--quantize", default="none", choices=("none",) + QUANTIZE_CHOICES,
                     help="FP8 (e4m3) projection weights, quantized at load: fp8 (one scale per "
                     "output channel), fp8-tensor, fp8-block (128 x 128); FP8 checkpoints are "
                     "read as FP8 without it")
    src.add_argument("--device", choices=("cpu", "cuda"), help="default cuda when a GPU is visible")
    inp = p.add_argument_group("input")
    inp.add_argument("--batch", type=int, default=1)
    inp.add_argument("--prompt-len", type=int, help="random prompt ids of this length")
    inp.add_argument("--prompt-ids", help="comma-separated prompt ids, e.g. 1,2,3")
    inp.add_argument("--prompt", help="prompt text (needs the tokenizer files in --model)")
    inp.add_argument("--chat", metavar="MESSAGE",
                     help="a user message, turned into the prompt by the checkpoint's chat "
                     "template (needs transformers and a chat_template in --model)")
    inp.add_argument("--context-fill", type=int, default=0,
                     help="benchmark: this many random KV-cache tokens before the prompt")
    gen = p.add_argument_group("generation")
    gen.add_argument("--max-new-tokens", type=int)
    gen.add_argument("--greedy", action="store_true", help="argmax decoding (the default unless "
                     "--temperature / --top-k / --top-p is given or --model's "
                     "generation_config.json sets do_sample)")
    gen.add_argument("--temperature", type=float)
    gen.add_argument("--top-k", type=int)
    gen.add_argument("--top-p", type=float)
    gen.add_argument("--seed", type=int, default=0, help="sampling and random-prompt seed")
    gen.add_argument("--ignore-eos", action="store_true", help="always generate max tokens "
                     "(default: stop at generation_config.json's or config.json's EOS ids)")
    run = p.add_argument_group("runner")
    run.add_argument("--kv-budget-gb", type=float, help="KV-cache memory (default: what the "
                     "batch and length need)")
    run.add_argument("--page-size", type=int, default=16)
    run.add_argument("--prefill-chunk", type=int, default=8192, help="tokens per prefill chunk")
    run.add_argument("--no-graphs", action="store_true", help="decode eagerly (no CUDA graphs)")
    run.add_argument("--prefill-graph-tokens", type=int, default=512, metavar="N",
                     help="replay prefill chunks of up to N tokens through CUDA graphs (token "
                     "buckets; the paged prefill kernel; 0: eager prefill)")
    run.add_argument("--kv-dtype", default="auto", choices=("auto", "fp8"),
                     help="the fusedist backend's KV cache: auto (the model dtype) or fp8 (e4m3 "
                     "with a float32 scale per token and kv head); the torch baselines keep "
                     "theirs in the model dtype")
    run.add_argument("--prefill-reps", type=int, default=None,
                     help="benchmark: warm prefills timed for prefill_ms (their median; "
                     "default 3)")
    out = p.add_argument_group("output")
    out.add_argument("--baseline",
                     help="benchmark: also run these baselines, comma-separated: torch (plain "
                     "torch ops), torch-compile (the same, decode step under torch.compile), "
                     "e.g. torch,torch-compile; or none (default: torch for the embedded "
                     "default model where the benchmark harness is present, else none)")
    out.add_argument("--compile-backend", default=None,
                     help="benchmark: torch.compile backend of the torch-compile baseline "
                     "(default inductor)")
    out.add_argument("--profile", action="store_true",
                     help="benchmark: break one decode step and one prefill down into GEMM / "
                     "attention / communication / other kernel time")
    out.add_argument("--json", action="store_true", help="one JSON object on stdout (without "
                     "it, the first sequence's text streams to stdout as it decodes when the "
                     "model has a tokenizer)")
    out.add_argument("--quiet", action="store_true", help="no progress on stderr")
    return p.parse_args(argv)


def parse_baselines(value: str) -> list[str]:
    """--baseline's value as a list of BASELINES ("none": no baseline)."""
    names = [v.strip() for v in value.split(",") if v.strip()]
    if names == ["none"]:
        return []
    if not names or any(n not in BASELINES for n in names) or len(set(names)) != len(names):
        raise SystemExit(f"fusedist.generate: --baseline takes 'none' or a comma-separated "
                         f"list of {', '.join(BASELINES)} (each once), got {value!r}")
    return names


class Progress:
    """Rank 0's progress on stderr: tqdm when installed, else a plain line every 10%."""

    def __init__(self, enabled: bool):
        self.enabled, self.bar, self.label, self.last = enabled, None, "", -1
        try:
            import tqdm  # noqa: F401
            self.tqdm = tqdm.tqdm
        except ImportError:
            self.tqdm = None

    def stage(self, label: str):
        self.close()
        self.label, self.last = label, -1
        return self.update

    def update(self, i: int, n: int):
        if not self.enabled:
            return
        if self.tqdm is not None:
            if self.bar is None:
                self.bar = self.tqdm(total=n, desc=self.label, file=sys.stderr, leave=False)
            self.bar.update(i - self.bar.n)
            return
        pct = 100 * i // max(n, 1)
        if pct // 10 != self.last // 10 or i == n:
            self.last = pct
            print(f"{self.label}: {i}/{n}", file=sys.stderr, flush=True)

    def note(self, msg: str):
        if self.enabled:
            self.close()
            print(msg, file=sys.stderr, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _fail(msg: str):
    """A user mistake: one line on stderr, exit status 1 (no traceback)."""
    raise SystemExit(f"fusedist.generate: {msg}")


def _check_flags(args) -> None:
    """Every numeric flag in its range, and the model flags consistent."""
    for flag, lo in (("batch", 1), ("page_size", 1), ("prefill_chunk", 1), ("context_fill", 0),
                     ("max_new_tokens", 1), ("prompt_len", 1), ("top_k", 0), ("tp", 1),
                     ("prefill_reps", 1), ("prefill_graph_tokens", 0), ("weights_seed", 0)):
        v = getattr(args, flag)
        if v is not None and v < lo:
            _fail(f"--{flag.replace('_', '-')} must be >= {lo}, got {v}")
    t = args.temperature
    if t is not None and not (math.isfinite(t) and t >= 0):
        _fail(f"--temperature must be a finite number >= 0, got {t}")
    if args.top_p is not None and not 0.0 < args.top_p <= 1.0:
        _fail(f"--top-p must be in (0, 1], got {args.top_p}")
    given = [f for f in ("prompt", "prompt_ids", "prompt_len", "chat")
             if getattr(args, f) is not None]
    if len(given) > 1:
        _fail(f"give one prompt source, got {' and '.join('--' + f.replace('_', '-') for f in given)}")
    gb = args.kv_budget_gb
    if gb is not None and not (math.isfinite(gb) and gb > 0):
        _fail(f"--kv-budget-gb must be a finite number > 0, got {gb}")
    if args.model is not None:
        if args.config is not None:
            _fail("--config and --model both given; drop --config (--model DIR reads "
                  "DIR/config.json; add --random-weights for random weights of its shape) or "
                  "drop --model (--config NAME --random-weights: a shipped shape)")
        if not os.path.isdir(args.model):
            _fail(f"--model {args.model!r} is not a directory; pass a Hugging Face checkpoint "
                  "directory (config.json + safetensors)")


def _defaults(args, cuda: bool, harness: Optional[bool] = None):
    """The flags checked and completed: the embedded default model (Llama-3-8B shape on a GPU,
    tiny on a CPU, random weights), default lengths, the baselines (torch beside the embedded
    default where the benchmark harness is present, else none)."""
    _check_flags(args)
    embedded = args.model is None and args.config is None
    if embedded:
        args.config = "llama-3-8b" if cuda else "tiny"
        args.random_weights = True
    if args.model is None and not args.random_weights:
        raise SystemExit("fusedist.generate: --config needs --random-weights (named configs ship "
                         "without weights); pass --model DIR for a checkpoint")
    if args.baseline is None:
        harness = _find_harness().is_file() if harness is None else harness
        args.baseline = "torch" if embedded and harness else "none"
    args.baselines = parse_baselines(args.baseline)
    if args.max_new_tokens is None:
        args.max_new_tokens = 128 if cuda else 32
    if args.prompt_len is None and args.prompt_ids is None and args.prompt is None and \
            args.chat is None:
        args.prompt_len = 128 if cuda else 16
    if args.prefill_reps is None:
        args.prefill_reps = 3
    if args.compile_backend is None:
        args.compile_backend = "inductor"
    return args


def _message(e: BaseException) -> str:
    """A library error's message without its "fusedist.models: " prefix (KeyError's text
    unquoted)."""
    msg = e.args[0] if e.args and isinstance(e.args[0], str) else str(e)
    return msg.removeprefix("fusedist.models: ")


def _load(args, tp: int):
    """(config, weight source, tokenizer) of the run; a bad config.json, checkpoint or
    tokenizer, an unknown --config, or a --tp that does not split the model: _fail. Sets
    args.quant: how the projection weights are held (weights.resolve_quant)."""
    from .models.llama import LlamaConfig, open_weights
    from .models.llama.weights import check_tp, check_weights, resolve_quant

    try:
        cfg = LlamaConfig.from_dir(args.model) if args.model else LlamaConfig.named(args.config)
        src = open_weights(args.model if not args.random_weights else None, cfg,
                           args.weights_seed if args.random_weights else None)
        args.quant = resolve_quant(cfg, args.quantize, src)
        check_tp(cfg, tp, args.quant, ep=args.ep)
        check_weights(src, cfg, args.quant)   # headers only; Transformer.load checks the same
    except (ValueError, KeyError, OSError) as e:
        _fail(_message(e))
    return cfg, src, _tokenizer(args.model)


def _generation_defaults(args, cfg):
    """generation_config.json's EOS ids and sampling (config.json's EOS without it)."""
    from .models.hf import GenerationDefaults

    try:
        return GenerationDefaults.from_dir(None if args.random_weights else args.model,
                                           cfg.eos_token_ids)
    except ValueError as e:
        _fail(_message(e))


def _check_positions(args, cfg, prompts) -> int:
    """context + the longest prompt + new tokens, refused past the model's positions."""
    longest = args.context_fill + max(len(p) for p in prompts) + args.max_new_tokens
    limit, what = cfg.position_limit()
    if longest > limit:
        _fail(f"context + prompt + new tokens = {args.context_fill} + "
              f"{max(len(p) for p in prompts)} + {args.max_new_tokens} = {longest} exceeds "
              f"{what} of {cfg.name or 'the model'}; lower --context-fill, the prompt length "
              "or --max-new-tokens")
    return longest


def memory_estimate(cfg, *, tp: int, dtype: torch.dtype, batch: int, seq_len: int,
                    page_size: int, prefill_chunk: int, kv_budget_bytes=None,
                    max_position=None, quant=None, kv_fp8: bool = False) -> dict:
    """Bytes one rank of the fusedist backend holds for a run, before it allocates them:
    "weights" (this rank's parameters and RoPE tables, as Transformer holds them; with quant,
    a WeightQuant, the projections at one byte an element plus their float32 scales, a
    per-tensor layout's stacked q | k | v and gate | up counted per channel), "kv_cache" (as
    Runner sizes it: the batch rounded up to a power of two, seq_len rounded up to pages; or
    the budget; kv_fp8: one byte an element plus a float32 scale per token and kv head; the
    bytes of a page are PagedKVCache.bytes_per_page's, the one formula),
    "activations" (an estimate: the largest prefill chunk's hidden states, twice,
    and the logits) and "total". max_position (default seq_len) sizes the RoPE tables."""
    from . import _dtypes
    from .models.llama.weights import padded_vocab
    from .nn.attention import kv_heads_per_rank
    from .nn.kv_cache import PagedKVCache

    elt = torch.tensor([], dtype=dtype).element_size()
    h, hd, L = cfg.hidden_size, cfg.head_dim, cfg.num_layers
    q, kv = cfg.num_heads // tp * hd, kv_heads_per_rank(cfg.num_kv_heads, tp) * hd
    inter = cfg.intermediate_size // tp
    vocab = padded_vocab(cfg, tp)
    # Every projection of every layer as (rows, columns, stacked from parts): qkv, o, and the
    # MLP's gate|up, down (each expert's and the shared expert's in a mixture of experts).
    proj, extra, mlp_act = [], 0, 0
    for i in range(L):
        proj += [(q + 2 * kv, h, True), (h, q, False)]
        if not cfg.sparse(i):
            proj += [(2 * inter, h, True), (h, inter, False)]
            mlp_act = max(mlp_act, 3 * inter)
            continue
        m = cfg.moe
        e_i, s_i = m.intermediate_size // tp, m.shared_intermediate_size // tp
        proj += [(2 * e_i, h, True), (h, e_i, False)] * m.num_experts
        if s_i:
            proj += [(2 * s_i, h, True), (h, s_i, False)]
        extra += 4 * (m.num_experts + (1 if s_i else 0)) * h   # float32 router, shared gate
        mlp_act = max(mlp_act, m.top_k * (3 * e_i + 2 * h) + 3 * s_i)
    layer = 2 * h + ((q + 2 * kv) if cfg.qkv_bias else 0) + (2 * hd if cfg.qk_norm else 0) + \
        (h if cfg.o_bias else 0)
    if quant is None:
        proj_bytes = elt * sum(n * k for n, k, _ in proj)
    else:
        blocks = lambda n: -(-n // 128)   # noqa: E731
        scales = {"tensor": lambda n, k, stacked: n if stacked else 1,
                  "channel": lambda n, k, stacked: n,
                  "block": lambda n, k, stacked: blocks(n) * blocks(k)}[quant.layout]
        proj_bytes = sum(n * k + 4 * scales(n, k, stacked) for n, k, stacked in proj)
    rope = (max_position or seq_len) * hd * 4 * L        # float32 cos|sin per layer
    weights = (L * layer + cfg.vocab_size * h + vocab // tp * h + h) * elt + rope + \
        proj_bytes + extra
    rows = 1 << (batch - 1).bit_length()
    kv_heads = kv_heads_per_rank(cfg.num_kv_heads, tp)
    page_bytes = PagedKVCache.bytes_per_page(L, kv_heads, hd, page_size,
                                             _dtypes.FP8 if kv_fp8 else dtype)
    need = rows * math.ceil(seq_len / page_size) * page_bytes
    kv_cache = need if kv_budget_bytes is None else \
        max(need, int(kv_budget_bytes // page_bytes) * page_bytes)
    tokens = min(prefill_chunk, batch * seq_len)
    per_token = 4 * h + 2 * q + 2 * kv + mlp_act
    activations = 2 * tokens * per_token * max(elt, 4) + 2 * rows * vocab * (elt + 4)
    return {"weights": weights, "kv_cache": kv_cache, "activations": activations,
            "total": weights + kv_cache + activations}


def _available_memory(device: torch.device) -> tuple:
    """(bytes, what) a rank may still allocate: the GPU's free memory, or the host's available
    memory (MemAvailable) on CPU."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0], f"free on {device}"
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "of host memory available"
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"), "of host memory free"


def _memory_problem(args, cfg, rt, dtype, prompts, longest, max_position) -> "str | None":
    """Why this rank cannot hold the run (None when it can)."""
    budget = None if args.kv_budget_gb is None else int(args.kv_budget_gb * 2**30)
    est = memory_estimate(cfg, tp=rt.tp.size, dtype=dtype, batch=len(prompts), seq_len=longest,
                          page_size=args.page_size, prefill_chunk=args.prefill_chunk,
                          kv_budget_bytes=budget, max_position=max_position,
                          quant=getattr(args, "quant", None),
                          kv_fp8=getattr(args, "kv_dtype", "auto") == "fp8")
    if budget is not None and budget < est["kv_cache"]:
        return (f"--kv-budget-gb {args.kv_budget_gb} is less than the {_size(est['kv_cache'])} "
                f"KV cache that {len(prompts)} sequences (--batch, rounded up to a power of two) "
                f"x {longest} tokens need per rank; raise it or lower --batch / the lengths")
    have, what = _available_memory(rt.device)
    ranks = rt.env.local_world_size if rt.device.type == "cpu" else 1
    if est["total"] * ranks <= have:
        return None
    each = f" x {ranks} ranks on this host" if ranks > 1 else ""
    return (f"the run needs about {_size(est['total'])} of memory per rank{each} (weights "
            f"{_size(est['weights'])}, KV cache {_size(est['kv_cache'])} for {len(prompts)} x "
            f"{longest} tokens, activations {_size(est['activations'])}), more than the "
            f"{_size(have)} {what}; lower --batch, --context-fill, the prompt length or "
            "--max-new-tokens, use a smaller --dtype, or split the model over more ranks "
            "(--tp)")


def _size(n: float) -> str:
    for unit, b in (("GiB", 2**30), ("MiB", 2**20)):
        if n >= b / 10:
            return f"{n / b:.1f} {unit}"
    return f"{n / 2**10:.1f} KiB"


def _prompts(args, cfg, tokenizer):
    if args.prompt is not None or args.chat is not None:
        if tokenizer is None:
            flag = "--prompt" if args.prompt is not None else "--chat"
            raise SystemExit(f"fusedist.generate: {flag} needs tokenizer files in --model; pass "
                             "--prompt-ids or --prompt-len instead")
        try:
            ids = tokenizer.encode(args.prompt) if args.prompt is not None else \
                tokenizer.chat([{"role": "user", "content": args.chat}])
        except ValueError as e:
            _fail(_message(e))
    elif args.prompt_ids is not None:
        try:
            ids = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
        except ValueError:
            raise SystemExit(f"fusedist.generate: --prompt-ids must be comma-separated ints, got "
                             f"{args.prompt_ids!r}")
    else:
        # The same seeded ids on every rank.
        g = torch.Generator().manual_seed(args.seed)
        return torch.randint(0, cfg.vocab_size, (args.batch, args.prompt_len), generator=g).tolist()
    bad = [t for t in ids if not 0 <= t < cfg.vocab_size]
    if not ids or bad:
        raise SystemExit(f"fusedist.generate: prompt ids must be in [0, {cfg.vocab_size}); got "
                         f"{bad[:5] or 'none'}")
    return [list(ids) for _ in range(args.batch)]


def _tokenizer(model_dir):
    """The checkpoint's tokenizer (AutoTokenizer when transformers is installed, else
    tokenizer.json through `tokenizers`); None without tokenizer files."""
    from .models.hf import load_tokenizer

    try:
        return load_tokenizer(model_dir)
    except ValueError as e:
        _fail(f"{_message(e)}; or pass --prompt-ids or --prompt-len instead of --prompt")


def _kv_dtype(args) -> "torch.dtype | None":
    """--kv-dtype: None (the model's dtype) or torch.float8_e4m3fn."""
    if getattr(args, "kv_dtype", "auto") != "fp8":
        return None
    from . import _dtypes
    if _dtypes.FP8 is None:
        _fail("--kv-dtype fp8 needs a torch with float8_e4m3fn")
    return _dtypes.FP8


def _stream(runner, prompts, max_new_tokens, sp, eos, context_fill, on_token):
    """runner.stream() on every rank, on_token(id) for each new id of the first sequence;
    returns the GenerationResult."""
    steps = runner.stream(prompts, max_new_tokens, sp, eos_ids=eos, context_fill=context_fill)
    while True:
        try:
            step = next(steps)
        except StopIteration as done:
            return done.value
        if step[0] is not None:
            on_token(step[0])


def _text_printer(tok):
    """on_token for the stream: rank 0 prints the first sequence's text as it decodes."""
    from .models.hf import TextStream

    text = TextStream(tok)
    return lambda t: print(text.push(t), end="", flush=True)


def print_run_header(summary: dict, cfg, args, tp: int) -> None:
    """The text report's first lines: the model, the run's shape, the weights' format (the
    CLI's and benchmarks/model.py's reports share them)."""
    print(f"model {summary['model']} ({cfg.num_params() / 1e6:.1f} M params), tp {tp}, "
          f"{summary['dtype']}, batch {summary['batch']}, prompt {summary['prompt_len']} tokens"
          + (f" after {args.context_fill} cached" if args.context_fill else "")
          + f", {args.max_new_tokens} new")
    w = summary["weights"]
    if w["format"] == "fp8":
        print(f"weights: q/k/v/o, gate/up, down in FP8 (e4m3, {w['scales']} scales, "
              f"{w['source']})")


def weight_format(quant, dtype) -> dict:
    """The report's "weights": the projections' format (FP8: dtype, scales, where from)."""
    if quant is None:
        return {"format": str(dtype).replace("torch.", "")}
    return quant.describe()


@dataclass
class Job:
    """A run checked and agreed on by every rank (prepare()): what to build and what to ask."""
    args: argparse.Namespace
    cfg: object
    src: object
    tok: object
    prompts: list
    dtype: torch.dtype
    rt: object
    max_position: int
    longest: int


def _fields(args) -> dict:
    """The flags every rank must share, as the mismatch message shows them (--name: value)."""
    skip = set(RANK_LOCAL_FLAGS) | {"defaults", "quant", "stream_text", "baselines"}
    return {f"--{k.replace('_', '-')}": repr(v) for k, v in sorted(vars(args).items())
            if k not in skip}


def prepare(args) -> Job:
    """Check this rank's flags, checkpoint, prompts and memory, then agree on every verdict
    with every rank: a rank whose own check failed stops every rank with its line (at the
    rendezvous, before any process group exists), ranks given different flags stop naming
    each rank's value, a rank that cannot hold the run stops them all. Raises SystemExit with
    the one line; on success the runtime is up (fusedist.init) and the job ready to run."""
    import fusedist
    from .distributed.launch_env import LaunchEnvError, detect_launch_env
    from .errors import CollectiveMismatchError
    from .models.llm import resolve_dtype

    if args.device == "cuda" and not torch.cuda.is_available():
        _fail("--device cuda but no GPU is visible; use --device cpu")
    cuda = torch.cuda.is_available() if args.device is None else args.device == "cuda"
    try:
        world = detect_launch_env().world_size
    except LaunchEnvError as e:
        _fail(_message(e).removeprefix("fusedist.init: "))
    problem = job = None
    try:
        args = _defaults(args, cuda)
        tp = args.tp or world
        if world % tp:
            _fail(f"--tp {tp} does not divide the world size {world}")
        cfg, src, tok = _load(args, tp)
        args.defaults = _generation_defaults(args, cfg)
        prompts = _prompts(args, cfg, tok)
        longest = _check_positions(args, cfg, prompts)
        max_position = min(max(longest, 16), cfg.position_limit()[0])
        try:
            dtype = resolve_dtype(args.dtype, cfg, torch.device("cuda" if cuda else "cpu"),
                                  "--dtype")
        except ValueError as e:
            _fail(str(e))
    except SystemExit as e:
        problem = str(e.code).removeprefix("fusedist.generate: ")
    try:
        # Every rank, even one that refused its flags: it tells the others at the rendezvous.
        # A tensor-parallel group may span nodes (the collectives take their two-level forms).
        rt = fusedist.init(tp_size=None if problem else tp, tp_spans_nodes=True,
                           backend="nccl" if cuda else "gloo", rank_error=problem)
    except CollectiveMismatchError as e:
        _fail(problem or _message(e))
    except (ValueError, RuntimeError) as e:
        _fail(_message(e))
    try:
        rt.world.check_same(_fields(args), where="fusedist.generate", what="flags",
                            fix="Launch every rank with the same flags")
    except CollectiveMismatchError as e:
        fusedist.shutdown()
        _fail(str(e).removeprefix("fusedist.generate: "))
    # Every rank's verdict on memory, so that all of them stop when one cannot hold the run.
    problem = _memory_problem(args, cfg, rt, dtype, prompts, longest, max_position)
    problem = next((p for p in rt.world.all_gather_object(problem) if p), None)
    if problem is not None:
        fusedist.shutdown()
        _fail(problem)
    job = Job(args, cfg, src, tok, prompts, dtype, rt, max_position, longest)
    return job


def agree(rt, stage: str, error: Optional[BaseException]) -> None:
    """Every rank at the end of `stage`: SystemExit (one line) on every rank when any rank's
    stage failed, naming the ranks and their errors."""
    mine = "" if error is None else _message(error)
    every = rt.world.all_gather_object(mine)
    bad = [(r, m) for r, m in enumerate(every) if m]
    if not bad:
        return
    import fusedist
    fusedist.shutdown()
    if error is not None:
        raise SystemExit(f"fusedist.generate: {mine}") from None
    raise SystemExit(f"fusedist.generate: {stage} failed on rank "
                     + "; ".join(f"{r}: {m}" for r, m in bad)) from None


def run(job: Job) -> int:
    """Build the fusedist model and its runner, generate (rank 0 streams the first sequence's
    text unless --json), report on rank 0. The runtime is shut down at the end."""
    import fusedist
    from .errors import FusedistError
    from .models import Runner, build_model

    args, rt = job.args, job.rt
    rank0 = rt.rank == 0
    prog = Progress(rank0 and not args.quiet)
    try:
        model = runner = err = None
        try:
            prog.note(f"building {job.cfg.name or 'model'} ({job.cfg.num_params() / 1e6:.1f} M "
                      f"params, {job.dtype}, tp {rt.tp.size}) on {rt.device}")
            model = build_model(job.cfg, job.src, group=rt.tp, dtype=job.dtype,
                                device=rt.device, max_position=job.max_position,
                                progress=prog.stage("loading"), quantize=args.quantize,
                                ep=args.ep)
            budget = None if args.kv_budget_gb is None else int(args.kv_budget_gb * 2**30)
            runner = Runner(model, max_batch=len(job.prompts), max_seq_len=job.longest,
                            page_size=args.page_size, kv_budget_bytes=budget,
                            cuda_graphs=False if args.no_graphs else None,
                            prefill_chunk=args.prefill_chunk,
                            prefill_graph_tokens=args.prefill_graph_tokens,
                            kv_dtype=_kv_dtype(args))
        except (ValueError, TypeError, KeyError, OSError) as e:
            err = e
        prog.close()
        agree(rt, "loading the model", err)
        sp = args.defaults.sampling(greedy=True if args.greedy else None,
                                    temperature=args.temperature, top_k=args.top_k,
                                    top_p=args.top_p, seed=args.seed)
        eos = () if args.ignore_eos or args.random_weights else args.defaults.eos_token_ids
        streamed = job.tok is not None and not args.json
        try:
            if streamed:
                # Every rank streams (its collectives), rank 0 prints.
                on_token = _text_printer(job.tok) if rank0 else (lambda t: None)
                res = _stream(runner, job.prompts, args.max_new_tokens, sp, eos,
                              args.context_fill, on_token)
                if rank0:
                    print(flush=True)           # ends the streamed text's line
            else:
                res = runner.generate(job.prompts, args.max_new_tokens, sp, eos_ids=eos,
                                      context_fill=args.context_fill,
                                      progress=prog.stage("decoding"))
        except (FusedistError, ValueError, TypeError) as e:
            prog.close()
            _fail(_message(e))
        prog.close()
        if rank0:
            report(job, res, runner, streamed)
        if getattr(model, "ep", False):
            model.close()   # the expert-parallel Buffers (collective: every rank)
    finally:
        prog.close()
        fusedist.shutdown()
    return 0


def report(job: Job, res, runner, streamed: bool) -> None:
    """Rank 0's report: the JSON object (--json) or a few lines."""
    args, rt, cfg = job.args, job.rt, job.cfg
    fd = {"prefill_ms": round(res.prefill_ms, 3), "ms_per_token": round(res.ms_per_step, 4),
          "tokens_per_s": round(res.tokens_per_s, 2), "decode_steps": res.steps,
          "cuda_graphs": bool(res.timings.get("graphs")), "streamed": streamed,
          "kv_cache_gib": round(runner.kv_bytes / 2**30, 3),
          "kv_dtype": str(runner.kv_dtype).replace("torch.", "")}
    summary = {"model": args.model or args.config, "tp": rt.tp.size, "ep": args.ep,
               "world": rt.world_size,
               "device": str(rt.device.type), "dtype": str(job.dtype).replace("torch.", ""),
               "weights": weight_format(getattr(args, "quant", None), job.dtype),
               "batch": len(job.prompts), "prompt_len": len(job.prompts[0]),
               "prompt_ids": job.prompts[0], "context_fill": args.context_fill,
               "max_new_tokens": args.max_new_tokens, "baselines": [], "ids": res.ids,
               "timings": {"fusedist": fd}}
    if rt.device.type == "cuda":
        summary["gpu"] = torch.cuda.get_device_name(rt.device)
    if job.tok is not None:
        summary["text"] = [job.tok.decode(ids) for ids in res.ids]
    if args.json:
        print(json.dumps(summary), flush=True)
        return
    print_run_header(summary, cfg, args, rt.tp.size)
    if "text" in summary and not streamed:
        print(f"text: {summary['text'][0]!r}")
    elif "text" not in summary:
        print(f"ids[0]: {res.ids[0]}")
    print(f"prefill {fd['prefill_ms']} ms, {fd['ms_per_token']} ms/token, "
          f"{fd['tokens_per_s']} tokens/s over {res.steps} decode steps"
          + (" (streamed: each token read back and decoded)" if streamed else ""))


def _uses_harness(argv, args) -> bool:
    """Whether this run is a benchmark (the harness's flags, or the embedded default beside
    its baseline)."""
    given = any(a == f or a.startswith(f + "=") for a in argv for f in BENCHMARK_FLAGS)
    if args.baseline is not None:
        given = given and args.baseline.strip() != "none"
    embedded = args.model is None and args.config is None and args.baseline is None
    return given or (embedded and _find_harness().is_file())


def _run_harness(argv) -> int:
    """The model benchmark's harness (benchmarks/_model_run.py) on these flags."""
    harness = _find_harness()
    if not harness.is_file():
        _fail(f"{', '.join(BENCHMARK_FLAGS)} run the model benchmark's harness, "
              "benchmarks/_model_run.py of a fusedist checkout, which neither this "
              "installation nor the working directory has: run it from a checkout (python "
              "benchmarks/_model_run.py ...) or drop those flags")
    import importlib.util

    spec = importlib.util.spec_from_file_location("fusedist_model_run", harness)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main(argv)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if _uses_harness(argv, args):
        return _run_harness(argv)
    return run(prepare(args))


if __name__ == "__main__":
    sys.exit(main())
