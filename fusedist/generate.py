"""python -m fusedist.generate: generate tokens with a tensor-parallel Llama-family model (dense,
or a mixture of experts: Mixtral, Qwen2-MoE, Qwen3-MoE).

    python -m fusedist.generate                                  # GPU: Llama-3-8B shape, random
                                                                 # weights, beside plain torch;
                                                                 # CPU: the tiny config
    torchrun --nproc-per-node 2 -m fusedist.generate --device cpu   # TP 2 over gloo
    torchrun --nproc-per-node 8 -m fusedist.generate --model /ckpt/Meta-Llama-3-70B \\
        --prompt "The capital of France is" --max-new-tokens 64
    python -m fusedist.generate --config llama-3-8b --random-weights --batch 64 \\
        --context-fill 4000 --baseline torch,torch-compile --json
    python -m fusedist.generate --model /ckpt/Meta-Llama-3-8B --quantize fp8   # FP8 weights

Launched like every fusedist job (torchrun, mpirun, srun: fusedist.init()); --tp defaults to
the launcher's world size. --ep shards a mixture of experts' experts over that group (expert
parallelism; attention stays tensor-parallel): num_experts must divide by it. Progress goes to stderr on rank 0; results to stdout on rank 0
(one JSON object with --json).

Baselines run in the same process after fusedist, on the same weights: "torch" is the same
model in plain torch ops (F.linear, SDPA, F.rms_norm, torch.distributed), its decode step
captured into the same CUDA graphs; "torch-compile" is that model with the decode step's body
under torch.compile(fullgraph=True, dynamic=False) before capture (its prefill runs eagerly).
Timings per backend: prefill_ms, the median of --prefill-reps warm prefills of the prompts
(synchronized, apart from the generate loop); ms_per_token, the generate loop; step_ms, graph
replays back to back.

FP8 weights: an FP8 checkpoint (config.json's quantization_config: quant_method "fp8" with
128 x 128 block or per-tensor scales, or "compressed-tensors" float-quantized) is read as FP8;
--quantize fp8 quantizes a bf16 / fp16 / fp32 checkpoint (or random weights) at load, one scale
per output channel (fp8-tensor, fp8-block: the other layouts). The q/k/v/o, gate/up and down
projections are then e4m3 with float32 scales, in fusedist and in the baselines alike (the
report's "weights" says which format ran).

Input is checked before anything is allocated: the flags, config.json and the checkpoint's
tensors (shapes and dtypes from the safetensors headers), context + prompt + new tokens
against the model's positions, and an estimate of each rank's memory (weights, KV cache,
activations) against the device's free memory (the host's available memory on CPU); a mistake
there is one line on stderr and exit status 1. Exit status 1 also when a backend fails (on one
process the other backends still run and the report is printed; the failure, a CUDA-graph
capture that fell back to eager decode and a failed --profile included, goes to stderr).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import time

import torch

BASELINES = ("torch", "torch-compile")
QUANTIZE_CHOICES = ("fp8", "fp8-channel", "fp8-tensor", "fp8-block")   # models.llama.QUANTIZE
DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
          "fp16": torch.float16, "float32": torch.float32, "fp32": torch.float32}


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
    run.add_argument("--prefill-reps", type=int, default=3,
                     help="warm prefills timed for prefill_ms (their median)")
    out = p.add_argument_group("output")
    out.add_argument("--baseline",
                     help="also run these baselines, comma-separated: torch (plain torch ops), "
                     "torch-compile (the same, decode step under torch.compile), e.g. "
                     "torch,torch-compile; or none (default: torch for the embedded default "
                     "model, else none)")
    out.add_argument("--compile-backend", default="inductor",
                     help="torch.compile backend of the torch-compile baseline (default "
                     "inductor)")
    out.add_argument("--profile", action="store_true",
                     help="break one decode step and one prefill down into GEMM / attention / "
                     "communication / other kernel time")
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
                     ("prefill_reps", 1), ("prefill_graph_tokens", 0)):
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


def _defaults(args, cuda: bool):
    _check_flags(args)
    embedded = args.model is None and args.config is None
    if embedded:
        args.config = "llama-3-8b" if cuda else "tiny"
        args.random_weights = True
    if args.model is None and not args.random_weights:
        raise SystemExit("fusedist.generate: --config needs --random-weights (named configs ship "
                         "without weights); pass --model DIR for a checkpoint")
    if args.baseline is None:
        args.baseline = "torch" if embedded else "none"
    args.baselines = parse_baselines(args.baseline)
    if args.max_new_tokens is None:
        args.max_new_tokens = 128 if cuda else 32
    if args.prompt_len is None and args.prompt_ids is None and args.prompt is None and \
            args.chat is None:
        args.prompt_len = 128 if cuda else 16
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
    the budget; kv_fp8: one byte an element plus a float32 scale per token and kv head),
    "activations" (an estimate: the largest prefill chunk's hidden states, twice,
    and the logits) and "total". max_position (default seq_len) sizes the RoPE tables."""
    from .models.llama.weights import padded_vocab
    from .nn.attention import kv_heads_per_rank

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
    layer = 2 * h + ((q + 2 * kv) if cfg.qkv_bias else 0) + (2 * hd if cfg.qk_norm else 0)
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
    page_bytes = 2 * L * (kv + 4 * kv_heads if kv_fp8 else kv * elt) * page_size
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


