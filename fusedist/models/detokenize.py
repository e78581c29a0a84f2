"""Incremental detokenization and stop strings, per generated choice.

IncrementalDetokenizer turns one id at a time into the text it adds, in O(1) per id: the
`tokenizers` library's streaming decoder (tokenizers.decoders.DecodeStream, which buffers ids
until they make whole UTF-8 characters) for fast tokenizers, or, for a tokenizer without a
`tokenizers` backend, the window method (decode the last few ids twice, before and after the
new one, and hand out the difference once it ends in a whole character). Either way the text
continues the prompt: the decoder starts from the prompt's last ids, so a first token that
opens with a word boundary comes out with its space (" Paris"), as OpenAI-style servers return
it.

TextAssembler adds stop strings on top: the text is searched for each stop string from where
the previous delta could have started one (a stop string split across tokens is found), the
output ends before the stop string (or after it, include_stop_str=True), and while a choice
runs the last len(longest stop) - 1 characters are held back, since they may begin a stop
string that the next token completes.
"""

from __future__ import annotations

from typing import Optional, Sequence


def raw_tokenizer(tokenizer):
    """The `tokenizers.Tokenizer` behind a fusedist.models.hf.Tokenizer, or None (a slow
    transformers tokenizer)."""
    impl = getattr(tokenizer, "impl", None)
    if getattr(tokenizer, "kind", None) == "tokenizers":
        return impl
    return getattr(impl, "backend_tokenizer", None)


class IncrementalDetokenizer:
    """push(id) -> the text this id adds ("" while it ends inside a character)."""

    def __init__(self, tokenizer, prompt_ids: Sequence[int] = (), *,
                 skip_special_tokens: bool = True, context: int = 6):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        tail = [int(t) for t in list(prompt_ids)[-context:]] if context else []
        self.raw = raw_tokenizer(tokenizer)
        self.stream = None
        if self.raw is not None:
            try:
                from tokenizers.decoders import DecodeStream
            except ImportError:
                DecodeStream = None
            if DecodeStream is not None:
                try:
                    self.stream = DecodeStream(ids=tail, skip_special_tokens=self.skip)
                except TypeError:          # tokenizers < 0.22: no prefix ids
                    self.stream = DecodeStream(skip_special_tokens=self.skip)
        # the window method's state
        self.ids = tail
        self.prefix = 0
        self.read = len(tail)

    def push(self, token_id: int) -> str:
        token_id = int(token_id)
        if self.stream is not None:
            return self.stream.step(self.raw, token_id) or ""
        self.ids.append(token_id)
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before):]
        return ""

    def _decode(self, ids) -> str:
        impl = getattr(self.tokenizer, "impl", self.tokenizer)
        return impl.decode(list(ids), skip_special_tokens=self.skip)


class TextAssembler:
    """The text of one choice as it grows, with its stop strings: add(delta) -> (the text to
    hand out now, the stop string that ended it or None)."""

    def __init__(self, stop: Sequence[str] = (), include_stop_str: bool = False):
        self.stop = tuple(stop)
        self.include = include_stop_str
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""
        self.sent = 0

    def add(self, delta: str, check_stop: bool = True) -> tuple[str, Optional[str]]:
        start = max(0, len(self.text) - self.hold)
        self.text += delta
        if self.stop and check_stop:
            hit = None
            for s in self.stop:
                i = self.text.find(s, start)
                if i >= 0 and (hit is None or i < hit[0]):
                    hit = (i, s)
            if hit is not None:
                i, s = hit
                self.text = self.text[:i + (len(s) if self.include else 0)]
                return self.flush(), s
        end = len(self.text) - self.hold
        if end <= self.sent:
            return "", None
        out = self.text[self.sent:end]
        self.sent = end
        return out, None

    def flush(self) -> str:
        """Everything not handed out yet (the choice ended)."""
        out = self.text[self.sent:]
        self.sent = len(self.text)
        return out


__all__ = ["IncrementalDetokenizer", "TextAssembler", "raw_tokenizer"]
