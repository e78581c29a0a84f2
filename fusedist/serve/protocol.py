"""The OpenAI-compatible request bodies (pydantic), checked field by field: an unknown field, a
wrong type or a value out of range is a 400 naming the field. Fields of OpenAI's API that
fusedist does not implement are accepted at their neutral value only (echo false, no
logit_bias, best_of <= n, ...). Extensions, under vLLM's names: top_k, min_p,
repetition_penalty, stop_token_ids, ignore_eos, min_tokens, include_stop_str_in_output,
skip_special_tokens; return_token_ids adds each choice's generated ids ("token_ids")."""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

Number = Union[StrictInt, StrictFloat]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Body):
    include_usage: StrictBool = False


class _Sampling(_Body):
    """What both endpoints share."""
    model: StrictStr
    max_tokens: Optional[StrictInt] = None
    temperature: Optional[Number] = None
    top_p: Optional[Number] = None
    n: StrictInt = 1
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Union[StrictStr, list[StrictStr]]] = None
    presence_penalty: Optional[Number] = None
    frequency_penalty: Optional[Number] = None
    logit_bias: Optional[dict[str, Number]] = None
    seed: Optional[StrictInt] = None
    user: Optional[StrictStr] = None
    # extensions
    top_k: Optional[StrictInt] = None
    min_p: Optional[Number] = None
    repetition_penalty: Optional[Number] = None
    stop_token_ids: Optional[list[StrictInt]] = None
    ignore_eos: StrictBool = False
    min_tokens: StrictInt = 0
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    return_token_ids: StrictBool = False

    def unsupported(self) -> Optional[tuple]:
        """(field, why) of a field set to a value fusedist does not implement, else None."""
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported; leave it out"
        return None


class CompletionRequest(_Sampling):
    prompt: Union[StrictStr, list[StrictInt], list[StrictStr], list[list[StrictInt]]]
    logprobs: Optional[StrictInt] = None
    echo: StrictBool = False
    best_of: Optional[StrictInt] = None
    suffix: Optional[StrictStr] = None

    def unsupported(self) -> Optional[tuple]:
        if self.echo:
            return "echo", "echo is not supported; leave it out or set it false"
        if self.suffix:
            return "suffix", "suffix (insertion) is not supported; leave it out"
        if self.best_of is not None and self.best_of != self.n:
            return "best_of", "best_of other than n is not supported; leave it out"
        return super().unsupported()


class TextPart(_Body):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[StrictStr, list[TextPart]]
    name: Optional[StrictStr] = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[dict] = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[StrictInt] = None
    logprobs: StrictBool = False
    top_logprobs: Optional[StrictInt] = None
    response_format: Optional[ResponseFormat] = None
    tools: Optional[list[dict]] = None
    tool_choice: Optional[Union[StrictStr, dict]] = None
    add_generation_prompt: StrictBool = True

    def unsupported(self) -> Optional[tuple]:
        if self.response_format is not None and self.response_format.type != "text":
            return "response_format", "only response_format {\"type\": \"text\"} is supported"
        if self.tools:
            return "tools", "tool calls are not supported; leave tools out"
        if self.tool_choice not in (None, "none", "auto"):
            return "tool_choice", "tool calls are not supported; leave tool_choice out"
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs: true"
        if self.max_tokens is not None and self.max_completion_tokens is not None and \
                self.max_tokens != self.max_completion_tokens:
            return "max_completion_tokens", "max_tokens and max_completion_tokens differ; " \
                                            "give one"
        return super().unsupported()


__all__ = ["CompletionRequest", "ChatCompletionRequest", "ChatMessage", "StreamOptions"]
