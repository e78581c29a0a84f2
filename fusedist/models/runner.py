"""Runner: chunked prefill and CUDA-graph decode of a fusedist.models Transformer.

    runner = Runner(model, max_batch=8, max_seq_len=4096)          # KV cache sized here
    out = runner.generate([[1, 2, 3], [4, 5]], max_new_tokens=32,
                          sampling=SamplingParams(temperature=0.8, top_p=0.9, seed=0))
    out.ids, out.prefill_ms, out.ms_per_step, out.tokens_per_s

Memory is sized up front: the KV cache holds one row per sequence of the largest bucket (the
batch rounded up to a power of two), max_seq_len tokens each, in pages of page_size tokens;
kv_budget_bytes, when given, must cover that. kv_dtype=torch.float8_e4m3fn stores K and V as
e4m3 with a float32 scale per token and kv head (half the bytes of bf16 plus the scales; the
fusedist model only). Row b owns pages b * pages_per_seq ... in a
static block table; padded rows of a bucket (batch < bucket) decode at seq_len 1 in their own
pages, and their outputs are dropped.

Decode is captured once per batch-size bucket (1, 2, 4, ..., the first >= max_batch) as one
CUDA graph over static buffers: token ids, positions, block_table, seq_lens, slot_mapping.
The graph computes positions (seq_lens - 1) and slot_mapping itself, so a step is: write the
new token ids, replay, sample, seq_lens += 1. The attention DecodePlan is made outside the
graph, for the cache's full length, so one graph replays for every length. Sampling (sampling.py) runs
outside the graph from a seeded torch.Generator: reproducible for a seed, and identical on every
rank because every rank holds the same gathered logits.

prefill_graph_tokens=N (default PREFILL_GRAPH_TOKENS = 512; 0: off) replays prefill chunks of up
to N tokens through CUDA graphs too, one per (sequences in the chunk, token bucket): the chunk's tokens padded to the
bucket (16, 32, 48, 64, 96, 128, 192, ...; padding tokens write no cache slot and their rows
are dropped), lengths and tables in static buffers that the paged prefill kernel reads on the
device. A short prompt then costs its kernels, not ~0.1 ms of host work per kernel. The first
chunk of a shape captures (one eager pass, then the capture). The fusedist model on CUDA with
the paged prefill kernel only; longer chunks, all_logits and the torch baseline run eagerly.
On H200 (Llama-3-8B, one GPU) they cut the time to first token of 1-128 token prompts from
32-36 ms to 5.5-8.3 ms (benchmarks/results/h200-w1/model-ttft.md).

compile_decode=True wraps the decode step's body in torch.compile(fullgraph=True,
dynamic=False) (mode default: inductor fuses the elementwise work, GEMMs stay cuBLAS) before
it is captured into the same CUDA graphs; each bucket compiles once, at its capture. Prefill
is not compiled. time_prefill / profile_prefill measure the prefill alone (warm,
synchronized; the profiler's classes are profiling.py's; profile_prefill runs eagerly).

stream() is generate() as it decodes: it yields every step's new ids (the same ids as
generate() for the same request) and returns the GenerationResult. A runner serves one request
at a time (its steps share the KV cache and the static buffers): while a stream is open (not
exhausted, not closed), generate() and stream() raise at the call. A sequence whose logits hold
NaN (weights that are not finite, an overflowed activation) has no next token: the loop keeps
each sequence's first NaN step on the device and raises fusedist.NonFiniteError where it
synchronizes anyway (every streamed step; the end of generate()).

At TP > 1 every rank must call generate() (or stream()) with the same request (prompts, max_new_tokens,
sampling parameters with the seed, eos_ids, context_fill, eos_check_every): each call first
all-gathers a 16-byte digest of it over the model's tensor-parallel group and raises
fusedist.RequestMismatchError on every rank, naming each differing field and every rank's
value, when they differ (a request invalid on some ranks only raises its ValueError there and
the mismatch elsewhere). Different requests would otherwise give wrong ids, or ranks that
stop at different steps and leave their peers in a collective.

A rank that is lost during generate() (its process killed, its connection broken) ends the
call on the others with fusedist.PeerLostError naming it (the group's ranks on this host are
looked at; ranks on other hosts are listed as unchecked). Over gloo, generate()'s collectives
after the request check are bounded by peer_timeout_s (default FUSEDIST_TIMEOUT_S, 30 s), so a
peer that stops answering fails the call in that time rather than the process group's
bootstrap timeout.

max_seq_len may not exceed the model's positions (model.max_position, the rotary table's
length); generate() holds every sequence to both. close() (or the end of a `with Runner(...)`
block) releases the graphs, the KV cache and the buckets' decode plans, whose workspaces the
attention op keeps registered until they are closed; a runner that is dropped without close()
closes its plans when it is collected.
"""

from __future__ import annotations

import math
import operator
import time
import weakref
import zlib
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Sequence

import torch

from .. import _dtypes, envs
from .._check import as_bool, as_int
from ..distributed import runtime as _runtime
from ..distributed.peers import collective_timeout, is_peer_failure, peer_lost_error
from ..errors import NonFiniteError, RequestMismatchError
from ..nn.attention import AttentionMetadata
from ..ops.attention import _prefill
from ..ops.device_errors import check_device_errors
from .profiling import profile, profile_timeline
from .sampling import SamplingParams, nan_rows, sample


