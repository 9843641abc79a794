# Each target builds its own virtual environment from nothing on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0  # the tested build; a looser spec can pull a CUDA build of several GB
	$(PY) -m pip install --quiet -e '.[train,test,distributed]'  # distributed: the build's Ray tests
	touch $@

demo: $(VENV)/.installed  ## the closed loop on a laptop: agent -> spans -> nightly (build, train, gate, publish) -> a better agent
	$(PY) examples/demo.py

test: $(VENV)/.installed  ## the whole test suite
	$(PY) -m pytest -q --durations=25  # the slowest tests named in every CI log: the suite has a 30-minute budget

bench: $(VENV)/.installed  ## every stage's benchmark: ingest, transform, train (tiny on CPU, Qwen shapes on a GPU), publish
	$(PY) benchmarks/ingest.py
	$(PY) benchmarks/transform.py
	$(PY) benchmarks/train_gpu.py
	$(PY) benchmarks/publish.py

clean:
	rm -rf $(VENV) .venv-agent nightshift-data
