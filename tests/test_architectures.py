"""The architecture matrix: tiny random models of every family in ``models.MATRIX_ARCHS``.

Each architecture either works - the empty stack and a window that covers every token generate exactly the
tokens of plain ``generate``, and a small window holds fewer bytes than the covering one - or is refused when
``compress()`` is entered, with a message naming what is unsupported.  docs/models.md lists both groups.
"""

from __future__ import annotations

import pytest
import torch

import kvcompress
from kvcompress.errors import UnsupportedModelError
from models import MATRIX_ARCHS, tiny_model

#: architectures refused at compress() time, with the words their message must contain
REFUSED = {"falcon": "does not dispatch attention through transformers' AttentionInterface"}
PROMPT, NEW = 12, 8


def _window(sinks, recent):
    return {"compressors": [{"window": {"sinks": sinks, "recent": recent}}]}


@pytest.mark.parametrize("arch", MATRIX_ARCHS)
def test_architecture_passes_or_is_refused_clearly(arch):
    model = tiny_model(arch)
    if arch in REFUSED:
        with pytest.raises(UnsupportedModelError, match=REFUSED[arch]):
            with kvcompress.compress(model, None):
                pass
        assert model.config._attn_implementation != "kvcompress"  # nothing was switched
        return
    ids = torch.randint(1, 256, (1, PROMPT), generator=torch.Generator().manual_seed(len(arch)))
    ref = model.generate(ids, max_new_tokens=NEW, do_sample=False)
    sizes = {}
    for name, stack in (("empty", None), ("covering", _window(4, 64)), ("small", _window(2, 4))):
        with kvcompress.compress(model, stack) as cache:
            out = model.generate(ids, max_new_tokens=NEW, do_sample=False, cache=cache)
        sizes[name] = cache.memory_report().cache_bytes
        if name != "small":
            assert torch.equal(out, ref), f"{arch}: {name} stack"
        assert cache.compressed_layers, arch  # at least one layer is kvcompress'
    assert sizes["small"] < sizes["covering"], arch
