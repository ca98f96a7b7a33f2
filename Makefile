# atom-core developer entry points. `make install` is idempotent: it reinstalls only when
# pyproject.toml is newer than the stamp.

PY := .venv/bin/python
PIP := .venv/bin/pip
STAMP := .venv/.installed
# Override on the command line, e.g. `make test HYPOTHESIS_PROFILE=deep`.
HYPOTHESIS_PROFILE := ci

.PHONY: install generate check-generated verify test lint bench demo pd-demo

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PIP) install --no-input -e '.[dev]'
	touch $(STAMP)

# The core from the spec, then the capacity table from the proofs (Config validates with it).
generate: install
	$(PY) -m atom_core.spec.codegen
	$(PY) -m atom_core.proofs.capacity --write atom_core/_generated/capacity.py

check-generated: generate
	git diff --exit-code -- atom_core/_generated
	@if [ -n "$$(git status --porcelain -- atom_core/_generated)" ]; then \
		echo "atom_core/_generated has uncommitted or untracked files (run make generate and commit):"; \
		git status --porcelain -- atom_core/_generated; \
		exit 1; \
	fi

verify: install
	.venv/bin/atom-core verify

test: install
	HYPOTHESIS_PROFILE=$(HYPOTHESIS_PROFILE) $(PY) -m pytest -q

lint: install
	.venv/bin/ruff check .

bench: install
	$(PY) -m bench.core
	$(PY) -m bench.batcher
	$(PY) -m bench.stateful
	$(PY) -m bench.prefix

demo: install
	.venv/bin/atom-core demo

# PD: a prefill worker in a subprocess and a decode worker here, over gloo on loopback, then the
# same workload colocated; prints the comparison.
pd-demo: install
	.venv/bin/atom-core pd-demo
