"""The model classes: a Llama-family decoder whose attention is `SparseAttention`.

`ForecastKVForCausalLM` works with `generate()` on transformers 5.17 (`past_key_values=`) and
5.24 (`cache=`); both keyword names are accepted by `forward`.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from dataclasses import dataclass, field, make_dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.activations import ACT2FN
from transformers.utils import ModelOutput

from ..selectors import get_selector
from .attention import SparseAttention
from .cache import CallInfo, SparseCache
from .configuration import ForecastKVConfig
from .rotary import RotaryEmbedding

# The cache keyword of this transformers version's generate loop: "cache" (5.24) or "past_key_values" (5.17).
CACHE_KWARG = (
    "cache"
    if "cache" in inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
    else "past_key_values"
)


# ----------------------------------------------------------------------------------------------
# Rotary position embeddings: default, the static HF variants, and MiniCPM's LongRoPE
# (`attention.apply_rope` rotates the queries, keys and forecast vectors with these tables)
# ----------------------------------------------------------------------------------------------

class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class MLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        h, i, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)
        self.act = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP, each added to the residual (scaled by muP's depth factor)."""

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = SparseAttention(config, layer_idx)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layer_idx = layer_idx

    def guess_queries(self, hidden: torch.Tensor, call: "LayerCall") -> torch.Tensor:
        """This layer's queries [B, T, Hq, d] guessed from the residual hidden [B, T, hidden] entering the
        layer before (the speculate selector, InfiniGen-style: this layer's input norm and q_proj, no training)."""
        return self.self_attn.queries(self.input_layernorm(hidden), call.cos, call.sin)

    def forward(
        self,
        hidden: torch.Tensor,
        call: "LayerCall",
        cache_layer,
        handoff: torch.Tensor | None = None,
        plan=None,
        next_cache_layer=None,
        selections_out: dict | None = None,
        next_layer: "DecoderLayer | None" = None,
    ):
        """hidden [B, T, hidden] -> (hidden, what the next layer selects from or None, the next
        layer's decode plan or None).

        call: what every layer of the call shares (`LayerCall`).  handoff: what this layer selects
        from, made by the layer before: forecast vectors [B, T, H*n, d] (forecast), guessed queries
        [B, T, Hq, d] (speculate) or the anchor's selection [B, H, T, K] (reuse); None: layer 0
        makes its own, or the selector needs none.  plan: this layer's decode `Plan`, made by the
        layer before.  next_cache_layer / next_layer: the next layer's cache layer and module
        (speculate guesses its queries): with a selector that plans ahead, at a decode step the next
        layer's blocks are planned here, so a runtime can fetch them while this layer runs."""
        attn = self.self_attn
        normed = self.input_layernorm(hidden)
        kind, next_kind = call.rules[self.layer_idx], call.rules[self.layer_idx + 1]
        if call.want_forecast and handoff is None and attn.scores_itself:
            handoff = attn.project_forecast(normed, call.cos, call.sin, "current_proj")
        next_handoff = None
        if next_cache_layer is not None:  # what the next layer's rule takes from this one (an anchor's: below)
            # a dense call hands over what the query selector's layer gets: Forecast vectors when made
            rule = next_kind if next_kind is not None else get_selector("query")
            next_handoff = rule.handoff(attn, next_layer, hidden, normed, call, handoff, kind)
        reuses = kind is not None and kind.scores_with == "blocks"  # it takes an anchor's blocks
        next_reuses = next_kind is not None and next_kind.scores_with == "blocks"
        anchor_of_next = next_cache_layer is not None and next_reuses and not reuses
        # the next layer's decode plan, made here (before this layer attends, so its fetch overlaps this
        # layer's work) when the call plans ahead and the next layer's rule knows its blocks a layer
        # ahead (reuse's anchors select with their own queries, at their turn); an anchor plans the
        # layer after it once it has selected, below
        plans_next = (
            call.plans_ahead and next_cache_layer is not None and next_kind.plans_ahead
            and next_cache_layer.is_initialized
        )
        device = next_cache_layer.device if plans_next else None
        next_plan = None
        if plans_next and next_handoff is not None:
            next_plan = next_kind.plan(next_handoff.to(device), call.positions.to(device), next_cache_layer,
                                       call.sparse)
        record = {} if anchor_of_next and selections_out is None else selections_out
        out = attn(
            normed,
            call.positions,
            call.cos,
            call.sin,
            cache_layer,
            forecast_in=None if reuses else handoff,
            plan=plan,
            selections_out=record,
            selector=kind,
            step=call.step,
            sparse=call.sparse,
            reused=handoff if reuses else None,
        )
        if anchor_of_next:  # an anchor hands its own blocks to the layers after it
            next_handoff = record.get("selected")
            if plans_next and next_handoff is not None:
                next_plan = next_kind.plan(next_handoff.to(device), call.positions.to(device), next_cache_layer,
                                           call.sparse)
        if call.layer_callback is not None:
            call.layer_callback(self.layer_idx, normed, call.positions, call.cos, call.sin, cache_layer)
        hidden = hidden + out * call.residual_scale
        hidden = hidden + self.mlp(self.post_attention_layernorm(hidden)) * call.residual_scale
        return hidden, next_handoff, next_plan


