"""Image references in image-text rows: resolve, fetch, decode and check them with Pillow.

A reference is a path (relative paths resolve against the data file's folder), a `file://` URL, an
`http(s)://` URL, a `data:image/...;base64,...` URI, a PIL image (a `datasets` Image feature,
decoded), `{"bytes": ..., "path": ...}` (the same feature, undecoded) or the encoded file's bytes (a binary
column). Whatever goes wrong becomes
an `ImageError` whose `reason` is the metric key (`data/skipped_<reason>`), so a bad row is skipped
and counted instead of failing deep inside the image processor.
"""
from __future__ import annotations

import base64
import binascii
import io
import struct
import time
import warnings
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from PIL import Image, ImageOps

# Modes Pillow converts to RGB faithfully. 16-bit and float modes ("I;16", "I", "F") would be clipped.
SUPPORTED_MODES = {"1", "L", "LA", "P", "PA", "RGB", "RGBA", "RGBX", "RGBa", "CMYK", "YCbCr", "La"}
REASONS = ("missing_image", "corrupt_image", "unsupported_mode", "too_large", "fetch_failed", "placeholder_mismatch",
           "bad_reference", "changed_since_load", "bad_aspect")
# What Pillow raises for a file it cannot read, by decoder (UnidentifiedImageError is an OSError; a truncated PPM
# header is a ValueError)
_UNDECODABLE = (OSError, ValueError, SyntaxError, EOFError, struct.error)
MAX_ASPECT_RATIO = 200  # the Qwen-VL image processors refuse a longer side over 200x the shorter


class ImageError(ValueError):
    def __init__(self, reason: str, message: str):
        assert reason in REASONS, reason
        super().__init__(message)
        self.reason = reason


def describe(ref: Any) -> str:
    """A short printable name for a reference (data URIs and raw bytes are not printed whole)."""
    if isinstance(ref, str):
        return ref if len(ref) <= 80 else ref[:60] + "..."
    if isinstance(ref, Image.Image):
        return f"<in-memory {ref.format or 'PIL'} image {ref.size[0]}x{ref.size[1]}>"
    if isinstance(ref, dict):
        return str(ref.get("path") or "<image bytes>")
    if isinstance(ref, (bytes, bytearray, memoryview)):
        return f"<{len(ref)} image bytes>"
    return type(ref).__name__


def image_bytes_source(ref: Any, base_dir: Path, timeout: float, max_bytes: int):
    """A file path or a bytes buffer Pillow can open."""
    if isinstance(ref, dict):
        data = ref.get("bytes")
        if isinstance(data, str):  # JSON holds bytes as text: base64
            try:
                data = base64.b64decode(data, validate=True)
            except (binascii.Error, ValueError) as e:
                raise ImageError("corrupt_image", f"image 'bytes' is a string that is not base64: {e}") from None
        if data is not None:
            if not isinstance(data, (bytes, bytearray, memoryview)):
                raise ImageError("bad_reference", f"image 'bytes' must be bytes or a base64 string, got "
                                                  f"{type(data).__name__}")
            return io.BytesIO(data)
        ref = ref.get("path")
    if isinstance(ref, (bytes, bytearray, memoryview)):  # a binary column: the encoded file itself
        return io.BytesIO(ref)
    if not isinstance(ref, str) or not ref:
        raise ImageError("bad_reference", f"image reference {describe(ref)} is not a path, URL, data URI, image "
                                          "bytes or image")
    if ref.startswith("data:"):
        head, _, payload = ref.partition(",")
        if not head.startswith("data:image/") or ";base64" not in head:
            raise ImageError("bad_reference", f"data URI must look like data:image/png;base64,... (got {head[:40]!r})")
        try:
            return io.BytesIO(base64.b64decode(payload, validate=True))
        except (binascii.Error, ValueError) as e:
            raise ImageError("corrupt_image", f"data URI is not valid base64: {e}") from None
    url = urlparse(ref)
    if url.scheme in ("http", "https"):
        return io.BytesIO(_fetch(ref, timeout, max_bytes))
    if url.scheme == "file" and url.netloc not in ("", "localhost"):  # file://images/a.png: host "images", /a.png
        raise ImageError("bad_reference", f"{describe(ref)}: a file URL names a host ({url.netloc!r}) here; write a "
                                          "relative path without file:// (images/a.png) and an absolute one as "
                                          "file:///abs/path")
    path = Path(unquote(url.path)) if url.scheme == "file" else Path(ref)
    if not path.is_absolute():
        path = base_dir / path
    if not path.is_file():
        raise ImageError("missing_image", f"image file {path} does not exist")
    return path


def _max_bytes(max_pixels: int) -> int:
    """The most bytes an image of max_pixels can take in any format (16-bit RGBA stored raw), plus headers."""
    return 8 * max_pixels + 2**20


