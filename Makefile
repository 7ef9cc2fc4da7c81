# The developer loop: `make dev` once (again after changing Rust code), then `make test`,
# `make lint` and `make copies` while you work, and `make ci` (.ci/run) before you push.
# The commands are .ci/run's (docs/ci.md), so a target that passes here passes there.

# .ci/run activates .venv; putting its bin first on PATH runs the same commands without that.
export PATH := $(CURDIR)/.venv/bin:$(PATH)

.PHONY: dev test lint copies ci

.venv/bin/python:
	python3 -m venv .venv
	python -m pip install --quiet --upgrade pip

# Builds the native module (maturin), so run it again after changing the Rust code.
dev: .venv/bin/python
	python -m pip install --quiet -e '.[dev]'

# The core crate's tests, then both backends' suite on every core (whole files per worker,
# as in CI). Its property tests run briefly: 32 cases each (proptest applies PROPTEST_CASES
# to every test) and a tenth of CI's Hypothesis examples (the "dev" profile of
# tests/conftest.py). tests/vllm needs vLLM's venv: without vLLM its conftest reports each
# module as skipped.
test:
	@python -c 'import xdist' 2>/dev/null || { echo 'pytest-xdist is not in .venv: run make dev' >&2; exit 1; }
	PROPTEST_CASES=32 cargo test -p kvblocks-core --locked
	HYPOTHESIS_PROFILE=dev python -m pytest -q -n auto --dist loadfile

lint:
	cargo fmt --all --check
	cargo clippy --workspace --all-targets --locked -- -D warnings
	ruff check python tests benches examples tools
	ruff format --check python tests benches examples tools
	mypy --strict

copies:
	python tools/api_copies.py --check

# Removes and rebuilds .venv, then runs every check, vLLM's real Scheduler included.
ci:
	bash .ci/run
