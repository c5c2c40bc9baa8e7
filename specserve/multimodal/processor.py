"""Prompts with images → token ids with each image's placeholder expanded, and one MultiModalFeature per image.

vLLM's conventions: `{"prompt" or "prompt_token_ids": ..., "multi_modal_data": {"image": image or list}}`,
the prompt holding one `<|image_pad|>` (between `<|vision_start|>` and `<|vision_end|>`) per image, which
becomes as many placeholders as the image has merged patches. A run already of that length is kept.
"""
from __future__ import annotations

import dataclasses

from specserve.multimodal.image import ImageProcessorConfig, load_image, preprocess_image
from specserve.types import MultiModalFeature

DEFAULT_IMAGE_TOKEN_ID = 151655  # <|image_pad|> in the Qwen2-VL family's vocabulary
DEFAULT_IMAGE_LIMIT = 16
SUPPORTED_MODALITIES = ("image",)
PROCESSOR_KWARGS = ("min_pixels", "max_pixels")


class MultiModalProcessor:
    """Image inputs of one model: placeholder id, preprocessing settings and per-prompt limits."""

    def __init__(self, hf_config: dict, model_path: str | None, accepts_images: bool,
                 limit_mm_per_prompt: dict | None = None, mm_processor_kwargs: dict | None = None) -> None:
        self.accepts_images = accepts_images
        self.model_type = hf_config.get("model_type", "this model")
        text = hf_config.get("text_config") or {}
        self.image_token_id = int(hf_config.get("image_token_id") or text.get("image_token_id")
                                  or DEFAULT_IMAGE_TOKEN_ID)
        self.limits = _limits(limit_mm_per_prompt)
        config = ImageProcessorConfig.from_model(model_path, hf_config.get("vision_config"))
        self.image_config = dataclasses.replace(config, **_processor_kwargs(mm_processor_kwargs))

    def process(self, token_ids: list[int], mm_data) -> tuple[list[int], list[MultiModalFeature]]:
        """(token ids with placeholders expanded, features in prompt order); ValueError naming the field for
        bad input (unknown modality, too many images, unreadable images, placeholders that do not match)."""
        images = self._images(mm_data)
        runs = _runs(token_ids, self.image_token_id) if self.accepts_images else []
        if len(runs) != len(images):
            raise ValueError(f"multi_modal_data.image: {len(images)} image(s) but the prompt holds {len(runs)} "
                             f"image placeholder(s) (token {self.image_token_id}, <|image_pad|>); put one "
                             "<|vision_start|><|image_pad|><|vision_end|> per image in the prompt")
        if not images:
            return token_ids, []
        processed = [self._preprocess(img, f"multi_modal_data.image[{i}]") for i, img in enumerate(images)]
        out, features, cursor = [], [], 0
        for i, ((start, length), image) in enumerate(zip(runs, processed)):
            if length not in (1, image.num_tokens):
                raise ValueError(f"multi_modal_data.image[{i}]: the prompt holds {length} placeholders for it; "
                                 f"use one (expanded by the engine) or exactly {image.num_tokens}")
            out.extend(token_ids[cursor:start])
            features.append(MultiModalFeature(len(out), image.num_tokens, image.grid_thw, image.hash,
                                              image.pixel_values))
            out.extend([self.image_token_id] * image.num_tokens)
            cursor = start + length
        out.extend(token_ids[cursor:])
        return out, features

    def _preprocess(self, image, field: str):
        image = load_image(image, field)
        try:
            return preprocess_image(image, self.image_config)
        except ValueError as exc:  # an aspect ratio or size the resize rule refuses
            raise ValueError(f"{field}: {exc}") from exc

    def _images(self, mm_data) -> list:
        if mm_data is None:
            return []
        if not isinstance(mm_data, dict):
            raise ValueError(f"multi_modal_data must be a dict such as {{'image': image}}, got {type(mm_data).__name__}")
        unknown = sorted(set(mm_data) - set(SUPPORTED_MODALITIES))
        if unknown:
            raise ValueError(f"multi_modal_data.{unknown[0]} is not supported (supported: image)")
        images = mm_data.get("image")
        images = [] if images is None else list(images) if isinstance(images, (list, tuple)) else [images]
        if images and not self.accepts_images:
            raise ValueError(f"multi_modal_data.image: {self.model_type} takes text only (no vision tower)")
        if len(images) > self.limits["image"]:
            raise ValueError(f"multi_modal_data.image: {len(images)} images exceed limit_mm_per_prompt"
                             f"['image'] = {self.limits['image']}")
        return images


def _runs(token_ids: list[int], token: int) -> list[tuple[int, int]]:
    """(start, length) of each maximal run of `token`."""
    runs, i = [], 0
    while i < len(token_ids):
        if token_ids[i] == token:
            j = i
            while j < len(token_ids) and token_ids[j] == token:
                j += 1
            runs.append((i, j - i))
            i = j
        else:
            i += 1
    return runs


def _limits(limit_mm_per_prompt: dict | None) -> dict[str, int]:
    limits = {"image": DEFAULT_IMAGE_LIMIT}
    for key, value in (limit_mm_per_prompt or {}).items():
        if key not in SUPPORTED_MODALITIES:
            raise ValueError(f"limit_mm_per_prompt.{key} is not supported (supported: image)")
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"limit_mm_per_prompt.{key} must be an integer >= 0, got {value!r}")
        limits[key] = value
    return limits


def _processor_kwargs(kwargs: dict | None) -> dict[str, int]:
    out = {}
    for key, value in (kwargs or {}).items():
        if key not in PROCESSOR_KWARGS:
            raise ValueError(f"mm_processor_kwargs.{key} is not supported (supported: {', '.join(PROCESSOR_KWARGS)})")
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"mm_processor_kwargs.{key} must be a positive integer, got {value!r}")
        out[key] = value
    if out.get("min_pixels", 0) > out.get("max_pixels", float("inf")):
        raise ValueError("mm_processor_kwargs.min_pixels must not exceed max_pixels")
    return out
