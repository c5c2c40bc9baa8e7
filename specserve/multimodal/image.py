"""Qwen2-VL image input: decode a request's image safely, resize it to the patch grid, and lay its pixels out
as the vision encoder's patch rows (numpy + Pillow only; matches transformers' Qwen2VLImageProcessorPil)."""
import base64
import binascii
import hashlib
import io
import json
import math
import os
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageOps

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_ASPECT_RATIO = 200

# Media type in the data URL -> the only Pillow decoder tried on its bytes.
ALLOWED_MEDIA_TYPES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/webp": "WEBP"}
_DECODERS = sorted(set(ALLOWED_MEDIA_TYPES.values()))


@dataclass(frozen=True)
class ImageProcessorConfig:
    min_pixels: int = 3136  # the hub preprocessor_config.json values, not transformers' class defaults
    max_pixels: int = 12845056
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    image_mean: tuple = CLIP_MEAN
    image_std: tuple = CLIP_STD

    def __post_init__(self):
        for name in ("min_pixels", "max_pixels", "patch_size", "merge_size", "temporal_patch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ImageProcessorConfig.{name} must be a positive int, got {value!r}")
        if self.min_pixels > self.max_pixels:
            raise ValueError(f"ImageProcessorConfig.min_pixels ({self.min_pixels}) is above max_pixels "
                             f"({self.max_pixels})")
        for name in ("image_mean", "image_std"):
            value = tuple(float(v) for v in getattr(self, name))
            if len(value) != 3:
                raise ValueError(f"ImageProcessorConfig.{name} needs one value per RGB channel, got {value}")
            object.__setattr__(self, name, value)  # json gives lists; keep the frozen config hashable
        if any(s <= 0 for s in self.image_std):
            raise ValueError(f"ImageProcessorConfig.image_std must be positive, got {self.image_std}")

    @property
    def factor(self) -> int:
        """Side multiple of a resized image: one merge block of patches."""
        return self.patch_size * self.merge_size

    @classmethod
    def from_model(cls, folder: str | None, vision_config: dict | None) -> "ImageProcessorConfig":
        """Reads <folder>/preprocessor_config.json when present (min_pixels/max_pixels, which win over
        size={"shortest_edge","longest_edge"} as in transformers; patch_size, merge_size, temporal_patch_size,
        image_mean, image_std); patch/merge/temporal sizes fall back to vision_config (patch_size,
        spatial_merge_size, temporal_patch_size), then the defaults. folder may be None or a GGUF file path."""
        pre = _read_preprocessor_json(folder)
        vision = vision_config or {}
        size = pre.get("size") or {}
        fields = {
            "min_pixels": pre.get("min_pixels", size.get("shortest_edge")),
            "max_pixels": pre.get("max_pixels", size.get("longest_edge")),
            "patch_size": pre.get("patch_size", vision.get("patch_size")),
            "merge_size": pre.get("merge_size", vision.get("spatial_merge_size")),
            "temporal_patch_size": pre.get("temporal_patch_size", vision.get("temporal_patch_size")),
            "image_mean": pre.get("image_mean"),
            "image_std": pre.get("image_std"),
        }
        return cls(**{k: v for k, v in fields.items() if v is not None})


