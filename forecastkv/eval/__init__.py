"""The evaluation harness: offline long-context tasks, LongBench v1, metrics, the mode-by-mode
runner (streamed, resumable, sharded) and its report.  `forecastkv eval --config <suite>.yaml`."""

from .codec import ByteCodec, TextCodec, as_codec
from .metrics import score_prediction
from .modes import ATTENTION_MODES, Mode, parse_mode
from .report import write_report
from .runner import run_eval
from .tasks import TASKS, Example, generate_example

__all__ = [
    "ATTENTION_MODES",
    "ByteCodec",
    "Example",
    "Mode",
    "TASKS",
    "TextCodec",
    "as_codec",
    "generate_example",
    "parse_mode",
    "run_eval",
    "score_prediction",
    "write_report",
]
