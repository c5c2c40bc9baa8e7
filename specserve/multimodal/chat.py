"""Chat messages with OpenAI content parts → messages for the chat template, and the images they carry.

Parts: {"type": "text", "text"}, {"type": "image_url", "image_url": {"url": data URL}} (OpenAI), and
vLLM's offline {"type": "image_pil", "image_pil": PIL image}. A template that renders image parts itself
(Qwen2-VL's does) gets list content with {"type": "image"} parts; any other template gets text with
IMAGE_PLACEHOLDER where each image was.
"""
from __future__ import annotations

from specserve.multimodal.image import load_image

IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
IMAGE_PART_TYPES = ("image_url", "image_pil")


def template_renders_images(chat_template: str | None) -> bool:
    """Whether the template handles image content parts itself (it tests parts for 'image')."""
    return any(quoted in (chat_template or "") for quoted in ("'image'", '"image"'))


def split_chat_images(messages: list[dict], renders_images: bool) -> tuple[list[dict], list]:
    """(messages for the template, RGB images in order). ValueError naming the part
    ("messages[i].content[j]...") for an unknown part type, a remote URL or an unreadable image."""
    out, images = [], []
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            out.append(message)
            continue
        parts, has_image = [], False
        for j, part in enumerate(content):
            field = f"messages[{i}].content[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                parts.append({"type": "text", "text": part.get("text") or ""})
            elif kind in IMAGE_PART_TYPES:
                images.append(_image(part, kind, f"{field}.{kind}"))
                parts.append({"type": "image"})
                has_image = True
            else:
                raise ValueError(f"{field}.type must be one of text, {', '.join(IMAGE_PART_TYPES)} (got {kind!r})")
        if not (has_image and renders_images):
            parts = "\n".join(IMAGE_PLACEHOLDER if p["type"] == "image" else p["text"] for p in parts)
        out.append({**message, "content": parts})
    return out, images


def _image(part: dict, kind: str, field: str):
    value = part.get(kind)
    if kind == "image_url":
        url = value.get("url") if isinstance(value, dict) else value
        if not isinstance(url, str):
            raise ValueError(f"{field}.url must be a string (a base64 data URL)")
        return load_image(url, f"{field}.url")
    return load_image(value, field)
