"""Image preprocessing against transformers' Qwen2VLImageProcessorPil and smart_resize; data-URL decoding
and its refusals."""
import base64
import io
import json
import random
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from specserve.multimodal.image import (
    ImageProcessorConfig,
    load_image,
    preprocess_image,
    smart_resize,
)

qwen2_vl_pil = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")

FIELD = "messages[0].content[1].image_url"


def noise_image(height: int, width: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    """Random pixels plus a gradient: noise stresses the bicubic filter, the gradient catches flips."""
    rng = np.random.default_rng(seed)
    channels = len(Image.new(mode, (1, 1)).getbands())
    pixels = rng.integers(0, 256, (height, width, channels), dtype=np.int64)
    pixels += np.linspace(0, 64, width, dtype=np.int64)[None, :, None]
    pixels = np.clip(pixels, 0, 255).astype(np.uint8)
    return Image.fromarray(pixels[..., 0] if channels == 1 else pixels, mode)


def encode(image: Image.Image, fmt: str, **kwargs) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **kwargs)
    return buf.getvalue()


def data_url(payload: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(payload).decode()}"


def reference(image: Image.Image, config: ImageProcessorConfig):
    processor = qwen2_vl_pil.Qwen2VLImageProcessorPil(
        min_pixels=config.min_pixels, max_pixels=config.max_pixels, patch_size=config.patch_size,
        merge_size=config.merge_size, temporal_patch_size=config.temporal_patch_size,
        image_mean=list(config.image_mean), image_std=list(config.image_std))
    out = processor(images=image, return_tensors="np")
    return out["pixel_values"], tuple(int(v) for v in out["image_grid_thw"][0])


def palette_image(transparent: bool) -> Image.Image:
    image = noise_image(61, 83, seed=3).quantize(colors=32)
    if transparent:
        image.info["transparency"] = 0
    return image


def rgba_image() -> Image.Image:
    image = noise_image(50, 70, mode="RGBA", seed=4)
    alpha = np.asarray(image)[..., 3].copy()
    alpha[:10] = 0  # fully transparent rows, whose colour the reference discards
    image.putalpha(Image.fromarray(alpha))
    return image


HUB = ImageProcessorConfig()
CASES = [
    ("448x448", lambda: noise_image(448, 448), HUB),
    ("480x640", lambda: noise_image(480, 640), HUB),
    ("37x300", lambda: noise_image(37, 300), HUB),
    ("28x28", lambda: noise_image(28, 28), HUB),
    ("1000x90", lambda: noise_image(1000, 90), HUB),
    ("10x10 scaled up", lambda: noise_image(10, 10), HUB),
    ("grayscale", lambda: noise_image(45, 33, mode="L"), HUB),
    ("RGBA PNG", lambda: load_image(encode(rgba_image(), "PNG")), HUB),
    ("RGBA PIL", rgba_image, HUB),
    ("palette", lambda: palette_image(transparent=False), HUB),
    ("palette with transparency", lambda: palette_image(transparent=True), HUB),
    ("1080x1920 capped", lambda: noise_image(1080, 1920), ImageProcessorConfig(max_pixels=1003520)),
    ("other patch sizes", lambda: noise_image(123, 77),
     ImageProcessorConfig(min_pixels=1024, max_pixels=4096, patch_size=8, merge_size=2, temporal_patch_size=3,
                          image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5))),
]


@pytest.mark.parametrize("name,make,config", CASES, ids=[c[0] for c in CASES])
def test_matches_transformers_processor(name, make, config):
    image = make()
    ours = preprocess_image(image, config)
    ref_values, ref_grid = reference(image, config)
    assert ours.grid_thw == ref_grid
    assert ours.pixel_values.dtype == np.float32
    assert ours.pixel_values.shape == ref_values.shape
    assert np.abs(ours.pixel_values - ref_values).max() <= 1e-5
    t, h, w = ref_grid
    assert ours.num_tokens == t * h * w // config.merge_size ** 2


