"""Continuous batching: requests join and finish at any step, over one Runner's KV cache.

    engine = Engine.from_llm(llm, max_seqs=64, max_num_batched_tokens=2048)
    engine.add_request("r1", prompt_ids, GenerationParams(max_tokens=64, temperature=0.7))
    while engine.has_work():
        for out in engine.step():            # RequestOutputs: each choice's new ids and text
            ...
    results = engine.generate([ids_a, ids_b], GenerationParams(max_tokens=32))   # or at once

A step (step()) schedules, runs one forward and samples:

1. Scheduling, deterministic from the engine's state (every rank of a tensor-parallel group
   that applies the same requests in the same order takes the same decisions). The running
   sequences go first, in admission order: one token for a sequence that decodes, a chunk of
   its prompt for one that prefills (at most the token budget max_num_batched_tokens, less one
   token kept for each decode behind it). Each needs KV pages for its new tokens; when the
   pool has none, the most recently admitted running sequence is preempted (its pages
   released, its prompt and output recomputed when it is admitted again; its sampling resumes
   at the same step, so a seeded output is unchanged), itself when it is the last. Then,
   when nothing was preempted, waiting sequences are admitted in arrival order while seats
   (max_seqs), budget and pages last: first their prompt's leading full pages are looked up in
   the prefix cache (prefix_cache.py) and taken as they are, the rest is prefilled. A request
   whose prompt and max_tokens could not fit the whole pool is refused at add_request, so
   every admitted request finishes: lack of pages only ever delays.
2. The forward. A step whose sequences all take one token is a decode step: their page
   tables, lengths and tokens are written into the Runner's static buffers and the decode
   CUDA graph of the batch-size bucket replays (Runner.decode_step; padding rows point at a
   scratch page outside the pool). A step with prefill chunks is one varlen prefill-mode
   forward over every sequence's tokens (a decoding sequence is a one-token chunk behind its
   cache): through the Runner's prefill CUDA graphs when it has them and the tokens fit
   (sequences padded to a power of two with one-token rows on the scratch page), eagerly
   otherwise. Pages a sequence shares but must write into (the partial last page the n > 1
   choices of a prompt share; a cached page whose last token a fully cached prompt recomputes
   for its logits) are copied first (copy on write).
3. Sampling per row (sampler.py: each request's own parameters and seeded noise), then per
   choice: incremental detokenization and stop strings (detokenize.py), EOS / stop ids,
   max_tokens. A request with n > 1 prefills its prompt once and forks into n choices at its
   first token, the choices holding the prompt's pages together.

Full pages are registered in the prefix cache as soon as their KV is written (generated
tokens too, so a later turn of a conversation hits the earlier one's pages); finished
requests release their pages, which stay findable until evicted (LRU).

Threads: add_request / abort may be called from any thread (they queue an event under a
lock; step() applies the queued events first). At TP > 1 every rank must apply the same events
in the same order: the same add_request / abort calls between the same steps (Engine.generate
on every rank), or async_engine.AsyncEngine, whose leader broadcasts them.
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import torch

from ..nn.attention import AttentionMetadata
from .detokenize import IncrementalDetokenizer, TextAssembler
from .prefix_cache import PagePool, page_hashes
from .runner import PREFILL_GRAPH_TOKENS, Runner
from .runner import buckets_for as _buckets
from .sampler import GenerationParams, ParamError, SampleRow, sample_rows_async, to_device


class QueueFull(RuntimeError):
    """The engine's queue of requests not yet admitted is at its bound (max_waiting)."""


# ---- outputs -----------------------------------------------------------------------------
@dataclass
class ChoiceOutput:
    index: int
    ids: list                       # new ids (a step's output) or all of them (a result)
    text: str                       # the text they add
    logprobs: Optional[list] = None  # per id: (logprob, [(id, logprob), ...top N])
    finish_reason: Optional[str] = None   # "stop", "length" or "abort" once it ended
    stop_reason: Union[int, str, None] = None   # the stop id or string that ended it


@dataclass
class RequestOutput:
    request_id: str
    choices: list                   # ChoiceOutputs of the choices that changed (a step) or
    #                                 of every choice (a result)
    finished: bool
    prompt_ids: list
    cached_tokens: int = 0          # prompt tokens found in the prefix cache
    ttft_s: Optional[float] = None  # arrival to first token (on the finishing output)

    def merge(self, later: "RequestOutput") -> None:
        """Fold a later step's output of the same request into this one."""
        by_index = {c.index: c for c in self.choices}
        for c in later.choices:
            mine = by_index.get(c.index)
            if mine is None:
                mine = ChoiceOutput(c.index, [], "", [] if c.logprobs is not None else None)
                self.choices.append(mine)
                by_index[c.index] = mine
            mine.ids += c.ids
            mine.text += c.text
            if c.logprobs is not None:
                mine.logprobs = (mine.logprobs or []) + c.logprobs
            mine.finish_reason = c.finish_reason or mine.finish_reason
            mine.stop_reason = c.stop_reason if c.stop_reason is not None else mine.stop_reason
        self.choices.sort(key=lambda c: c.index)
        self.finished = later.finished
        self.cached_tokens = later.cached_tokens
        self.ttft_s = later.ttft_s if later.ttft_s is not None else self.ttft_s


