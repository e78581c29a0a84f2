"""Per-request sampling and stopping for the continuous-batching engine (scheduler.py).

    params = GenerationParams(max_tokens=64, temperature=0.7, top_p=0.9, min_p=0.05,
                              repetition_penalty=1.1, stop=("\\n\\n",), n=2, logprobs=3, seed=1)
    rows = [SampleRow(params, seed, choice, step, prompt_ids, output_ids, eos_ids), ...]
    ids, logprobs = sample_rows(logits, rows)          # logits [len(rows), vocab]

Every row of a batch carries its own parameters; the batch is processed in one pass of
tensor ops (no per-row loop on the device), in transformers' order:
  1. penalties on the raw logits: repetition_penalty over the prompt and the output (HF's
     RepetitionPenaltyLogitsProcessor: a positive logit divided by it, a negative one
     multiplied), then presence / frequency penalties over the output (OpenAI's meaning:
     logit -= presence * [count > 0] + frequency * count); min_tokens keeps the stop ids out
     until that many tokens are out;
  2. temperature 0 (or top_k 1): the argmax; else logits / temperature, top_k, top_p (HF's:
     the smallest set whose probability reaches top_p; at least one token), min_p (tokens below
     min_p x the top token's probability dropped), then one draw.

The draw is a Gumbel / exponential race, argmax(log p - log E), whose noise E is a function of
(seed, choice, step, token id) only: a counter-based hash, not a generator's state. A request's
sample therefore does not depend on where it sits in the batch or what else is in it (the same
logits give the same token), is identical on every rank of a tensor-parallel group (which hold
the same gathered logits), and survives preemption (a recomputed sequence resumes its stream at
the same step). Choice i of an n > 1 request draws from its own stream.

logprobs are the model's: log_softmax of the raw logits (before penalties and temperature), the
sampled token's and the top-N (OpenAI's `logprobs` / `top_logprobs`).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field, fields
from typing import Optional, Sequence

import torch


class ParamError(ValueError):
    """A request parameter that is out of range or of the wrong type; `param` names it."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)


@dataclass(frozen=True)
class GenerationParams:
    """What to generate for one request and when to stop. Defaults are neutral (sampling at
    temperature 1 over the whole vocabulary); generation_config.json's defaults come from
    fusedist.models.hf.GenerationDefaults.params()."""
    max_tokens: int = 16            # new tokens per choice
    temperature: float = 1.0        # 0: greedy
    top_p: float = 1.0              # 1: off
    top_k: int = 0                  # 0: off
    min_p: float = 0.0              # 0: off
    repetition_penalty: float = 1.0  # 1: off (HF's meaning, prompt and output)
    presence_penalty: float = 0.0   # OpenAI's meaning, output tokens
    frequency_penalty: float = 0.0
    seed: Optional[int] = None      # None: the engine draws one
    n: int = 1                      # choices sharing the prompt's KV pages
    logprobs: Optional[int] = None  # top-N logprobs per token (0: the sampled token's only)
    stop: tuple = ()                # stop strings (matched across token boundaries)
    stop_token_ids: tuple = ()
    ignore_eos: bool = False
    min_tokens: int = 0             # stop ids and strings are not honoured before this many
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    MAX_LOGPROBS = 20               # OpenAI's top_logprobs limit

    def __post_init__(self):
        def bad(name, want):
            raise ParamError(name, f"{name} must be {want}, got {getattr(self, name)!r}")

        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            bad("max_tokens", "an int >= 1")
        if not _is_num(self.temperature) or self.temperature < 0:
            bad("temperature", "a finite number >= 0 (0: greedy)")
        if not _is_num(self.top_p) or not 0 < self.top_p <= 1:
            bad("top_p", "a number in (0, 1] (1: off)")
        if not _is_int(self.top_k) or self.top_k < 0:
            bad("top_k", "an int >= 0 (0: off)")
        if not _is_num(self.min_p) or not 0 <= self.min_p <= 1:
            bad("min_p", "a number in [0, 1] (0: off)")
        if not _is_num(self.repetition_penalty) or self.repetition_penalty <= 0:
            bad("repetition_penalty", "a finite number > 0 (1: off)")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_num(v) or not -2 <= v <= 2:
                bad(name, "a number in [-2, 2] (0: off)")
        if self.seed is not None and (not _is_int(self.seed) or
                                      not -2 ** 63 <= self.seed < 2 ** 64):
            bad("seed", "None or an int in [-2**63, 2**64)")
        if not _is_int(self.n) or self.n < 1:
            bad("n", "an int >= 1")
        if self.logprobs is not None and (not _is_int(self.logprobs) or
                                          not 0 <= self.logprobs <= self.MAX_LOGPROBS):
            bad("logprobs", f"None or an int in [0, {self.MAX_LOGPROBS}]")
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s
                                                          for s in stop):
            bad("stop", "a non-empty str or a list of them")
        object.__setattr__(self, "stop", tuple(stop))
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or not all(_is_int(t) and t >= 0 for t in ids):
            bad("stop_token_ids", "a list of token ids (ints >= 0)")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in ids))
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                bad(name, "true or false")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            bad("min_tokens", "an int >= 0")

    @property
    def greedy(self) -> bool:
        """Argmax: temperature 0 (below 1e-5, where logits / temperature would overflow the
        softmax) or top_k 1."""
        return self.temperature < 1e-5 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or \
            self.frequency_penalty != 0

    def replace(self, **kw) -> "GenerationParams":
        names = {f.name for f in fields(self)}
        for k in kw:
            if k not in names:
                raise ParamError(k, f"GenerationParams has no field {k!r}")
        return GenerationParams(**{**{f.name: getattr(self, f.name) for f in fields(self)},
                                   **kw})


