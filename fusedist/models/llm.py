"""fusedist.LLM: a Llama-family model on this rank's tensor-parallel group, loaded from a
Hugging Face checkpoint directory or a named shape, with generate() (ids and text) and stream()
(tokens as they decode).

    llm = fusedist.LLM("/ckpt/Qwen2-0.5B-Instruct")          # fusedist.init() if needed
    out = llm.generate("The capital of France is", max_new_tokens=16)
    print(out.text, out.ids)
    for tok in llm.stream(llm.chat_prompt([{"role": "user", "content": "Hi"}])):
        print(tok.text, end="", flush=True)
    llm.close()

Run it the same way on every rank (torchrun / mpirun / srun, one process per GPU, or gloo on
a CPU): every rank loads its shard, every rank makes the same calls with the same arguments
(a request that differs between ranks raises RequestMismatchError), and every rank gets the
same ids and text back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional, Sequence, Union

import torch

from ..distributed import runtime
from .hf import GenerationDefaults, TextStream, Tokenizer, checkpoint_dtype, load_tokenizer
from .llama import LlamaConfig, build_model
from .llama.weights import check_tp, check_weights, open_weights, resolve_quant
from .runner import PREFILL_GRAPH_TOKENS, Runner

Prompt = Union[str, Sequence[int]]
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class Completion:
    ids: list               # generated ids (up to and including an EOS)
    text: Optional[str]     # their text (None without a tokenizer)
    prompt_ids: list
    finish_reason: str      # "eos" or "length"


@dataclass
class Token:
    id: int
    text: str               # the text this token completes ("" inside a multi-byte character,
    #                         or without a tokenizer)


def resolve_dtype(dtype, cfg: LlamaConfig, device: torch.device) -> torch.dtype:
    """dtype "auto": the checkpoint's torch_dtype on a GPU (bfloat16 when it names none or
    float32), float32 on a CPU (the reference path computes in float32). A torch.dtype or its
    name is taken as given."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"fusedist.LLM: dtype must be float32, float16 or bfloat16, got "
                             f"{dtype}")
        return dtype
    if dtype == "auto":
        if device.type != "cuda":
            return torch.float32
        ck = checkpoint_dtype(cfg)
        return ck if ck in (torch.float16, torch.bfloat16) else torch.bfloat16
    if dtype not in DTYPES:
        raise ValueError(f"fusedist.LLM: dtype must be 'auto', {', '.join(DTYPES)} or a "
                         f"torch.dtype, got {dtype!r}")
    return DTYPES[dtype]