def _read_preprocessor_json(folder: str | None) -> dict:
    if folder is None or not os.path.isdir(folder):
        return {}
    path = os.path.join(folder, "preprocessor_config.json")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width) closest to the input with both sides multiples of factor and the area within
    [min_pixels, max_pixels] (up to rounding), keeping the aspect ratio."""
    if height < 1 or width < 1:
        raise ValueError(f"image size must be positive, got {height}x{width}")
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise ValueError(f"image aspect ratio must be at most {MAX_ASPECT_RATIO}, got {ratio:.1f} "
                         f"({height}x{width})")
    # round() is Python's round-half-to-even, as in the reference.
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        scale = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / scale / factor) * factor)
        w = max(factor, math.floor(width / scale / factor) * factor)
    elif h * w < min_pixels:
        scale = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * scale / factor) * factor
        w = math.ceil(width * scale / factor) * factor
    return h, w


@dataclass(frozen=True, eq=False)  # eq=False: identity comparison, since an ndarray field has no truth value
class ProcessedImage:
    pixel_values: np.ndarray  # [t*h*w, 3 * temporal_patch * patch * patch] float32, rows in merge-block order
    grid_thw: tuple[int, int, int]  # patch grid: frames / temporal_patch, rows, columns
    num_tokens: int  # t*h*w // merge**2, the image's placeholder tokens in the prompt
    hash: str  # hex sha256 of the normalised pixels and the grid: the prefix-cache key of the image


def load_image(source, field: str = "image", max_bytes: int = 20 << 20,
               max_decoded_pixels: int = 64_000_000) -> Image.Image:
    """RGB image from a PIL image, raw bytes, or a data URL 'data:image/<png|jpeg|webp>;base64,...'.

    Every failure is a ValueError whose message starts with `field`: a URL other than a data URL (nothing is
    fetched), a media type other than PNG/JPEG/WebP, bad base64, more than max_bytes encoded bytes, more than
    max_decoded_pixels pixels (read from the header, before decoding), or bytes Pillow cannot decode.
    Decoded bytes are turned upright by their EXIF orientation; transparency is composited onto white."""
    if isinstance(source, Image.Image):
        image = source
        _check_decoded_size(image, field, max_decoded_pixels)
    else:
        if isinstance(source, str):
            source = _data_url_bytes(source, field, max_bytes)
        elif isinstance(source, (bytes, bytearray, memoryview)):
            source = bytes(source)
        else:
            raise ValueError(f"{field}: expected a base64 data URL, bytes or a PIL image, "
                             f"got {type(source).__name__}")
        if len(source) > max_bytes:
            raise ValueError(f"{field}: image is {len(source)} bytes, above the limit of {max_bytes}")
        image = _decode(source, field, max_decoded_pixels)
    return to_rgb(image)


def _data_url_bytes(url: str, field: str, max_bytes: int) -> bytes:
    if url[:5].lower() != "data:":
        if "://" in url[:16]:
            raise ValueError(f"{field}: remote image URLs are not fetched; send the image as a base64 data URL")
        raise ValueError(f"{field}: expected a base64 data URL 'data:image/<png|jpeg|webp>;base64,...', "
                         f"got a string starting {url[:16]!r}")
    header, comma, payload = url[5:].partition(",")
    if not comma:
        raise ValueError(f"{field}: malformed data URL (no ',' before the data)")
    media_type, *params = [p.strip().lower() for p in header.split(";")]
    if media_type not in ALLOWED_MEDIA_TYPES:
        raise ValueError(f"{field}: unsupported media type {media_type!r}; allowed: "
                         f"{', '.join(ALLOWED_MEDIA_TYPES)}")
    if "base64" not in params:
        raise ValueError(f"{field}: data URL must be base64-encoded (';base64,')")
    payload = "".join(payload.split())  # some encoders wrap lines
    if len(payload) > 4 * math.ceil(max_bytes / 3):
        raise ValueError(f"{field}: image is about {len(payload) * 3 // 4} bytes, above the limit of {max_bytes}")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"{field}: invalid base64 in data URL ({e})") from None


def _decode(data: bytes, field: str, max_decoded_pixels: int) -> Image.Image:
    try:
        image = Image.open(io.BytesIO(data), formats=_DECODERS)  # reads the header only
    except Image.DecompressionBombError:
        raise ValueError(f"{field}: image has more than {max_decoded_pixels} pixels") from None
    except Exception:  # Pillow signals bad input with many exception types
        raise ValueError(f"{field}: could not decode the image: not a valid PNG, JPEG or WebP file") from None
    _check_decoded_size(image, field, max_decoded_pixels)
    try:
        image.load()
        return ImageOps.exif_transpose(image)
    except Exception as e:
        raise ValueError(f"{field}: could not decode the image, it is corrupt or truncated ({e})") from None


def _check_decoded_size(image: Image.Image, field: str, max_decoded_pixels: int):
    width, height = image.size
    if width * height > max_decoded_pixels:
        raise ValueError(f"{field}: image is {width}x{height} pixels, above the limit of {max_decoded_pixels}")


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB image; transparent pixels are composited onto white, as the reference processor does, because
    the colour under a fully transparent pixel is arbitrary."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image if image.mode == "RGB" else image.convert("RGB")


def preprocess_image(image: Image.Image, config: ImageProcessorConfig) -> ProcessedImage:
    """Resizes to the patch grid (bicubic), rescales by 1/255, normalises, repeats the frame
    temporal_patch_size times and lays the pixels out as the vision encoder's patch rows."""
    image = to_rgb(image)
    height, width = smart_resize(image.height, image.width, config.factor, config.min_pixels, config.max_pixels)
    resized = np.asarray(image.resize((width, height), Image.Resampling.BICUBIC))  # [H, W, 3] uint8
    # float64 multiply, then float32: the reference's rounding, so the values match it exactly.
    pixels = (resized.astype(np.float64) * (1 / 255)).astype(np.float32)
    pixels = (pixels - np.float32(config.image_mean)) / np.float32(config.image_std)  # [H, W, 3] float32
    grid = (1, height // config.patch_size, width // config.patch_size)
    digest = hashlib.sha256(np.asarray(grid, dtype=np.int64).tobytes())
    digest.update(np.ascontiguousarray(pixels).tobytes())
    return ProcessedImage(pixel_values=patchify(pixels, config), grid_thw=grid,
                          num_tokens=grid[0] * grid[1] * grid[2] // config.merge_size ** 2,
                          hash=digest.hexdigest())


def patchify(frame: np.ndarray, config: ImageProcessorConfig) -> np.ndarray:
    """[H, W, 3] frame -> [gh*gw, 3 * temporal_patch * patch * patch] rows.

    Rows go merge block by merge block (row-major over blocks, then row-major inside a block), so the
    encoder's merger sees each block's merge**2 patches as consecutive rows; each row is ordered
    [channel][time][y][x], the frame repeated along time."""
    p, m, t = config.patch_size, config.merge_size, config.temporal_patch_size
    height, width, channels = frame.shape
    gh, gw = height // p, width // p
    blocks = frame.reshape(gh // m, m, p, gw // m, m, p, channels)
    blocks = blocks.transpose(0, 3, 1, 4, 6, 2, 5)  # [gh/m, gw/m, m, m, 3, p, p]
    blocks = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], t, p, p))
    return blocks.reshape(gh * gw, channels * t * p * p)
