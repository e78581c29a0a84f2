"""Hugging Face conventions around a checkpoint directory: its tokenizer (AutoTokenizer when
transformers is installed: chat templates, sentencepiece tokenizers; else tokenizer.json
through the `tokenizers` library), its generation_config.json (EOS ids, default sampling) and
its torch_dtype."""

from __future__ import annotations

import json
import numbers
import os
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

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
    the new id completes ("" while it ends inside a multi-byte character)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer, self.ids, self.text = tokenizer, [], ""

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):      # an incomplete UTF-8 sequence: wait for the rest
            return ""
        delta = text[len(self.text):] if text.startswith(self.text) else text
        self.text = text
        return delta


@dataclass(frozen=True)
class GenerationDefaults:
    """generation_config.json's EOS ids and sampling defaults, Hugging Face's meaning:
    do_sample False is greedy whatever the temperature says; sampling without top_k uses
    transformers' default of 50."""
    eos_token_ids: tuple = ()
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 50
    top_p: float = 1.0
    max_new_tokens: Optional[int] = None
    source: str = ""

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
        for key, lo in (("temperature", 0.0), ("top_p", 0.0)):
            if d.get(key) is not None:
                v = d[key]
                if isinstance(v, bool) or not isinstance(v, numbers.Real) or v < lo or \
                        (key == "top_p" and not 0 < v <= 1):
                    bad(key, "a number in (0, 1]" if key == "top_p" else "a number >= 0")
                kw[key] = float(v)
        for key in ("top_k", "max_new_tokens"):
            if d.get(key) is not None:
                v = d[key]
                if isinstance(v, bool) or not isinstance(v, int) or v < (0 if key == "top_k"
                                                                          else 1):
                    bad(key, "an int >= 0" if key == "top_k" else "an int >= 1")
                kw[key] = v
        return cls(**kw)

    def sampling(self, *, greedy: Optional[bool] = None, temperature: Optional[float] = None,
                 top_k: Optional[int] = None, top_p: Optional[float] = None,
                 seed: int = 0) -> SamplingParams:
        """SamplingParams from these defaults and the caller's overrides (None: the default).
        greedy=True forces greedy; a temperature / top_k / top_p given turns sampling on, the
        others taken from these defaults."""
        if greedy is None:
            greedy = not self.do_sample and temperature is None and top_k is None and \
                top_p is None
        return SamplingParams(
            greedy=bool(greedy), seed=seed,
            temperature=self.temperature if temperature is None else temperature,
            top_k=(self.top_k if self.do_sample else 0) if top_k is None else top_k,
            top_p=self.top_p if top_p is None else top_p)


def checkpoint_dtype(cfg) -> Optional[torch.dtype]:
    """The dtype config.json names (torch_dtype, or dtype in transformers >= 5), when it is
    float32 / float16 / bfloat16; None otherwise."""
    extra = getattr(cfg, "extra", None) or {}
    name = extra.get("torch_dtype") or extra.get("dtype")
    return CHECKPOINT_DTYPES.get(str(name).replace("torch.", "")) if name else None