def test_smart_resize_matches_transformers():
    rng = random.Random(0)
    for _ in range(3000):
        height, width = rng.randint(1, 5000), rng.randint(1, 5000)
        factor = rng.choice([14, 16, 28, 32, 56])
        min_pixels = rng.randint(1, 200_000)
        max_pixels = rng.randint(min_pixels, 20_000_000)
        args = (height, width, factor, min_pixels, max_pixels)
        try:
            expected = qwen2_vl_pil.smart_resize(*args)
        except ValueError:
            with pytest.raises(ValueError, match="aspect ratio"):
                smart_resize(*args)
            continue
        assert smart_resize(*args) == expected, args


def test_smart_resize_rejects_extreme_aspect_ratio():
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(10, 2010, 28, 3136, 12845056)
    assert smart_resize(10, 2000, 28, 3136, 12845056)  # exactly 200 is allowed


def test_hash_tracks_pixels():
    image = noise_image(56, 84)
    changed = image.copy()
    r, g, b = changed.getpixel((5, 7))
    changed.putpixel((5, 7), ((r + 1) % 256, g, b))
    assert preprocess_image(image, HUB).hash == preprocess_image(image.copy(), HUB).hash
    assert preprocess_image(image, HUB).hash != preprocess_image(changed, HUB).hash
    # Same pixel bytes in another grid shape must not collide.
    flat = Image.fromarray(np.asarray(image).reshape(84, 56, 3))
    assert preprocess_image(flat, HUB).hash != preprocess_image(image, HUB).hash


@pytest.mark.parametrize("fmt,media_type,kwargs", [
    ("PNG", "image/png", {}),
    ("WEBP", "image/webp", {"lossless": True}),
    ("JPEG", "image/jpeg", {"quality": 90}),
])
def test_load_image_data_urls(fmt, media_type, kwargs):
    original = noise_image(40, 60, seed=7)
    payload = encode(original, fmt, **kwargs)
    image = load_image(data_url(payload, media_type), field=FIELD)
    assert image.mode == "RGB" and image.size == (60, 40)
    expected = np.asarray(Image.open(io.BytesIO(payload)).convert("RGB"))
    np.testing.assert_array_equal(np.asarray(image), expected)
    if fmt != "JPEG":
        np.testing.assert_array_equal(np.asarray(image), np.asarray(original))


def test_load_image_bytes_pil_and_wrapped_base64():
    original = noise_image(20, 30)
    payload = encode(original, "PNG")
    np.testing.assert_array_equal(np.asarray(load_image(payload)), np.asarray(original))
    np.testing.assert_array_equal(np.asarray(load_image(original)), np.asarray(original))
    wrapped = "data:image/png;base64," + base64.encodebytes(payload).decode()  # newline every 76 chars
    np.testing.assert_array_equal(np.asarray(load_image(wrapped)), np.asarray(original))


def test_load_image_composites_alpha_onto_white():
    image = Image.new("RGBA", (4, 4), (10, 20, 30, 0))
    assert load_image(encode(image, "PNG")).getpixel((0, 0)) == (255, 255, 255)
    assert load_image(palette_image(transparent=False)).mode == "RGB"


def test_load_image_applies_exif_orientation():
    original = noise_image(20, 30)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90° clockwise to display
    payload = encode(original, "JPEG", exif=exif, quality=95)
    assert load_image(payload).size == (20, 30)


def png_with_header_size(width: int, height: int) -> bytes:
    """A PNG whose IHDR claims width x height over a 1x1 image's data: a decoder would expand it."""
    png = encode(Image.new("RGB", (1, 1)), "PNG")
    ihdr = b"IHDR" + struct.pack(">II", width, height) + png[24:29]
    return png[:12] + ihdr + struct.pack(">I", zlib.crc32(ihdr)) + png[33:]


def gif_bytes() -> bytes:
    return encode(noise_image(8, 8), "GIF")


