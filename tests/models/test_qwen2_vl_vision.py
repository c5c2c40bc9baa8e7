"""Qwen2-VL / Qwen2.5-VL vision towers against transformers' `get_image_features` on tiny random models."""
import copy

import pytest
import torch

from specserve.models.qwen2_vl_vision import build_vision_tower
from tests.multimodal.tiny_vl import tiny_vl

PATCH_DIM = 3 * 2 * 14 * 14
GRIDS = {
    "one": [(1, 8, 12)],
    "two": [(1, 8, 12), (1, 6, 4)],
    "2x2": [(1, 2, 2)],
    "tall": [(1, 16, 4)],
    "partial_windows": [(1, 10, 6)],
    "two_frames": [(2, 4, 6), (1, 6, 4)],
}


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def tiny(request):
    """(transformers model, config dict, transformers-5 state dict) of a tiny random VL model."""
    model = tiny_vl(request.param, seed=0)
    return model, model.config.to_dict(), {k: v.detach().clone() for k, v in model.state_dict().items()}


def hub_layout(state: dict) -> dict:
    """transformers 5 names → the hub checkpoints' (`visual.*`); other tensors keep their names."""
    return {("visual." + k[len("model.visual."):] if k.startswith("model.visual.") else k): v
            for k, v in state.items()}


def reference(model, pixel_values: torch.Tensor, grid_thw: list) -> torch.Tensor:
    with torch.no_grad():
        out = model.model.get_image_features(pixel_values, torch.tensor(grid_thw))
    return torch.cat(list(out.pooler_output))


def random_pixels(grid_thw: list, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(sum(t * h * w for t, h, w in grid_thw), PATCH_DIM, generator=generator)


@pytest.mark.parametrize("layout", ["transformers5", "hub"])
@pytest.mark.parametrize("grid", list(GRIDS))
def test_matches_transformers(tiny, grid, layout):
    model, config, state = tiny
    tower = build_vision_tower(config, hub_layout(state) if layout == "hub" else state)
    grid_thw = GRIDS[grid]
    pixels = random_pixels(grid_thw)
    ours = tower.forward(pixels, grid_thw)
    expected = reference(model, pixels, grid_thw)
    assert ours.shape == (sum(t * h * w for t, h, w in grid_thw) // 4, tower.out_hidden_size)
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)


def test_images_do_not_mix(tiny):
    _, config, state = tiny
    tower = build_vision_tower(config, state)
    grid_thw = [(1, 8, 12), (1, 8, 12)]  # same size, so both images' segments share attention batches
    pixels = random_pixels(grid_thw)
    first = 8 * 12
    changed = pixels.clone()
    changed[first:] = random_pixels(grid_thw[1:], seed=2)
    before, after = tower.forward(pixels, grid_thw), tower.forward(changed, grid_thw)
    tokens = first // 4
    torch.testing.assert_close(after[:tokens], before[:tokens], atol=1e-6, rtol=0)
    assert (after[tokens:] - before[tokens:]).abs().max() > 1e-2
    alone = tower.forward(pixels[:first], grid_thw[:1])
    torch.testing.assert_close(alone, before[:tokens], atol=1e-6, rtol=0)


def test_no_vision_weights_gives_none(tiny):
    _, config, state = tiny
    text_only = {k: v for k, v in state.items() if "visual." not in k}
    assert build_vision_tower(config, text_only) is None


def test_unsupported_settings_raise(tiny):
    _, config, state = tiny
    bad_act = copy.deepcopy(config)
    bad_act["vision_config"]["hidden_act"] = "not_an_activation"
    with pytest.raises(ValueError, match="hidden_act"):
        build_vision_tower(bad_act, state)
    bad_heads = copy.deepcopy(config)
    bad_heads["vision_config"]["num_heads"] = 5
    with pytest.raises(ValueError, match="heads"):
        build_vision_tower(bad_heads, state)
    missing = {k: v for k, v in state.items() if not k.endswith("merger.mlp.2.bias")}
    with pytest.raises(ValueError, match="missing"):
        build_vision_tower(config, missing)


def test_bad_inputs_raise(tiny):
    _, config, state = tiny
    tower = build_vision_tower(config, state)
    with pytest.raises(ValueError, match="multiples"):
        tower.forward(random_pixels([(1, 3, 4)]), [(1, 3, 4)])
    with pytest.raises(ValueError, match="pixel_values"):
        tower.forward(random_pixels([(1, 4, 4)]), [(1, 4, 6)])
