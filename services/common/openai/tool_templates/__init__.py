"""Shipped tool chat templates (``--tool-chat-template hermes|llama3_json|mistral``) for models whose own
template drops ``tools`` (SmolLM2's does): each renders tools, tool calls and tool results in the format
its same-named tool parser reads back."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

NAMES = ("hermes", "llama3_json", "mistral")
HELP = (
    "a shipped chat template that shows the model its tools: hermes (ChatML, e.g. SmolLM2, Qwen) | "
    "llama3_json | mistral; implies --tool-call-parser NAME and --enable-auto-tool-choice"
)


def template_path(name: str) -> Path:
    """The shipped template file of ``name`` (ValueError naming the flag and the choices)."""
    if name not in NAMES:
        raise ValueError(f"--tool-chat-template: unknown template {name!r}; choose one of {', '.join(NAMES)}")
    return Path(__file__).with_name(f"{name}.jinja")


def add_tool_template_flag(add: Callable[..., Any]) -> None:
    add("--tool-chat-template", default=None, metavar="NAME", help=HELP)


def apply_tool_template(args: argparse.Namespace) -> None:
    """``--tool-chat-template NAME`` as the flags it stands for: ``--chat-template`` the shipped file,
    ``--tool-call-parser NAME`` (unless given) and ``--enable-auto-tool-choice``. ValueError with
    ``--chat-template`` too."""
    name = getattr(args, "tool_chat_template", None)
    if name is None:
        return
    if args.chat_template is not None:
        raise ValueError("give --chat-template FILE or --tool-chat-template NAME, not both")
    args.chat_template = str(template_path(name))
    args.tool_call_parser = args.tool_call_parser or name
    args.enable_auto_tool_choice = True