def prefill_flops(cfg, prompt_lens, context: int) -> float:
    """Model FLOPs of prefilling these prompts (2 per multiply-add; causal attention counted
    over the cached context plus the prompt's own triangle; the LM head on one token each)."""
    h, L = cfg.hidden_size, cfg.num_layers
    per_tok = 2.0 * (L * (h * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * h) +
                     sum(cfg.mlp_params(i)[1] for i in range(L)))   # a token's routed experts
    total = 0.0
    for n in prompt_lens:
        attn = 4.0 * L * cfg.q_size * (n * context + n * (n + 1) / 2)
        total += per_tok * n + attn + 2.0 * cfg.vocab_size * h
    return total


def run_backend(backend, args, cfg, src, prompts, rt, dtype, device, prog, max_position):
    """One backend's run; on one process a failure is reported in the result (and a failed
    CUDA-graph run is retried eagerly) so the other backends still run."""
    if rt.world_size > 1:
        return _run_backend(backend, args, cfg, src, prompts, rt, dtype, device, prog,
                            max_position, None)
    import traceback
    try:
        return _run_backend(backend, args, cfg, src, prompts, rt, dtype, device, prog,
                            max_position, None)
    except Exception as e:  # noqa: BLE001 - reported in the JSON, the run goes on
        prog.close()
        print(f"[{backend}] failed: {traceback.format_exc()}", file=sys.stderr, flush=True)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if args.no_graphs or device.type != "cuda":
            return {"error": f"{type(e).__name__}: {e}"}
        try:
            out = _run_backend(backend, args, cfg, src, prompts, rt, dtype, device, prog,
                               max_position, False)
        except Exception as e2:  # noqa: BLE001
            print(f"[{backend}] eager retry failed: {traceback.format_exc()}", file=sys.stderr)
            return {"error": f"{type(e).__name__}: {e}", "eager_error": f"{e2}"}
        out["graph_error"] = f"{type(e).__name__}: {e}"
        return out


def _kv_dtype(args) -> "torch.dtype | None":
    """--kv-dtype: None (the model's dtype) or torch.float8_e4m3fn."""
    if getattr(args, "kv_dtype", "auto") != "fp8":
        return None
    from . import _dtypes
    if _dtypes.FP8 is None:
        _fail("--kv-dtype fp8 needs a torch with float8_e4m3fn")
    return _dtypes.FP8


def _round(d: dict) -> dict:
    return {k: (round(v, 1) if isinstance(v, float) else v) for k, v in d.items()}


