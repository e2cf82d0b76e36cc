"""The body of `forecastkv convert` (its parser: `forecastkv/cli.py`): load any supported checkpoint format
(`checkpoints.py`), with a block geometry and Forecast heads if asked, and write it as a forecastkv
checkpoint with its tokenizer.  The console script imports this module only when the command runs.
"""

from __future__ import annotations

from ..usage import UsageError, check_preset, model_path


def run_convert(args) -> int:
    """`forecastkv convert SOURCE OUTPUT`: 0 when OUTPUT was written."""
    source = model_path("source", args.source)
    check_preset("--sparse-config", args.sparse_config)
    if args.forecast_init and args.forecast_weights:
        raise UsageError("--forecast-init makes new heads and --forecast-weights loads trained ones: give one")

    from .head_files import has_forecast_heads
    from .modeling import ForecastKVForCausalLM
    from .remote_code import copy_tokenizer_files

    model = ForecastKVForCausalLM.from_pretrained(
        source,
        sparse_config=args.sparse_config,
        forecast_weights=args.forecast_weights,
        forecast={"init": args.forecast_init} if args.forecast_init else None,
        dtype=args.dtype,
        allow_geometry_mismatch=args.allow_geometry_mismatch,
    )
    model.save_pretrained(args.output)
    tokenizer = copy_tokenizer_files(source, args.output)  # replacing any an earlier run left in OUTPUT
    heads = (
        "yes" if has_forecast_heads(args.output) else "none (forecast modes need --forecast-init/--forecast-weights)"
    )
    print(
        f"wrote {args.output} (model_type forecastkv, {str(model.dtype).removeprefix('torch.')}; "
        f"Forecast heads: {heads}; tokenizer files: {', '.join(tokenizer) if tokenizer else 'none in the source'}); "
        "it loads with AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True) and serves with vLLM"
    )
    return 0
