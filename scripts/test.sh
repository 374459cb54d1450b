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
echo "== pytest"
if [ $# -gt 0 ]; then
  exec "$VENV/bin/python" -m pytest "$@"
fi
# Celery's own integration suite (tests/celery_compat) waits far more than it computes (about
# 20 minutes, little CPU, on Redis servers of its own): it runs beside the rest, niced.
compat_log=$(mktemp)
nice -n 10 "$VENV/bin/python" -m pytest tests/celery_compat >"$compat_log" 2>&1 &
compat=$!
status=0
"$VENV/bin/python" -m pytest --ignore=tests/celery_compat || status=$?
compat_status=0
wait "$compat" || compat_status=$?
echo "== pytest tests/celery_compat (Celery's integration suite, run beside the rest)"
cat "$compat_log"
if [ "$status" -ne 0 ]; then exit "$status"; fi
exit "$compat_status"
