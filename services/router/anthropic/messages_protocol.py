"""MessagesRequest: the body of ``POST /v1/messages`` (Anthropic's Messages API), validated."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag

from services.common.openai.protocol_common import RequestModel
from services.common.openai.protocol_tools import ToolName


class TextBlock(RequestModel):
    type: Literal["text"]
    text: str


class ImageSource(RequestModel):
    type: Literal["base64", "url"]
    media_type: str | None = None
    data: str | None = None
    url: str | None = None

    def data_url(self) -> str:
        if self.type == "url" and self.url:
            return self.url
        if self.type == "base64" and self.data and self.media_type:
            return f"data:{self.media_type};base64,{self.data}"
        raise ValueError("an image source needs media_type and data (base64) or url (url)")


class ImageBlock(RequestModel):
    type: Literal["image"]
    source: ImageSource


class ToolUseBlock(RequestModel):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]


class ToolResultBlock(RequestModel):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[TextBlock] = ""
    is_error: bool = False

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)


class ThinkingBlock(RequestModel):
    """A thinking block of an earlier answer: accepted, not shown to the model again."""

    type: Literal["thinking", "redacted_thinking"]


def _block_type(value: Any) -> str:
    return str(value.get("type") if isinstance(value, dict) else getattr(value, "type", ""))


ContentBlock = Annotated[
    Annotated[TextBlock, Tag("text")]
    | Annotated[ImageBlock, Tag("image")]
    | Annotated[ToolUseBlock, Tag("tool_use")]
    | Annotated[ToolResultBlock, Tag("tool_result")]
    | Annotated[ThinkingBlock, Tag("thinking")]
    | Annotated[ThinkingBlock, Tag("redacted_thinking")],
    Discriminator(_block_type),
]


class Message(RequestModel):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]

    def blocks(self) -> list[Any]:
        return (
            [TextBlock(type="text", text=self.content)]
            if isinstance(self.content, str)
            else list(self.content)
        )


class Tool(RequestModel):
    name: ToolName
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(RequestModel):
    type: Literal["auto", "any", "tool", "none"]
    name: ToolName | None = None
    disable_parallel_tool_use: bool = False


class MessagesRequest(RequestModel):
    """What ``POST /v1/messages`` accepts (unknown fields ignored, as on every route)."""

    model: str
    max_tokens: Annotated[int, Field(gt=0)]
    messages: Annotated[list[Message], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    stop_sequences: list[str] | None = None
    temperature: Annotated[float, Field(ge=0, le=1)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None

    def system_text(self) -> str | None:
        if self.system is None or isinstance(self.system, str):
            return self.system or None
        return "".join(b.text for b in self.system) or None
