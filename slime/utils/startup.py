"""The start of a program that imports torch, transformers and DeepSpeed."""
from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def long_lived_imports():
    """Around a program's imports: torch, transformers and DeepSpeed make ~500k objects that live as long as the
    process. The collector would walk them at each full collection it makes during the imports and the set-up
    after them (9 in a training run, 1.2 s of every start on the CI machine); with it off during the imports and
    their objects frozen after (gc.freeze), it looks only at what the program allocates. The few cycles the
    imports leave, a few hundred objects, are kept."""
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()
