#!/usr/bin/env bash
# Set up a virtual environment with the test extras and run lint (ruff check, ruff format, mypy) + the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q -e '.[test]'
ruff check cortexc tests benchmarks examples scripts
ruff format --check cortexc tests benchmarks examples scripts
mypy
python scripts/run_tests.py -q "$@"