@dataclass
class GenerationResult:
    ids: list                       # per sequence: generated ids (up to and including an EOS)
    prefill_ms: float
    decode_ms: float
    steps: int                      # decode steps (graph replays) after the prefill
    batch: int
    prompt_tokens: int
    timings: dict = field(default_factory=dict)

    @property
    def ms_per_step(self) -> float:
        return self.decode_ms / self.steps if self.steps else float("nan")

    @property
    def tokens_per_s(self) -> float:
        return self.batch * self.steps / (self.decode_ms / 1e3) if self.steps else float("nan")


def _show_ids(ids: list) -> str:
    """A prompt as the mismatch message shows it: short ones whole, long ones by their head,
    length and CRC-32."""
    if len(ids) <= 16:
        return f"{len(ids)} ids {ids}"
    crc = zlib.crc32(repr(ids).encode())
    return f"{len(ids)} ids [{', '.join(map(str, ids[:8]))}, ...] crc32 {crc:08x}"


def _int(where: str, name: str, v, low: int) -> int:
    return as_int(where, name, v, low)


def _current_runtime():
    return _runtime.get_runtime() if _runtime.is_initialized() else None


def _close_plans(plans: list) -> None:
    """Close the decode plans a runner made (weakref.finalize's callback: it holds the list,
    never the runner)."""
    while plans:
        plans.pop().close()


def buckets_for(max_batch: int) -> list[int]:
    out, b = [], 1
    while True:
        out.append(b)
        if b >= max_batch:
            return out
        b *= 2


# Runner's default prefill_graph_tokens (the module docstring).
PREFILL_GRAPH_TOKENS = 512


def prefill_token_bucket(n: int) -> int:
    """The token count a prefill graph of n tokens is captured for: 16, 32, 48, 64, 96, 128,
    192, 256, 384, 512, ... (powers of two and the midpoints between them, from 32 on)."""
    b = 16
    while b < n:
        p = 1 << (b.bit_length() - 1)          # the power of two at or below b
        b = p + p // 2 if b == p and p >= 32 else 2 * p
    return b


def _prefill_graphs_fit(model, cache) -> bool:
    """Prefill graphs need the fusedist model on CUDA whose attention the paged prefill kernel
    takes (it reads lengths on the device): fusedist.ops.attention says whether it takes this
    model's q heads, head_dim and dtype over this cache."""
    if getattr(model, "backend", None) != "fusedist" or cache is None:
        return False
    cfg = getattr(model, "cfg", None)
    k = cache.k[0]
    q = torch.empty(16, getattr(model, "local_heads", 0), getattr(cfg, "head_dim", 0),
                    dtype=getattr(model, "dtype", torch.float32), device=k.device)
    return _prefill.paged_why_not(q, k) == ""