def _run_backend(backend, args, cfg, src, prompts, rt, dtype, device, prog, max_position,
                 graphs):
    from statistics import median

    from .models import Runner, build_model

    compiled = backend == "torch-compile"
    longest = args.context_fill + max(len(p) for p in prompts) + args.max_new_tokens
    prog.note(f"[{backend}] building {cfg.name or 'model'} ({cfg.num_params() / 1e6:.1f} M params, "
              f"{dtype}, tp {rt.tp.size}) on {device}")
    t0 = time.perf_counter()
    model = build_model(cfg, src, backend="torch" if backend.startswith("torch") else backend,
                        group=rt.tp, dtype=dtype, device=device,
                        max_position=max_position, progress=prog.stage(f"[{backend}] loading"),
                        quantize=args.quantize, ep=args.ep and backend == "fusedist")
    load_s = time.perf_counter() - t0
    budget = None if args.kv_budget_gb is None else int(args.kv_budget_gb * 2**30)
    runner = Runner(model, max_batch=len(prompts), max_seq_len=longest, page_size=args.page_size,
                    kv_budget_bytes=budget,
                    cuda_graphs=False if args.no_graphs else graphs,
                    prefill_chunk=args.prefill_chunk, compile_decode=compiled,
                    compile_backend=args.compile_backend,
                    prefill_graph_tokens=args.prefill_graph_tokens,
                    kv_dtype=_kv_dtype(args) if backend == "fusedist" else None)
    sp = args.defaults.sampling(greedy=True if args.greedy else None,
                                temperature=args.temperature, top_k=args.top_k,
                                top_p=args.top_p, seed=args.seed)
    eos = () if args.ignore_eos or args.random_weights else args.defaults.eos_token_ids
    try:
        # Warm-up outside the timed run, at the timed run's shapes: graph capture (and the
        # decode step's compilation), and the first calls of cuBLAS / cuDNN SDPA / the
        # allocator at the prompt's length (a first 4K-token SDPA call plans for hundreds of
        # ms). Its prefill and (with 2 or more new tokens) one decode step fit the cache the
        # timed run needs, so every request that fits the model runs.
        prog.note(f"[{backend}] warm-up" + (" (compiling the decode step)" if compiled else ""))
        t0 = time.perf_counter()
        runner.generate(prompts, min(2, args.max_new_tokens), sp, context_fill=args.context_fill)
        warm_s = time.perf_counter() - t0
        prefill = runner.time_prefill(prompts, start=args.context_fill, reps=args.prefill_reps)
        streamed = backend == "fusedist" and args.stream_text is not None
        if streamed:
            res = _stream(runner, prompts, args.max_new_tokens, sp, eos, args.context_fill,
                          args.stream_text)
        else:
            res = runner.generate(prompts, args.max_new_tokens, sp, eos_ids=eos,
                                  context_fill=args.context_fill,
                                  progress=prog.stage(f"[{backend}] decoding"))
        prog.close()
        prefill_ms = median(prefill)
        flops = prefill_flops(cfg, [len(p) for p in prompts], args.context_fill)
        out = {"ids": res.ids, "load_s": round(load_s, 3), "warmup_s": round(warm_s, 3),
               "prefill_ms": round(prefill_ms, 3),
               "prefill_ms_reps": [round(t, 3) for t in prefill],
               "generate_prefill_ms": round(res.prefill_ms, 3),
               "ms_per_token": round(res.ms_per_step, 4),
               "tokens_per_s": round(res.tokens_per_s, 2),
               "decode_steps": res.steps, "cuda_graphs": bool(res.timings.get("graphs")),
               "streamed": streamed,
               "decode": "torch.compile" if compiled else "eager ops", "prefill": "eager",
               "prefill_tflops_per_gpu": round(flops / rt.tp.size / (prefill_ms / 1e3) / 1e12,
                                               2),
               "kv_cache_gib": round(runner.kv_bytes / 2**30, 3),
               "kv_dtype": str(getattr(runner, "kv_dtype", dtype)).replace("torch.", "")}
        if compiled:
            out["compile_s"] = round(runner.compile_s.get(res.timings["bucket"], 0.0), 1)
            out["compile_backend"] = args.compile_backend
        out["step_ms"] = round(runner.time_step(len(prompts)), 4)
        if backend != "fusedist":
            from .models.llama.baseline import decode_path_choices
            out["decode_attention"] = sorted({f"batch {k[0]}, cache {k[1]}: {v}"
                                              for k, v in decode_path_choices.items()})
        if args.profile:
            for key, what in (("profile_us", lambda: runner.profile_step(len(prompts))),
                              ("prefill_profile_us",
                               lambda: runner.profile_prefill(prompts, start=args.context_fill))):
                try:
                    out[key] = _round(what())
                except Exception as e:  # noqa: BLE001 - the timings stand without it
                    out[key.replace("_us", "_error")] = f"{type(e).__name__}: {e}"
        if getattr(model, "ep", False):
            out["ep"] = True
            model.close()   # the expert-parallel Buffers (collective)
    finally:
        del runner, model
        if compiled:
            torch._dynamo.reset()   # its compiled code holds the model's weights
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


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


