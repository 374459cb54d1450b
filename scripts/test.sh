#!/usr/bin/env bash
# The whole test suite on a fresh machine: services, a virtualenv of its own, lint, types, tests.
# Extra arguments go to pytest (e.g. scripts/test.sh tests/unit -x).
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/services.sh

VENV=${RESILIENT_VENV:-.venv}
PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade "pip>=25.1"
"$VENV/bin/python" -m pip install -q -e . --group dev

echo "== ruff"; "$VENV/bin/ruff" check celery_resilient tests benchmarks example_project
echo "== mypy"; "$VENV/bin/mypy" celery_resilient
echo "== layers"; "$VENV/bin/lint-imports"
echo "== docs"; NO_MKDOCS_2_WARNING=1 "$VENV/bin/mkdocs" build --strict --site-dir "$(mktemp -d)"
echo "== pytest"; "$VENV/bin/python" -m pytest "$@"