class Runner:
    def __init__(self, model, *, max_batch: int, max_seq_len: int, page_size: int = 16,
                 kv_budget_bytes: Optional[int] = None, cuda_graphs: Optional[bool] = None,
                 prefill_chunk: int = 4096, compile_decode: bool = False,
                 compile_backend: str = "inductor", peer_timeout_s: Optional[float] = None,
                 prefill_graph_tokens: int = PREFILL_GRAPH_TOKENS,
                 kv_dtype: Optional[torch.dtype] = None):
        # Every argument checked before anything is allocated.
        max_batch = as_int("Runner", "max_batch", max_batch, 1)
        max_seq_len = as_int("Runner", "max_seq_len", max_seq_len, 1)
        page_size = as_int("Runner", "page_size", page_size, 1)
        prefill_chunk = as_int("Runner", "prefill_chunk", prefill_chunk, 1,
                               what="an int >= 1 (tokens per prefill chunk)")
        prefill_graph_tokens = as_int("Runner", "prefill_graph_tokens", prefill_graph_tokens, 0,
                                      what="an int >= 0 (0: no prefill graphs)")
        cuda_graphs = as_bool("Runner", "cuda_graphs", cuda_graphs, allow_none=True)
        compile_decode = as_bool("Runner", "compile_decode", compile_decode)
        if kv_budget_bytes is not None:
            kv_budget_bytes = as_int("Runner", "kv_budget_bytes", kv_budget_bytes, 1)
        max_position = getattr(model, "max_position", None)
        if max_position is not None and max_seq_len > max_position:
            raise ValueError(
                f"Runner: max_seq_len={max_seq_len} exceeds the model's max_position "
                f"{max_position} (the positions its rotary table holds); pass max_seq_len <= "
                f"{max_position}, or build the model with a larger max_position (build_model("
                "..., max_position=), at most the config's max_position)")
        self.max_position = max_position
        if peer_timeout_s is not None and (
                isinstance(peer_timeout_s, bool) or not isinstance(peer_timeout_s, (int, float))
                or not math.isfinite(peer_timeout_s) or peer_timeout_s <= 0):
            raise ValueError(f"Runner: peer_timeout_s must be a finite number of seconds > 0, "
                             f"got {peer_timeout_s!r}; omit it for FUSEDIST_TIMEOUT_S")
        self.peer_timeout_s = peer_timeout_s
        model_dtype = getattr(model, "dtype", None)
        if kv_dtype is not None and kv_dtype not in (model_dtype, _dtypes.FP8):
            raise ValueError(f"Runner: kv_dtype must be None (the model's {model_dtype}) or "
                             f"torch.float8_e4m3fn (e4m3 with a scale per token and kv head), "
                             f"got {kv_dtype!r}")
        self.kv_dtype = model_dtype if kv_dtype is None else kv_dtype
        self.closed = False
        self._plans: list = []       # decode plans of the buckets, closed by close()
        self._release = weakref.finalize(self, _close_plans, self._plans)
        self.model, self.device = model, model.device
        self._group = getattr(getattr(model, "comm", None), "group", None)
        self.page_size = page_size
        self.buckets = buckets_for(max_batch)
        self.max_rows = self.buckets[-1]
        self.pages_per_seq = math.ceil(max_seq_len / page_size)
        self.max_seq_len = self.pages_per_seq * page_size
        self.prefill_chunk = prefill_chunk
        # CUDA graphs on a GPU unless turned off; a CPU model always decodes eagerly.
        self.cuda_graphs = self.device.type == "cuda" and cuda_graphs is not False
        self.prefill_graphs: dict[tuple[int, int], tuple] = {}
        # What the errors of a request tell the caller to change (an LLM speaks of its own
        # arguments: fusedist.models.LLM sets these).
        self.fixes = {"max_seq_len": "build the Runner with a larger max_seq_len",
                      "max_batch": "build the Runner with a larger max_batch, or split the "
                                   "prompts into batches of at most {max_batch}",
                      "closed": "build a new Runner"}
        self._stream_open = None     # the open stream() of this runner (generator), if any
        page_bytes = model.kv_bytes_per_token(self.kv_dtype) * page_size
        need = self.max_rows * self.pages_per_seq
        if kv_budget_bytes is not None:
            num_pages = int(kv_budget_bytes // page_bytes)
            if num_pages < need:
                raise ValueError(
                    f"Runner: the KV budget of {kv_budget_bytes / 2**30:.2f} GiB holds {num_pages} "
                    f"pages of {page_size} tokens; {self.max_rows} rows x {self.max_seq_len} "
                    f"tokens "
                    f"need {need} ({need * page_bytes / 2**30:.2f} GiB); raise the budget "
                    "(--kv-budget-gb) or lower the batch / sequence length")
        else:
            num_pages = need
            if self.device.type == "cuda":
                free = torch.cuda.mem_get_info(self.device)[0]
                if need * page_bytes > 0.9 * free:
                    raise ValueError(
                        f"Runner: the KV cache for {self.max_rows} rows x {self.max_seq_len} "
                        f"tokens needs {need * page_bytes / 2**30:.2f} GiB, more than 90% of the "
                        f"{free / 2**30:.2f} GiB free; lower the batch or sequence length")
        self.num_pages = num_pages
        self.kv_bytes = num_pages * page_bytes
        self.cache = model.new_cache(self.max_rows, self.max_seq_len, page_size, num_pages,
                                     kv_dtype=self.kv_dtype)
        self.prefill_graph_tokens = prefill_graph_tokens if self.cuda_graphs and \
            _prefill_graphs_fit(model, self.cache) else 0
        # A model whose MoE layers exchange tokens (expert parallelism) sizes its Buffers from
        # the largest step and the largest captured step (collective: every rank builds the
        # same runner).
        reserve = getattr(model, "reserve_tokens", None)
        if reserve is not None:
            graph_tokens = max(self.max_rows if self.cuda_graphs else 0,
                               prefill_token_bucket(min(prefill_chunk, self.prefill_graph_tokens))
                               if self.prefill_graph_tokens else 0)
            reserve(max(prefill_chunk, self.max_rows, graph_tokens), graph_tokens)
        dev, R = self.device, self.max_rows
        bt = torch.zeros(R, self.pages_per_seq, dtype=torch.int32)
        bt[:] = torch.arange(R * self.pages_per_seq, dtype=torch.int32).view(R, -1)
        self.block_table_host = bt
        # Static decode buffers (graph inputs).
        self.bt = bt.to(dev)
        self.tokens = torch.zeros(R, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(R, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(R, dtype=torch.int32, device=dev)
        self.slots = torch.zeros(R, dtype=torch.int64, device=dev)
        self.graphs: dict[int, tuple] = {}
        self.pool = None
        self._metas: dict[int, object] = {}
        self.compile_decode = compile_decode
        # The compiled step is the unbound function (called with self): a bound method stored
        # on self would be a reference cycle, leaving the runner's CUDA graphs to the cyclic
        # GC, which may run during another capture (destroying a graph there invalidates it).
        self._compiled_step = None
        if compile_decode:
            self._compiled_step = torch.compile(Runner._decode_forward, fullgraph=True,
                                                dynamic=False, backend=compile_backend)
        self.compile_s: dict[int, float] = {}    # bucket -> seconds of its first (compiling) call

    # ---- lifetime ------------------------------------------------------------------------
    def close(self) -> None:
        """Release the CUDA graphs, the KV cache and the buckets' decode plans (their
        workspaces). The runner cannot be used afterwards; calling close() again does nothing."""
        if self.closed:
            return
        self.closed = True
        self.graphs.clear()          # before the plans: the graphs replay into their workspaces
        self.prefill_graphs.clear()
        self._metas.clear()
        self.pool = None
        self.cache = None
        self._release()

    def __enter__(self) -> "Runner":
        self._check_open("Runner")
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self, where: str) -> None:
        if self.closed:
            raise RuntimeError(f"{where}: the {self.fixes.get('owner', 'runner')} is closed "
                               "(close() or the end of its with-block released its cache and "
                               f"plans); {self.fixes['closed']}")

    # ---- decode --------------------------------------------------------------------------
    def _meta(self, b: int):
        if b not in self._metas:
            plan = self.model.decode_plan(b, self.page_size, self.max_seq_len,
                                          kv_dtype=self.kv_dtype)
            if plan is not None:
                self._plans.append(plan)
            self._metas[b] = AttentionMetadata(mode="decode", block_table=self.bt[:b],
                                       seq_lens=self.seq_lens[:b], slot_mapping=self.slots[:b],
                                       plan=plan)
        return self._metas[b]

    def _body(self, b: int) -> torch.Tensor:
        meta = self._meta(b)
        if not self.compile_decode:
            return self._decode_forward(b, meta)
        from ..ops.attention import sdpa_priority
        # SDPA picks its backend while tracing: the priority the eager step has.
        first = b not in self.compile_s
        if first:   # one eager step first: what the model picks by timing (the torch
            self._decode_forward(b, meta)   # baseline's decode form) is picked before tracing
        t0 = time.perf_counter()
        with sdpa_priority(self.device):
            out = self._compiled_step(self, b, meta)
        if first:
            self.compile_s[b] = time.perf_counter() - t0
        return out

    def _decode_forward(self, b: int, meta) -> torch.Tensor:
        pos = self.seq_lens[:b].long() - 1
        self.positions[:b].copy_(pos)
        page = self.bt[:b].gather(1, (pos // self.page_size)[:, None]).squeeze(1).long()
        self.slots[:b].copy_(page * self.page_size + pos % self.page_size)
        return self.model(self.tokens[:b], self.positions[:b], self.cache, meta)

    def capture(self, b: int) -> None:
        """Capture the batch-b decode step (the live batch rows' cache slots at position
        seq_lens - 1 are written by the warm-up: call before prefill)."""
        self._check_open("Runner.capture")
        if b in self.graphs or not self.cuda_graphs:
            return
        s = torch.cuda.Stream(self.device)
        s.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(s), torch.no_grad():
            for _ in range(2):
                self._body(b)
        torch.cuda.current_stream(self.device).wait_stream(s)
        torch.cuda.synchronize(self.device)
        g = torch.cuda.CUDAGraph()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(g, pool=self.pool), torch.no_grad():
            out = self._body(b)
        self.graphs[b] = (g, out)

    @torch.no_grad()
    def decode_step(self, b: int) -> torch.Tensor:
        """One decode step of bucket b over the static buffers; logits [b, vocab]."""
        self._check_open("Runner.decode_step")
        if b in self.graphs:
            g, out = self.graphs[b]
            g.replay()
            return out
        return self._body(b)

    def bucket(self, n: int, where: str = "Runner") -> int:
        for b in self.buckets:
            if b >= n:
                return b
        raise ValueError(f"{where}: a batch of {n} prompts exceeds max_batch "
                         f"{self.buckets[-1]}; "
                         + self.fixes["max_batch"].format(max_batch=self.buckets[-1]))

    # ---- prefill -------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, prompts: Sequence[Sequence[int]], start: int = 0,
                all_logits: bool = False):
        """Chunked prefill of every prompt (sequence b in batch row b, its tokens at positions
        start..start+len-1 after `start` tokens already in the cache); returns the last
        token's logits [len(prompts), vocab], or with all_logits a list of [len, vocab], one
        per prompt (every position's logits)."""
        self._check_open("Runner.prefill")
        P, dev = self.page_size, self.device
        last = [None] * len(prompts)
        every = [[] for _ in prompts]
        work = [(b, 0) for b in range(len(prompts))]     # (row, tokens of it done)
        while work:
            budget, chunk = self.prefill_chunk, []
            while work and budget > 0:
                b, done = work.pop(0)
                n = min(len(prompts[b]) - done, budget)
                chunk.append((b, done, n))
                budget -= n
                if done + n < len(prompts[b]):
                    work.insert(0, (b, done + n))
            toks, pos, cu, lens, out_rows, out_seq = [], [], [0], [], [], []
            for b, done, n in chunk:
                toks += list(prompts[b][done:done + n])
                p = list(range(start + done, start + done + n))
                pos += p
                cu.append(cu[-1] + n)
                lens.append(start + done + n)
                if all_logits:
                    out_rows += range(cu[-2], cu[-1])
                    out_seq += [b] * n
                elif done + n == len(prompts[b]):
                    out_rows.append(cu[-1] - 1)
                    out_seq.append(b)
            rows = [b for b, _, _ in chunk]
            if not all_logits and 0 < len(toks) <= self.prefill_graph_tokens:
                logits = self._prefill_graphed(toks, pos, cu, lens, rows)
                for i, (b, done, n) in enumerate(chunk):   # row i: sequence i's last token
                    if done + n == len(prompts[b]):
                        last[b] = logits[i].clone()   # the next replay rewrites the graph's
                continue
            pos_t = torch.tensor(pos, dtype=torch.int64)
            rows_t = torch.tensor(rows, dtype=torch.int64)
            seq_of_tok = torch.repeat_interleave(rows_t, torch.tensor([n for _, _, n in chunk]))
            page = self.block_table_host[seq_of_tok, pos_t // P].long()
            bt = self.bt[rows_t.to(dev)]
            seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
            cu_t = torch.tensor(cu, dtype=torch.int32, device=dev)
            meta = AttentionMetadata(mode="prefill", block_table=bt, seq_lens=seq_lens,
                             slot_mapping=(page * P + pos_t % P).to(dev), cu_seqlens_q=cu_t,
                             max_q_len=max(n for _, _, n in chunk),
                             seq_lens_host=lens, cu_seqlens_q_host=cu,
                             plan=self._prefill_plan(bt, seq_lens, cu_t, len(toks), lens, cu))
            # seq_rows stays on the host: the torch backend's static cache slices by it.
            logits = self.model(torch.tensor(toks, dtype=torch.int64, device=dev), pos_t.to(dev),
                                self.cache, meta, seq_rows=rows_t,
                                logits_rows=torch.tensor(out_rows, dtype=torch.int64, device=dev)
                                if out_rows else None)
            for i, b in enumerate(out_seq):
                last[b] = logits[i]
                every[b].append(logits[i])
        if all_logits:
            return [torch.stack(e) for e in every]
        return torch.stack(last)

    def _prefill_plan(self, bt, seq_lens, cu_t, T, lens, cu):
        """The step's PrefillPlan for the fusedist model (its metadata checked once for every
        layer); None for the torch baseline, which reads the lengths itself."""
        if getattr(self.model, "backend", None) != "fusedist":
            return None
        try:
            from ..ops.attention import prefill_plan
        except ImportError:
            return None
        return prefill_plan(bt, seq_lens, cu_t, tokens=T, page_size=self.page_size,
                            num_pages=self.num_pages, seq_lens_host=lens, cu_seqlens_q_host=cu)

    def _prefill_graphed(self, toks, pos, cu, lens, rows) -> torch.Tensor:
        """One prefill chunk through the CUDA graph of its (sequences, token bucket), captured
        on first use; returns the logits of each sequence's last token [len(rows), vocab] (the
        graph's output buffer)."""
        B, T = len(rows), len(toks)
        Tb = prefill_token_bucket(T)
        key = (B, Tb)
        entry = self.prefill_graphs.get(key)
        dev = self.device
        if entry is None:
            bufs = {"tokens": torch.zeros(Tb, dtype=torch.int64, device=dev),
                    "positions": torch.zeros(Tb, dtype=torch.int64, device=dev),
                    "slots": torch.full((Tb,), -1, dtype=torch.int64, device=dev),
                    "bt": torch.zeros(B, self.pages_per_seq, dtype=torch.int32, device=dev),
                    "seq_lens": torch.zeros(B, dtype=torch.int32, device=dev),
                    "cu": torch.zeros(B + 1, dtype=torch.int32, device=dev),
                    "last": torch.zeros(B, dtype=torch.int64, device=dev)}
            # the paged kernel in the eager pass too: the padded bucket's lengths are only on
            # the device (cu_seqlens_q ends short of the Tb tokens)
            meta = AttentionMetadata(mode="prefill", block_table=bufs["bt"], seq_lens=bufs["seq_lens"],
                             slot_mapping=bufs["slots"], cu_seqlens_q=bufs["cu"], max_q_len=Tb,
                             prefill_backend="paged")
            body = lambda: self.model(bufs["tokens"], bufs["positions"], self.cache, meta,  # noqa
                                      logits_rows=bufs["last"])
            entry = (None, None, bufs, body)
        g, out, bufs, body = entry
        # One host tensor, one copy: [tokens | positions | slots | seq_lens | cu | last],
        # padding tokens at slot -1 (no cache write); then the rows of the block table.
        P = self.page_size
        pad = Tb - T
        page = self.block_table_host[torch.repeat_interleave(
            torch.tensor(rows), torch.tensor([b - a for a, b in zip(cu, cu[1:])])),
            torch.tensor(pos) // P].long()
        slots = (page * P + torch.tensor(pos) % P).tolist()
        host = torch.tensor(list(toks) + [0] * pad + list(pos) + [0] * pad + slots + [-1] * pad
                            + list(lens) + list(cu) + [c - 1 for c in cu[1:]],
                            dtype=torch.int64).to(dev)
        o = 0
        for name, n in (("tokens", Tb), ("positions", Tb), ("slots", Tb), ("seq_lens", B),
                        ("cu", B + 1), ("last", B)):
            bufs[name].copy_(host[o:o + n])
            o += n
        bufs["bt"].copy_(self.bt[torch.tensor(rows, device=dev)])
        if g is None:   # first use: one eager pass (this chunk's prefill), then the capture
            s = torch.cuda.Stream(dev)
            s.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(s):
                body()
            torch.cuda.current_stream(dev).wait_stream(s)
            torch.cuda.synchronize(dev)
            g = torch.cuda.CUDAGraph()
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            with torch.cuda.graph(g, pool=self.pool):
                out = body()
            # no body (its closure holds self): a stored cycle would leave the graph to the
            # cyclic GC, which may run during another capture, where destroying a graph
            # invalidates it
            self.prefill_graphs[key] = (g, out, bufs, None)
        g.replay()
        return out

    @torch.no_grad()
    def fill_context(self, tokens: int, seed: int = 0) -> None:
        """Benchmarks: make every row's first `tokens` cache positions random keys / values
        (N(0, 1)), as if a prompt of that length had been prefilled."""
        self._check_open("Runner.fill_context")
        g = torch.Generator(device=self.device)
        g.manual_seed(seed)
        for kv in (self.cache.k, self.cache.v):
            for t in kv:
                t.copy_(torch.randn(t.shape, generator=g, device=self.device, dtype=torch.float32))

    # ---- generate ------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 sampling: SamplingParams = SamplingParams(), eos_ids: Sequence[int] = (),
                 context_fill: int = 0, eos_check_every: int = 1,
                 progress: Optional[Callable[[int, int], None]] = None) -> GenerationResult:
        steps = self._start("Runner.generate", lambda: (
            prompts, max_new_tokens, sampling, eos_ids, context_fill, eos_check_every),
            progress)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value

    def stream(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
               sampling: SamplingParams = SamplingParams(), eos_ids: Sequence[int] = (),
               context_fill: int = 0) -> Iterator[list]:
        """generate() as it decodes: yields, after the prefill and after every decode step,
        each sequence's new token id (None for a sequence that already ended with an EOS);
        the generator's return value (StopIteration.value) is the GenerationResult, with the
        same ids as generate() for the same request. Each step reads its ids back to the host
        (one synchronization a step that generate() does not make). The request is checked
        here, on every rank of the group, before the first step. Every rank of the group
        iterates it to the end, or closes it at the same step. The runner holds one request
        at a time: while the stream is open (not exhausted, not closed), generate() and
        stream() raise."""
        steps = self._start("Runner.stream", lambda: (
            prompts, max_new_tokens, sampling, eos_ids, context_fill, 1), None)
        return self._stream_ids(steps, set(eos_ids))

    def _stream_ids(self, steps, stop: set) -> Iterator[list]:
        """The open stream: each step's ids, None for a sequence that ended (stream())."""
        token = object()
        self._stream_open = token
        try:
            ended: Optional[list] = None
            while True:
                try:
                    nxt = next(steps)
                except StopIteration as done:
                    return done.value
                ids = nxt.tolist()
                self._check_finite(self._nan_at)
                if ended is None:
                    ended = [False] * len(ids)
                out = [None if e else t for t, e in zip(ids, ended)]
                ended = [e or t in stop for t, e in zip(ids, ended)]
                yield out
        finally:
            steps.close()
            if self._stream_open is token:
                self._stream_open = None

    def _start(self, where, request, progress):
        """Check the request (request() returns it as (prompts, max_new_tokens, sampling,
        eos_ids, context_fill, eos_check_every); an LLM converts its arguments there) on every
        rank of the group, then return the steps of _steps under the group's peer timeout. A
        rank whose request is invalid raises its own error and every other rank a
        RequestMismatchError naming it; a collective that fails because a peer is gone raises
        PeerLostError."""
        group = self._tp_group()
        try:
            req = self._checked_request(where, request)
        except RuntimeError as e:
            raise self._peer_lost(where, group, e) from e
        return self._run_steps(where, group, req, progress)

    def _run_steps(self, where, group, req, progress):
        try:
            with collective_timeout(group, self._peer_timeout(), self._group_timeout(group)):
                result = yield from self._steps(*req, progress)
            return result
        except RuntimeError as e:
            raise self._peer_lost(where, group, e) from e

    @staticmethod
    def _peer_lost(where, group, e: RuntimeError) -> RuntimeError:
        """PeerLostError for a collective failure of `group`, else e itself."""
        if group is None or group.size == 1 or not is_peer_failure(e):
            return e
        rt = _current_runtime()
        return peer_lost_error(where, group, rt.peers if rt else None, rt.rank if rt else -1, e)

    def _checked_request(self, where, request) -> tuple:
        """(prompts as lists of python ints, max_new_tokens, sampling, eos_ids, context_fill,
        eos_check_every), the same on every rank of the group."""
        try:
            self._check_open(where)
            if self._stream_open is not None:
                raise RuntimeError(
                    f"{where}: a stream of this {self.fixes.get('owner', 'runner')} is open "
                    "(one request at a time: the stream's steps share its KV cache); iterate "
                    "it to the end or call its close() first")
            prompts, max_new_tokens, sampling, eos_ids, context_fill, eos_check_every = \
                request()
            fields, req = self._request(where, prompts, max_new_tokens, sampling, eos_ids,
                                        context_fill, eos_check_every)
            bad = None
        except (ValueError, TypeError, RuntimeError) as e:
            if isinstance(e, RequestMismatchError) or (isinstance(e, RuntimeError) and
                                                       is_peer_failure(e)):
                raise
            bad, fields, req = e, {"request": f"invalid: {type(e).__name__}: {e}"}, None
        try:
            self._check_same_request(where, fields, None if req is None else req[0])
        except RequestMismatchError as e:
            if bad is None:
                raise
            raise bad from e              # this rank's own error says what to fix here
        if bad is not None:
            raise bad
        return req

    def _peer_timeout(self) -> float:
        return self.peer_timeout_s if self.peer_timeout_s is not None else \
            envs.get("FUSEDIST_TIMEOUT_S")

    @staticmethod
    def _group_timeout(group) -> Optional[float]:
        """The timeout `group` was created with, when fusedist's runtime created it (an adopted
        engine group's is not known, and is left alone)."""
        rt = _current_runtime()
        if group is None or rt is None or group.pg is None:
            return None
        if rt.owns_process_group or any(group.pg is pg for pg in rt.created_groups):
            return rt.timeout_s
        return None

    def _steps(self, prompts, max_new_tokens, sampling, eos_ids, context_fill, eos_check_every,
               progress):
        """The prefill and the decode loop as a generator: yields each step's sampled ids (a
        device tensor [n]) and returns the GenerationResult."""
        n = len(prompts)
        b = self.bucket(n)
        dev = self.device
        self.seq_lens.fill_(1)
        self.capture(b)
        if context_fill:
            self.fill_context(context_fill, sampling.seed)
        gen = torch.Generator(device=dev)
        gen.manual_seed(sampling.seed)
        eos = torch.tensor(list(eos_ids) or [-1], device=dev)
        sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
        check_errors = (lambda: check_device_errors(dev)) if dev.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        logits = self.prefill(prompts, start=context_fill)
        # The step at which each sequence's logits first held NaN (-1: never), kept on the
        # device and read where the loop synchronizes anyway (each streamed step, the end).
        nan_at = torch.where(nan_rows(logits), 0, -1)
        nxt = sample(logits, sampling, gen, check=False)
        sync()
        t1 = time.perf_counter()
        check_errors()   # bad metadata a kernel recorded (the engine's tables), at the sync
        outs = [nxt]
        self._nan_at = nan_at
        yield nxt
        done = torch.isin(nxt, eos)
        lens = torch.tensor([context_fill + len(p) + 1 for p in prompts], dtype=torch.int32)
        self.seq_lens[:n].copy_(lens.to(dev))
        steps = 0
        for step in range(1, max_new_tokens):
            if eos_ids and step % eos_check_every == 0 and bool(done.all()):
                break
            self.tokens[:n].copy_(nxt)
            logits = self.decode_step(b)[:n]
            nan_at = torch.where((nan_at < 0) & nan_rows(logits), step, nan_at)
            self._nan_at = nan_at
            nxt = sample(logits, sampling, gen, check=False)
            self.seq_lens[:n] += 1
            outs.append(nxt)
            yield nxt
            if eos_ids:
                done |= torch.isin(nxt, eos)
            steps += 1
            if progress is not None:
                progress(step + 1, max_new_tokens)
        sync()
        t2 = time.perf_counter()
        check_errors()
        self._check_finite(nan_at)
        ids = torch.stack(outs, dim=1).tolist()
        if eos_ids:
            stop = set(eos_ids)
            ids = [row[:next((i + 1 for i, t in enumerate(row) if t in stop), len(row))]
                   for row in ids]
        return GenerationResult(ids=ids, prefill_ms=(t1 - t0) * 1e3, decode_ms=(t2 - t1) * 1e3,
                                steps=steps, batch=n,
                                prompt_tokens=sum(len(p) for p in prompts),
                                timings={"bucket": b, "graphs": b in self.graphs})

    def _check_finite(self, nan_at: torch.Tensor) -> None:
        """NonFiniteError when a sequence's logits held NaN (nan_at: the step it first did,
        -1: never). Every rank holds the same gathered logits, so every rank raises."""
        steps = nan_at.tolist()
        bad = [(i, t) for i, t in enumerate(steps) if t >= 0]
        if bad:
            what = ", ".join(f"sequence {i} at step {t}" + (" (the prefill)" if t == 0 else "")
                             for i, t in bad[:8])
            raise NonFiniteError(
                f"Runner: the model's logits hold NaN ({what}), so there is no next token to "
                "sample; its weights or activations are not finite (a corrupt checkpoint, or "
                "an activation past its dtype's range, e.g. float16: try bfloat16)")

    def _request(self, where, prompts, max_new_tokens, sampling, eos_ids, context_fill,
                 eos_check_every) -> tuple[dict, tuple]:
        """Check generate()'s arguments here (a ValueError or TypeError naming the argument);
        return the request's fields as the mismatch message shows them, and the request with
        the prompts' ids as python ints (which long prompts' fields abbreviate)."""
        if hasattr(prompts, "tolist") and not isinstance(prompts, (list, tuple)):
            prompts = prompts.tolist()      # a tensor or a numpy array
        if isinstance(prompts, (str, bytes, dict)) or not hasattr(prompts, "__len__") or \
                not hasattr(prompts, "__iter__") or len(prompts) == 0:
            raise ValueError(f"{where}: prompts must be a non-empty list of token-id lists, got "
                             f"{type(prompts).__name__}")
        vocab = getattr(getattr(self.model, "cfg", None), "vocab_size", None)
        ids = []
        for i, p in enumerate(prompts):
            if hasattr(p, "tolist") and not isinstance(p, (list, tuple)):
                p = p.tolist()
            try:
                if isinstance(p, (str, bytes)) or any(isinstance(t, bool) for t in p):
                    raise TypeError
                row = [operator.index(t) for t in p]
            except TypeError:
                raise TypeError(f"{where}: prompts[{i}] must be a sequence of int token ids "
                                f"(not bools or floats), got {p!r:.80}") from None
            if not row:
                raise ValueError(f"{where}: prompts[{i}] is empty; every prompt needs >= 1 "
                                 "token")
            if vocab is not None and not all(0 <= t < vocab for t in row):
                bad = next(t for t in row if not 0 <= t < vocab)
                raise ValueError(f"{where}: prompts[{i}] holds token id {bad}, outside the "
                                 f"model's vocabulary [0, {vocab})")
            ids.append(row)
        max_new_tokens = _int(where, "max_new_tokens", max_new_tokens, 1)
        context_fill = _int(where, "context_fill", context_fill, 0)
        eos_check_every = _int(where, "eos_check_every", eos_check_every, 1)
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"{where}: sampling must be a fusedist.models.SamplingParams, got "
                            f"{type(sampling).__name__}")
        try:
            if isinstance(eos_ids, (str, bytes)) or any(isinstance(t, bool) for t in eos_ids):
                raise TypeError
            stop = sorted({operator.index(t) for t in eos_ids})
        except TypeError:
            raise TypeError(f"{where}: eos_ids must be a sequence of int token ids (e.g. "
                            f"[2] or ()), got {eos_ids!r:.80}") from None
        longest = context_fill + max(len(p) for p in ids) + max_new_tokens
        if longest > self.max_seq_len:
            raise ValueError(f"{where}: {longest} tokens (context + prompt + new) exceed "
                             f"max_seq_len {self.max_seq_len}; {self.fixes['max_seq_len']}, or "
                             "lower max_new_tokens or the prompt")
        if self.max_position is not None and longest > self.max_position:
            raise ValueError(f"{where}: {longest} tokens (context + prompt + new) exceed "
                             f"the model's max_position {self.max_position}; lower "
                             "max_new_tokens or the prompt, or build the model with a larger "
                             "max_position")
        self.bucket(len(ids), where)
        fields = {"request": "valid", "prompts": f"{len(ids)} prompts"}
        fields.update((f"prompts[{i}]", _show_ids(row)) for i, row in enumerate(ids))
        fields["max_new_tokens"] = repr(max_new_tokens)
        for f in ("greedy", "temperature", "top_k", "top_p", "seed"):
            fields[f"sampling.{f}"] = repr(getattr(sampling, f))
        fields["eos_ids"] = repr(stop)
        fields["context_fill"] = repr(context_fill)
        fields["eos_check_every"] = repr(eos_check_every)
        return fields, (ids, max_new_tokens, sampling, stop, context_fill, eos_check_every)

    def _tp_group(self):
        """The model's tensor-parallel fusedist Group (None for a model without one); kept
        from construction, so that a closed runner still agrees with its peers that it is
        closed."""
        return self._group

    def _check_same_request(self, where: str, fields: dict, exact) -> None:
        group = self._tp_group()
        if group is None or group.size == 1:
            return
        group.check_same(
            fields, exact=exact, where=where, what="requests",
            error=RequestMismatchError,
            fix="Every rank of the tensor-parallel group must call generate() with the same "
                "prompts, max_new_tokens, sampling parameters (seed included), eos_ids, "
                "context_fill and eos_check_every: build the request on one rank and send it "
                "to the others (e.g. torch.distributed.broadcast_object_list)")

    @torch.no_grad()
    def time_step(self, n: int, iters: int = 20) -> float:
        """ms per decode step of batch n alone (graph replays back to back, CUDA events;
        no sampling). Call after generate(): each replay rewrites the slot at seq_lens - 1."""
        b = self.bucket(n)
        if self.device.type != "cuda":
            t0 = time.perf_counter()
            for _ in range(iters):
                self.decode_step(b)
            return (time.perf_counter() - t0) * 1e3 / iters
        self.decode_step(b)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            self.decode_step(b)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / iters

    @torch.no_grad()
    def time_prefill(self, prompts: Sequence[Sequence[int]], start: int = 0,
                     reps: int = 3) -> list[float]:
        """ms of each of `reps` prefills of `prompts` after `start` cached tokens, the device
        synchronized before and after each (host wall time: the launches and any host work of
        the prefill included). Call after a warm-up at the same shapes (generate() of these
        prompts): a first call at a shape pays cuDNN / cuBLAS planning. Each prefill rewrites
        the prompts' cache slots with the same keys and values."""
        if reps < 1:
            raise ValueError(f"Runner.time_prefill: reps must be >= 1, got {reps}")
        sync = (lambda: torch.cuda.synchronize(self.device)) if self.device.type == "cuda" \
            else (lambda: None)
        out = []
        for _ in range(reps):
            sync()
            t0 = time.perf_counter()
            self.prefill(prompts, start=start)
            sync()
            out.append((time.perf_counter() - t0) * 1e3)
        return out

    # ---- profile -------------------------------------------------------------------------
    @torch.no_grad()
    def profile_step(self, n: int, top: int = 12) -> dict:
        """One decode step of batch n under torch.profiler, run eagerly (the graph's kernels,
        each named; their durations are the replay's, the launch gaps are not counted):
        kernel time per class (GEMM / attention / communication / other), us, and the `top`
        kernels. Call after generate(): the step writes the cache slot at each row's
        seq_lens - 1."""
        b = self.bucket(n)
        self._body(b)
        return profile(lambda: self._body(b), self.device, top)

    @torch.no_grad()
    def profile_timeline(self, n: int, reps: int = 5, top: int = 5) -> dict:
        """The device timeline of `reps` decode steps of batch n back to back, as time_step
        runs them (the bucket's graph replay where captured; CUDA only): per step its wall
        time, the time some kernel runs ("busy_us"), the idle rest ("bubble_us",
        "bubble_pct"), the kernel count and the largest gaps (profiling.timeline), plus
        "graphs", whether the steps were graph replays. Call after generate(), as time_step."""
        b = self.bucket(n)
        self.decode_step(b)
        out = profile_timeline(lambda: self.decode_step(b), self.device, reps, top)
        out["graphs"] = b in self.graphs
        return out

    @torch.no_grad()
    def profile_prefill(self, prompts: Sequence[Sequence[int]], start: int = 0,
                        top: int = 12) -> dict:
        """One prefill of `prompts` after `start` cached tokens under torch.profiler: the
        classes and top kernels of profile_step, plus "wall_us", the profiled call's host
        wall time (profiler overhead included), and "kernels", the kernel count. Call after
        a warm-up at the same shapes. Runs eagerly (every kernel named; a graph replay's
        kernels would show without their launches)."""
        keep, self.prefill_graph_tokens = self.prefill_graph_tokens, 0
        try:
            return profile(lambda: self.prefill(prompts, start=start), self.device, top)
        finally:
            self.prefill_graph_tokens = keep
