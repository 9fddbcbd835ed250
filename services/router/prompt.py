"""PromptPreparer: validate once, apply the chat template, tokenize, hash blocks, build the engine body.

Engines always receive token ids on ``/v1/completions``: the ids the router hashed and looked up are
exactly the ids the engine caches (and, in P/D mode, the ids prefill and decode both see), so the
router's prefix view and the engines' caches can never drift apart through a template or tokenizer
difference. Chat requests are answered in chat shape by ``ChatAdapter``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

from services.common.kv.hashing import BlockHasher, BlockHashExtras, MMSpan
from services.common.media.image_inputs import load_image
from services.common.media.media_fetch import inline_remote
from services.common.media.media_settings import MediaLimits, RemoteMedia
from services.common.media.mm_placeholders import MediaPlaceholders
from services.common.media.video_inputs import load_video
from services.common.openai.chat_prompt import chat_prompt_ids, chat_top_logprobs, image_urls, video_urls
from services.common.openai.chat_tools import ChatPlan, ToolSettings, plan_chat
from services.common.openai.errors import bad_request
from services.common.openai.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest
from services.common.openai.protocol_structured import CONSTRAINT_FIELDS, spec_request_fields
from services.common.openai.tokenizer import Tokenizer

Kind = Literal["completion", "chat"]
_NONE: Mapping[str, str] = MappingProxyType({})  # no fetched media

# Chat-only fields the engine's completions endpoint does not take (they are translated instead).
_CHAT_ONLY = (
    "messages",
    "add_generation_prompt",
    "max_completion_tokens",
    "logprobs",
    "top_logprobs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
)
# Fields the router owns: the engine fills in its model name, P/D params come from the flow.
_ROUTER_OWNED = ("model", "kv_transfer_params", "request_id")


@dataclass
class PreparedRequest:
    """One validated request, ready to route: its prompts' ids, the first prompt's block hashes, the
    engine body (``/v1/completions`` with token ids) and what the response must look like."""

    kind: Kind
    prompts: list[list[int]]
    block_hashes: list[bytes]
    engine_body: dict[str, Any]
    stream: bool
    n: int = 1
    include_usage: bool = False
    chat_top_logprobs: int | None = None
    chat_plan: ChatPlan | None = None  # chat: how tools and reasoning shape the message
    lora_name: str | None = None  # the LoRA adapter the request's ``model`` names
    session: str | None = None  # the session key (tenant-scoped) for session affinity
    arrival: float = field(default_factory=time.perf_counter)  # the app sets the HTTP arrival (middleware)

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompts[0])

    @property
    def max_output_tokens(self) -> int | None:
        """Tokens the request may generate in all (None: no max_tokens, up to the context)."""
        limit = self.engine_body.get("max_tokens")
        return None if limit is None else int(limit) * max(self.n, 1)

    @property
    def splittable(self) -> bool:
        """Whether another engine may prefill: one prompt (one KV hand-off), and no prompt logprobs to score."""
        body = self.engine_body
        scores_prompt = body.get("prompt_logprobs") is not None or (
            bool(body.get("echo")) and body.get("logprobs") is not None
        )
        return len(self.prompts) == 1 and not scores_prompt


class PromptPreparer:
    """Turns an OpenAI request into a PreparedRequest with the pool's tokenizer and block hasher."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        hasher: BlockHasher,
        tools: ToolSettings | None = None,
        images: MediaPlaceholders | None = None,
        remote: RemoteMedia | None = None,
        limits: MediaLimits | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.hasher = hasher
        self.images = images  # a vision-language pool: its placeholder and preprocessing
        self.remote = remote or RemoteMedia()  # http(s) media URLs: refused unless allowed
        self.limits = limits or MediaLimits()  # images / videos per request, as the engines count them
        self.tools = tools or ToolSettings(
            template_renders_tools=tokenizer.chat_template is not None and tokenizer.renders_tools()
        )

    async def completion_async(
        self, body: CompletionRequest, lora_name: str | None = None
    ) -> PreparedRequest:
        """``completion``; with media, http(s) URLs are fetched first (on this loop) and the decoding,
        preprocessing and hashing run on a worker thread."""
        data = body.multi_modal_data
        if data is None or not (data.image or data.video):
            return self.completion(body, lora_name)
        fetched = await self._fetch(data.image, data.video, "multi_modal_data")
        return await asyncio.to_thread(self.completion, body, lora_name, fetched)

    async def chat_async(self, body: ChatCompletionRequest, lora_name: str | None = None) -> PreparedRequest:
        """``chat``, with media prepared as ``completion_async`` prepares them."""
        urls, videos = image_urls(body), video_urls(body)
        if not urls and not videos:
            return self.chat(body, lora_name)
        fetched = await self._fetch(urls, videos, "messages")
        return await asyncio.to_thread(self.chat, body, lora_name, fetched)

    async def _fetch(self, urls: list[str], videos: list[str], param: str) -> dict[str, str]:
        """The http(s) URLs fetched as data: URLs (the engine gets those: one fetch, the same bytes)."""
        self._check_counts(urls, videos, param)
        fetched: dict[str, str] = {}
        for kind, items in (("image", urls), ("video", videos)):
            for i, got in await inline_remote(items, kind, self.remote):  # type: ignore[arg-type]
                if isinstance(got, ValueError):
                    raise bad_request(f"{kind} {i}: {got}", param)
                fetched[items[i]] = got
        return fetched

    def completion(
        self, body: CompletionRequest, lora_name: str | None = None, fetched: Mapping[str, str] = _NONE
    ) -> PreparedRequest:
        """Strings are encoded as the engine would (special tokens added); ids pass as they are.
        ``fetched``: http(s) media URLs -> the data: URLs they were fetched as."""
        prompts = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in body.prompts()]
        vocab = self.tokenizer.vocab_size
        if any(
            t >= vocab for ids in prompts for t in ids
        ):  # as the engine says; hashing would overflow first
            raise bad_request(f"token ids must be in [0, {vocab})", "prompt")
        engine = _base_body(body)
        data = body.multi_modal_data
        urls = [fetched.get(u, u) for u in data.image] if data is not None else []
        videos = [fetched.get(u, u) for u in data.video] if data is not None else []
        prompts[0], spans = self._expand(prompts[0], urls, videos, "multi_modal_data")
        if urls or videos:
            engine["multi_modal_data"] = {"image": urls, "video": videos}
        engine["prompt"] = prompts[0] if len(prompts) == 1 else prompts
        if body.echo and isinstance(body.prompts()[0], str) and not urls and not videos:
            engine["prompt"] = body.prompt  # echo returns the caller's text, not text decoded from the ids
        return self._prepared("completion", body, prompts, engine, lora_name, spans)

    def chat(
        self, body: ChatCompletionRequest, lora_name: str | None = None, fetched: Mapping[str, str] = _NONE
    ) -> PreparedRequest:
        """Chat template (with the tools it should show), then the same completions body; logprobs asked as
        completions logprobs; a tool_choice the engine must enforce becomes its output constraint."""
        plan = plan_chat(body, self.tools)
        ids = chat_prompt_ids(self.tokenizer, body, plan.template_tools, *self._markers())
        urls = [fetched.get(u, u) for u in image_urls(body)]
        videos = [fetched.get(u, u) for u in video_urls(body)]
        ids, spans = self._expand(ids, urls, videos, "messages")
        engine = _base_body(body)
        if urls or videos:
            engine["multi_modal_data"] = {"image": urls, "video": videos}
        for key in (*_CHAT_ONLY, *CONSTRAINT_FIELDS):
            engine.pop(key, None)
        if plan.constraint is not None:
            engine.update(spec_request_fields(plan.constraint))
            reasoning = plan.reasoning
            if reasoning is not None and reasoning.implicit_start:
                engine["structured_outputs_after"] = reasoning.end_tag
        if plan.tool_parser is not None and any(
            self.tokenizer.backend.token_to_id(m) for m in plan.tool_parser.markers
        ):
            engine["skip_special_tokens"] = False
        engine["prompt"] = ids
        engine["max_tokens"] = body.max_output_tokens()  # None: up to the context (chat's default)
        top_n = chat_top_logprobs(body)
        if top_n is not None:
            engine["logprobs"] = top_n
        prepared = self._prepared("chat", body, [ids], engine, lora_name, spans)
        prepared.chat_top_logprobs = top_n
        prepared.chat_plan = plan
        return prepared

    def _markers(self) -> tuple[str | None, str | None]:
        """The image and video placeholders' text (None where the pool's model takes no such media)."""
        if self.images is None:
            return None, None
        video = self.images.video_token_id
        return self.tokenizer.id_to_token(self.images.token_id), (
            self.tokenizer.id_to_token(video) if video is not None else None
        )

    def _expand(
        self, ids: list[int], urls: list[str], videos: list[str], param: str
    ) -> tuple[list[int], tuple[MMSpan, ...]]:
        """The ids with each image's (video's) placeholders expanded as the engine expands them, and their
        block-hash keys; the engine gets these ids and the URLs."""
        if not urls and not videos:
            return ids, ()
        self._check_counts(urls, videos, param)
        if self.images is None:
            raise bad_request("images need a vision-language model; this pool serves text only", param)
        sampling = self.images.video_sampling
        media = _decode_images(urls, param)
        for i, url in enumerate(videos):
            if sampling is None:
                raise bad_request("videos need a model that takes videos; this pool's does not", param)
            try:
                media.append(load_video(url, sampling))
            except ValueError as exc:
                raise bad_request(f"video {i}: {exc}", param) from exc
        try:
            expanded, placed = self.images.expand(ids, media)
        except ValueError as exc:
            raise bad_request(str(exc), param) from exc
        return expanded, tuple(p.span() for p in placed)

    def _check_counts(self, urls: list[str], videos: list[str], param: str) -> None:
        """The engines' --limit-mm-per-prompt, before anything is fetched or decoded."""
        for kind, items, limit in (("image", urls, self.limits.image), ("video", videos, self.limits.video)):
            if len(items) > limit:
                raise bad_request(
                    f"{len(items)} {kind}s is over this server's limit of {limit} per request", param
                )

    def _prepared(
        self,
        kind: Kind,
        body: SamplingRequest,
        prompts: list[list[int]],
        engine: dict[str, Any],
        lora_name: str | None,
        spans: tuple[MMSpan, ...] = (),
    ) -> PreparedRequest:
        """Block hashes as the engine computes them: an adapter's blocks are its own (the name is hashed),
        an image's blocks carry its content hash."""
        extras = BlockHashExtras(cache_salt=body.cache_salt, lora_name=lora_name, mm_spans=spans)
        hashes = self.hasher.hash_tokens(prompts[0], extras)
        if lora_name is not None:
            engine["model"] = lora_name  # the engine picks the adapter by model
        return PreparedRequest(
            kind,
            prompts,
            hashes,
            engine,
            body.stream,
            body.n,
            body.include_usage_in_stream(),
            lora_name=lora_name,
        )


def _decode_images(urls: list[str], param: str) -> list[Any]:
    images = []
    for i, url in enumerate(urls):
        try:
            images.append(load_image(url))
        except ValueError as exc:
            raise bad_request(f"image {i}: {exc}", param) from exc
    return images


def _base_body(body: SamplingRequest) -> dict[str, Any]:
    data = body.model_dump(mode="json", exclude_unset=True)
    for key in _ROUTER_OWNED:
        data.pop(key, None)
    return data