# ---- statistics ---------------------------------------------------------------------------
class Histogram:
    """Cumulative-bucket histogram (Prometheus' shape)."""

    def __init__(self, bounds: Sequence[float]):
        self.bounds = list(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, v)] += 1
        self.sum += v
        self.count += 1


def _latency_buckets() -> list:
    return [0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0,
            2.5, 5.0, 10.0, 30.0, 60.0]


@dataclass
class EngineStats:
    steps: int = 0
    decode_steps: int = 0
    prompt_tokens: int = 0          # prompt tokens of admitted requests
    generation_tokens: int = 0
    preemptions: int = 0
    overlapped_steps: int = 0       # decode steps launched before the previous one's tokens
    overlap_dropped: int = 0        # their rows of sequences that had ended (tokens dropped)
    requests_added: int = 0
    finished: dict = field(default_factory=dict)     # finish reason -> requests
    ttft: Histogram = field(default_factory=lambda: Histogram(_latency_buckets()))
    itl: Histogram = field(default_factory=lambda: Histogram(_latency_buckets()))
    e2e: Histogram = field(default_factory=lambda: Histogram(_latency_buckets()))


# ---- state ---------------------------------------------------------------------------------
class _Request:
    def __init__(self, rid, prompt, params, seed, eos_ids, arrival):
        self.id, self.prompt, self.params, self.seed = rid, prompt, params, seed
        self.eos_ids = eos_ids
        self.arrival = arrival
        self.seqs: list = []
        self.first_token_at: Optional[float] = None
        self.cached_tokens = 0
        self.admitted = False
        self.done = 0                       # finished choices


class _Seq:
    """One choice of a request (before an n > 1 request forks: its prompt, seats n)."""

    def __init__(self, req: _Request, choice: int, detok):
        self.req, self.choice = req, choice
        self.ids = list(req.prompt)         # prompt + output
        self.output: list = []
        self.pages: list = []
        self.hashes: list = []              # hash chain of the full pages of ids
        self.registered = 0                 # leading pages registered in the prefix cache
        self.computed = 0                   # tokens whose KV is in the pages
        self.forked = req.params.n == 1
        self.row = -1                       # row of the engine's host block table
        self.order = 0                      # admission order (preemption takes the latest)
        self.detok = detok
        self.text = TextAssembler(req.params.stop, req.params.include_stop_str_in_output)
        self.finish_reason: Optional[str] = None
        self.stop_reason = None
        self.last_token_at: Optional[float] = None

    @property
    def seats(self) -> int:
        return 1 if self.forked else self.req.params.n


class _Step:
    """A forward whose sampling is queued: its sequences, the choices that sample (owners,
    one per row of sampled.ids), and whether it decoded one token of each sequence."""

    def __init__(self, seqs: list, owners: list, sampled, decode: bool):
        self.seqs, self.owners, self.sampled, self.decode = seqs, owners, sampled, decode


