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

import hashlib
import operator
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence, Union

import torch

from .. import _dtypes
from .._check import as_bool, as_int
from ..distributed import runtime
from ..errors import CollectiveMismatchError, RequestMismatchError
from .hf import GenerationDefaults, TextStream, Tokenizer, checkpoint_dtype, load_tokenizer
from .llama import LlamaConfig, build_model
from .llama.weights import QUANTIZE, check_tp, check_weights, open_weights, resolve_quant
from .runner import PREFILL_GRAPH_TOKENS, Runner

Prompt = Union[str, Sequence[int]]
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Short names accepted for dtype= (and python -m fusedist.generate --dtype).
DTYPE_ALIASES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
# The fixes an LLM's errors name (its Runner's messages speak of the LLM's arguments).
LLM_FIXES = {"max_seq_len": "build the LLM with a larger max_seq_len (fusedist.LLM(..., "
                            "max_seq_len=))",
             "max_batch": "pass max_batch >= the batch to fusedist.LLM(...), or split the "
                          "prompts into batches of at most {max_batch}",
             "closed": "build a new fusedist.LLM", "owner": "LLM"}


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


def resolve_dtype(dtype, cfg: LlamaConfig, device: torch.device,
                  where: str = "fusedist.LLM") -> torch.dtype:
    """dtype "auto": the checkpoint's torch_dtype on a GPU (bfloat16 when it names none or
    float32), float32 on a CPU (the reference path computes in float32). A torch.dtype or its
    name (float32, float16, bfloat16, or fp32, fp16, bf16) is taken as given."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"{where}: dtype must be float32, float16 or bfloat16, got {dtype}")
        return dtype
    if dtype == "auto":
        if device.type != "cuda":
            return torch.float32
        ck = checkpoint_dtype(cfg)
        return ck if ck in (torch.float16, torch.bfloat16) else torch.bfloat16
    name = DTYPE_ALIASES.get(dtype, dtype) if isinstance(dtype, str) else dtype
    if name not in DTYPES:
        raise ValueError(f"{where}: dtype must be 'auto', {', '.join(DTYPES)} (or "
                         f"{', '.join(DTYPE_ALIASES)}) or a torch.dtype, got {dtype!r}")
    return DTYPES[name]


def _token_ids(where: str, what: str, ids) -> list:
    """`ids` (a sequence of token ids: ints, numpy ints, a tensor or an array) as python ints;
    a TypeError naming `what` for anything else (bools and floats included)."""
    if hasattr(ids, "tolist") and not isinstance(ids, (list, tuple)):
        ids = ids.tolist()
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise TypeError(f"{where}: {what} must be a list of int token ids, got "
                        f"{type(ids).__name__} {ids!r:.60}")
    out = []
    for i, t in enumerate(ids):
        if isinstance(t, bool) or type(t).__name__ == "bool_":
            raise TypeError(f"{where}: {what}[{i}] is the bool {t!r}; token ids are ints")
        try:
            out.append(operator.index(t))
        except TypeError:
            kind = "a float" if isinstance(t, float) else type(t).__name__
            raise TypeError(f"{where}: {what}[{i}] is {t!r} ({kind}); token ids are ints "
                            "(int(t) if it is a whole number)") from None
    return out


def _is_id(t) -> bool:
    if isinstance(t, bool) or type(t).__name__ == "bool_":
        return False
    try:
        operator.index(t)
    except TypeError:
        return False
    return True


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
    tensor-parallel; num_experts must divide by the group's size).

    Every rank of the group builds its LLM with the same arguments: they are checked on every
    rank before anything is loaded, and a rank that refuses its own (or whose checkpoint
    cannot be read) stops every rank with an error naming it (CollectiveMismatchError on the
    others, listing each rank's values where they differ)."""

    def __init__(self, model: Optional[str] = None, *, config: Optional[str] = None,
                 random_weights: bool = False, weights_seed: int = 0, dtype="auto",
                 tp_size: Optional[int] = None, max_batch: int = 8,
                 max_seq_len: Optional[int] = None, page_size: int = 16,
                 cuda_graphs: Optional[bool] = None, quantize: str = "none",
                 prefill_graph_tokens: int = PREFILL_GRAPH_TOKENS,
                 kv_dtype: Optional[torch.dtype] = None, ep: bool = False):
        self.runner = None
        self.closed = False
        self._owns_runtime = not runtime.is_initialized()
        args = dict(model=model, config=config, random_weights=random_weights,
                    weights_seed=weights_seed, dtype=dtype, tp_size=tp_size,
                    max_batch=max_batch, max_seq_len=max_seq_len, page_size=page_size,
                    cuda_graphs=cuda_graphs, quantize=quantize,
                    prefill_graph_tokens=prefill_graph_tokens, kv_dtype=kv_dtype, ep=ep)
        own = None
        try:
            a = self._checked_args(**args)
        except (ValueError, TypeError) as e:
            own = e
        if self._owns_runtime:
            world = None
            if own is None and a["tp_size"] is None:
                from ..distributed.launch_env import detect_launch_env
                world = detect_launch_env().world_size
            try:
                # A rank that refused its arguments still meets the others, and stops them.
                runtime.init(tp_size=None if own is not None else a["tp_size"] or world,
                             rank_error=None if own is None else
                             f"fusedist.LLM: {type(own).__name__}: {own}")
            except CollectiveMismatchError as e:
                if own is not None:
                    raise own from e
                raise
        rt = runtime.get_runtime()
        self.device = rt.device
        try:
            self._build(rt, a if own is None else None, own)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _checked_args(model, config, random_weights, weights_seed, dtype, tp_size, max_batch,
                      max_seq_len, page_size, cuda_graphs, quantize, prefill_graph_tokens,
                      kv_dtype, ep=False) -> dict:
        """Every argument checked (a ValueError or TypeError naming it and the fix), as the
        values the LLM uses."""
        w = "fusedist.LLM"
        if (model is None) == (config is None):
            raise ValueError(f"{w}: pass exactly one of model (a checkpoint directory) and "
                             "config (a named shape, with random_weights=True)")
        for name, v in (("model", model), ("config", config)):
            if v is not None and not isinstance(v, (str, bytes)) and not hasattr(v, "__fspath__"):
                raise TypeError(f"{w}: {name} must be a path / name (str), got "
                                f"{type(v).__name__}")
        random_weights = as_bool(w, "random_weights", random_weights)
        if config is not None and not random_weights:
            raise ValueError(f"{w}: config=NAME ships without weights; pass "
                             "random_weights=True, or model=DIR for a checkpoint")
        if isinstance(dtype, str) or isinstance(dtype, torch.dtype):
            resolve_dtype(dtype if dtype != "auto" else torch.float32, None,
                          torch.device("cpu"), w)
        else:
            raise TypeError(f"{w}: dtype must be 'auto', a dtype name or a torch.dtype, got "
                            f"{dtype!r}")
        if quantize is not None and quantize != "none" and quantize not in QUANTIZE:
            raise ValueError(f"{w}: quantize must be 'none' or one of {', '.join(QUANTIZE)}, "
                             f"got {quantize!r}")
        if kv_dtype is not None and kv_dtype not in (_dtypes.FP8,) + tuple(DTYPES.values()):
            raise ValueError(f"{w}: kv_dtype must be None (the model's dtype) or "
                             f"torch.float8_e4m3fn, got {kv_dtype!r}")
        return dict(
            model=None if model is None else str(model), config=config,
            random_weights=random_weights,
            weights_seed=as_int(w, "weights_seed", weights_seed, 0),
            dtype=dtype,
            tp_size=None if tp_size is None else as_int(w, "tp_size", tp_size, 1),
            max_batch=as_int(w, "max_batch", max_batch, 1),
            max_seq_len=None if max_seq_len is None else as_int(w, "max_seq_len",
                                                                  max_seq_len, 1),
            page_size=as_int(w, "page_size", page_size, 1),
            cuda_graphs=as_bool(w, "cuda_graphs", cuda_graphs, allow_none=True),
            quantize=quantize,
            prefill_graph_tokens=as_int(w, "prefill_graph_tokens", prefill_graph_tokens, 0,
                                        what="an int >= 0 (0: no prefill graphs)"),
            kv_dtype=kv_dtype, ep=as_bool(w, "ep", ep))

    def _build(self, rt, a: Optional[dict], own: Optional[BaseException]) -> None:
        """Read the config and the checkpoint's headers, agree with every rank of the group
        that they hold the same (a rank that cannot read its own stops them all), then load
        and size the runner."""
        src = cfg = quant = None
        if own is None:
            try:
                cfg = LlamaConfig.from_dir(a["model"]) if a["model"] is not None else \
                    LlamaConfig.named(a["config"])
                src = open_weights(None if a["random_weights"] else a["model"], cfg,
                                   a["weights_seed"] if a["random_weights"] else None)
                quant = resolve_quant(cfg, a["quantize"], src)
                check_tp(cfg, rt.tp.size, quant, ep=a["ep"])
                check_weights(src, cfg, quant)
                self.dtype = resolve_dtype(a["dtype"], cfg, self.device)
                limit = cfg.position_limit()[0]
                if a["max_seq_len"] is not None and a["max_seq_len"] > limit:
                    raise ValueError(f"fusedist.LLM: max_seq_len={a['max_seq_len']} exceeds "
                                     f"{cfg.position_limit()[1]} of {cfg.name or 'the model'}; "
                                     f"pass max_seq_len <= {limit}")
                self.max_seq_len = min(limit, 4096) if a["max_seq_len"] is None else \
                    a["max_seq_len"]
                self.tokenizer: Optional[Tokenizer] = load_tokenizer(a["model"])
                self.defaults = GenerationDefaults.from_dir(a["model"], cfg.eos_token_ids)
            except (ValueError, TypeError, KeyError, OSError) as e:
                own = e
        self._agree(rt, "settings", None if own is not None else self._settings(a, cfg), own)
        self.cfg = cfg
        try:
            self.model = build_model(cfg, src, group=rt.tp, dtype=self.dtype,
                                     device=self.device, max_position=self.max_seq_len,
                                     quantize=a["quantize"], ep=a["ep"])
            self.runner = Runner(self.model, max_batch=a["max_batch"],
                                 max_seq_len=self.max_seq_len, page_size=a["page_size"],
                                 cuda_graphs=a["cuda_graphs"],
                                 prefill_graph_tokens=a["prefill_graph_tokens"],
                                 kv_dtype=a["kv_dtype"])
            self.runner.fixes = dict(LLM_FIXES)
        except (ValueError, TypeError, KeyError, OSError) as e:
            self._agree(rt, "load", None, e)
            raise
        self._agree(rt, "load", {"load": "ok"}, None)

    @staticmethod
    def _settings(a: dict, cfg: LlamaConfig) -> dict:
        """What every rank's LLM must agree on, as the mismatch message shows it: the model
        (its config, not its path: ranks on other nodes may mount it elsewhere) and the
        arguments that shape the model, the cache and the runs."""
        shape = repr(sorted((k, repr(v)) for k, v in vars(cfg).items() if k not in ("name",
                                                                                  "extra")))
        digest = hashlib.blake2b(shape.encode(), digest_size=6).hexdigest()
        return {"model": f"{cfg.name or 'model'} (config {digest})",
                "random_weights": repr(a["random_weights"]),
                "weights_seed": repr(a["weights_seed"]) if a["random_weights"] else "-",
                **{k: repr(a[k]) for k in ("dtype", "quantize", "max_batch", "max_seq_len",
                                           "page_size", "cuda_graphs", "prefill_graph_tokens",
                                           "kv_dtype", "ep")}}

    @staticmethod
    def _agree(rt, stage: str, fields: Optional[dict], own: Optional[BaseException]) -> None:
        """Every rank of the group at this point of the construction: raise `own` here, and on
        every other rank an error naming this rank's, when some rank failed; raise
        CollectiveMismatchError naming the differing fields when the ranks' fields differ."""
        mine = {"status": "ok"} if own is None else \
            {"status": f"failed: {type(own).__name__}: {own}"}
        try:
            rt.tp.check_same({**mine, **(fields or {})}, where="fusedist.LLM",
                             what="arguments" if stage == "settings" else "load results",
                             fix="Build the LLM with the same arguments on every rank of the "
                                 "group (and fix what a rank above reports)")
        except CollectiveMismatchError as e:
            if own is not None:
                raise own from e
            raise
        if own is not None:
            raise own

    # ---- prompts -------------------------------------------------------------------------
    def encode(self, text: str) -> list:
        return self._tok("encode").encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok("decode").decode(_token_ids("fusedist.LLM.decode", "ids", ids))

    def chat_prompt(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> list:
        """Prompt ids of chat `messages` through the checkpoint's chat template."""
        return self._tok("chat_prompt").chat(messages, add_generation_prompt)

    def _tok(self, where: str) -> Tokenizer:
        if self.tokenizer is None:
            raise ValueError(f"fusedist.LLM.{where}: this model has no tokenizer (no tokenizer "
                             "files in its directory); pass prompts as lists of token ids")
        return self.tokenizer

    def _ids(self, prompt, where: str, what: str) -> list:
        if isinstance(prompt, str):
            return self._tok(where).encode(prompt)
        ids = _token_ids(f"fusedist.LLM.{where}", what, prompt)
        if not ids:
            raise TypeError(f"fusedist.LLM.{where}: {what} is empty; a prompt is a str or a "
                            "non-empty list of int token ids")
        return ids

    def _batch(self, prompts, where: str) -> tuple:
        """(list of id lists, whether one prompt was given)."""
        w = f"fusedist.LLM.{where}"
        if isinstance(prompts, str) or hasattr(prompts, "tolist") and \
                getattr(prompts, "ndim", 1) == 1:
            return [self._ids(prompts, where, "prompt")], True
        if hasattr(prompts, "tolist") and not isinstance(prompts, (list, tuple)):
            prompts = prompts.tolist()           # a 2-D tensor / array: one prompt a row
        if _is_id(prompts) or isinstance(prompts, bool):
            raise TypeError(f"{w}: prompts must be a str, a list of token ids, or a non-empty "
                            f"list of those; got the single {type(prompts).__name__} "
                            f"{prompts!r} (pass [{prompts!r}] for a one-token prompt)")
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise TypeError(f"{w}: prompts must be a str, a list of token ids, or a non-empty "
                            f"list of those, got {prompts!r:.80}")
        if all(not isinstance(p, (str, list, tuple)) and not hasattr(p, "tolist")
               or (hasattr(p, "ndim") and p.ndim == 0) for p in prompts):
            return [self._ids(prompts, where, "prompt")], True     # one prompt of ids
        return [self._ids(p, where, f"prompts[{i}]") for i, p in enumerate(prompts)], False

    def _request(self, max_new_tokens, greedy, temperature, top_k, top_p, seed, eos_ids,
                 ignore_eos, where):
        w = f"fusedist.LLM.{where}"
        n = max_new_tokens if max_new_tokens is not None else \
            (self.defaults.max_new_tokens or 64)
        n = as_int(w, "max_new_tokens", n, 1)
        greedy = as_bool(w, "greedy", greedy, allow_none=True)
        ignore_eos = as_bool(w, "ignore_eos", ignore_eos)
        sp = self.defaults.sampling(greedy=greedy, temperature=temperature, top_k=top_k,
                                    top_p=top_p, seed=seed)
        eos = () if ignore_eos else (self.defaults.eos_token_ids if eos_ids is None
                                     else tuple(_token_ids(w, "eos_ids", eos_ids)))
        return n, sp, eos

    def _runner(self, where: str) -> Runner:
        """The runner; a closed LLM's closed runner, which tells the other ranks in the
        request's agreement, unless the runtime this LLM started is gone with it (then there
        is no one to tell)."""
        if self.runner is None or (self.closed and not runtime.is_initialized()):
            raise RuntimeError(f"fusedist.LLM.{where}: the LLM is closed (close() or the end of "
                               "its with-block released its model and cache); build a new "
                               "fusedist.LLM")
        return self.runner

    def _start(self, where: str, prompts, max_new_tokens, greedy, temperature, top_k, top_p,
               seed, eos_ids, ignore_eos):
        """The request converted and checked on every rank of the group (the runner's
        agreement: a rank whose request is invalid raises its own error, the others a
        RequestMismatchError naming it); returns (batch, one, eos, steps)."""
        runner = self._runner(where)
        got = {}

        def request():
            batch, got["one"] = self._batch(prompts, where)
            n, sp, eos = self._request(max_new_tokens, greedy, temperature, top_k, top_p,
                                       seed, eos_ids, ignore_eos, where)
            got["batch"], got["eos"] = batch, eos
            return batch, n, sp, eos, 0, 1

        steps = runner._start(f"fusedist.LLM.{where}", request, None)
        return got["batch"], got["one"], got["eos"], steps

    # ---- generation ----------------------------------------------------------------------
    def generate(self, prompts, max_new_tokens: Optional[int] = None, *,
                 greedy: Optional[bool] = None, temperature: Optional[float] = None,
                 top_k: Optional[int] = None, top_p: Optional[float] = None, seed: int = 0,
                 eos_ids: Optional[Sequence[int]] = None, ignore_eos: bool = False):
        """Completion of one prompt (a str or a list of ids), or a list of Completions of a
        list of prompts (of any lengths). Sampling: generation_config.json's defaults unless
        given (greedy=True forces argmax); eos_ids default: generation_config.json's."""
        batch, one, eos, steps = self._start("generate", prompts, max_new_tokens, greedy,
                                             temperature, top_k, top_p, seed, eos_ids,
                                             ignore_eos)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                res = done.value
                break
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
        checked here, before the first token. One request at a time: while a stream is open
        (not exhausted, not closed), generate() and stream() raise."""
        batch, one, eos, steps = self._start("stream", prompts, max_new_tokens, greedy,
                                             temperature, top_k, top_p, seed, eos_ids,
                                             ignore_eos)
        return self._stream(batch, one, self.runner._stream_ids(steps, set(eos)))

    def _stream(self, batch, one, ids):
        texts = [TextStream(self.tokenizer) if self.tokenizer is not None else None
                 for _ in batch]
        try:
            for step in ids:
                toks = [None if t is None else
                        Token(t, texts[i].push(t) if texts[i] is not None else "")
                        for i, t in enumerate(step)]
                if not one:
                    yield toks
                elif toks[0] is not None:
                    yield toks[0]
        finally:
            ids.close()

    def _completion(self, prompt_ids, ids, eos) -> Completion:
        reason = "eos" if ids and ids[-1] in set(eos) else "length"
        text = self.tokenizer.decode(ids) if self.tokenizer is not None else None
        return Completion(ids=list(ids), text=text, prompt_ids=list(prompt_ids),
                          finish_reason=reason)

    # ---- lifetime -------------------------------------------------------------------------
    def close(self) -> None:
        """Release the runner (graphs, KV cache), the model and its expert-parallel Buffers
        (ep); shut fusedist down if this LLM started it. generate() and stream() raise
        afterwards; close() again does nothing."""
        runner = getattr(self, "runner", None)
        if runner is not None:
            runner.close()
            runner.model = None            # the weights go; the closed runner stays to say so
        model = getattr(self, "model", None)
        if getattr(model, "ep", False):
            model.close()
        self.model = None
        self.closed = True
        if self._owns_runtime and runtime.is_initialized():
            self._owns_runtime = False
            runtime.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
