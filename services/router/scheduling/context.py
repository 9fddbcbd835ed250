"""One request as the scheduler sees it: prompt length, block size, and the index's prefix matches."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from services.common.kv.prefix_index import PrefixMatch
from services.router.scheduling.endpoint import Endpoint, normalize_url


@dataclass(frozen=True, slots=True)
class RequestContext:
    """``matches`` maps an endpoint url to its match; ``None`` when the index could not answer."""

    prompt_tokens: int
    block_size: int
    matches: Mapping[str, PrefixMatch] | None = field(default_factory=dict)
    store_blocks: int = 0  # leading blocks the pool's kvstore holds: any engine can fetch them
    splittable: bool = True  # False: decode must compute the prompt itself (no separate prefill)
    lora_name: str | None = None  # only engines serving this LoRA adapter can take the request
    session: str | None = None  # the session key (x-session-id, the Responses chain, or user)
    sticky_url: str | None = None  # the session's warm engine while it is not saturated: decode goes there
    affinity: str | None = None  # why (sticky, moved, new), for the decision log
    # matches of engines routed by load only (the index's predictions for them went wrong): still measured
    held_back: Mapping[str, PrefixMatch] = field(default_factory=dict)

    @classmethod
    def from_lookup(
        cls, prompt_tokens: int, block_size: int, lookup: Mapping[str, PrefixMatch] | None
    ) -> RequestContext:
        """Re-key the index's answer (by engine id) by the url each engine registered.

        A kvstore reports its blocks under its grpc:// address: every engine of the pool shares it, so
        its run counts as each engine's kvstore tier.
        """
        if lookup is None:
            return cls(prompt_tokens, block_size, None)
        stores = [m for m in lookup.values() if m.url.startswith("grpc://")]
        engines = {normalize_url(m.url): m for m in lookup.values() if not m.url.startswith("grpc://")}
        return cls(prompt_tokens, block_size, engines, max((m.kvstore for m in stores), default=0))

    @property
    def prompt_blocks(self) -> int:
        return self.prompt_tokens // self.block_size if self.block_size > 0 else 0

    def match(self, endpoint: Endpoint) -> PrefixMatch | None:
        if self.matches is None:
            return None
        own = self.matches.get(endpoint.url)
        if self.store_blocks == 0 or (own is not None and own.kvstore >= self.store_blocks):
            return own
        if own is None:
            return PrefixMatch("", endpoint.url, kvstore=self.store_blocks, longest=self.store_blocks)
        return replace(own, kvstore=self.store_blocks, longest=max(own.longest, self.store_blocks))

    def predicted_tokens(self, endpoint: Endpoint) -> int:
        """``cached_tokens`` as the index predicts it, also for an engine routed by load only."""
        if endpoint.url not in self.held_back:
            return self.cached_tokens(endpoint)
        return min(self.held_back[endpoint.url].longest * self.block_size, self.prompt_tokens)

    def cached_tokens(self, endpoint: Endpoint) -> int:
        """Prompt tokens the endpoint holds in any of its tiers (leading blocks only)."""
        m = self.match(endpoint)
        return 0 if m is None else min(m.longest * self.block_size, self.prompt_tokens)
