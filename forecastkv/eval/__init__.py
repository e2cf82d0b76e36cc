"""The evaluation harness: offline long-context tasks, LongBench v1, metrics, the mode-by-mode
runner (streamed, resumable, sharded) and its report.  `forecastkv eval --config <suite>.yaml`.

The names below import on first use, so the `eval` command's parser imports no torch."""

from ..lazy import lazy_attributes

_PUBLIC = {
    "ATTENTION_MODES": ".modes",
    "ByteCodec": ".codec",
    "Example": ".tasks",
    "Mode": ".modes",
    "TASKS": ".tasks",
    "TextCodec": ".codec",
    "as_codec": ".codec",
    "generate_example": ".tasks",
    "parse_mode": ".modes",
    "run_eval": ".runner",
    "score_prediction": ".metrics",
    "write_report": ".report",
}
__all__ = sorted(_PUBLIC)
__getattr__, __dir__ = lazy_attributes(__name__, _PUBLIC)
