"""The images and videos of an HTTP request for a vision-language engine: the placeholders the chat template
shows, and the decoded media (400s naming the part; a text model refuses them, an images-only family
refuses videos)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from services.common.errors import bad_request
from services.common.image_inputs import load_image
from services.common.video_inputs import load_video
from services.engine.entrypoints.serving import ServingContext


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


def request_images(ctx: ServingContext, urls: Sequence[str], param: str) -> list[Any]:
    """The images at ``urls``, decoded; 400 for a text model, too many images, or an image that fails."""
    if urls and ctx.llm.engine.image_inputs is None:
        raise bad_request("images need a vision-language model; this one takes text only", param)
    folder = ctx.settings.allowed_local_media_path
    return _load_each(
        "image", urls, ctx.settings.limit_mm_per_prompt.image, lambda u: load_image(u, folder), param
    )


def request_videos(ctx: ServingContext, urls: Sequence[str], param: str) -> list[Any]:
    """The videos at ``urls``, decoded and sampled as the model samples; 400 for a model without video, too
    many videos, or a video that fails."""
    if not urls:
        return []
    inputs = ctx.llm.engine.image_inputs
    sampling = inputs.placeholders.video_sampling if inputs is not None else None
    if sampling is None:
        raise bad_request("videos need a model that takes videos; this one does not", param)
    folder = ctx.settings.allowed_local_media_path
    limit = ctx.settings.limit_mm_per_prompt.video
    return _load_each("video", urls, limit, lambda u: load_video(u, sampling, folder), param)


def _load_each(
    kind: str, urls: Sequence[str], limit: int, load: Callable[[str], Any], param: str
) -> list[Any]:
    """load(url) for each of at most ``limit`` urls; a 400 naming the item for one that fails."""
    if len(urls) > limit:
        raise bad_request(f"{len(urls)} {kind}s is over this server's limit of {limit} per request", param)
    items = []
    for i, url in enumerate(urls):
        try:
            items.append(load(url))
        except ValueError as exc:
            raise bad_request(f"{kind} {i}: {exc}", param) from exc
    return items