@dataclass
class SampleRow:
    """One row of a sampling batch: a choice of a request at its `step` (tokens it has out)."""
    params: GenerationParams
    seed: int                       # the request's resolved seed
    choice: int
    step: int
    prompt_ids: Sequence[int] = ()
    output_ids: Sequence[int] = ()
    eos_ids: Sequence[int] = field(default_factory=tuple)


# ---- the counter-based noise ------------------------------------------------------------
_M32 = 0xFFFFFFFF


def _mix32(x):
    """A 32-bit integer hash (two multiply-xorshift rounds; constant < 2**27 so that the
    product of a 32-bit value stays inside int64 on every device). Works on Python ints and
    int64 tensors alike."""
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    return (x >> 16) ^ x


def row_key(seed: int, choice: int, step: int) -> int:
    """The noise key of (seed, choice, step): a 32-bit value, computed on the host."""
    s = seed & 0xFFFFFFFFFFFFFFFF
    k = _mix32((step + 0x2545F491) & _M32)
    k = _mix32(k ^ ((choice + 0x68E31DA4) & _M32))
    k = _mix32(k ^ (s >> 32))
    return _mix32(k ^ (s & _M32))


_VOCAB_HASH: dict = {}


def _vocab_hash(vocab: int, device) -> torch.Tensor:
    key = (vocab, str(device))
    t = _VOCAB_HASH.get(key)
    if t is None:
        t = _mix32((torch.arange(vocab, dtype=torch.int64, device=device) + 0x5BD1E995) & _M32)
        _VOCAB_HASH[key] = t
    return t


def exponential_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """float32 [len(keys), vocab] of Exp(1) draws, element (r, v) a function of keys[r] and v
    only: -log(u), u = (24 hashed bits + 0.5) / 2**24 in (0, 1)."""
    x = _mix32(keys[:, None] ^ _vocab_hash(vocab, keys.device)[None, :])
    u = ((x >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))
    return -torch.log(u)


