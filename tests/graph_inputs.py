"""The tensors a compiled decode step takes as graph inputs, and which of them a CUDA-graph replay would copy.

Under ``torch.compile(mode="reduce-overhead")`` cudagraph trees copy every graph input that is not marked as a
static address into the graphs' pool before each replay; a static cache marks every tensor it holds, so only the
step's own inputs (token ids, positions, mask) may be unmarked.
"""

from __future__ import annotations

import torch


def recording_backend(record: list):
    """A ``torch.compile`` backend: ``aot_eager``, appending each compiled graph's tensor inputs to ``record``."""
    def backend(gm, example_inputs):
        record.extend(x for x in example_inputs if isinstance(x, torch.Tensor))
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)
    return backend


def unmarked_inputs(graph_inputs: list, model, step_storages: set) -> list:
    """``(shape, dtype)`` of the graph inputs that are neither the model's weights, nor tensors sharing a storage in
    ``step_storages`` (the step's own inputs, by ``untyped_storage().data_ptr()``), nor marked static."""
    weights = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    return [(tuple(x.shape), x.dtype) for x in graph_inputs
            if x.untyped_storage().data_ptr() not in weights | step_storages
            and not hasattr(x, "_dynamo_static_input_type")]
