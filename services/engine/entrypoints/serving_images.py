"""The images and videos of an HTTP request for a vision-language engine: the placeholders the chat template
shows, and the media fetched, decoded and preprocessed off the loops (400s naming the part; a text model
refuses them, an images-only family refuses videos)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from services.common.media.image_inputs import load_image
from services.common.media.media_fetch import inline_remote
from services.common.media.media_settings import Kind, RemoteMedia
from services.common.media.video_inputs import load_video
from services.common.openai.errors import bad_request
from services.engine.core.mm_input import MMInput
from services.engine.entrypoints.serving import ServingContext
from services.engine.llm_engine import LLMEngine


def image_marker(ctx: ServingContext) -> str | None:
    """The placeholder token's text (what the chat template is given for an image part); None: text model."""
    inputs = ctx.llm.engine.image_inputs
    if inputs is None:
        return None
    return ctx.llm.tokenizer.id_to_token(inputs.token_id)


def video_marker(ctx: ServingContext) -> str | None:
    """The video placeholder's text; None: the model takes no videos."""
    inputs = ctx.llm.engine.image_inputs
    if inputs is None or inputs.video_token_id is None:
        return None
    return ctx.llm.tokenizer.id_to_token(inputs.video_token_id)


async def prepare_media(
    ctx: ServingContext, prompt_ids: list[int], images: Sequence[str], videos: Sequence[str], param: str
) -> tuple[list[int], tuple[MMInput, ...] | None]:
    """The prompt's ids with its images and videos expanded, and their preprocessed pixels (None: no media):
    http(s) URLs are fetched on the event loop (where allowed), decoding and preprocessing run on a worker
    thread, so neither the event loop nor the engine's step loop waits for them; 400s name the part."""
    engine = ctx.llm.engine
    if not images and not videos:  # no pixels to prepare: a vision model still checks the prompt's markers
        return (
            _expanded(engine, prompt_ids, [], param)
            if engine.image_inputs is not None
            else (prompt_ids, None)
        )
    if engine.image_inputs is None:
        raise bad_request("images need a vision-language model; this one takes text only", param)
    sampling = engine.image_inputs.placeholders.video_sampling
    if videos and sampling is None:
        raise bad_request("videos need a model that takes videos; this one does not", param)
    limits, remote = ctx.settings.limit_mm_per_prompt, ctx.settings.remote_media
    for kind, urls, limit in (("image", images, limits.image), ("video", videos, limits.video)):
        if len(urls) > limit:  # before anything is fetched
            raise bad_request(
                f"{len(urls)} {kind}s is over this server's limit of {limit} per request", param
            )
    image_urls = await _fetched("image", images, remote, param)
    video_urls = await _fetched("video", videos, remote, param)
    folder = ctx.settings.allowed_local_media_path

    def prepare() -> tuple[list[int], tuple[MMInput, ...]]:
        media: list[Any] = _load_each("image", image_urls, lambda u: load_image(u, folder), param)
        if sampling is not None:
            media += _load_each("video", video_urls, lambda u: load_video(u, sampling, folder), param)
        return _expanded(engine, prompt_ids, media, param)

    return await asyncio.to_thread(prepare)


def _expanded(
    engine: LLMEngine, prompt_ids: list[int], media: list[Any], param: str
) -> tuple[list[int], tuple[MMInput, ...]]:
    try:
        return engine.expand_media(prompt_ids, media)
    except ValueError as exc:
        raise bad_request(str(exc), param) from exc


async def _fetched(kind: Kind, urls: Sequence[str], remote: RemoteMedia, param: str) -> list[str]:
    """``urls`` with the http(s) ones fetched as data: URLs; a 400 naming the item that failed."""
    out = list(urls)
    for i, got in await inline_remote(urls, kind, remote):
        if isinstance(got, ValueError):
            raise bad_request(f"{kind} {i}: {got}", param)
        out[i] = got
    return out


def _load_each(kind: str, urls: Sequence[str], load: Callable[[str], Any], param: str) -> list[Any]:
    """load(url) for each url; a 400 naming the item for one that fails."""
    items = []
    for i, url in enumerate(urls):
        try:
            items.append(load(url))
        except ValueError as exc:
            raise bad_request(f"{kind} {i}: {exc}", param) from exc
    return items