def main(argv=None) -> int:
    args = parse_args(argv)
    import fusedist
    from .distributed.launch_env import detect_launch_env

    cuda = torch.cuda.is_available() if args.device is None else args.device == "cuda"
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("fusedist.generate: --device cuda but no GPU is visible; use --device cpu")
    args = _defaults(args, cuda)
    world = detect_launch_env().world_size
    tp = args.tp or world
    if world % tp:
        raise SystemExit(f"fusedist.generate: --tp {tp} does not divide the world size {world}")
    cfg, src, tok = _load(args, tp)
    args.defaults = _generation_defaults(args, cfg)
    prompts = _prompts(args, cfg, tok)
    longest = _check_positions(args, cfg, prompts)
    max_position = min(max(longest, 16), cfg.position_limit()[0])
    from .models.llm import resolve_dtype

    dtype = resolve_dtype(args.dtype, cfg, torch.device("cuda" if cuda else "cpu"))
    rt = fusedist.init(tp_size=tp, backend="nccl" if cuda else "gloo")
    # Every rank's verdict, so that all of them stop when one cannot hold the run.
    problem = _memory_problem(args, cfg, rt, dtype, prompts, longest, max_position)
    problem = next((p for p in rt.world.all_gather_object(problem) if p), None)
    if problem is not None:
        fusedist.shutdown()
        _fail(problem)
    rank0 = rt.rank == 0
    prog = Progress(rank0 and not args.quiet)
    # Every rank streams (its collectives), rank 0 prints: the first sequence's text.
    args.stream_text = None
    if tok is not None and not args.json:
        args.stream_text = _text_printer(tok) if rank0 else (lambda t: None)
    device = rt.device
    try:
        results = {"fusedist": run_backend("fusedist", args, cfg, src, prompts, rt, dtype,
                                           device, prog, max_position)}
        for name in args.baselines:
            results[name] = run_backend(name, args, cfg, src, prompts, rt, dtype, device, prog,
                                        max_position)
    finally:
        prog.close()
    if rank0:
        if args.stream_text is not None:
            print(flush=True)            # ends the streamed text's line
        report(args, cfg, rt, dtype, prompts, results, tok)
        # The report stands; a backend's failure is also an error line and exit status 1.
        for line in failures(results):
            print(f"fusedist.generate: {line}", file=sys.stderr, flush=True)
    fusedist.shutdown()
    return 1 if failures(results) else 0


def failures(results: dict) -> list[str]:
    """One line per failure the backends' results record (a failed run, a CUDA-graph decode
    that fell back to eager, a failed --profile); empty when every backend did all it was
    asked."""
    out = []
    for name, r in results.items():
        if "error" in r:
            out.append(f"{name} failed: {r['error']}" +
                       (f" (eager retry: {r['eager_error']})" if "eager_error" in r else ""))
        if "graph_error" in r:
            out.append(f"{name}: CUDA-graph decode failed, ran eagerly instead: "
                       f"{r['graph_error']}")
        for key in ("profile_error", "prefill_profile_error"):
            if key in r:
                out.append(f"{name}: --profile failed ({key}): {r[key]}")
    return out


def speedups(results: dict) -> dict:
    """{baseline: {"per_token", "per_step", "prefill": baseline time / fusedist time}} for every
    baseline that ran beside a fusedist run that did not fail."""
    fd = results.get("fusedist", {})
    out = {}
    if "error" in fd:
        return out
    for name, r in results.items():
        if name == "fusedist" or "error" in r:
            continue
        out[name] = {k: round(r[key] / fd[key], 3) for k, key in
                     (("per_token", "ms_per_token"), ("per_step", "step_ms"),
                      ("prefill", "prefill_ms"))}
    return out


def weight_format(quant, dtype) -> dict:
    """The report's "weights": the projections' format (FP8: dtype, scales, where from)."""
    if quant is None:
        return {"format": str(dtype).replace("torch.", "")}
    return quant.describe()


