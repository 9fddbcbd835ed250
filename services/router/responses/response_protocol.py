"""ResponsesRequest: the body of ``POST /v1/responses`` (OpenAI's Responses API), validated."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag

from services.common.openai.protocol_common import RequestModel
from services.common.openai.protocol_tools import ToolName


class InputText(RequestModel):
    """A text part of a message item (``input_text`` from callers, ``output_text`` from earlier answers)."""

    type: Literal["input_text", "output_text", "text"]
    text: str


class MessageItem(RequestModel):
    """A message in the conversation; ``content`` is text or text parts."""

    type: Literal["message"] = "message"
    id: str | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(RequestModel):
    """A tool call the model made (echoed back by the caller, or carried by the stored chain)."""

    type: Literal["function_call"]
    id: str | None = None
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str


class FunctionCallOutputItem(RequestModel):
    """The caller's result of a tool call; ``call_id`` must name a call of the conversation."""

    type: Literal["function_call_output"]
    id: str | None = None
    call_id: str = Field(min_length=1)
    output: str


class ReasoningItem(RequestModel):
    """A reasoning item from an earlier answer: accepted and not shown to the model again (as OpenAI)."""

    type: Literal["reasoning"]
    id: str | None = None


def _item_type(value: Any) -> str:
    """An item's ``type``; a bare ``{"role", "content"}`` is a message (as OpenAI accepts it)."""
    if isinstance(value, dict):
        return str(value.get("type", "message"))
    return str(getattr(value, "type", "message"))


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type),
]


class FunctionTool(RequestModel):
    """A function tool (``{"type": "function", "name", "description", "parameters", "strict"}``)."""

    type: Literal["function"]
    name: ToolName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(RequestModel):
    type: Literal["function"]
    name: ToolName


class TextFormat(RequestModel):
    """``text.format``: plain text, any JSON object, or a named JSON schema (structured outputs)."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = Field(None, min_length=1, max_length=64)
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(RequestModel):
    format: TextFormat = TextFormat()


class ReasoningConfig(RequestModel):
    effort: Literal["minimal", "low", "medium", "high"] | None = None
    summary: str | None = None


class ResponsesRequest(RequestModel):
    """What ``POST /v1/responses`` accepts. Unknown fields are ignored, as on every route."""

    model: str | None = None
    input: str | Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = None
    previous_response_id: str | None = Field(None, min_length=1, max_length=128)
    store: bool = True
    stream: bool = False
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: Annotated[int, Field(gt=0)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    user: str | None = Field(None, max_length=256)
    metadata: dict[str, str] | None = None

    def input_items(self) -> list[InputItem]:
        """``input`` as items (a string is one user message)."""
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)
