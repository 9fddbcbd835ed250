"""Tokenizer: an HF tokenizer.json + chat template, torch-free (shared by engines and the router)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from services.common.openai.errors import bad_request


class ChatTemplateError(ValueError):
    """The chat template rejected the messages or is missing."""


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


class Tokenizer:
    """Encode/decode with `tokenizers` and render the model's chat template with jinja2."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        folder = Path(path)
        tok_file = folder / "tokenizer.json"
        if not tok_file.is_file():
            raise ValueError(f"tokenizer: {folder} has no tokenizer.json")
        self._tok = HFTokenizer.from_file(str(tok_file))
        # A tokenizer.json may pad every encoding to a fixed length or silently truncate it (sentence-
        # transformers exports do): a prompt is its own tokens, and too long is an error, not a cut.
        self._tok.no_padding()
        self._tok.no_truncation()
        cfg_file = folder / "tokenizer_config.json"
        cfg: dict[str, Any] = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        self.chat_template: str | None = cfg.get("chat_template")
        template_file = folder / "chat_template.jinja"
        if self.chat_template is None and template_file.is_file():
            self.chat_template = template_file.read_text()
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self._template: jinja2.Template | None = None
        self._parts: bool | None = None  # renders_content_parts, probed once
        # Servers set this to max_model_len: a text that cannot fit is refused before it is tokenized
        # (tokenizing 10 MB takes seconds on the event loop). None (offline use): no limit.
        self.max_text_tokens: int | None = None
        self._max_token_chars: int | None = None

    @property
    def backend(self) -> Any:
        """The underlying ``tokenizers.Tokenizer`` (grammar libraries build their token tables from it)."""
        return self._tok

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.max_text_tokens is not None and len(text) > self.max_text_chars():
            raise bad_request(
                f"This model's maximum context length is {self.max_text_tokens} tokens, and the prompt's "
                f"{len(text)} characters need more than that (refused without tokenizing).",
                "prompt",
            )
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def max_text_chars(self) -> int:
        """Characters beyond which a text surely has more than ``max_text_tokens`` tokens: no token spells
        more characters than the longest vocabulary entry (x4 for normalizers that merge characters)."""
        if self._max_token_chars is None:
            self._max_token_chars = max(len(t) for t in self._tok.get_vocab(with_added_tokens=True))
        return 4 * self._max_token_chars * (self.max_text_tokens or 0)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render messages with the model's chat template (HF semantics: trim/lstrip blocks)."""
        if not self.chat_template:
            raise ChatTemplateError("this model has no chat template; use the completions API instead")
        if self._template is None:
            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
            )
            env.globals["raise_exception"] = _raise
            env.filters["tojson"] = lambda v, indent=None: json.dumps(v, indent=indent, ensure_ascii=False)
            self._template = env.from_string(self.chat_template)
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **kwargs,
        )

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """Chat template then encode without adding special tokens again (the template has them);
        ``template_kwargs``: extra template variables (a request's ``chat_template_kwargs``)."""
        extra = {**(template_kwargs or {}), **({"tools": tools} if tools else {})}
        return self.encode(
            self.apply_chat_template(messages, add_generation_prompt, **extra), add_special_tokens=False
        )

    def set_chat_template(self, template: str) -> None:
        """Replace the model's chat template (``--chat-template FILE``)."""
        self.chat_template, self._template, self._parts = template, None, None

    def renders_content_parts(self) -> bool:
        """Whether the chat template renders list content itself (``{"type": "image"}`` parts where they
        stand, as HF processors pass them), rather than printing the list."""
        if self._parts is None:
            probe = [
                {"role": "user", "content": [{"type": "text", "text": "kvferry_probe_a1"}, {"type": "image"}]}
            ]
            try:
                out = self.apply_chat_template(probe, True)
                self._parts = "kvferry_probe_a1" in out and "'type'" not in out and '"type"' not in out
            except (ChatTemplateError, jinja2.TemplateError, TypeError, AttributeError):
                self._parts = False
        return self._parts

    def renders_tools(self) -> bool:
        """Whether the chat template shows the model the ``tools`` it is given (SmolLM2's drops them)."""
        probe = [{"role": "user", "content": "hi"}]
        tool = {"type": "function", "function": {"name": "kvferry_probe_tool_3f9", "parameters": {}}}
        try:
            return "kvferry_probe_tool_3f9" in self.apply_chat_template(probe, True, tools=[tool])
        except (ChatTemplateError, jinja2.TemplateError):
            return False


def _token_text(tok: Any) -> str | None:
    text: str | None = tok.get("content") if isinstance(tok, dict) else tok
    return text
