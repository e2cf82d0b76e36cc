"""Two settings where forecastkv follows a published system's own rule, each tested:

* SparDA's MiniCPM4.1 pipeline selects (and trained its heads against) the exact LSE: its preset,
  and SparDA heads loaded onto a MiniCPM4.1 base, use `lse: exact`; plain MiniCPM4.1 keeps `coarse`;
* SparDA-NOSA's dense fallback (below dense_len) adds no CIS bias: `dense_cis_bias: false` in its
  preset; the default (True) adds it as sparse attention does.
"""

import pytest
import torch

from forecastkv import ForecastKVForCausalLM
from forecastkv.modeling.configuration import SparseConfig, load_preset
from tests.helpers import TINY_SPARSE, tiny_model
from tests.modeling.test_checkpoints import DENSE_MINICPM, HEAD_DIM, minicpm_dir


def test_sparda_presets_follow_sparda():
    assert load_preset("sparda-minicpm4.1-8b")["sparse_config"]["lse"] == "exact"
    assert load_preset("minicpm4.1-8b")["sparse_config"]["lse"] == "coarse"
    assert load_preset("sparda-nosa-8b")["sparse_config"]["dense_cis_bias"] is False
    assert SparseConfig().dense_cis_bias is True


def test_sparda_heads_on_a_minicpm_base_select_with_the_exact_lse(tmp_path):
    heads = {f"model.layers.{i}.self_attn.q_future_proj.weight": torch.randn(2 * HEAD_DIM, 96) for i in range(3)}
    heads["model.layers.0.self_attn.q_curr_proj.weight"] = torch.randn(2 * HEAD_DIM, 96)
    directory, _ = minicpm_dir(tmp_path, {**DENSE_MINICPM, "dense_len": 0}, heads)
    assert ForecastKVForCausalLM.from_pretrained(directory).config.sparse.lse == "exact"
    # a plain MiniCPM4.1 checkpoint keeps its coarse LSE
    plain, _ = minicpm_dir(tmp_path / "plain", {**DENSE_MINICPM, "dense_len": 0})
    assert ForecastKVForCausalLM.from_pretrained(plain).config.sparse.lse == "coarse"
    # the caller's own dict still decides
    mine = ForecastKVForCausalLM.from_pretrained(
        directory, sparse_config={**TINY_SPARSE, "lse": "coarse", "selector": "forecast"}
    )
    assert mine.config.sparse.lse == "coarse"


@pytest.mark.parametrize("dense_len", [1000, 0])
def test_dense_fallback_without_cis_bias(dense_len):
    """dense_len 1000: every row is dense, and dense_cis_bias False equals the same model with A = 0
    (CIS = 0: no bias), unlike True.  dense_len 0: always sparse, the option changes nothing."""
    ids = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(3))
    logits = {}
    for bias in (True, False):
        model = tiny_model({"policy": "nosa", "dense_len": dense_len, "dense_cis_bias": bias}, seed=5)
        with torch.no_grad():
            logits[bias] = model(ids).logits
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.A.zero_()
        unbiased = model(ids).logits
    if dense_len:
        assert not torch.allclose(logits[True], logits[False])
        torch.testing.assert_close(logits[False], unbiased)
    else:
        assert torch.equal(logits[True], logits[False])