# ---- the batch -------------------------------------------------------------------------
def _token_counts(lists: Sequence[Sequence[int]], vocab: int, device) -> torch.Tensor:
    """float32 [len(lists), vocab]: how often each id occurs in each list."""
    width = max((len(x) for x in lists), default=0)
    out = torch.zeros(len(lists), vocab, dtype=torch.float32, device=device)
    if width == 0:
        return out
    idx = torch.zeros(len(lists), width, dtype=torch.int64)
    w = torch.zeros(len(lists), width, dtype=torch.float32)
    for i, x in enumerate(lists):
        if x:
            idx[i, :len(x)] = torch.as_tensor(list(x), dtype=torch.int64)
            w[i, :len(x)] = 1.0
    return out.scatter_add_(1, to_device(idx, out.device), to_device(w, out.device))


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor t on `device`; to a GPU through pinned memory, without waiting for the
    stream (a copy from pageable memory waits for the work queued before it, which the
    engine's launched-ahead step must not: fusedist.models.Engine's overlap)."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def _tensor(values, device, dtype) -> torch.Tensor:
    return to_device(torch.tensor(values, dtype=dtype), torch.device(device))


def _column(values, device, dtype=torch.float32) -> torch.Tensor:
    return _tensor(values, device, dtype)[:, None]


