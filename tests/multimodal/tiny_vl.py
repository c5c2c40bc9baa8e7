"""Tiny random Qwen2-VL / Qwen2.5-VL models with a vision tower and a word-level tokenizer whose special
tokens (<|image_pad|>, <|vision_start|>, ...) are the config's ids, saved as folders `LLM` loads."""
from __future__ import annotations

import copy
import json
import os

import torch

from tests.tiny_models import perturb_norms_and_biases

# head_dim 16 → 8 rotary frequencies, t/h/w 2/3/3; weights at init 0.2 so a wrong position moves logits.
TEXT = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6, rope_theta=10000.0,
            bos_token_id=1, eos_token_id=125, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
            initializer_range=0.2)
VISION = {
    "qwen2_vl": dict(depth=2, embed_dim=32, hidden_size=64, num_heads=4, mlp_ratio=2, patch_size=14,
                     spatial_merge_size=2, temporal_patch_size=2, in_channels=3, initializer_range=0.2),
    # window_size 56: windows of 2x2 merged tokens, so test images hold several, some partial
    "qwen2_5_vl": dict(depth=3, hidden_size=32, intermediate_size=48, out_hidden_size=64, num_heads=4,
                       patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_channels=3, window_size=56,
                       fullatt_block_indexes=[1], tokens_per_second=2, hidden_act="silu", initializer_range=0.2),
}
IMAGE_PAD, VIDEO_PAD, VISION_START, VISION_END, IM_START, IM_END = 120, 121, 122, 123, 124, 125
IDS = dict(image_token_id=IMAGE_PAD, video_token_id=VIDEO_PAD, vision_start_token_id=VISION_START,
           vision_end_token_id=VISION_END)
SPECIAL = {"<|image_pad|>": IMAGE_PAD, "<|video_pad|>": VIDEO_PAD, "<|vision_start|>": VISION_START,
           "<|vision_end|>": VISION_END, "<|im_start|>": IM_START, "<|im_end|>": IM_END}
WORDS = {"user": 117, "assistant": 118, "system": 119}
# Qwen2-VL's shape of template: image parts become the vision placeholder, text parts their text.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }} "
    "{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}"
    "{% if p.type == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ p.text }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|> {% endfor %}{% if add_generation_prompt %}<|im_start|>assistant {% endif %}")


def tiny_vl(kind: str = "qwen2_vl", seed: int = 1234):
    """A random transformers Qwen2-VL (or Qwen2.5-VL) for conditional generation, eager attention."""
    import transformers

    cls_cfg, cls_model = {
        "qwen2_vl": (transformers.Qwen2VLConfig, transformers.Qwen2VLForConditionalGeneration),
        "qwen2_5_vl": (transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration),
    }[kind]
    torch.manual_seed(seed)
    # Deep copies: building a config writes rope_theta/rope_type into the rope dict it is given.
    config = cls_cfg(text_config=copy.deepcopy(TEXT), vision_config=copy.deepcopy(VISION[kind]), **IDS)
    config._attn_implementation = "eager"
    return perturb_norms_and_biases(cls_model(config).eval().float())


def save_tiny_vl(model, path, chat_template: str | None = CHAT_TEMPLATE) -> str:
    """The model's folder with a word-level tokenizer: "t<i>" per plain id, the roles, and the special
    tokens at the config's ids; a Qwen2-VL-shaped chat template unless chat_template is None."""
    import tokenizers
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    model.save_pretrained(str(path))
    named = {**SPECIAL, **WORDS}
    vocab = {f"t{i}": i for i in range(TEXT["vocab_size"]) if i not in named.values()}
    vocab.update(named)
    tok = tokenizers.Tokenizer(WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = Whitespace()
    tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tok.save(os.path.join(path, "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "bos_token": None}
    if chat_template is not None:
        config["chat_template"] = chat_template
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    return str(path)


def image_prompt(text_ids: list[list[int]]) -> list[int]:
    """Token ids: the text pieces with one <|vision_start|><|image_pad|><|vision_end|> between each two."""
    out = list(text_ids[0])
    for piece in text_ids[1:]:
        out += [VISION_START, IMAGE_PAD, VISION_END] + list(piece)
    return out
