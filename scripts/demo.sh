#!/usr/bin/env bash
# Set up cortexc and run the main job: check the example Tree-LSTM and run it on the built-in forest.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q -e .
cortexc check examples/treelstm.cell
cortexc compile examples/treelstm.cell -o build/
cortexc run examples/treelstm.cell
