"""Hugging Face conventions around a checkpoint directory: its tokenizer (AutoTokenizer when
transformers is installed: chat templates, sentencepiece tokenizers; else tokenizer.json
through the `tokenizers` library), its generation_config.json (EOS ids, default sampling) and
its torch_dtype."""

from __future__ import annotations

import json
import numbers
import os
import warnings
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .detokenize import IncrementalDetokenizer
from .sampler import GenerationParams
from .sampling import SamplingParams

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")
CHECKPOINT_DTYPES = {"float32": torch.float32, "float16": torch.float16,
                     "bfloat16": torch.bfloat16}


class Tokenizer:
    """encode / decode / chat over one of two implementations: `kind` "transformers"
    (AutoTokenizer) or "tokenizers" (tokenizer.json alone; no chat template)."""

    def __init__(self, impl, kind: str, path: str):
        self.impl, self.kind, self.path = impl, kind, path

    def encode(self, text: str) -> list:
        if not isinstance(text, str):
            raise TypeError(f"Tokenizer.encode: text must be a str, got {type(text).__name__}")
        if self.kind == "transformers":
            return list(self.impl.encode(text))
        return list(self.impl.encode(text).ids)

    def decode(self, ids: Sequence[int]) -> str:
        """The text of `ids`, special tokens (EOS, ...) left out."""
        return self.impl.decode(list(ids), skip_special_tokens=True)

    @property
    def has_chat_template(self) -> bool:
        return self.kind == "transformers" and bool(getattr(self.impl, "chat_template", None))

    def chat(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> list:
        """Prompt ids of `messages` ([{"role": "user", "content": "..."}, ...]) through the
        checkpoint's chat template (tokenizer_config.json's chat_template)."""
        if not self.has_chat_template:
            why = ("transformers is not installed (pip install transformers)"
                   if self.kind == "tokenizers" else
                   "the checkpoint's tokenizer_config.json has no chat_template")
            raise ValueError(f"fusedist.models: no chat template for {self.path}: {why}; pass "
                             "the prompt as plain text instead")
        if not isinstance(messages, (list, tuple)) or not all(
                isinstance(m, dict) and "role" in m and "content" in m for m in messages):
            raise TypeError("fusedist.models: messages must be a list of {'role': ..., "
                            f"'content': ...}} dicts, got {messages!r:.100}")
        if not messages:
            raise ValueError("fusedist.models: messages is empty; a chat prompt needs at least "
                             "one {'role': ..., 'content': ...} message")
        try:
            out = self.impl.apply_chat_template(list(messages), tokenize=True,
                                                add_generation_prompt=add_generation_prompt)
        except Exception as e:  # noqa: BLE001 - jinja2's and transformers' own error types
            raise ValueError(f"fusedist.models: the chat template of {self.path} rejected the "
                             f"messages ({type(e).__name__}: {e}); change the conversation to "
                             "what the template accepts (its message says how)") from None
        if isinstance(out, dict) or hasattr(out, "input_ids"):   # a BatchEncoding
            out = out["input_ids"]
        return [int(t) for t in out]


def load_tokenizer(path: Optional[str]) -> Optional[Tokenizer]:
    """The tokenizer of checkpoint directory `path`; None when it has no tokenizer files.
    AutoTokenizer when transformers is installed and the directory has tokenizer_config.json
    (or no tokenizer.json); else tokenizer.json through `tokenizers`."""
    if path is None or not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
        return None
    try:
        import transformers
    except ImportError:
        transformers = None
    tj = os.path.join(path, "tokenizer.json")
    # A truncated or hand-edited tokenizer_config.json would be skipped without a word (and
    # the chat template in it lost): refuse it, naming the file.
    tc = os.path.join(path, "tokenizer_config.json")
    if os.path.isfile(tc):
        from .llama.config import load_json
        load_json(tc, "fix or re-download the checkpoint's tokenizer_config.json")
    # Without tokenizer_config.json AutoTokenizer would pick a class from config.json's
    # model_type and rebuild it from the vocabulary; tokenizer.json alone is what was saved.
    auto = transformers is not None and (
        os.path.isfile(os.path.join(path, "tokenizer_config.json")) or not os.path.isfile(tj))
    if auto:
        try:
            return Tokenizer(transformers.AutoTokenizer.from_pretrained(path), "transformers",
                             path)
        except Exception as e:  # noqa: BLE001 - transformers raises many types here
            error = e
        if not os.path.isfile(os.path.join(path, "tokenizer.json")):
            raise ValueError(f"fusedist.models: transformers.AutoTokenizer cannot read the "
                             f"tokenizer in {path!r} ({type(error).__name__}: {error}); fix "
                             "or re-download its tokenizer files") from error
    if not os.path.isfile(tj):
        raise ValueError(f"fusedist.models: {path!r} has no tokenizer.json, and its other "
                         "tokenizer files (e.g. a sentencepiece tokenizer.model) need "
                         "transformers: pip install transformers sentencepiece")
    try:
        from tokenizers import Tokenizer as RawTokenizer
    except ImportError:
        raise ValueError("fusedist.models: reading tokenizer.json needs transformers or "
                         "tokenizers: pip install transformers") from None
    try:
        return Tokenizer(RawTokenizer.from_file(tj), "tokenizers", path)
    except Exception as e:  # noqa: BLE001 - tokenizers raises its own Exception types
        raise ValueError(f"fusedist.models: {tj} is not a readable tokenizer ({e}); fix or "
                         "re-download it") from e


class TextStream:
    """Decoded text of a growing list of ids, handed out as deltas: push(id) returns the text
    the new id completes ("" while it ends inside a multi-byte character). Incremental
    (detokenize.IncrementalDetokenizer, no prompt context): O(1) per id, and the deltas add up
    to decode(ids)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer, self.ids, self.text = tokenizer, [], ""
        self._detok = IncrementalDetokenizer(tokenizer, (), context=0)

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        delta = self._detok.push(token_id)
        self.text += delta
        return delta


# generation_config.json fields that change nothing fusedist computes (ids of special tokens
# the prompt side uses, bookkeeping, what transformers returns).
_NEUTRAL_FIELDS = frozenset({
    "bos_token_id", "pad_token_id", "decoder_start_token_id", "transformers_version",
    "_from_model_config", "use_cache", "return_dict_in_generate", "output_attentions",
    "output_hidden_states", "output_scores", "output_logits", "cache_implementation",
    "cache_config", "return_legacy_cache", "is_assistant", "compile_config",
    "disable_compile"})
# Fields fusedist does not implement, with the value at which they do nothing: any other value
# is a warning naming the field.
_UNSUPPORTED = {
    "num_beams": 1, "num_beam_groups": 1, "penalty_alpha": None, "typical_p": 1.0,
    "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "diversity_penalty": 0.0,
    "encoder_repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0, "bad_words_ids": None, "force_words_ids": None,
    "renormalize_logits": False, "constraints": None, "forced_bos_token_id": None,
    "forced_eos_token_id": None, "exponential_decay_length_penalty": None,
    "suppress_tokens": None, "begin_suppress_tokens": None, "sequence_bias": None,
    "guidance_scale": None, "max_time": None, "top_h": None, "dola_layers": None,
    "watermarking_config": None, "prompt_lookup_num_tokens": None,
    "remove_invalid_values": False, "token_healing": False, "low_memory": None,
    "max_matching_ngram_size": None, "assistant_early_exit": None,
    "num_assistant_tokens": None, "num_assistant_tokens_schedule": None,
    "assistant_confidence_threshold": None}
# Fields whose effect is only with beam search (num_beams > 1, itself warned about).
_BEAM_ONLY = frozenset({"length_penalty", "early_stopping"})


@dataclass(frozen=True)
class GenerationDefaults:
    """generation_config.json's EOS ids and sampling defaults, Hugging Face's meaning field by
    field: do_sample False is greedy whatever the temperature says; sampling without top_k uses
    transformers' default of 50; repetition_penalty (prompt and output), min_p, min_new_tokens
    / min_length, max_new_tokens / max_length, stop_strings and num_return_sequences become the
    defaults of fusedist.models.Engine's requests (params()). A field fusedist does not
    implement, set to a value that would change the output (num_beams > 1, typical_p, ...),
    or a field it does not know, is a warning naming it (`ignored` lists them)."""
    eos_token_ids: tuple = ()
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 50
    top_p: float = 1.0
    max_new_tokens: Optional[int] = None
    source: str = ""
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    max_length: Optional[int] = None     # prompt + new tokens (max_new_tokens wins)
    min_length: int = 0                  # prompt + new tokens before EOS may end it
    stop_strings: tuple = ()
    num_return_sequences: int = 1
    ignored: tuple = ()                  # fields read but not honoured (warned about)

    @classmethod
    def from_dir(cls, path: Optional[str], eos_token_ids: Sequence[int] = ()) -> \
            "GenerationDefaults":
        """From path/generation_config.json; without it, greedy with `eos_token_ids` (the
        config.json's)."""
        f = None if path is None else os.path.join(path, "generation_config.json")
        if f is None or not os.path.isfile(f):
            return cls(eos_token_ids=tuple(eos_token_ids))
        try:
            with open(f) as fh:
                d = json.load(fh)
        except (OSError, ValueError) as e:
            raise ValueError(f"fusedist.models: {f} is not readable JSON ({e}); fix or delete "
                             "it") from None
        if not isinstance(d, dict):
            raise ValueError(f"fusedist.models: {f} must hold a JSON object")
        return cls.from_dict(d, eos_token_ids, f)

    @classmethod
    def from_dict(cls, d: dict, eos_token_ids: Sequence[int] = (),
                  source: str = "generation_config.json") -> "GenerationDefaults":
        f = source

        def bad(key, want):
            raise ValueError(f"fusedist.models: {f}: {key} must be {want}, got {d[key]!r}; "
                             "fix the file")

        eos = d.get("eos_token_id")
        if eos is None:
            eos = tuple(eos_token_ids)
        else:
            eos = tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
            if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in eos):
                bad("eos_token_id", "a token id or a list of token ids")
        kw = {"eos_token_ids": eos, "source": f}
        if d.get("do_sample") is not None:
            if not isinstance(d["do_sample"], bool):
                bad("do_sample", "true or false")
            kw["do_sample"] = d["do_sample"]
        for key, lo in (("temperature", 0.0), ("top_p", 0.0), ("min_p", 0.0),
                        ("repetition_penalty", 0.0)):
            if d.get(key) is not None:
                v = d[key]
                if isinstance(v, bool) or not isinstance(v, numbers.Real) or v < lo or \
                        (key == "top_p" and not 0 < v <= 1) or (key == "min_p" and v > 1) or \
                        (key == "repetition_penalty" and v <= 0):
                    bad(key, {"top_p": "a number in (0, 1]", "min_p": "a number in [0, 1]",
                              "repetition_penalty": "a number > 0"}.get(key, "a number >= 0"))
                kw[key] = float(v)
        for key, lo in (("top_k", 0), ("max_new_tokens", 1), ("min_new_tokens", 0),
                        ("max_length", 1), ("min_length", 0), ("num_return_sequences", 1)):
            if d.get(key) is not None:
                v = d[key]
                if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                    bad(key, f"an int >= {lo}")
                kw[key] = v
        if d.get("stop_strings") is not None:
            v = d["stop_strings"]
            v = [v] if isinstance(v, str) else v
            if not isinstance(v, list) or not all(isinstance(x, str) and x for x in v):
                bad("stop_strings", "a string or a list of strings")
            kw["stop_strings"] = tuple(v)
        ignored = []
        for key, v in d.items():
            if key in _UNSUPPORTED:
                if v != _UNSUPPORTED[key] and not (key == "num_beams" and v == 1):
                    ignored.append(key)
                    warnings.warn(f"fusedist.models: {f}: {key}={v!r} is not honoured "
                                  "(fusedist does not implement it); generation goes on "
                                  "without it", stacklevel=3)
            elif key in _BEAM_ONLY:
                pass                        # no effect without num_beams > 1
            elif key not in _NEUTRAL_FIELDS and key not in cls.__dataclass_fields__ and \
                    key not in ("eos_token_id", "stop_strings"):
                ignored.append(key)
                warnings.warn(f"fusedist.models: {f}: {key}={v!r} is not a field fusedist "
                              "knows; it is not honoured", stacklevel=3)
        kw["ignored"] = tuple(ignored)
        return cls(**kw)

    def sampling(self, *, greedy: Optional[bool] = None, temperature: Optional[float] = None,
                 top_k: Optional[int] = None, top_p: Optional[float] = None,
                 seed: int = 0) -> SamplingParams:
        """SamplingParams from these defaults and the caller's overrides (None: the default).
        greedy=True forces greedy; a temperature / top_k / top_p given turns sampling on, the
        others taken from these defaults. The static Runner's sampling has no penalties, min_p,
        min_new_tokens or stop strings: fields of the file that set them are a warning here
        (fusedist.models.Engine honours them)."""
        dropped = [f"{k}={getattr(self, k)!r}" for k, off in
                   (("repetition_penalty", 1.0), ("min_p", 0.0), ("min_new_tokens", 0),
                    ("min_length", 0), ("stop_strings", ()), ("num_return_sequences", 1))
                   if getattr(self, k) != off]
        if dropped:
            warnings.warn(f"fusedist.models: {self.source}: {', '.join(dropped)} not applied "
                          "by the static Runner's sampling (LLM.generate / stream); "
                          "fusedist.models.Engine and python -m fusedist.serve apply them",
                          stacklevel=3)
        if greedy is None:
            greedy = not self.do_sample and temperature is None and top_k is None and \
                top_p is None
        return SamplingParams(
            greedy=bool(greedy), seed=seed,
            temperature=self.temperature if temperature is None else temperature,
            top_k=(self.top_k if self.do_sample else 0) if top_k is None else top_k,
            top_p=self.top_p if top_p is None else top_p)

    def params(self, prompt_len: int = 0, **overrides) -> GenerationParams:
        """GenerationParams of a request from these defaults, transformers' meaning, and the
        request's `overrides` (GenerationParams fields; None values are left to the
        defaults). Greedy unless do_sample or the request sets temperature / top_k / top_p /
        min_p; sampling without top_k takes the file's (transformers' 50) only when do_sample
        is set. max_tokens: max_new_tokens, else max_length - prompt_len, else 64."""
        o = {k: v for k, v in overrides.items() if v is not None}
        sampling_asked = any(k in o for k in ("temperature", "top_k", "top_p", "min_p"))
        kw = {"repetition_penalty": self.repetition_penalty,
              "min_tokens": max(self.min_new_tokens, self.min_length - prompt_len, 0),
              "stop": self.stop_strings, "n": self.num_return_sequences}
        if self.max_new_tokens is not None:
            kw["max_tokens"] = self.max_new_tokens
        elif self.max_length is not None and self.max_length > prompt_len:
            kw["max_tokens"] = self.max_length - prompt_len
        else:
            kw["max_tokens"] = 64
        if self.do_sample or sampling_asked:
            kw.update(temperature=self.temperature, top_k=self.top_k if self.do_sample else 0,
                      top_p=self.top_p, min_p=self.min_p)
        else:
            kw["temperature"] = 0.0
        kw.update(o)
        return GenerationParams(**kw)


def checkpoint_dtype(cfg) -> Optional[torch.dtype]:
    """The dtype config.json names (torch_dtype, or dtype in transformers >= 5), when it is
    float32 / float16 / bfloat16; None otherwise."""
    extra = getattr(cfg, "extra", None) or {}
    name = extra.get("torch_dtype") or extra.get("dtype")
    return CHECKPOINT_DTYPES.get(str(name).replace("torch.", "")) if name else None