@dataclass
class LayerCall:
    """What every decoder layer of one forward call shares: positions [B, T], RoPE cos/sin [B, T, d]
    (moved to each layer's device under a device_map), the call's `CallInfo` and SparseConfig,
    each layer's selection rule (`rules[l]`: the call's selector's `at_layer(l)`, None when dense;
    one more None past the last layer), muP's residual scale, whether forecast vectors are made (`want_forecast`)
    and whether layers plan the next layer's decode blocks (`plans_ahead`), and the training /
    recall `layer_callback`."""

    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    step: CallInfo
    sparse: object
    rules: tuple
    residual_scale: float
    want_forecast: bool
    plans_ahead: bool
    layer_callback: object = None

    def to(self, device) -> "LayerCall":
        """This call with its tensors on `device` (layers spread over devices by a device_map)."""
        return dataclasses.replace(
            self, positions=self.positions.to(device), cos=self.cos.to(device), sin=self.sin.to(device)
        )


# Causal-LM output: loss, logits, the cache under this transformers version's name (`CACHE_KWARG`;
# only that one field exists, because 5.24 warns about any `past_key_values` field), hidden_states
# and, when asked for, `selections`: a per-layer list of {"query": ids, "forecast": ids}.
ForecastKVOutput = make_dataclass(
    "ForecastKVOutput",
    [
        ("loss", "torch.Tensor | None", field(default=None)),
        ("logits", "torch.Tensor | None", field(default=None)),
        (CACHE_KWARG, "SparseCache | None", field(default=None)),
        ("hidden_states", "torch.Tensor | None", field(default=None)),
        ("selections", "list | None", field(default=None)),
    ],
    bases=(ModelOutput,),
    namespace={"__module__": __name__},
)


class ForecastKVPreTrainedModel(PreTrainedModel):
    config_class = ForecastKVConfig
    base_model_prefix = "model"
    _no_split_modules = ["DecoderLayer"]
    _supports_sdpa = True

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, SparseAttention):
            for name in ("forecast_proj", "current_proj"):
                if hasattr(module, name):
                    # SparDA's indexer init: U(-1/sqrt(fan_in), 1/sqrt(fan_in))
                    bound = 1.0 / math.sqrt(getattr(module, name).in_features)
                    getattr(module, name).weight.uniform_(-bound, bound)
            if hasattr(module, "A"):
                module.A.zero_()
        elif isinstance(module, nn.Linear):
            if getattr(module, "_is_forecast_head", False):
                return
            module.weight.normal_(0.0, std)
            if module.bias is not None:
                module.bias.zero_()
        elif isinstance(module, nn.Embedding):
            module.weight.normal_(0.0, std)
        elif isinstance(module, RMSNorm):
            module.weight.fill_(1.0)


