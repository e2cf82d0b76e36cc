"""forecastkv's own `generate()` and pipeline calls print no transformers warning (a user once saw
"Both max_new_tokens and max_length" and "Passing generation_config together with generation-related
arguments" on every call).  Run in a fresh process: transformers prints some warnings once per
process, so an earlier test could hide them."""

import subprocess
import sys

import pytest

CALLS = r"""
import io, logging, sys, warnings
import torch
from transformers import AutoTokenizer, pipeline
from transformers.utils import logging as hf_logging

from forecastkv import ForecastKVForCausalLM

hf_logging.set_verbosity_warning()
printed = io.StringIO()
hf_logging.get_logger().addHandler(logging.StreamHandler(printed))
warnings.simplefilter("always")
path = sys.argv[1]
with warnings.catch_warnings(record=True) as caught:
    model = ForecastKVForCausalLM.from_pretrained(path, sparse_config="smollm2-135m", forecast={"init": "next_query"})
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = tokenizer("The essay begins", return_tensors="pt").input_ids
    with torch.no_grad():
        model.generate(ids, max_new_tokens=3, do_sample=False)
        model.generate(ids, max_new_tokens=3, do_sample=False, cache_implementation="forecast-offload")
    generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
    generator("The essay begins", max_new_tokens=3, do_sample=False)
    generator("The essay begins", max_new_tokens=3, do_sample=False, cache_implementation="sparse-offload")
print("LOGGED:" + printed.getvalue())
for warning in caught:
    print("WARNED:" + str(warning.message))
"""


@pytest.mark.bundled
def test_generate_and_pipeline_print_no_transformers_warning(bundled_path):
    import transformers
    from packaging.version import Version

    if Version(transformers.__version__) < Version("5.20"):
        # 5.19's text-generation pipeline hands generate() its own generation_config beside the
        # caller's arguments and warns twice for a plain LlamaForCausalLM too (transformers' own)
        pytest.skip(f"transformers {transformers.__version__}: its pipeline warns for every model")
    done = subprocess.run([sys.executable, "-c", CALLS, bundled_path], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    reported = [line for line in done.stdout.splitlines() if line.startswith(("LOGGED:", "WARNED:"))]
    assert reported == ["LOGGED:"], "\n".join(reported) + done.stderr[-2000:]
