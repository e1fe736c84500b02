"""json.loads, but a key twice in one object is an error: Python's json keeps the last one without a word, so a
row `{"prompt": "a", ..., "prompt": "b"}` or a DeepSpeed JSON with two "zero_optimization" objects would drop what
the user wrote first."""
from __future__ import annotations

import json


class DuplicateKeyError(ValueError):
    pass


def _unique(pairs: list[tuple[str, object]]) -> dict:
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKeyError(f"the key {key!r} is given twice in one object (JSON would keep only the last); "
                                    "remove or rename one")
        out[key] = value
    return out


def loads(text: str | bytes) -> object:
    """json.loads, raising DuplicateKeyError (a ValueError) on a key twice in one object."""
    return json.loads(text, object_pairs_hook=_unique)


def decoder() -> json.JSONDecoder:
    """A JSONDecoder raising DuplicateKeyError on a key twice in one object (for raw_decode)."""
    return json.JSONDecoder(object_pairs_hook=_unique)
