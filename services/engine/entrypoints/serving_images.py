"""The images and videos of an HTTP request for a vision-language engine: the placeholders the chat template
shows, and the decoded media (400s naming the part; a text model refuses them, an images-only family
refuses videos)."""

from __future__ import annotations

from collections.abc import Sequence
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
    if not urls:
        return []
    if ctx.llm.engine.image_inputs is None:
        raise bad_request("images need a vision-language model; this one takes text only", param)
    limit = ctx.settings.limit_mm_per_prompt.image
    if len(urls) > limit:
        raise bad_request(f"{len(urls)} images is over this server's limit of {limit} per request", param)
    images = []
    for i, url in enumerate(urls):
        try:
            images.append(load_image(url, ctx.settings.allowed_local_media_path))
        except ValueError as exc:
            raise bad_request(f"image {i}: {exc}", param) from exc
    return images


def request_videos(ctx: ServingContext, urls: Sequence[str], param: str) -> list[Any]:
    """The videos at ``urls``, decoded and sampled as the model samples; 400 for a model without video, too
    many videos, or a video that fails."""
    if not urls:
        return []
    inputs = ctx.llm.engine.image_inputs
    sampling = inputs.placeholders.video_sampling if inputs is not None else None
    if sampling is None:
        raise bad_request("videos need a model that takes videos; this one does not", param)
    limit = ctx.settings.limit_mm_per_prompt.video
    if len(urls) > limit:
        raise bad_request(f"{len(urls)} videos is over this server's limit of {limit} per request", param)
    videos = []
    for i, url in enumerate(urls):
        try:
            videos.append(load_video(url, sampling, ctx.settings.allowed_local_media_path))
        except ValueError as exc:
            raise bad_request(f"video {i}: {exc}", param) from exc
    return videos
