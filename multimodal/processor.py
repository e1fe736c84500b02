"""Qwen2-VL / Qwen2.5-VL prompt processing: images -> pixel patches, and each image placeholder in the
prompt expanded to the number of tokens its patches merge into.

This is what the models' `AutoProcessor` does for images, built from the two parts that load without
torchvision: the image processor (Pillow backend) and the tokenizer (whose chat template renders
image parts as `<|vision_start|><|image_pad|><|vision_end|>`). The full AutoProcessor also builds a
video processor, which needs torchvision; a CPU install has none.

Sizes: every image is resized to a multiple of patch_size x merge_size with its pixel count within
[model.min_pixels, model.max_pixels] (`smart_resize`), so the token count of an image is known from
its width and height alone; `prompt_len` uses that to filter prompts before decoding any pixels.
"""
from __future__ import annotations

import dataclasses

import torch
from PIL import Image


@dataclasses.dataclass
class MultimodalInputs:
    """The image inputs of one prompt, travelling with its samples (never all-gathered)."""
    pixel_values: torch.Tensor  # (patches, channels * temporal_patch * patch * patch)
    image_grid_thw: torch.Tensor  # (images, 3) long: temporal, height, width in patches
    token_id: int = -1
    """The image placeholder token; the prompt's occurrences of it (never a generated one) take the features."""
    images: list[Image.Image] | None = None
    """The images at their processed size, for engines that run the processor themselves (SGLang)."""
    num_tokens: int = -1
    """Placeholder tokens the images fill (-1: not known)."""

    @property
    def num_patches(self) -> int:
        return int(self.pixel_values.shape[0])

    def without_images(self) -> "MultimodalInputs":
        return dataclasses.replace(self, images=None)

    def check_context(self, ids: list[int], row: int) -> None:
        """An engine generates from ids whose image tokens are all filled by these images; a generated image token
        in a multi-turn context is one no image fills (the trainer reads it as text; the engines cannot)."""
        n = sum(t == self.token_id for t in ids)
        if self.num_tokens >= 0 and n != self.num_tokens:
            raise ValueError(
                f"image-text prompt {row} of this generate call holds {n} image tokens (id {self.token_id}) but its "
                f"images fill {self.num_tokens}: a multi-turn context that carries a generated image token? A "
                "generate function must not send the model's own image tokens back as context (drop or replace "
                "them, or end the turn)")


def check_contexts(prompts: list[list[int]], mm: list[MultimodalInputs | None] | None) -> None:
    """`MultimodalInputs.check_context` of each image-text row of a generate call; and no image token in its text
    rows, which the model would count with the images' (a quoted `<|image_pad|>` in a custom rollout's context)."""
    token_ids = {m.token_id for m in mm or () if m is not None}
    for row, (ids, m) in enumerate(zip(prompts, mm or [None] * len(prompts))):
        if m is not None:
            m.check_context(ids, row)
        elif n := sum(t in token_ids for t in ids):
            raise ValueError(f"text prompt {row} of this generate call holds {n} image token(s) (id "
                             f"{', '.join(map(str, token_ids))}) and no images, beside image-text prompts whose "
                             "images the model would give them: drop or replace the token in that prompt's context")


class VLProcessor:
    def __init__(self, model_path: str, tokenizer, *, min_pixels: int | None = None, max_pixels: int | None = None):
        from transformers import AutoConfig, AutoImageProcessor

        kwargs = {k: v for k, v in (("min_pixels", min_pixels), ("max_pixels", max_pixels)) if v is not None}
        self.image_processor = AutoImageProcessor.from_pretrained(model_path, backend="pil", **kwargs)
        self.tokenizer = tokenizer
        config = AutoConfig.from_pretrained(model_path)
        self.image_token_id = config.image_token_id
        self.image_token = tokenizer.convert_ids_to_tokens(self.image_token_id)
        ip = self.image_processor
        self.merge = ip.merge_size
        self.factor = ip.patch_size * ip.merge_size
        self.min_pixels, self.max_pixels = ip.size["shortest_edge"], ip.size["longest_edge"]
        tile = self.factor ** 2  # the pixels of one image token
        if self.max_pixels < tile or self.min_pixels > self.max_pixels:
            raise ValueError(f"model.max_pixels={self.max_pixels} (model.min_pixels={self.min_pixels}; null: the image "
                             f"processor's) leaves every image one {self.factor}x{self.factor} tile, one image token: "
                             f"give max_pixels at least {tile} and min_pixels no more than max_pixels")

    def processed_size(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) the image processor resizes an image to."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        h, w = smart_resize(height, width, factor=self.factor, min_pixels=self.min_pixels, max_pixels=self.max_pixels)
        return w, h

    def image_tokens(self, width: int, height: int) -> int:
        w, h = self.processed_size(width, height)
        return (w // self.factor) * (h // self.factor)

    def expand(self, text: str, sizes: list[tuple[int, int]]) -> str:
        """Repeat the i-th image placeholder once per token of image i (of size `sizes[i]`)."""
        pieces = text.split(self.image_token)
        if len(pieces) - 1 != len(sizes):
            raise ValueError(f"the prompt renders {len(pieces) - 1} image placeholder(s) for {len(sizes)} image(s); "
                             "does the tokenizer's chat template render image parts?")
        out = [pieces[0]]
        for size, piece in zip(sizes, pieces[1:]):
            out.append(self.image_token * self.image_tokens(*size) + piece)
        return "".join(out)

    def prompt_ids(self, text: str, sizes: list[tuple[int, int]]) -> list[int]:
        return self.tokenizer(self.expand(text, sizes), add_special_tokens=False).input_ids

    def pixels(self, images: list[Image.Image]) -> MultimodalInputs:
        """Patches of RGB images (in prompt order), and the images at their processed size."""
        out = self.image_processor(images=images, return_tensors="pt")
        resized = [img.resize(self.processed_size(*img.size), Image.BICUBIC) for img in images]
        grid = out["image_grid_thw"].long()
        return MultimodalInputs(pixel_values=out["pixel_values"], image_grid_thw=grid, token_id=self.image_token_id,
                                images=resized, num_tokens=int(grid.prod(-1).sum()) // self.merge ** 2)
