#!/usr/bin/env bash
# Builds a wheel from this checkout (as a user's `pip install .` would, with
# build isolation), installs it into a fresh virtual environment outside the
# source tree, and runs .ci/wheel_smoke.py there. The editable install the
# tests use hides packaging mistakes; this does not.
set -euo pipefail
SRC=$(cd "$(dirname "$0")/.." && pwd)
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

pip wheel --progress-bar off --no-deps -w "$TMP/dist" "$SRC"
python -m venv "$TMP/venv"
"$TMP/venv/bin/pip" install --progress-bar off -q torch==2.13.0
# bench extras and triton: every module of the wheel must import
"$TMP/venv/bin/pip" install --progress-bar off -q "$(ls "$TMP"/dist/fastzero-*.whl)[bench]" "triton>=3.2"
mkdir "$TMP/work"
cd "$TMP/work"
FASTZERO_JIT=0 "$TMP/venv/bin/python" "$SRC/.ci/wheel_smoke.py" "$SRC"