class ForecastKVModel(ForecastKVPreTrainedModel):
    def __init__(self, config: ForecastKVConfig) -> None:
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)
        # each layer's rule for the (selector, sparse config) objects of the last call (`forward`)
        self._layer_rules: tuple = ((None, None), ())
        for layer in self.layers:
            for name in ("forecast_proj", "current_proj"):
                if hasattr(layer.self_attn, name):
                    getattr(layer.self_attn, name)._is_forecast_head = True
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    def positions_for(
        self, batch: int, length: int, cache: SparseCache, attention_mask, position_ids, device
    ) -> torch.Tensor:
        """Positions [B, T] of the new tokens, -1 for padding.  Derived from the cache's stored
        lengths and the 2-D attention mask, so left padding never shifts a sequence.

        A decode step (one token on a cache that holds tokens) stores one token per sequence at
        its stored length, what generate() does: the mask's new column is not read, and the
        length limit is checked on the host counters, so the step reads nothing back.
        """
        stored = cache.sequence_lengths()
        host = cache.host_lengths()
        limit = self.config.max_position_embeddings
        if length == 1 and host is not None and stored is not None:
            if max(host, default=0) >= limit:
                raise ValueError(f"sequence length {max(host) + 1} exceeds max_position_embeddings={limit}")
            return stored.view(-1, 1).to(device, copy=True)  # a copy: the layers update their lengths in place
        if stored is None:
            stored = torch.zeros(batch, dtype=torch.long, device=device)
        if attention_mask is not None:
            if attention_mask.dim() != 2:
                raise ValueError(
                    f"attention_mask must be 2-D [batch, columns], got shape {tuple(attention_mask.shape)}"
                )
            new = attention_mask[:, -length:].to(device).bool()
            positions = stored.view(-1, 1) + new.long().cumsum(dim=1) - 1
            positions = positions.masked_fill(~new, -1)
        elif position_ids is not None:
            positions = position_ids.to(device).long().expand(batch, -1)
        else:
            positions = stored.view(-1, 1) + torch.arange(length, device=device)
        if int(positions.max()) >= limit:  # a multi-token call reads its positions once anyway
            raise ValueError(f"sequence length {int(positions.max()) + 1} exceeds max_position_embeddings={limit}")
        return positions

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: SparseCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        collect_selections: bool = False,
        layer_callback=None,
        prefill_chunk: int | None = None,
    ) -> tuple[torch.Tensor, SparseCache, list | None]:
        """Returns (last hidden states [B, T, hidden], the cache, per-layer selections or None).

        layer_callback(idx, normed, positions, cos, sin, cache_layer), if given, runs after each
        layer's attention with that layer's post-norm input [B, T, hidden], positions [B, T],
        cos/sin [B, T, d] and cache layer (its K/V now stored): what training and the recall
        protocol read, so they need no decoder loop of their own.

        prefill_chunk: a call of more rows than this runs as several forward calls of at most this
        many rows (`forward_chunked`), each attending to the cache so far, so activations follow
        the chunk, not the prompt; None takes `config.prefill_chunk` (absent or 0: one call).
        generate() goes through here, so a long prompt is prefilled in chunks.  Not with a
        layer_callback (it expects the whole call's rows at once)."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        chunk = getattr(self.config, "prefill_chunk", 0) if prefill_chunk is None else prefill_chunk
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
            raise ValueError(f"prefill_chunk must be a non-negative integer (0 = one call), got {chunk!r}")
        if (
            chunk
            and layer_callback is None
            and (input_ids if inputs_embeds is None else inputs_embeds).shape[1] > chunk
        ):
            return self.forward_chunked(
                input_ids, attention_mask, position_ids, cache, inputs_embeds, collect_selections, chunk
            )
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        batch, length = hidden.shape[:2]
        if cache is None:
            cache = SparseCache(self.config)
        elif not isinstance(cache, SparseCache):
            raise TypeError(f"forecastkv models need a SparseCache (or a subclass), got {type(cache).__name__}")
        config = self.config
        sparse = config.sparse  # read once per call: `routing.attending_with` may swap it between calls
        cache.check_model(config)
        positions = self.positions_for(batch, length, cache, attention_mask, position_ids, hidden.device)
        step = cache.begin_call(positions, sparse, input_ids)  # the call's host-side facts and bookkeeping, once
        cos, sin = self.rotary_emb(positions, hidden.dtype)
        mup = config.mup_config
        residual_scale = 1.0
        if mup is not None:
            hidden = hidden * mup.scale_emb
            residual_scale = mup.scale_depth / math.sqrt(config.num_hidden_layers)
        # a cache may carry a selector of its own (the runtime's modes compare selectors on one model)
        selector = (cache.rule or sparse.rule) if sparse is not None else None
        forecast = selector is not None and selector.needs_forecast_heads
        want_forecast = config.forecast_config.enabled and (forecast or collect_selections)
        plans_ahead = selector is not None and selector.plans_ahead and step.decode and not step.any_dense
        rules = (None,) * (len(self.layers) + 1)
        if selector is not None:
            made_for, rules = self._layer_rules
            if made_for[0] is not selector or made_for[1] is not sparse:  # else the last call's, checked
                selector.check(sparse, len(self.layers))
                rules = (*[selector.at_layer(idx, sparse) for idx in range(len(self.layers))], None)
                self._layer_rules = ((selector, sparse), rules)
        call = LayerCall(
            positions, cos, sin, step, sparse, rules, residual_scale, want_forecast, plans_ahead, layer_callback
        )
        hidden, selections = self.decode_layers(hidden, call, cache, collect_selections)
        cache.finish_call()
        return self.norm(hidden.to(self.norm.weight.device)), cache, selections

    def forward_chunked(
        self, input_ids, attention_mask, position_ids, cache, inputs_embeds, collect_selections: bool, chunk: int
    ):
        """`forward` over the new columns in pieces of `chunk`, one forward call each: every piece
        stores its K/V through the cache's own append (an offloaded cache writes each layer's
        rows to the host as they come) and attends to everything stored before it, so the result
        is one call's (hidden states concatenated, selections concatenated per layer on the row
        axis).  The first piece is stretched to reach `sparse.dense_len` for every sequence that
        ends at or past it, so each sequence makes MiniCPM's dense / sparse decision (from its
        key length) as it would in one call.  One host read of the attention mask."""
        source = input_ids if inputs_embeds is None else inputs_embeds
        batch, length = source.shape[:2]
        if cache is None:
            cache = SparseCache(self.config)
            cache.reserve(length)  # one allocation: the pieces never regrow the buffers
        stored = cache.host_lengths() or [0] * batch
        real = (
            torch.ones(batch, length, dtype=torch.long)
            if attention_mask is None
            else attention_mask[:, -length:].detach().to("cpu", torch.long)
        )
        first = chunk
        sparse = self.config.sparse
        if sparse is not None and sparse.dense_len > 0:
            counts = torch.tensor(stored, dtype=torch.long).view(-1, 1) + real.cumsum(
                dim=1
            )  # key length after each column
            for b in range(batch):
                reaches = (counts[b] >= sparse.dense_len).nonzero()
                if len(reaches):
                    first = max(first, int(reaches[0]) + 1)
        bounds = [0, *range(first, length, chunk), length] if first < length else [0, length]
        hidden_parts, selection_parts = [], []
        for start, stop in zip(bounds[:-1], bounds[1:]):
            mask = None if attention_mask is None else attention_mask[:, : attention_mask.shape[1] - length + stop]
            ids = None if input_ids is None else input_ids[:, start:stop]
            embeds = None if inputs_embeds is None else inputs_embeds[:, start:stop]
            pos_ids = None if position_ids is None else position_ids[..., start:stop]
            hidden, cache, selections = self(ids, mask, pos_ids, cache, embeds, collect_selections, prefill_chunk=0)
            hidden_parts.append(hidden)
            selection_parts.append(selections)
        selections = None
        if collect_selections:
            selections = [
                {key: torch.cat([part[idx][key] for part in selection_parts], dim=2) for key in selection_parts[0][idx]}
                for idx in range(len(selection_parts[0]))
            ]
        return torch.cat(hidden_parts, dim=1), cache, selections

    def decode_layers(
        self, hidden: torch.Tensor, call: LayerCall, cache: SparseCache, collect_selections: bool = False
    ):
        """The decoder layers over hidden [B, T, hidden]: the part of a call that runs on the
        device.  The host side (positions, the `CallInfo` and the cache's bookkeeping, the step
        logs) happens around it in `forward`, so a decode step's layers read no Python number that
        changes from step to step: what `torch.compile(fullgraph=True)` can take whole
        (`compiled.py`).  Each layer hands the next its forecast vectors and decode plan.
        Returns (hidden, per-layer selections or None)."""
        selections = [] if collect_selections else None
        handoff = plan = None
        last = len(self.layers) - 1
        for idx, layer in enumerate(self.layers):
            device = layer.input_layernorm.weight.device
            if hidden.device != device:  # device_map: layers on several devices
                hidden, handoff, call = (
                    hidden.to(device),
                    None if handoff is None else handoff.to(device),
                    call.to(device),
                )
            record = {} if collect_selections else None
            next_cache_layer, next_layer = (cache.layers[idx + 1], self.layers[idx + 1]) if idx < last else (None, None)
            hidden, handoff, plan = layer(
                hidden, call, cache.layers[idx], handoff, plan, next_cache_layer, record, next_layer
            )
            if selections is not None:
                selections.append(record)
        return hidden, selections


def _pick_cache(cache, past_key_values):
    if cache is not None and past_key_values is not None and cache is not past_key_values:
        raise ValueError("pass the cache as either cache= or past_key_values=, not both")
    return cache if cache is not None else past_key_values


class ForecastKVForCausalLM(ForecastKVPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: ForecastKVConfig) -> None:
        super().__init__(config)
        self.model = ForecastKVModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @classmethod
    def from_pretrained(
        cls, pretrained_model_name_or_path, *args, sparse_config=None, forecast=None, forecast_weights=None, **kwargs
    ):
        """Load our format, MiniCPM4/4.1, NOSA, plain Llama-family or SparDA checkpoints.

        sparse_config: a preset name (`forecastkv/presets/<name>.json`, see `list_presets()`) or a dict of
            sparse_config keys;
            None keeps the checkpoint's own (a checkpoint without one loads dense).
        forecast: a dict of forecast keys; creates (and initialises) heads the checkpoint lacks.
        forecast_weights: a directory written by `save_forecast_weights`, loaded onto the base.  Heads
            from another base are an error; so are heads trained for another block geometry
            (kernel_size, kernel_stride, block_size) than `sparse_config`'s, unless
            allow_geometry_mismatch=True (then a warning names both).  Another budget (topk,
            window_size, ...) only warns.
        dtype / device: where the loaded model lives; device_map ("auto" or a dict) spreads it over
            devices through accelerate.  Loading is lean: built on the meta device, each tensor
            read once into its final dtype and device (peak ~ the model's own bytes).
        """
        from .checkpoints import load_model

        if args:
            raise TypeError(f"unexpected positional arguments {args}")
        return load_model(
            cls,
            pretrained_model_name_or_path,
            sparse_config=sparse_config,
            forecast=forecast,
            forecast_weights=forecast_weights,
            **kwargs,
        )

    def save_forecast_weights(self, directory, base_model: str | None = None):
        """Save only the Forecast heads (a few MB) beside an untouched base checkpoint."""
        from .head_files import save_forecast_weights

        return save_forecast_weights(self, directory, base_model)

    def save_pretrained(self, save_directory, *args, **kwargs):
        """transformers' `save_pretrained`, plus `auto_map` in config.json and two small modules
        that import the installed package, so the directory also loads with
        `AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)` in a process that never
        imported forecastkv (`remote_code.save_with_remote_code`)."""
        from .remote_code import save_with_remote_code

        return save_with_remote_code(self, super().save_pretrained, save_directory, *args, **kwargs)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: SparseCache | None = None,
        past_key_values: SparseCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int = 0,
        collect_selections: bool = False,
        **kwargs,
    ) -> ForecastKVOutput:
        """input_ids [B, T]; attention_mask [B, past + T] (1 = token, 0 = left padding)."""
        cache = _pick_cache(cache, past_key_values)
        hidden, cache, selections = self.model(
            input_ids, attention_mask, position_ids, cache, inputs_embeds, collect_selections
        )
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        mup = self.config.mup_config
        if mup is not None:
            hidden = hidden / (self.config.hidden_size / mup.dim_model_base)
        logits = self.lm_head(hidden.to(self.lm_head.weight.device))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        use_cache = self.config.use_cache if use_cache is None else use_cache
        kept = {CACHE_KWARG: cache if use_cache else None}
        return ForecastKVOutput(loss=loss, logits=logits, selections=selections, **kept)

    def _prepare_generation_config(self, generation_config=None, *args, **kwargs):
        """transformers' own, except that `cache_implementation` may name an offload mode
        (`inference.MODES`), which transformers' validation would refuse (`modeling/generation.py`)."""
        from .generation import prepare_generation_config

        return prepare_generation_config(self, super()._prepare_generation_config, generation_config, *args, **kwargs)

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        """generate() gets a SparseCache unless the caller passed a cache of their own; either way
        the cache reserves generate()'s max_length (prompt + new tokens) so that no buffer is
        regrown, and no buffer changes shape or address, while decoding."""
        user_cache = model_kwargs.get("cache") or model_kwargs.get("past_key_values")
        rows = generation_config.max_length
        if user_cache is not None:
            user_cache._is_user_defined = True
            if rows is not None and hasattr(user_cache, "reserve"):
                user_cache.reserve(rows)
            return None
        if generation_config.use_cache is False:
            return None
        from .generation import cache_for_generation

        cache = cache_for_generation(
            self, generation_config
        )  # SparseCache, or the offload mode named as cache_implementation
        if rows is not None:
            cache.reserve(rows)
        model_kwargs[CACHE_KWARG] = cache
        return None
