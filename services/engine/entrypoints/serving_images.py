"""The images of an HTTP request for a vision-language engine: the placeholder the chat template shows,
and the decoded images (400s naming the problem; a text model refuses them)."""

from __future__ import annotations

from collections.abc import Sequence

from PIL import Image

from services.common.errors import bad_request
from services.common.image_inputs import load_image
from services.engine.entrypoints.serving import ServingContext


def image_marker(ctx: ServingContext) -> str | None:
    """The placeholder token's text (what the chat template is given for an image part); None: text model."""
    inputs = ctx.llm.engine.image_inputs
    if inputs is None:
        return None
    return ctx.llm.tokenizer.id_to_token(inputs.token_id)


def request_images(ctx: ServingContext, urls: Sequence[str], param: str) -> list[Image.Image]:
    """The images at ``urls``, decoded; 400 for a text model, too many images, or an image that fails."""
    if not urls:
        return []
    if ctx.llm.engine.image_inputs is None:
        raise bad_request("images need a vision-language model; this one takes text only", param)
    limit = ctx.settings.limit_images_per_prompt
    if len(urls) > limit:
        raise bad_request(f"{len(urls)} images is over this server's limit of {limit} per request", param)
    images = []
    for i, url in enumerate(urls):
        try:
            images.append(load_image(url, ctx.settings.allowed_local_media_path))
        except ValueError as exc:
            raise bad_request(f"image {i}: {exc}", param) from exc
    return images