def process_logits(logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    """Penalties and min_tokens applied to float32 logits [n, vocab] (a new tensor)."""
    lg = logits.float().clone()
    n, V = lg.shape
    dev = lg.device
    pen = [i for i, r in enumerate(rows) if r.params.penalized]
    if pen:
        sel = _tensor(pen, dev, torch.int64)
        part = lg.index_select(0, sel)
        rp = [rows[i].params.repetition_penalty for i in pen]
        if any(p != 1 for p in rp):
            seen = _token_counts([list(rows[i].prompt_ids) + list(rows[i].output_ids)
                                  for i in pen], V, dev) > 0
            p = _column(rp, dev)
            part = torch.where(seen, torch.where(part > 0, part / p, part * p), part)
        pres = [rows[i].params.presence_penalty for i in pen]
        freq = [rows[i].params.frequency_penalty for i in pen]
        if any(pres) or any(freq):
            counts = _token_counts([rows[i].output_ids for i in pen], V, dev)
            part = part - _column(freq, dev) * counts - _column(pres, dev) * (counts > 0)
        lg.index_copy_(0, sel, part)
    early = [(i, t) for i, r in enumerate(rows) if r.step < r.params.min_tokens
             for t in set(r.params.stop_token_ids) |
             (set() if r.params.ignore_eos else set(r.eos_ids)) if 0 <= t < V]
    if early:
        ri, ti = zip(*early)
        # the fill value made on the device: a Python number would be copied from pageable
        # host memory, which waits for the stream
        lg.index_put_((_tensor(ri, dev, torch.int64), _tensor(ti, dev, torch.int64)),
                      lg.new_full((len(ri),), float("-inf")))
    return lg


def warp(lg: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    """The scores each row samples from: logits [n, vocab] (after process_logits) / the row's
    temperature, tokens outside its top_k, top_p and min_p sets at -inf (transformers' warpers,
    in its order; every row keeps at least its top token). Rows must not be greedy."""
    n, V = lg.shape
    dev = lg.device
    s = lg / _column([r.params.temperature for r in rows], dev)
    ks = [r.params.top_k if r.params.top_k and r.params.top_k < V else V for r in rows]
    ps = [r.params.top_p for r in rows]
    mps = [r.params.min_p for r in rows]
    if all(k == V for k in ks) and all(p >= 1 for p in ps) and not any(mps):
        return s
    srt, order = torch.sort(s, dim=-1, descending=True)
    rank = torch.arange(V, device=dev)[None, :]
    srt = srt.masked_fill(rank >= _column(ks, dev, torch.int64), float("-inf"))
    if any(p < 1 for p in ps):
        prob = srt.softmax(-1)
        before = prob.cumsum(-1) - prob            # mass of the tokens ranked above
        srt = srt.masked_fill((before >= _column(ps, dev)) & (rank > 0), float("-inf"))
    if any(mps):
        prob = srt.softmax(-1)
        srt = srt.masked_fill((prob < _column(mps, dev) * prob[:, :1]) & (rank > 0),
                              float("-inf"))
    return torch.empty_like(s).scatter_(1, order, srt)


class Sampled:
    """Sampled ids on the device (`ids`, int64 [n]) on their way to the host: result() waits
    for their copy only (not for work queued after them on the stream) and returns
    sample_rows' (ids, logprobs)."""

    def __init__(self, ids: torch.Tensor, rows: Sequence[SampleRow], want: list,
                 mine: Optional[torch.Tensor] = None, top=None):
        self.ids, self._n, self._want = ids, len(rows), want
        self._ks = [rows[i].params.logprobs for i in want]
        parts = [ids] + ([mine] if mine is not None else []) + \
            ([top.values, top.indices] if top is not None else [])
        cuda = ids.is_cuda
        # to("cpu", non_blocking=True) lands in pinned memory; the event marks the copies
        self._host = [t.to("cpu", non_blocking=cuda) for t in parts]
        self._event = None
        if cuda:
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(ids.device))

    def result(self) -> tuple[list, list]:
        if self._event is not None:
            self._event.synchronize()
        host_ids = self._host[0].tolist()
        if not self._want:
            return host_ids, [None] * self._n
        mine_h = self._host[1].tolist()
        top_v = self._host[2].tolist() if len(self._host) > 2 else None
        top_i = self._host[3].tolist() if len(self._host) > 2 else None
        out: list = [None] * self._n
        for j, (i, k) in enumerate(zip(self._want, self._ks)):
            out[i] = (mine_h[j], list(zip(top_i[j][:k], top_v[j][:k])) if k else [])
        return host_ids, out


def sample_rows(logits: torch.Tensor, rows: Sequence[SampleRow]) -> tuple[list, list]:
    """Next ids (a host list of ints) for logits [len(rows), vocab], and per row None or
    (the sampled id's logprob, [(id, logprob) of the top N]) when its params ask for
    logprobs. One device-to-host copy."""
    return sample_rows_async(logits, rows).result()


def sample_rows_async(logits: torch.Tensor, rows: Sequence[SampleRow]) -> Sampled:
    """sample_rows with the device work queued and the host copies started, not waited for:
    Sampled.result() gives what sample_rows returns; Sampled.ids stays on the device (the
    next decode step's input tokens)."""
    n, V = logits.shape
    if n != len(rows):
        raise ValueError(f"sample_rows: logits has {n} rows for {len(rows)} sample rows")
    dev = logits.device
    if n == 0:
        return Sampled(torch.zeros(0, dtype=torch.int64, device=dev), rows, [])
    lg = process_logits(logits, rows)
    ids = lg.argmax(dim=-1)
    samp = [i for i, r in enumerate(rows) if not r.params.greedy]
    if samp:
        sel = _tensor(samp, dev, torch.int64)
        scores = warp(lg.index_select(0, sel), [rows[i] for i in samp])
        keys = _tensor([row_key(rows[i].seed, rows[i].choice, rows[i].step) for i in samp],
                       dev, torch.int64)
        # the exponential race: argmax p / E == argmax log p - log E
        race = scores.log_softmax(-1) - exponential_noise(keys, V).log()
        ids = ids.index_copy(0, sel, race.argmax(-1))
    want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    if not want:
        return Sampled(ids, rows, want)
    sel = _tensor(want, dev, torch.int64)
    raw = logits.index_select(0, sel).float().log_softmax(-1)
    mine = raw.gather(1, ids.index_select(0, sel)[:, None]).squeeze(1)
    top_n = max(rows[i].params.logprobs for i in want)
    top = raw.topk(top_n, dim=-1) if top_n else None
    return Sampled(ids, rows, want, mine, top)


__all__ = ["GenerationParams", "ParamError", "SampleRow", "Sampled", "sample_rows",
           "sample_rows_async", "process_logits", "warp", "exponential_noise", "row_key",
           "to_device"]
