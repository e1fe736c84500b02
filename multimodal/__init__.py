"""The image-text path: the jsonl schemas with image references (schema), Pillow loading and validation
(images), and the processor calls that make the pixel patches travelling with packed samples (processor)."""
