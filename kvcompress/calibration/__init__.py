"""LeanK calibration: learned static K-channel masks and the baselines they are compared with.

* :mod:`.masks`: ``binarize``, ``rope_mask``, ``save_mask`` / ``load_mask`` (``MaskFile``),
  ``config_hash`` - light (torch + safetensors only); this is what a compressor imports.
* :mod:`.leank`: two-stage training (``LeanKTrainer``, ``calibrate``; settings in :mod:`.settings`).
* :mod:`.qk`: the calibrated mean |q.k| baseline (``qk_scores``, ``qk_mask``).
* :mod:`.attention`: the alpha-scaled attention, registered through ``kvcompress.adapters.hf``.
* :mod:`.emulate`: a one-pass quality check of a mask (KL, perplexity, top-1).
* :mod:`.data`: offline text (``pydoc_data.topics``, train / held-out split) and training samples.
* :mod:`.cli`: ``kvcompress calibrate leank ...`` (importing it loads neither transformers nor a model).

The training parts import transformers; they load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from .masks import FORMAT, MaskFile, MaskFileError, binarize, config_hash, load_mask, rope_mask, save_mask

_LAZY = {
    "LeanKSettings": "settings", "LeanKTrainer": "leank", "calibrate": "leank",
    "qk_mask": "qk", "qk_scores": "qk",
}

__all__ = ["FORMAT", "MaskFile", "MaskFileError", "binarize", "config_hash", "load_mask", "rope_mask", "save_mask",
           *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