class Engine:
    """Continuous batching over a fusedist model (the module docstring). model: a
    fusedist.models Transformer (the fusedist backend: a paged KV cache); tokenizer: a
    fusedist.models.hf.Tokenizer (None: ids only, no text or stop strings); defaults: a
    fusedist.models.hf.GenerationDefaults (EOS ids, default parameters).

    max_seqs: sequences decoded together (choices count one each); max_model_len: prompt +
    new tokens of one sequence (default the model's positions); max_num_batched_tokens: the
    token budget of a step (>= max_seqs); kv_budget_bytes / num_pages: the KV pool (default:
    max_seqs x max_model_len tokens, or num_pages pages (the cache then holds num_pages + 1:
    the scratch page)); prefix_caching: keep and reuse full pages by their tokens' hash chain;
    max_waiting: the bound on requests not yet admitted (add_request raises QueueFull past
    it; None: unbounded). cuda_graphs, prefill_graph_tokens, kv_dtype: the Runner's.
    overlap: launch each decode step from the sampled ids on the device before the host hands
    out the previous step's tokens (the same outputs; None: on for GPUs, off on the CPU)."""

    def __init__(self, model, tokenizer=None, defaults=None, *, max_seqs: int = 8,
                 max_model_len: Optional[int] = None, max_num_batched_tokens: int = 2048,
                 page_size: int = 16, kv_budget_bytes: Optional[int] = None,
                 num_pages: Optional[int] = None, prefix_caching: bool = True,
                 max_waiting: Optional[int] = None, cuda_graphs: Optional[bool] = None,
                 prefill_graph_tokens: int = PREFILL_GRAPH_TOKENS,
                 kv_dtype: Optional[torch.dtype] = None, overlap: Optional[bool] = None):
        where = "fusedist.models.Engine"
        if overlap is not None and not isinstance(overlap, bool):
            raise ValueError(f"{where}: overlap must be None (on for GPUs), True or False, got "
                             f"{overlap!r}")
        if getattr(model, "backend", "fusedist") != "fusedist":
            raise ValueError(f"{where}: the model's backend is {model.backend!r}; continuous "
                             "batching needs the paged KV cache of the fusedist backend")
        for name, v, low in (("max_seqs", max_seqs, 1), ("page_size", page_size, 1),
                             ("max_num_batched_tokens", max_num_batched_tokens, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"{where}: {name} must be an int >= {low}, got {v!r}")
        if max_num_batched_tokens < max_seqs:
            raise ValueError(f"{where}: max_num_batched_tokens={max_num_batched_tokens} is "
                             f"below max_seqs={max_seqs}; a step must fit one token of every "
                             "running sequence")
        if max_waiting is not None and (isinstance(max_waiting, bool) or
                                        not isinstance(max_waiting, int) or max_waiting < 1):
            raise ValueError(f"{where}: max_waiting must be None or an int >= 1, got "
                             f"{max_waiting!r}")
        limit = getattr(model, "max_position", None)
        if max_model_len is None:
            max_model_len = limit if limit is not None else 4096
        if num_pages is not None and kv_budget_bytes is None and \
                isinstance(num_pages, int) and num_pages > 0:
            # a pool larger than the Runner's static rows: size the cache by the pages
            static = len(_buckets(max_seqs)) and _buckets(max_seqs)[-1] * \
                -(-max_model_len // page_size)
            if num_pages + 1 > static:
                kv_budget_bytes = (num_pages + 1) * page_size * model.kv_bytes_per_token(
                    kv_dtype if kv_dtype is not None else getattr(model, "dtype", None))
        self.runner = Runner(model, max_batch=max_seqs, max_seq_len=max_model_len,
                             page_size=page_size, kv_budget_bytes=kv_budget_bytes,
                             cuda_graphs=cuda_graphs, prefill_graph_tokens=prefill_graph_tokens,
                             kv_dtype=kv_dtype)
        r = self.runner
        self.model, self.device = model, r.device
        self.tokenizer, self.defaults = tokenizer, defaults
        self.eos_ids = tuple(defaults.eos_token_ids) if defaults is not None else ()
        self.vocab = model.cfg.vocab_size
        self.max_seqs, self.page_size = max_seqs, page_size
        self.max_model_len = max_model_len
        self.budget = max_num_batched_tokens
        self.max_waiting = max_waiting
        # The last page of the cache is the padding rows' scratch page; the pool is the rest.
        self.scratch = r.num_pages - 1
        usable = r.num_pages - 1
        if num_pages is not None:
            if isinstance(num_pages, bool) or not isinstance(num_pages, int) or \
                    not 1 <= num_pages <= usable:
                raise ValueError(f"{where}: num_pages must be an int in [1, {usable}] (the "
                                 f"cache's pages less the scratch page), got {num_pages!r}")
            usable = num_pages
        if usable < 1:
            raise ValueError(f"{where}: the KV cache has {r.num_pages} page(s); it needs one "
                             "for the scratch page and at least one more")
        self.pool = PagePool(range(usable), page_size, prefix_caching)
        # Host copy of every running sequence's page table: one row each (a free-list of rows).
        self.table = torch.full((r.max_rows, r.pages_per_seq), self.scratch, dtype=torch.int32)
        self._free_rows = list(range(r.max_rows - 1, -1, -1))
        self.requests: dict = {}            # id -> _Request (live)
        self.running: list = []             # _Seqs, admission order
        self.waiting: list = []             # _Seqs, arrival order (preempted ones first)
        self.stats = EngineStats()
        self._order = itertools.count()
        self._lock = threading.Lock()
        self._inbox: list = []              # events not applied yet
        self._queued: set = set()           # request ids added, not admitted yet
        self._copies: list = []             # (src, dst) pages to copy before the forward
        # On a GPU the launched-ahead step hides the host's work (benchmarks/serve.py "step" vs
        # "step_overlap"); on the CPU the forward runs on the host itself, nothing to hide.
        self.overlap = overlap if overlap is not None else self.device.type == "cuda"
        self._ahead: Optional[_Step] = None  # a launched step whose tokens are not out yet
        self._capture()

    @classmethod
    def from_llm(cls, llm, **kw) -> "Engine":
        """An engine over an LLM's model, tokenizer and generation_config.json defaults, with
        its own KV cache (the LLM's runner keeps its own for LLM.generate). max_model_len
        defaults to the LLM's max_seq_len (the model's positions)."""
        kw.setdefault("max_model_len", llm.max_seq_len)
        return cls(llm.model, llm.tokenizer, llm.defaults, **kw)

    # ---- lifetime ------------------------------------------------------------------------
    def close(self) -> None:
        self.runner.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _capture(self) -> None:
        """Capture every decode bucket now, over the scratch page (a capture's warm-up steps
        write the cache slot of each row: none may be a live sequence's)."""
        r = self.runner
        if not r.cuda_graphs:
            return
        r.bt.fill_(self.scratch)
        r.block_table_host.fill_(self.scratch)
        r.seq_lens.fill_(1)
        r.tokens.zero_()
        for b in r.buckets:
            r.capture(b)

    # ---- requests ------------------------------------------------------------------------
    def default_params(self, prompt_len: int = 0, **overrides) -> GenerationParams:
        """GenerationParams from generation_config.json (the defaults; GenerationDefaults.params)
        and `overrides` (None values left to the defaults)."""
        if self.defaults is not None and hasattr(self.defaults, "params"):
            return self.defaults.params(prompt_len, **overrides)
        return GenerationParams(**{k: v for k, v in overrides.items() if v is not None})

    def check_request(self, prompt_ids: Sequence[int], params: GenerationParams) -> list:
        """The prompt as a list of ints, or a ParamError naming what is wrong."""
        if not isinstance(params, GenerationParams):
            raise TypeError(f"Engine: params must be a GenerationParams, got "
                            f"{type(params).__name__}")
        if isinstance(prompt_ids, torch.Tensor):
            prompt_ids = prompt_ids.tolist()
        if isinstance(prompt_ids, (str, bytes)):
            raise ParamError("prompt", "the prompt must be token ids here; encode text first")
        try:
            ids = [int(t) for t in prompt_ids]
        except (TypeError, ValueError):
            raise ParamError("prompt", f"the prompt must be a list of int token ids, got "
                                       f"{prompt_ids!r:.80}") from None
        if not ids:
            raise ParamError("prompt", "the prompt is empty; give at least one token")
        bad = next((t for t in ids if not 0 <= t < self.vocab), None)
        if bad is not None:
            raise ParamError("prompt", f"token id {bad} is outside the vocabulary [0, "
                                       f"{self.vocab})")
        total = len(ids) + params.max_tokens
        if len(ids) >= self.max_model_len:
            raise ParamError("prompt", f"the prompt has {len(ids)} tokens; the model's context "
                                       f"is {self.max_model_len} (prompt + new tokens)")
        if total > self.max_model_len:
            raise ParamError("max_tokens", f"{len(ids)} prompt tokens + max_tokens "
                                           f"{params.max_tokens} = {total} exceed the model's "
                                           f"context of {self.max_model_len}; lower max_tokens "
                                           f"to <= {self.max_model_len - len(ids)}")
        # one choice alone, its copy-on-write page included, must fit the pool
        need = -(-total // self.page_size) + 1
        if need > self.pool.total:
            raise ParamError("max_tokens", f"{total} tokens need {need} KV pages of "
                                           f"{self.page_size}; the engine has {self.pool.total}")
        if params.n > self.max_seqs:
            raise ParamError("n", f"n={params.n} choices exceed the engine's max_seqs "
                                  f"{self.max_seqs}")
        return ids

    def add_request(self, request_id: Optional[str], prompt_ids: Sequence[int],
                    params: Optional[GenerationParams] = None, *, check_queue: bool = True,
                    seed: Optional[int] = None) -> str:
        """Queue a request (applied at the next step); returns its id (a new one for None).
        Raises ParamError for a bad request, QueueFull past max_waiting, before queuing
        anything. A request without a seed gets a random one here (an AsyncEngine leader
        sends it to the other ranks with the request)."""
        params = self.default_params() if params is None else params
        ids = self.check_request(prompt_ids, params)
        if seed is None:
            seed = params.seed if params.seed is not None else random.getrandbits(63)
        with self._lock:
            rid = request_id if request_id is not None else uuid.uuid4().hex
            if not isinstance(rid, str) or not rid:
                raise ParamError("request_id", f"request_id must be a non-empty str, got "
                                               f"{rid!r}")
            if rid in self.requests or rid in self._queued:
                raise ParamError("request_id", f"request {rid!r} is already in the engine")
            if check_queue and self.max_waiting is not None and \
                    len(self._queued) >= self.max_waiting:
                raise QueueFull(f"{len(self._queued)} requests are waiting (max_waiting="
                                f"{self.max_waiting}); try again later")
            self._queued.add(rid)
            self._inbox.append(("add", rid, ids, params, seed, time.monotonic()))
        return rid

    def abort(self, request_id: str) -> None:
        """End a request (finish reason "abort") at the next step; its pages are released.
        An unknown or finished id is ignored."""
        with self._lock:
            self._inbox.append(("abort", request_id))

    def take_events(self) -> list:
        with self._lock:
            ev, self._inbox = self._inbox, []
        return ev

    def apply(self, events: Sequence[tuple]) -> list:
        """Apply queued events (add / abort) in order; returns the outputs of aborted
        requests."""
        outs = []
        for ev in events:
            if ev[0] == "add":
                _, rid, ids, params, seed, arrival = ev
                with self._lock:
                    self._queued.add(rid)       # a follower's copy of the leader's event
                req = _Request(rid, ids, params, seed, self.eos_ids, arrival)
                seq = _Seq(req, 0, self._detok(req))
                req.seqs.append(seq)
                self.requests[rid] = req
                self.waiting.append(seq)
                self.stats.requests_added += 1
            elif ev[0] == "abort":
                req = self.requests.get(ev[1])
                if req is not None:
                    outs.append(self._abort(req))
        return outs

    def _detok(self, req: _Request):
        if self.tokenizer is None:
            return None
        return IncrementalDetokenizer(self.tokenizer, req.prompt,
                                      skip_special_tokens=req.params.skip_special_tokens)

    # ---- state queries -------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self._inbox)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + sum(1 for e in self._inbox if e[0] == "add")

    # ---- the step ------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> list:
        """Apply queued events, then one scheduled forward and its sampling; returns the
        RequestOutputs of the requests that changed."""
        outs = self.apply(self.take_events())
        return outs + self.run_step()

    @torch.no_grad()
    def run_step(self) -> list:
        """One scheduled forward and its sampling (events already applied); with overlap,
        the next decode step is launched before this one's tokens are handed out."""
        step, self._ahead = self._ahead, None
        if step is not None and all(s.finish_reason is not None for s in step.owners):
            step = None                     # launched for sequences that all ended since
        if step is None:
            items = self._schedule()
            if not items:
                return []
            step = self._launch_sampling(items, self._forward(items))
        if self.overlap:
            self._ahead = self._launch_next(step)
        return self._emit(step)

    # ---- scheduling ----------------------------------------------------------------------
    def _schedule(self) -> list:
        """[(seq, tokens this step)] (the module docstring, step 1)."""
        items, budget, preempted = [], self.budget, False
        decodes_left = sum(1 for s in self.running if s.computed >= len(s.ids) - 1)
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            remaining = len(seq.ids) - seq.computed
            decoding = remaining == 1
            if decoding:
                decodes_left -= 1
                n = 1 if budget >= 1 else 0
            else:
                n = min(remaining, budget - decodes_left)
            if n <= 0:
                i += 1
                continue
            while not self._reserve(seq, n):
                victim = self.running[-1]       # the latest admitted; not scheduled yet
                if victim is not seq and len(victim.ids) - victim.computed == 1:
                    decodes_left -= 1
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.row < 0:                 # preempted itself
                continue                    # (running[i] is now the next sequence)
            items.append((seq, n))
            budget -= n
            i += 1
        if preempted:
            return items
        seats = sum(s.seats for s in self.running)
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if seats + seq.seats > self.max_seqs or not self._free_rows:
                break
            hit = self._match(seq)
            n = min(len(seq.ids) - seq.computed, budget)
            if not self._reserve(seq, n):
                self._unmatch(seq, hit)
                break
            self.waiting.pop(0)
            self._admit(seq, hit)
            seats += seq.seats
            items.append((seq, n))
            budget -= n
        return items

    def _match(self, seq: _Seq) -> int:
        """Take the prefix cache's pages for the sequence's leading full pages; returns the
        tokens they hold. The last token is always computed (its logits sample the next), so
        a fully cached sequence recomputes it, in a copy of its page (_reserve)."""
        P = self.page_size
        seq.hashes = page_hashes(seq.ids, P, seq.hashes)
        pages = self.pool.match(seq.hashes)
        self.pool.acquire(pages)
        seq.pages = list(pages)
        seq.registered = len(pages)
        seq.computed = min(len(pages) * P, len(seq.ids) - 1)
        return seq.computed

    def _unmatch(self, seq: _Seq, hit: int) -> None:
        self.pool.release(seq.pages)
        seq.pages, seq.registered, seq.computed = [], 0, 0

    def _admit(self, seq: _Seq, hit: int) -> None:
        req = seq.req
        seq.row = self._free_rows.pop()
        self._write_row(seq)
        seq.order = next(self._order)
        self.running.append(seq)
        self.pool.count_query(len(seq.ids), hit)
        if not req.admitted:
            req.admitted = True
            req.cached_tokens = hit
            self.stats.prompt_tokens += len(req.prompt)
            with self._lock:
                self._queued.discard(req.id)

    def _reserve(self, seq: _Seq, n: int) -> bool:
        """Pages for tokens [computed, computed + n) of seq, copying a shared page it must
        write into; False (nothing changed) when the pool cannot give them."""
        P = self.page_size
        start = seq.computed
        first = start // P
        held = len(seq.pages)
        cow = first < held and self.pool.shared(seq.pages[first])
        new = -(-(start + n) // P) - held
        if new <= 0 and not cow:        # the tokens fit the pages held (a decode, mostly)
            return True
        new = max(0, new)
        got = self.pool.allocate(new + cow)
        if got is None:
            return False
        if cow:
            old, seq.pages[first] = seq.pages[first], got.pop()
            self._copies.append((old, seq.pages[first]))
            self.pool.release([old])
            seq.registered = min(seq.registered, first)
        seq.pages += got
        if seq.row >= 0 and (got or cow):
            self._write_row(seq)
        return True

    def _write_row(self, seq: _Seq) -> None:
        if seq.pages:
            self.table[seq.row, :len(seq.pages)] = torch.tensor(seq.pages, dtype=torch.int32)

    def _release_seq(self, seq: _Seq) -> None:
        self.pool.release(seq.pages)
        seq.pages, seq.registered, seq.computed = [], 0, 0
        if seq.row >= 0:
            self.table[seq.row].fill_(self.scratch)
            self._free_rows.append(seq.row)
            seq.row = -1

    def _preempt(self, seq: _Seq) -> None:
        self.running.remove(seq)
        self._release_seq(seq)
        self.waiting.insert(0, seq)
        self.stats.preemptions += 1

    # ---- the forward ---------------------------------------------------------------------
    def _do_copies(self) -> None:
        if not self._copies:
            return
        cache = self.runner.cache
        src = torch.tensor([a for a, _ in self._copies], device=self.device)
        dst = torch.tensor([b for _, b in self._copies], device=self.device)
        bufs = [cache.k_buffer, cache.v_buffer]
        if cache.fp8:
            bufs += [cache.k_scale_buffer, cache.v_scale_buffer]
        for buf in bufs:                    # [layers, pages, ...]: gather, then scatter
            buf[:, dst] = buf[:, src]
        self._copies = []

    def _forward(self, items: list) -> torch.Tensor:
        """Logits [len(items), vocab] of each item's last token."""
        self._do_copies()
        r, dev = self.runner, self.device
        self.stats.steps += 1
        rows = torch.tensor([s.row for s, _ in items], dtype=torch.int64)
        if all(n == 1 for _, n in items):
            self.stats.decode_steps += 1
            B = len(items)
            b = r.bucket(B)
            bt = torch.full((b, r.pages_per_seq), self.scratch, dtype=torch.int32)
            bt[:B] = self.table.index_select(0, rows)
            host = torch.ones(2, b, dtype=torch.int64)
            host[0, :B] = torch.tensor([s.ids[s.computed] for s, _ in items])
            host[1, :B] = torch.tensor([s.computed + 1 for s, _ in items])
            host = host.to(dev)
            r.bt[:b].copy_(bt.to(dev))
            r.tokens[:b].copy_(host[0])
            r.seq_lens[:b].copy_(host[1])
            return r.decode_step(b)[:B]
        toks, pos, cu, lens = [], [], [0], []
        for s, n in items:
            toks += s.ids[s.computed:s.computed + n]
            pos += range(s.computed, s.computed + n)
            cu.append(cu[-1] + n)
            lens.append(s.computed + n)
        B, T = len(items), len(toks)
        if r.prefill_graph_tokens:
            Bp = 1 << (B - 1).bit_length()
            if Bp <= r.max_rows and T + Bp - B <= r.prefill_graph_tokens:
                return self._forward_graphed(rows, toks, pos, cu, lens, Bp)[:B]
        P = self.page_size
        bt = self.table.index_select(0, rows)
        pos_t = torch.tensor(pos, dtype=torch.int64)
        seq_of_tok = torch.repeat_interleave(torch.arange(B), torch.tensor([n for _, n in items]))
        slots = bt[seq_of_tok, pos_t // P].long() * P + pos_t % P
        bt_d = bt.to(dev)
        lens_d = torch.tensor(lens, dtype=torch.int32, device=dev)
        cu_d = torch.tensor(cu, dtype=torch.int32, device=dev)
        meta = AttentionMetadata(mode="prefill", block_table=bt_d, seq_lens=lens_d,
                                 slot_mapping=slots.to(dev), cu_seqlens_q=cu_d,
                                 max_q_len=max(n for _, n in items), seq_lens_host=lens,
                                 cu_seqlens_q_host=cu,
                                 plan=r._prefill_plan(bt_d, lens_d, cu_d, T, lens, cu))
        last = torch.tensor(cu[1:], dtype=torch.int64, device=dev) - 1
        return self.model(torch.tensor(toks, dtype=torch.int64, device=dev), pos_t.to(dev),
                          r.cache, meta, logits_rows=last)

    def _forward_graphed(self, rows, toks, pos, cu, lens, Bp) -> torch.Tensor:
        """The step through the Runner's prefill CUDA graph of (Bp sequences, token bucket):
        the step's tables in the Runner's rows 0 .. Bp-1, padding sequences of one token on
        the scratch page."""
        r = self.runner
        B = len(lens)
        bt = torch.full((Bp, r.pages_per_seq), self.scratch, dtype=torch.int32)
        bt[:B] = self.table.index_select(0, rows)
        r.block_table_host[:Bp] = bt
        r.bt[:Bp].copy_(bt.to(self.device))
        pad = Bp - B
        toks = toks + [0] * pad
        pos = pos + [0] * pad
        cu = cu + [cu[-1] + i + 1 for i in range(pad)]
        lens = lens + [1] * pad
        return r._prefill_graphed(toks, pos, cu, lens, list(range(Bp)))

    # ---- overlap -------------------------------------------------------------------------
    def _next_decode(self, step: "_Step") -> Optional[list]:
        """The sequences of the decode step after `step`, when it can be launched before
        step's tokens reach the host (None otherwise): step decoded every running sequence,
        in order; no waiting sequence could be admitted; no row applies penalties (they read
        the previous tokens on the host). Sequences that step ends by length are left out;
        one that ends by EOS or a stop string takes its row once more, its token dropped.
        Every decision reads state all ranks share (never the queue of new events)."""
        live = [s for s in step.owners if s.finish_reason is None]
        if not step.decode or len(live) != len(self.running) or \
                any(a is not b for a, b in zip(live, self.running)):
            return None
        if self.waiting:
            seats = sum(s.seats for s in self.running)
            if seats + self.waiting[0].seats <= self.max_seqs and self._free_rows:
                return None                 # the next step admits (and prefills)
        nxt = []
        for seq in live:
            p = seq.req.params
            if p.penalized:
                return None
            if len(seq.output) + 1 >= p.max_tokens or len(seq.ids) + 1 >= self.max_model_len:
                continue                    # step's token ends it
            nxt.append(seq)
        if not nxt or not all(self._reserve(seq, 1) for seq in nxt):
            return None                     # (pages reserved so far are the next step's too)
        return nxt

    def _launch_next(self, step: "_Step") -> Optional["_Step"]:
        """Launch the decode step after `step` with step's tokens read on the device (the
        overlap: the host hands out step's tokens while this step runs)."""
        nxt = self._next_decode(step)
        if nxt is None:
            return None
        self._do_copies()
        r, dev = self.runner, self.device
        self.stats.steps += 1
        self.stats.decode_steps += 1
        self.stats.overlapped_steps += 1
        row_of = {id(s): i for i, s in enumerate(step.owners)}
        # Every host-to-device copy here is from pinned memory and asynchronous: a plain one
        # waits for the stream (the previous step), which is what this launch must not do.
        src = to_device(torch.tensor([row_of[id(s)] for s in nxt], dtype=torch.int64), dev)
        B = len(nxt)
        b = r.bucket(B)
        bt = torch.full((b, r.pages_per_seq), self.scratch, dtype=torch.int32)
        bt[:B] = self.table.index_select(0, torch.tensor([s.row for s in nxt],
                                                         dtype=torch.int64))
        lens = torch.ones(b, dtype=torch.int64)
        lens[:B] = torch.tensor([s.computed + 1 for s in nxt])
        r.bt[:b].copy_(to_device(bt, dev))
        r.seq_lens[:b].copy_(to_device(lens, dev))
        r.tokens[B:b].fill_(1)
        r.tokens[:B].copy_(step.sampled.ids.index_select(0, src))
        logits = r.decode_step(b)[:B]
        # Rows at step's tokens + 1: sampling steps are known before the tokens are.
        return self._launch_sampling([(s, 1) for s in nxt], logits, ahead=1)

    # ---- sampling and outputs ------------------------------------------------------------
    def _launch_sampling(self, items: list, logits: torch.Tensor, ahead: int = 0) -> "_Step":
        """Queue the sampling of a forward's logits (items: [(seq, tokens)]); its tokens are
        handed out by _emit. ahead: tokens each sequence has sampled that _emit has not
        appended yet (1 for a step launched by _launch_next)."""
        done_rows, sample_rows_, owners = [], [], []
        for i, (seq, n) in enumerate(items):
            seq.computed += n
            if not ahead:
                self._register(seq)         # (a step launched ahead registers in _emit)
            if seq.computed < len(seq.ids) + ahead:
                continue                    # a prompt chunk: no token yet
            req = seq.req
            if not seq.forked:              # n > 1: the prompt's logits sample every choice
                seqs = [seq] + [self._fork(seq, c) for c in range(1, req.params.n)]
                seq.forked = True
            else:
                seqs = [seq]
            for s in seqs:
                done_rows.append(i)
                owners.append(s)
                sample_rows_.append(SampleRow(req.params, req.seed, s.choice,
                                              len(s.output) + ahead, req.prompt, s.output,
                                              req.eos_ids))
        sampled = None
        if owners:
            if done_rows != list(range(logits.shape[0])):
                idx = to_device(torch.tensor(done_rows, dtype=torch.int64), logits.device)
                logits = logits.index_select(0, idx)
            sampled = sample_rows_async(logits, sample_rows_)
        return _Step([s for s, _ in items], owners, sampled,
                     all(n == 1 for _, n in items) and len(owners) == len(items))

    def _emit(self, step: "_Step") -> list:
        """Hand out a launched step's tokens: wait for them, append them (stops, lengths,
        text), register the pages they filled. A sequence that ended meanwhile (a token of
        the step before, an abort) drops its token."""
        if step.sampled is None:
            for seq in step.seqs:
                self._register(seq)
            return []
        ids, lps = step.sampled.result()
        now = time.monotonic()
        for seq in step.seqs:               # before the tokens end any sequence
            self._register(seq)
        changed: dict = {}
        for s, t, lp in zip(step.owners, ids, lps):
            if s.finish_reason is not None:
                self.stats.overlap_dropped += 1
                continue
            c = self._append(s, t, lp, now)
            changed.setdefault(s.req.id, []).append(c)
        outs = []
        for rid, choices in changed.items():
            req = self.requests[rid]
            finished = req.done == len(req.seqs) and all(x.finish_reason for x in req.seqs)
            outs.append(self._output(req, choices, finished, now))
        return outs

    def _fork(self, seq: _Seq, choice: int) -> _Seq:
        req = seq.req
        child = _Seq(req, choice, self._detok(req))
        child.ids = list(seq.ids)
        child.pages = list(seq.pages)
        self.pool.acquire(child.pages)
        child.hashes, child.registered = list(seq.hashes), seq.registered
        child.computed = seq.computed
        child.forked = True
        child.row = self._free_rows.pop()
        child.order = next(self._order)
        self._write_row(child)
        req.seqs.append(child)
        self.running.append(child)
        return child

    def _register(self, seq: _Seq) -> None:
        """Register the sequence's pages that are now full in the prefix cache (of tokens the
        host holds: a step launched ahead counts a token in `computed` before it is in
        `ids`)."""
        if not self.pool.caching:
            return
        full = min(seq.computed, len(seq.ids)) // self.page_size
        if full <= seq.registered:
            return
        seq.hashes = page_hashes(seq.ids[:full * self.page_size], self.page_size,
                                 seq.hashes[:full])
        for k in range(seq.registered, full):
            self.pool.register(seq.pages[k], seq.hashes[k])
        seq.registered = full

    def _append(self, seq: _Seq, t: int, lp, now: float) -> ChoiceOutput:
        req, p = seq.req, seq.req.params
        seq.output.append(t)
        seq.ids.append(t)
        self.stats.generation_tokens += 1
        if req.first_token_at is None:
            req.first_token_at = now
            self.stats.ttft.observe(now - req.arrival)
        if seq.last_token_at is not None:
            self.stats.itl.observe(now - seq.last_token_at)
        seq.last_token_at = now
        out = ChoiceOutput(seq.choice, [t], "", [lp] if lp is not None else None)
        k = len(seq.output)
        if not p.ignore_eos and t in req.eos_ids:
            self._finish(seq, "stop", None, out, keep_text=p.include_stop_str_in_output)
        elif t in p.stop_token_ids and k >= p.min_tokens:
            self._finish(seq, "stop", t, out, keep_text=p.include_stop_str_in_output)
        if seq.finish_reason is None:
            delta = seq.detok.push(t) if seq.detok is not None else ""
            out.text, hit = seq.text.add(delta, check_stop=k >= p.min_tokens)
            if hit is not None:
                self._finish(seq, "stop", hit, out)
            elif k >= p.max_tokens or len(seq.ids) >= self.max_model_len:
                self._finish(seq, "length", None, out)
        return out

    def _finish(self, seq: _Seq, reason: str, stop_reason, out: ChoiceOutput,
                keep_text: bool = False) -> None:
        if keep_text and seq.detok is not None:
            seq.text.add(seq.detok.push(out.ids[-1]), check_stop=False)
        out.text += seq.text.flush()
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        out.finish_reason, out.stop_reason = reason, stop_reason
        seq.req.done += 1
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release_seq(seq)

    def _output(self, req: _Request, choices: list, finished: bool, now: float) -> \
            RequestOutput:
        out = RequestOutput(req.id, choices, finished, req.prompt, req.cached_tokens)
        if finished:
            out.ttft_s = None if req.first_token_at is None else req.first_token_at - req.arrival
            del self.requests[req.id]
            reason = next((c.finish_reason for c in req.seqs), "stop")
            self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1
            self.stats.e2e.observe(now - req.arrival)
        return out

    def _abort(self, req: _Request) -> RequestOutput:
        choices = []
        for seq in list(req.seqs):
            if seq.finish_reason is None:
                out = ChoiceOutput(seq.choice, [], "")
                self._finish(seq, "abort", None, out)
                choices.append(out)
        if not req.admitted:
            with self._lock:
                self._queued.discard(req.id)
        if req.params.n > 1 and len(req.seqs) < req.params.n:   # aborted before the fork
            for c in range(len(req.seqs), req.params.n):
                choices.append(ChoiceOutput(c, [], "", None, "abort"))
            req.done = len(req.seqs)
        return self._output(req, choices, True, time.monotonic())

    # ---- whole requests ------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]],
                 params: Union[GenerationParams, Sequence[GenerationParams], None] = None) \
            -> list:
        """Run requests to completion; a RequestOutput per prompt with every choice's ids,
        text (and logprobs), in prompt order. At TP > 1 every rank calls it with the same
        arguments (seeds included: a request without one draws its seed on each rank, which
        then differ; pass seeds)."""
        if params is None or isinstance(params, GenerationParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"Engine.generate: {len(params)} params for {len(prompts)} prompts")
        ids = [self.add_request(None, p, sp, check_queue=False)
               for p, sp in zip(prompts, params)]
        results: dict = {}
        while any(rid not in results or not results[rid].finished for rid in ids):
            if not self.has_work():
                raise RuntimeError("Engine.generate: the engine ran out of work before every "
                                   "request finished")
            for out in self.step():
                if out.request_id in results:
                    results[out.request_id].merge(out)
                else:
                    results[out.request_id] = out
        for out in results.values():
            out.choices.sort(key=lambda c: c.index)
        return [results[rid] for rid in ids]


__all__ = ["Engine", "EngineStats", "RequestOutput", "ChoiceOutput", "QueueFull", "Histogram"]