PNG = encode(noise_image(16, 16), "PNG")
ERRORS = [
    ("http URL", "http://example.com/cat.png", {}, "remote image URLs are not fetched"),
    ("https URL", "https://example.com/cat.png", {}, "remote image URLs are not fetched"),
    ("file URL", "file:///etc/passwd", {}, "remote image URLs are not fetched"),
    ("plain path", "/tmp/cat.png", {}, "data URL"),
    ("gif media type", data_url(gif_bytes(), "image/gif"), {}, "unsupported media type 'image/gif'"),
    ("svg media type", "data:image/svg+xml;base64,PHN2Zz4=", {}, "unsupported media type"),
    ("no media type", "data:;base64," + base64.b64encode(PNG).decode(), {}, "unsupported media type"),
    ("not base64", "data:image/png," + PNG.hex(), {}, "base64"),
    ("no comma", "data:image/png;base64", {}, "malformed"),
    ("bad base64", "data:image/png;base64,iVBOR*w0KGgo=", {}, "invalid base64"),
    ("bad padding", "data:image/png;base64,iVBORw0KGgoAA", {}, "invalid base64"),
    ("corrupt", data_url(b"\x89PNG\r\n\x1a\n" + b"\x00" * 64), {}, "could not decode"),
    ("truncated", data_url(PNG[: len(PNG) // 2]), {}, "could not decode"),
    ("gif bytes under png type", data_url(gif_bytes()), {}, "could not decode"),
    ("gif raw bytes", gif_bytes(), {}, "could not decode"),
    ("data URL over max_bytes", data_url(PNG), {"max_bytes": len(PNG) - 1}, "above the limit"),
    ("bytes over max_bytes", PNG, {"max_bytes": len(PNG) - 1}, "above the limit"),
    ("bomb header", data_url(png_with_header_size(9000, 9000)), {}, "9000x9000 pixels, above the limit"),
    ("pixels over limit", PNG, {"max_decoded_pixels": 255}, "16x16 pixels, above the limit"),
    ("PIL over limit", noise_image(16, 16), {"max_decoded_pixels": 255}, "above the limit"),
    ("wrong type", 12345, {}, "expected a base64 data URL"),
]


@pytest.mark.parametrize("name,source,kwargs,message", ERRORS, ids=[e[0] for e in ERRORS])
def test_load_image_errors_name_the_field(name, source, kwargs, message):
    with pytest.raises(ValueError) as info:
        load_image(source, field=FIELD, **kwargs)
    assert str(info.value).startswith(FIELD + ": ")
    assert message in str(info.value)


def test_from_model_reads_both_key_styles(tmp_path):
    mean, std = [0.5, 0.4, 0.3], [0.2, 0.25, 0.3]
    legacy = {"min_pixels": 1000, "max_pixels": 200000, "patch_size": 16, "merge_size": 2,
              "temporal_patch_size": 2, "image_mean": mean, "image_std": std}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(legacy))
    config = ImageProcessorConfig.from_model(str(tmp_path), {"patch_size": 14, "spatial_merge_size": 4})
    assert config == ImageProcessorConfig(1000, 200000, 16, 2, 2, tuple(mean), tuple(std))

    sized = {"size": {"shortest_edge": 2000, "longest_edge": 300000}, "image_mean": mean, "image_std": std}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(sized))
    config = ImageProcessorConfig.from_model(str(tmp_path), {"patch_size": 16, "spatial_merge_size": 4,
                                                             "temporal_patch_size": 3})
    assert config == ImageProcessorConfig(2000, 300000, 16, 4, 3, tuple(mean), tuple(std))

    both = {**sized, "min_pixels": 1234, "max_pixels": 56789}  # transformers: the *_pixels keys win
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(both))
    config = ImageProcessorConfig.from_model(str(tmp_path), None)
    assert (config.min_pixels, config.max_pixels) == (1234, 56789)


def test_from_model_without_json(tmp_path):
    assert ImageProcessorConfig.from_model(None, None) == ImageProcessorConfig()
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    config = ImageProcessorConfig.from_model(str(gguf), {"patch_size": 16, "spatial_merge_size": 4})
    assert (config.patch_size, config.merge_size, config.temporal_patch_size) == (16, 4, 2)
    assert (config.min_pixels, config.max_pixels) == (3136, 12845056)
    assert config.image_mean == pytest.approx((0.48145466, 0.4578275, 0.40821073))


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="min_pixels"):
        ImageProcessorConfig(min_pixels=10, max_pixels=5)
    with pytest.raises(ValueError, match="patch_size"):
        ImageProcessorConfig(patch_size=0)
    with pytest.raises(ValueError, match="image_std"):
        ImageProcessorConfig(image_std=(0.5, 0.0, 0.5))
