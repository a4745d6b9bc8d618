"""What the report shows of a picture sample: each picture as a small JPEG inline (a data
URI, so the report stays one file), and its prompt with a picture's run of image tokens
said once with its count (``<image_soft_token>×256``) instead of 256 times."""

from __future__ import annotations

import base64
import io
import re

SIDE = 96  # a thumbnail's longest side, in pixels
SHOWN = 16  # the samples (the first of the eval set) that carry their pictures' thumbnails
_RUN = re.compile(r"(<[^<>\s]{1,40}>)(?:\s?\1){3,}")  # a decoder may put spaces between


def thumbnail(data: bytes) -> str:
    """A picture (encoded bytes) as a JPEG data URI at most SIDE pixels a side."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as img:
        small = img.convert("RGB")
        small.thumbnail((SIDE, SIDE))
    buf = io.BytesIO()
    small.save(buf, format="JPEG", quality=80)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def shown(text: str) -> str:
    """``text`` with each run of four or more of one special token said once, with its count."""
    return _RUN.sub(lambda m: f"{m.group(1)}×{m.group(0).count(m.group(1))}", text)
