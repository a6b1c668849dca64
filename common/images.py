"""An image item's size, read from its header before any pixel is decoded (``maxImagePixels``).

A few KB of PNG or JPEG can declare a picture of hundreds of millions of pixels (12000 x 12000 black pixels
compress to 17 KB and decode to 432 MB of RGB), so the bytes caps of :mod:`api.media` do not bound what decoding
costs: the pixel count does. Both sides check it with :func:`open_image`: the API pod, so that such an item is
refused before anything is queued, and the worker before it decodes (a pod and a worker may run different
settings). ``PIL.Image.open`` reads the header only; the pixels are decoded by ``load``/``convert``, and for an
animated PNG or a multi-picture JPEG only the first frame is (every APNG frame lies inside the canvas checked
here). Pillow's own module-wide limit is left as it is: :attr:`~common.settings.Settings.max_image_pixels` is
bounded below the point where it refuses an image.
"""

from __future__ import annotations

import io

import PIL.Image


class ImageRefused(ValueError):
    """An image that is not decoded; the message is a predicate ("is ...", "cannot ...") for the caller to
    prefix with the item's name."""


def open_image(data: bytes, max_pixels: int) -> PIL.Image.Image:
    """``data`` opened as an image (its header read, its pixels not yet decoded), or :class:`ImageRefused` when
    Pillow reads no image header in it or the image has more than ``max_pixels`` pixels."""
    try:
        image = PIL.Image.open(io.BytesIO(data))
    except PIL.Image.DecompressionBombError:  # past Pillow's own ceiling, which maxImagePixels stays under
        raise ImageRefused(f"is an image of more than the {max_pixels:,} pixels an image may have "
                           "(maxImagePixels)") from None
    except PIL.UnidentifiedImageError:
        raise ImageRefused("cannot be decoded as an image: its header is not one Pillow reads") from None
    except (OSError, ValueError) as exc:
        raise ImageRefused(f"cannot be decoded as an image: {exc}") from None
    width, height = image.size
    if width * height > max_pixels:
        image.close()
        raise ImageRefused(f"is an image of {width} x {height} = {width * height:,} pixels, more than the "
                           f"{max_pixels:,} pixels an image may have (maxImagePixels)")
    return image
