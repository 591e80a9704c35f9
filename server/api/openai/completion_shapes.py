"""The shapes of ``/v1/chat/completions`` and ``/v1/completions``, as OpenAI documents them.

Requests take OpenAI's sampling parameters; a parameter we do not implement is refused (400)
rather than ignored, except those that change nothing here (``user``, ``store``, ``metadata``,
penalties of 0). Responses are built as dicts by ``server/api/openai/completions.py``; the models
below document them in the OpenAPI schema.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationInfo,
    field_validator,
)

from server.schemas import LINE_PATTERN

MAX_N = 16  # choices of one request
MAX_STOPS = 4  # OpenAI's limit
ModelName = Annotated[str, StringConstraints(min_length=1, max_length=512, pattern=LINE_PATTERN)]
Stop = Annotated[str, StringConstraints(min_length=1, max_length=256)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class StreamOptions(_Request):
    include_usage: bool = Field(False, description="a last chunk with the usage (and no choices)")


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ImageURL(_Request):
    url: str = Field(
        min_length=1,
        description="a data:image/<type>;base64,... URL; an http(s) URL only where the operator allows "
        "fetching images (ROUNDHOUSE_ALLOW_IMAGE_URLS)",
    )
    detail: Literal["auto", "low", "high"] | None = Field(None, description="accepted, not used")


class ImagePart(_Request):
    """An image for a vision-language model (a text-only model refuses it: 400 naming the part)."""

    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart]
    name: str | None = Field(None, max_length=64, description="accepted, not used")

    def text(self) -> str:
        """The text parts joined (image parts left out)."""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content if isinstance(p, TextPart))


class _Sampling(_Request):
    model: ModelName = Field(
        description="a base model, a fine-tuned model (ft:...) or checkpoint (...:ckpt-step-N)"
    )
    temperature: float | None = Field(None, ge=0, le=2, description="0: greedy (default 1)")
    top_p: float | None = Field(None, gt=0, le=1, description="nucleus sampling (default 1)")
    seed: int | None = Field(None, ge=0, le=2**63 - 1, description="the same seed gives the same answer")
    stop: Stop | list[Stop] | None = Field(None, description=f"up to {MAX_STOPS} strings that end an answer")
    n: int | None = Field(None, ge=1, le=MAX_N, description="answers to make (default 1)")
    stream: bool | None = Field(None, description="server-sent events, ending with data: [DONE]")
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=256, description="accepted, not used")
    store: bool | None = Field(None, description="accepted, not used")
    metadata: dict[str, str] | None = Field(None, description="accepted, not used")
    frequency_penalty: float | None = Field(None, ge=0, le=0, description="only 0 (no penalty)")
    presence_penalty: float | None = Field(None, ge=0, le=0, description="only 0 (no penalty)")

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        if len(stops) > MAX_STOPS:
            raise ValueError(f"stop: at most {MAX_STOPS} strings (got {len(stops)})")
        return stops


class ChatCompletionCreate(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1, max_length=2048)
    max_tokens: int | None = Field(None, ge=1, description="deprecated by OpenAI: max_completion_tokens")
    max_completion_tokens: int | None = Field(None, ge=1, description="the most new tokens of each answer")
    logprobs: bool | None = Field(None, description="each answer token's log-probability")
    top_logprobs: int | None = Field(None, ge=0, le=20, description="with logprobs: the likeliest tokens")

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, top: int | None, info: ValidationInfo) -> int | None:
        # a field's validator (logprobs, declared before it, is in info.data): the error is the field's
        if top is not None and not info.data.get("logprobs"):
            raise ValueError("needs logprobs set to true")
        return top


class CompletionCreate(_Sampling):
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=MAX_N)]
    max_tokens: int | None = Field(16, ge=1, description="the most new tokens of each answer (default 16)")
    logprobs: int | None = Field(None, ge=0, le=5, description="the chosen token's and the k likeliest")
    echo: bool | None = Field(None, description="the prompt before the answer's text")

    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else self.prompt


# -- responses (documentation) -------------------------------------------------------------
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str
    refusal: None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: dict[str, Any] | None
    finish_reason: Literal["stop", "length"]


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None
    finish_reason: Literal["stop", "length"]


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    system_fingerprint: str | None = None


EVENT_STREAM = {
    "description": "with stream: true, server-sent events: `data: <chunk JSON>` lines, then `data: [DONE]`",
    "content": {"text/event-stream": {"schema": {"type": "string"}}},
}
