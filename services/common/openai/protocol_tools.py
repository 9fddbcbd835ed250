"""OpenAI function tools in chat requests and responses: definitions, tool_choice, calls in messages."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from services.common.openai.protocol_base import RequestModel, ResponseModel

ToolName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]


class FunctionDefinition(RequestModel):
    """``tools[i].function``: a name, what it does, and a JSON schema of its parameters."""

    name: ToolName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(RequestModel):
    """One entry of ``tools`` (only function tools exist in the chat API)."""

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: ToolName


class NamedToolChoice(RequestModel):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``: that tool must be called."""

    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(RequestModel):
    """A call in an assistant message of the history: ``arguments`` is a JSON string, as OpenAI sends it."""

    name: str
    arguments: str


class MessageToolCall(RequestModel):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class FunctionCall(ResponseModel):
    name: str
    arguments: str


class ToolCall(ResponseModel):
    """``message.tool_calls[i]`` of a response."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall
