"""dense-offload books its whole-layer copies against the decode step that made them, on a dense
model (whose decode reads each offloaded layer through `full()`) and on a sparse one alike."""

from __future__ import annotations

import pytest
import torch

from forecastkv.inference import OffloadedSparseCache
from forecastkv.modeling.modeling import CACHE_KWARG
from tests.helpers import left_padded, tiny_model


@pytest.mark.parametrize("sparse", [None, {"policy": "infllmv2"}], ids=["dense-model", "sparse-model"])
def test_dense_offload_counts_each_decode_step(sparse):
    model = tiny_model(sparse)
    ids, mask = left_padded([21, 17])
    new_tokens = 6
    cache = OffloadedSparseCache.for_model(model, mode="dense-offload", first_layer_resident=False)
    with torch.no_grad():
        model.generate(
            ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0, **{CACHE_KWARG: cache}
        )
    stats = cache.stats()
    # generate() makes new_tokens - 1 decode steps after the prefill
    assert stats["decode_steps"] == new_tokens - 1
    row_bytes = sum(layer.store.host.row_bytes() for layer in cache.layers if layer.offloaded)
    batch, prompt = ids.shape
    # step k copies every stored row of every sequence (the longest sequence's rows, all sequences): prompt + k + 1 rows
    expected = [(prompt + k + 1) * row_bytes * batch for k in range(new_tokens - 1)]
    assert stats["h2d_bytes_per_step"] == expected
    # the prefill into an empty cache stages no stored rows, and no decode copy is booked as "other"
    assert stats["h2d_other_bytes"] == 0