def _fetch(url: str, timeout: float, max_bytes: int) -> bytes:
    """The body of an http(s) image, within `timeout` seconds in all (requests' own timeout is per read: a server
    that trickles bytes would hold the rank, and the ranks waiting for it, for ever) and `max_bytes`."""
    import requests
    import urllib3

    deadline = time.monotonic() + timeout
    body = bytearray()
    try:
        with requests.get(url, timeout=timeout, stream=True) as r:
            r.raise_for_status()
            if int(r.headers.get("Content-Length") or 0) > max_bytes:
                raise ImageError("too_large", f"{url} is {r.headers['Content-Length']} bytes, more than an image of "
                                              f"data.max_image_pixels takes ({max_bytes})")
            r.raw.decode_content = True
            while chunk := r.raw.read1(1 << 16):  # what has arrived (read() waits to fill its size)
                body += chunk
                if len(body) > max_bytes:
                    raise ImageError("too_large", f"{url} sent more than {max_bytes} bytes, more than an image of "
                                                  "data.max_image_pixels takes")
                if time.monotonic() > deadline:
                    raise ImageError("fetch_failed", f"{url} took more than data.image_fetch_timeout={timeout} s "
                                                     f"({len(body)} bytes so far)")
    except (requests.RequestException, urllib3.exceptions.HTTPError, OSError) as e:  # r.raw's are urllib3's own
        raise ImageError("fetch_failed", f"could not fetch {url}: {e}") from None
    return bytes(body)


def read_image(ref: Any, base_dir: str | Path, *, max_pixels: int, timeout: float = 10.0) -> Image.Image:
    """The fully decoded image as RGB, EXIF orientation applied. `max_pixels` guards decoding: a larger
    image (a decompression bomb, or just too big) is refused from its header, before any decoding."""
    if Image.MAX_IMAGE_PIXELS is not None and max_pixels > Image.MAX_IMAGE_PIXELS:
        Image.MAX_IMAGE_PIXELS = max_pixels  # the limit asked for is the guard; Pillow's lower one would refuse first
    if isinstance(ref, Image.Image):
        img = ref
    else:
        source = image_bytes_source(ref, Path(base_dir), timeout, _max_bytes(max_pixels))  # its own ImageErrors pass
        try:
            img = Image.open(source)
        except Image.DecompressionBombError as e:
            raise ImageError("too_large", f"{describe(ref)}: {e}") from None
        except _UNDECODABLE as e:
            raise ImageError("corrupt_image", f"{describe(ref)} is not a readable image: {e}") from None
    width, height = img.size
    if max(width, height) > MAX_ASPECT_RATIO * max(min(width, height), 1):
        raise ImageError("bad_aspect", f"{describe(ref)} is {width}x{height}: the image processor takes no aspect "
                                       f"ratio over {MAX_ASPECT_RATIO}; crop or pad it")
    if width * height > max_pixels:
        raise ImageError("too_large", f"{describe(ref)} has {width}x{height} = {width * height} pixels, more than "
                                      f"data.max_image_pixels={max_pixels}")
    if img.mode not in SUPPORTED_MODES:
        raise ImageError("unsupported_mode", f"{describe(ref)} has mode {img.mode!r}; supported: "
                                             f"{', '.join(sorted(SUPPORTED_MODES))}")
    # a GIF, APNG or WebP animation: the model would see its first frame only (a camera's JPEG with an embedded
    # preview opens as a 2-frame MPO: a still photo)
    if img.format in ("GIF", "PNG", "WEBP") and getattr(img, "is_animated", False):
        raise ImageError("unsupported_mode", f"{describe(ref)} is animated ({img.n_frames} frames); the model takes "
                                             "one image: give the frame it should see")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img.load()  # a truncated file fails here, not later inside the processor
            img = ImageOps.exif_transpose(img)
            if img.mode == "La":  # premultiplied: Pillow converts it to LA only
                img = img.convert("LA")
            if img.mode in ("RGBA", "RGBa", "LA", "PA") or (img.mode == "P" and "transparency" in img.info):
                # On white, as Qwen's own qwen_vl_utils does: convert("RGB") keeps whatever colour lies under
                # transparent pixels (black, often: a black-on-transparent diagram became a black square).
                img = Image.alpha_composite(Image.new("RGBA", img.size, (255, 255, 255, 255)), img.convert("RGBA"))
            return img.convert("RGB")
    except (*_UNDECODABLE, Image.DecompressionBombWarning) as e:
        raise ImageError("corrupt_image", f"{describe(ref)} could not be decoded: {e}") from None


def to_png_base64(img: Image.Image) -> str:
    """What SGLang's `image_data` takes: the image as base64 PNG (lossless, so it sees our pixels)."""
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()
