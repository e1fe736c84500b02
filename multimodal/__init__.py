"""The image-text path (planned): jsonl with image references, Pillow loading and validation,
processor calls, and pixel tensors that travel with packed samples. Not implemented yet."""
