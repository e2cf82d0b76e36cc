"""`routing.attending_with`: another sparse_config inside the block, the model's own config object
untouched throughout (also when the block raises)."""

import pytest
import torch

from forecastkv.modeling.routing import attending_with, backbone_sparse_config
from tests.helpers import TINY_SPARSE, tiny_model


def test_swaps_a_copy_and_restores_it():
    model = tiny_model({})
    config = model.config
    saved = config.to_dict()
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        sparse_logits = model(ids).logits
        with attending_with(model, None) as swapped:
            assert swapped is not config and swapped.sparse is None
            assert all(m.config is swapped for m in model.modules() if hasattr(m, "config"))
            assert config.to_dict() == saved  # the original is never written
            dense_logits = model(ids).logits
        assert model.config is config and config.to_dict() == saved
        assert torch.equal(model(ids).logits, sparse_logits)
    assert not torch.equal(dense_logits, sparse_logits)  # the swap took effect: 40 tokens select


def test_restores_after_an_error():
    model = tiny_model({})
    config = model.config
    with pytest.raises(RuntimeError, match="inside"):
        with attending_with(model, {**TINY_SPARSE, "topk": 1}):
            raise RuntimeError("inside")
    assert all(m.config is config for m in model.modules() if hasattr(m, "config"))
    assert config.sparse.topk == TINY_SPARSE["topk"]


def test_backbones():
    sparse = tiny_model({}).config.sparse
    assert backbone_sparse_config("dense", sparse) is None
    assert backbone_sparse_config("forecast", sparse)["selector"] == "forecast"
    with pytest.raises(ValueError, match=r"backbone 'sparse' is not one of \('dense', 'query', 'forecast'\)"):
        backbone_sparse_config("sparse", sparse)
