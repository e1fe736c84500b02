"""The two image-text row forms, turned into chat messages plus image references in order.

(a) chat messages whose content is a list of parts:
    {"messages": [{"role": "user", "content": [{"type": "image", "image": "cat.png"},
                                                {"type": "text", "text": "What animal is this?"}]}],
     "label": "cat"}
(b) the flat form: a prompt with `<image>` placeholders and a list of images:
    {"prompt": "<image>What animal is this?", "images": ["cat.png"], "label": "cat"}

Image parts come out as {"type": "image"} (the chat template renders the vision placeholders); the
references come out separately, in the order the images appear.
"""
from __future__ import annotations

from typing import Any

from .images import ImageError

IMAGE_KEYS = ("image", "image_url", "url", "path")
PART_TYPES = ("text", "image", "image_url")  # image_url: OpenAI's {"type": "image_url", "image_url": {"url": ...}}


def _image_ref(part: dict) -> Any:
    for key in IMAGE_KEYS:
        value = part.get(key)
        if isinstance(value, dict) and key == "image_url":  # OpenAI style {"image_url": {"url": ...}}
            value = value.get("url")
        if value is not None:
            return value
    raise ImageError("bad_reference", f"image part {sorted(part)} has none of the keys {', '.join(IMAGE_KEYS)}")


def check_messages(messages: Any, key: str) -> None:
    """A TypeError naming what is wrong unless `messages` is a list of chat messages: objects with a string role
    and a content that is a string or a list of part objects."""
    if not isinstance(messages, list):
        raise TypeError(f"field '{key}' must be a list of chat messages ({{\"role\": ..., \"content\": ...}}), got "
                        f"{type(messages).__name__}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise TypeError(f"'{key}'[{i}] must be an object with a string 'role' and a 'content', got {m!r:.80}")
        content = m.get("content")
        if isinstance(content, list):
            bad = next((part for part in content if not isinstance(part, dict)), None)
            if bad is not None:
                raise TypeError(f"'{key}'[{i}].content lists {bad!r:.60}; each part must be an object such as "
                                '{"type": "text", "text": ...} or {"type": "image", "image": ...}')
            # A part of another type would reach the chat template, which renders nothing for it: an image given
            # as {"type": "input_image", ...} would train as a text prompt without it.
            other = next((part for part in content if part.get("type") not in PART_TYPES), None)
            if other is not None:
                raise TypeError(f"'{key}'[{i}].content has a part of type {other.get('type')!r} ({other!r:.60}); "
                                f"parts are of type {', '.join(map(repr, PART_TYPES))}: an image is "
                                '{"type": "image", "image": ...}, a text {"type": "text", "text": ...}')
            # {"type": "text", "content": ...} renders as no text at all: the question would vanish unsaid
            text = next((part for part in content if part["type"] == "text" and not isinstance(part.get("text"), str)),
                        None)
            if text is not None:
                raise TypeError(f"'{key}'[{i}].content has a text part without a string 'text' ({text!r:.60}); a "
                                'text part is {"type": "text", "text": "..."}')
        elif not isinstance(content, str):
            raise TypeError(f"'{key}'[{i}].content must be a string or a list of parts, got {type(content).__name__}")


def parse_row(row: dict, *, prompt_key: str, messages_key: str, images_key: str,
              placeholder: str = "<image>") -> tuple[list[dict], list[Any]] | None:
    """(messages, image references) of an image-text row, or None for a text-only row. A field of the wrong
    type is a TypeError naming it."""
    images = row.get(images_key)
    prompt = row.get(prompt_key)
    if images is not None and not isinstance(images, (list, tuple)):
        raise TypeError(f"field '{images_key}' must be a list of image references, got {type(images).__name__} "
                        f"(a single image goes in a one-element list)")
    if prompt is None and row.get(messages_key) is not None:
        check_messages(row[messages_key], messages_key)
    if prompt is not None and (images or (isinstance(prompt, str) and placeholder and placeholder in prompt)):
        if not isinstance(prompt, str):
            raise TypeError(f"field '{prompt_key}' must be a string, got {type(prompt).__name__}")
        images = list(images or [])
        pieces = prompt.split(placeholder)
        if len(pieces) - 1 != len(images):
            raise ImageError("placeholder_mismatch", f"'{prompt_key}' has {len(pieces) - 1} {placeholder} "
                                                     f"placeholder(s) but '{images_key}' lists {len(images)} image(s)")
        content: list[dict] = []
        for k, piece in enumerate(pieces):
            if k:
                content.append({"type": "image"})
            if piece:
                content.append({"type": "text", "text": piece})
        return [{"role": "user", "content": content}], images
    messages = row.get(messages_key)
    if prompt is None and isinstance(messages, list):
        refs, bare, out = [], 0, []
        for m in messages:
            content = m.get("content")
            if isinstance(content, str) and placeholder and placeholder in content and m.get("role") != "assistant":
                # LLaMA-Factory's and ShareGPT's form: "<image>" in a turn's text marks where an image of the list
                # goes, as in the flat form (it loaded as literal text, or skipped its row naming no placeholder)
                pieces = content.split(placeholder)
                content = [part for k, piece in enumerate(pieces)
                           for part in ([{"type": "image"}] if k else [])
                           + ([{"type": "text", "text": piece}] if piece else [])]
            if not isinstance(content, list):
                out.append(m)
                continue
            parts = []
            for part in content:
                if part.get("type") in ("image", "image_url"):  # OpenAI's {"type": "image_url", "image_url": ...}
                    if any(part.get(key) is not None for key in IMAGE_KEYS):
                        refs.append(_image_ref(part))
                    else:
                        bare += 1
                    parts.append({"type": "image"})
                else:
                    parts.append(part)
            out.append({**m, "content": parts})
        if bare or images:  # bare {"type": "image"} parts take their images from the image list, in order
            images = list(images or [])
            if refs or bare != len(images):
                raise ImageError("placeholder_mismatch", f"'{messages_key}' has {bare + len(refs)} image part(s) "
                                                         f"or {placeholder} placeholder(s) ({len(refs)} with a "
                                                         f"reference) but '{images_key}' lists {len(images)} image(s); "
                                                         "give every image once")
            refs = images
        return (out, refs) if refs else None
    return None