def report(args, cfg, rt, dtype, prompts, results, tok):
    fd = results["fusedist"]
    summary = {"model": args.model or args.config, "tp": rt.tp.size, "ep": args.ep,
               "world": rt.world_size,
               "device": str(rt.device.type), "dtype": str(dtype).replace("torch.", ""),
               "weights": weight_format(getattr(args, "quant", None), dtype),
               "batch": len(prompts), "prompt_len": len(prompts[0]), "prompt_ids": prompts[0],
               "context_fill": args.context_fill, "max_new_tokens": args.max_new_tokens,
               "baselines": list(args.baselines), "ids": fd.get("ids"),
               "timings": {k: {kk: vv for kk, vv in v.items() if kk != "ids"}
                           for k, v in results.items()}}
    if rt.device.type == "cuda":
        summary["gpu"] = torch.cuda.get_device_name(rt.device)
    if tok is not None and "ids" in fd:
        summary["text"] = [tok.decode(ids) for ids in fd["ids"]]
    sp = speedups(results)
    if sp:
        summary["speedups"] = sp
        summary["ids_match"] = {k: results[k]["ids"] == fd["ids"] for k in sp}
    if "torch" in sp:   # the plain-torch baseline's figures under their long-standing names
        summary["torch_ids_match"] = summary["ids_match"]["torch"]
        summary["speedup"] = sp["torch"]["per_token"]
        summary["step_speedup"] = sp["torch"]["per_step"]
    if args.json:
        print(json.dumps(summary), flush=True)
        return
    print(f"model {summary['model']} ({cfg.num_params() / 1e6:.1f} M params), tp {rt.tp.size}, "
          f"{summary['dtype']}, batch {len(prompts)}, prompt {len(prompts[0])} tokens"
          + (f" after {args.context_fill} cached" if args.context_fill else "")
          + f", {args.max_new_tokens} new")
    w = summary["weights"]
    if w["format"] == "fp8":
        print(f"weights: q/k/v/o, gate/up, down in FP8 (e4m3, {w['scales']} scales, "
              f"{w['source']})")
    if "text" in summary and not fd.get("streamed"):
        print(f"text: {summary['text'][0]!r}")
    elif "ids" in fd:
        print(f"ids[0]: {fd['ids'][0]}")
    cols = ("prefill ms", "ms/token", "step ms", "tokens/s", "prefill TFLOP/s/GPU")
    keys = ("prefill_ms", "ms_per_token", "step_ms", "tokens_per_s", "prefill_tflops_per_gpu")
    w = max(len(n) for n in results) + 2
    print(f"{'backend':<{w}}" + "".join(f"{c:>21}" for c in cols))
    for name, r in results.items():
        if "error" in r:
            print(f"{name:<{w}}failed: {r['error']}")
            continue
        print(f"{name:<{w}}" + "".join(f"{r[k]:>21}" for k in keys))
    print(f"prefill ms: the median of {args.prefill_reps} warm prefills of the prompts")
    if fd.get("streamed"):
        print("fusedist streamed its text: its ms/token includes reading each token back and "
              "decoding it (--json times the loop without)")
    if "compile_s" in results.get("torch-compile", {}):
        print(f"torch-compile: decode step under torch.compile ({args.compile_backend}; its "
              f"first, compiling call {results['torch-compile']['compile_s']} s), prefill eager")
    if sp and rt.device.type == "cpu":
        print("CPU: fusedist ran its reference path (plain torch, fp32 accumulation, gloo), which "
              "checks correctness, not speed; speed is measured on GPUs. Same ids as "
              + ", ".join(f"{k}: {v}" for k, v in summary["ids_match"].items()))
    for name, v in (sp.items() if rt.device.type != "cpu" else ()):
        print(f"speedup over {name}: {v['per_token']}x per token (generate loop), "
              f"{v['per_step']}x per step (graph replays), {v['prefill']}x prefill; same ids: "
              f"{summary['ids_match'][name]}")
    classes = ("gemm", "attention", "communication", "other", "total")
    for name, r in results.items():
        for key, what in (("profile_us", "decode step"), ("prefill_profile_us", "prefill")):
            if key in r:
                p = r[key]
                print(f"{name} {what}, kernel time (us): " +
                      ", ".join(f"{k} {p[k]}" for k in classes) +
                      (f"; {p['kernels']} kernels, {p['wall_us']} us wall (profiled)"
                       if key == "prefill_profile_us" else ""))


if __name__ == "__main__":
    sys.exit(main())
