"""ScriptedLM: wraps an engine's model so its next tokens follow a script (then its own logits again).

For tests of what servers do with model text (tool-call and reasoning parsing): the random tiny model
would never write `<tool_call>...`, so the logits of the one sequence in flight are forced, token by
token, to the scripted ids. One sequence at a time (n=1, requests in turn).
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch


class ScriptedLM:
    """``compute_logits`` returns a one-hot row for each scripted token, in order, then the model's own."""

    def __init__(self, model: Any) -> None:
        self._model = model
        self._script: deque[int] = deque()

    def say(self, token_ids: list[int]) -> None:
        """The next tokens to produce (the rest of the previous script is dropped)."""
        self._script = deque(token_ids)

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self._model(*args, **kwargs)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self._model.compute_logits(hidden)
        if self._script:
            token = self._script.popleft()
            logits = torch.full_like(logits, -1e4)
            logits[:, token] = 1e4
        return logits

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)
