"""One request as the scheduler sees it: prompt length, block size, and the index's prefix matches."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from services.common.prefix_index import PrefixMatch
from services.router.scheduling.endpoint import Endpoint, normalize_url


@dataclass(frozen=True, slots=True)
class RequestContext:
    """``matches`` maps an endpoint url to its match; ``None`` when the index could not answer."""

    prompt_tokens: int
    block_size: int
    matches: Mapping[str, PrefixMatch] | None = field(default_factory=dict)

    @classmethod
    def from_lookup(cls, prompt_tokens: int, block_size: int,
                    lookup: Mapping[str, PrefixMatch] | None) -> RequestContext:
        """Re-key the index's answer (by engine id) by the url each engine registered."""
        if lookup is None:
            return cls(prompt_tokens, block_size, None)
        return cls(prompt_tokens, block_size, {normalize_url(m.url): m for m in lookup.values()})

    @property
    def prompt_blocks(self) -> int:
        return self.prompt_tokens // self.block_size if self.block_size > 0 else 0

    def match(self, endpoint: Endpoint) -> PrefixMatch | None:
        return None if self.matches is None else self.matches.get(endpoint.url)

    def cached_tokens(self, endpoint: Endpoint) -> int:
        """Prompt tokens the endpoint holds in any of its tiers (leading blocks only)."""
        m = self.match(endpoint)
        return 0 if m is None else min(m.longest * self.block_size, self.prompt_tokens)
