"""Draft heads shipped with specserve, trained by `specserve train-drafter` (each folder's README.md says
how): used when speculative_config names a method but no model and the target is the default model."""
from __future__ import annotations

import os

HEADS_DIR = os.path.dirname(os.path.abspath(__file__))
BUNDLED = {"eagle3": "smollm2-135m-instruct-eagle3"}  # method -> folder, for the default target


def is_default_model(model: str | None) -> bool:
    if model is None:
        return True
    from specserve.models.loader import default_model_path

    try:
        return os.path.samefile(model, default_model_path())
    except (FileNotFoundError, OSError):
        return False


def bundled_head(method: str, target_model: str | None) -> str | None:
    """The shipped head folder for `method` on this target, or None."""
    folder = BUNDLED.get(method)
    if folder is None or not is_default_model(target_model):
        return None
    path = os.path.join(HEADS_DIR, folder)
    return path if os.path.isfile(os.path.join(path, "model.safetensors")) else None