class LLM:
    """model: a Hugging Face checkpoint directory; or config=NAME (a shipped shape:
    llama-3-8b, tiny, ...) with random_weights=True. tp_size: used when this call initializes
    fusedist (default: the world size); with fusedist already initialized the runtime's tp
    group is used. max_batch / max_seq_len size the KV cache (max_seq_len default: the model's
    positions, at most 4096). generation_config.json in the directory gives the EOS ids and
    the default sampling; generate() and stream() override them per call.
    prefill_graph_tokens: Runner's (prompts of up to that many tokens prefill through CUDA
    graphs; default 512, 0 prefills eagerly). kv_dtype: Runner's (torch.float8_e4m3fn for an
    e4m3 KV cache with per-token-head scales; default the model's dtype). ep=True: a mixture
    of experts' experts sharded over the tp group (expert parallelism; attention stays
    tensor-parallel; num_experts must divide by the group's size)."""

    def __init__(self, model: Optional[str] = None, *, config: Optional[str] = None,
                 random_weights: bool = False, weights_seed: int = 0, dtype="auto",
                 tp_size: Optional[int] = None, max_batch: int = 8,
                 max_seq_len: Optional[int] = None, page_size: int = 16,
                 cuda_graphs: Optional[bool] = None, quantize: str = "none",
                 prefill_graph_tokens: int = PREFILL_GRAPH_TOKENS,
                 kv_dtype: Optional[torch.dtype] = None, ep: bool = False):
        if (model is None) == (config is None):
            raise ValueError("fusedist.LLM: pass exactly one of model (a checkpoint directory) "
                             "and config (a named shape, with random_weights=True)")
        if config is not None and not random_weights:
            raise ValueError("fusedist.LLM: config=NAME ships without weights; pass "
                             "random_weights=True, or model=DIR for a checkpoint")
        self._owns_runtime = not runtime.is_initialized()
        if self._owns_runtime:
            world = None
            if tp_size is None:
                from ..distributed.launch_env import detect_launch_env
                world = detect_launch_env().world_size
            runtime.init(tp_size=tp_size or world)
        rt = runtime.get_runtime()
        self.device = rt.device
        try:
            cfg = LlamaConfig.from_dir(model) if model is not None else LlamaConfig.named(config)
            src = open_weights(None if random_weights else model, cfg,
                               weights_seed if random_weights else None)
            quant = resolve_quant(cfg, quantize, src)
            check_tp(cfg, rt.tp.size, quant, ep=ep)
            check_weights(src, cfg, quant)
            self.cfg = cfg
            self.dtype = resolve_dtype(dtype, cfg, self.device)
            self.tokenizer: Optional[Tokenizer] = load_tokenizer(model)
            self.defaults = GenerationDefaults.from_dir(model, cfg.eos_token_ids)
            limit = cfg.position_limit()[0]
            self.max_seq_len = min(limit, 4096) if max_seq_len is None else max_seq_len
            self.model = build_model(cfg, src, group=rt.tp, dtype=self.dtype,
                                     device=self.device, max_position=self.max_seq_len,
                                     quantize=quantize, ep=ep)
            self.runner = Runner(self.model, max_batch=max_batch, max_seq_len=self.max_seq_len,
                                 page_size=page_size, cuda_graphs=cuda_graphs,
                                 prefill_graph_tokens=prefill_graph_tokens,
                                 kv_dtype=kv_dtype)
        except BaseException:
            if self._owns_runtime:
                runtime.shutdown()
            raise

    # ---- prompts -------------------------------------------------------------------------
    def encode(self, text: str) -> list:
        return self._tok("encode").encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok("decode").decode(ids)

    def chat_prompt(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> list:
        """Prompt ids of chat `messages` through the checkpoint's chat template."""
        return self._tok("chat_prompt").chat(messages, add_generation_prompt)

    def _tok(self, where: str) -> Tokenizer:
        if self.tokenizer is None:
            raise ValueError(f"fusedist.LLM.{where}: this model has no tokenizer (no tokenizer "
                             "files in its directory); pass prompts as lists of token ids")
        return self.tokenizer

    def _ids(self, prompt, where: str) -> list:
        if isinstance(prompt, str):
            return self._tok(where).encode(prompt)
        if isinstance(prompt, torch.Tensor):
            prompt = prompt.tolist()
        ids = list(prompt)
        if not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise TypeError(f"fusedist.LLM.{where}: a prompt is a str or a non-empty list of "
                            f"int token ids, got {prompt!r:.80}")
        return ids

    def _batch(self, prompts, where: str) -> tuple:
        """(list of id lists, whether one prompt was given)."""
        one = isinstance(prompts, (str, torch.Tensor)) or (
            isinstance(prompts, (list, tuple)) and bool(prompts) and
            all(isinstance(t, int) and not isinstance(t, bool) for t in prompts))
        if one:
            return [self._ids(prompts, where)], True
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise TypeError(f"fusedist.LLM.{where}: prompts must be a str, a list of token ids, "
                            f"or a non-empty list of those, got {prompts!r:.80}")
        return [self._ids(p, where) for p in prompts], False

    def _request(self, max_new_tokens, greedy, temperature, top_k, top_p, seed, eos_ids,
                 ignore_eos):
        n = max_new_tokens if max_new_tokens is not None else \
            (self.defaults.max_new_tokens or 64)
        sp = self.defaults.sampling(greedy=greedy, temperature=temperature, top_k=top_k,
                                    top_p=top_p, seed=seed)
        eos = () if ignore_eos else (self.defaults.eos_token_ids if eos_ids is None
                                     else tuple(eos_ids))
        return n, sp, eos

    # ---- generation ----------------------------------------------------------------------
    def generate(self, prompts, max_new_tokens: Optional[int] = None, *,
                 greedy: Optional[bool] = None, temperature: Optional[float] = None,
                 top_k: Optional[int] = None, top_p: Optional[float] = None, seed: int = 0,
                 eos_ids: Optional[Sequence[int]] = None, ignore_eos: bool = False):
        """Completion of one prompt (a str or a list of ids), or a list of Completions of a
        list of prompts (of any lengths). Sampling: generation_config.json's defaults unless
        given (greedy=True forces argmax); eos_ids default: generation_config.json's."""
        batch, one = self._batch(prompts, "generate")
        n, sp, eos = self._request(max_new_tokens, greedy, temperature, top_k, top_p, seed,
                                   eos_ids, ignore_eos)
        res = self.runner.generate(batch, n, sp, eos_ids=eos)
        outs = [self._completion(p, ids, eos) for p, ids in zip(batch, res.ids)]
        return outs[0] if one else outs

    def stream(self, prompts, max_new_tokens: Optional[int] = None, *,
               greedy: Optional[bool] = None, temperature: Optional[float] = None,
               top_k: Optional[int] = None, top_p: Optional[float] = None, seed: int = 0,
               eos_ids: Optional[Sequence[int]] = None,
               ignore_eos: bool = False) -> Iterator:
        """generate() as it decodes: for one prompt, yields a Token per generated id; for a
        list of prompts, yields per step a list with a Token per prompt (None once that
        prompt has ended). The ids are generate()'s for the same arguments. Arguments are
        checked here, before the first token."""
        batch, one = self._batch(prompts, "stream")
        n, sp, eos = self._request(max_new_tokens, greedy, temperature, top_k, top_p, seed,
                                   eos_ids, ignore_eos)
        return self._stream(batch, one, n, sp, eos)

    def _stream(self, batch, one, n, sp, eos):
        texts = [TextStream(self.tokenizer) if self.tokenizer is not None else None
                 for _ in batch]
        for step in self.runner.stream(batch, n, sp, eos_ids=eos):
            toks = [None if t is None else
                    Token(t, texts[i].push(t) if texts[i] is not None else "")
                    for i, t in enumerate(step)]
            if not one:
                yield toks
            elif toks[0] is not None:
                yield toks[0]

    def _completion(self, prompt_ids, ids, eos) -> Completion:
        reason = "eos" if ids and ids[-1] in set(eos) else "length"
        text = self.tokenizer.decode(ids) if self.tokenizer is not None else None
        return Completion(ids=list(ids), text=text, prompt_ids=list(prompt_ids),
                          finish_reason=reason)

    # ---- lifetime -------------------------------------------------------------------------
    def close(self) -> None:
        """Release the runner (graphs, KV cache) and the expert-parallel Buffers (ep); shut
        fusedist down if this LLM started it."""
        runner = getattr(self, "runner", None)
        if runner is not None:
            runner.close()
            self.runner = None
        model = getattr(self, "model", None)
        if getattr(model, "ep", False):
            model.close()
        if self._owns_runtime and runtime.is_initialized():
            self._owns_runtime = False
            runtime.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
