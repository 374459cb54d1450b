#!/usr/bin/env bash
# The whole test suite on a fresh machine: services, a virtualenv of its own, lint, types, tests.
# Extra arguments go to pytest (e.g. scripts/test.sh tests/unit -x; add -n 3 to run them in
# parallel processes, as the full run does).
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/services.sh

VENV=${RESILIENT_VENV:-.venv}
PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
# mysqlclient (the suite runs the MySQL store through both of its drivers) builds against the
# MariaDB client library: Debian's libmariadb-dev, found through pkg-config.
if ! pkg-config --exists libmariadb 2>/dev/null && ! pkg-config --exists mysqlclient 2>/dev/null
then
  echo "== installing libmariadb-dev and pkg-config (mysqlclient is built against them)"
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get install -y -q --no-install-recommends libmariadb-dev pkg-config >/dev/null \
    || { $sudo apt-get update -q >/dev/null \
         && $sudo apt-get install -y -q --no-install-recommends libmariadb-dev pkg-config >/dev/null; }
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

# The full run. Most tests wait on real worker processes (observation windows, deadlines),
# not on the CPU, so three phases overlap:
#  - parallel: everything but what follows, in $RUNNERS processes (pytest-xdist), each with a
#    Redis database and a RabbitMQ virtual host of its own (tests/conftest.py);
#  - alone: the tests marked `alone` (timing bounds a busy machine overruns), one at a time,
#    after the parallel phase; then the Django tests once more with Django's database on
#    MySQL (MariaDB), its settings chosen per process (RESILIENT_TEST_DJANGO_DB); then the
#    MySQL store's tests once more through the other driver, mysqlclient;
#  - celery_compat: Celery's own integration suite, which waits far more than it computes, on
#    Redis servers of its own, beside both, niced.
# Each phase is bounded: past its limit it is interrupted (SIGINT to the phase's whole process
# group: pytest prints where it stood) and fails the run, instead of running into CI's own time
# limit with nothing said. A single hung test fails sooner, at its own timeout (pytest-timeout:
# 240 s unless marked), and a test still running 7 minutes after it started dumps every
# thread's stack (faulthandler_timeout), a teardown that hangs after a timeout included.
# The tests' temporary directories (worker logs, effect logs) stay in .pytest-tmp/<phase>
# until the next run, where other pytest runs on the machine do not rotate them away.
RUNNERS=${RESILIENT_TEST_RUNNERS:-3}
PYTEST=("$VENV/bin/python" -m pytest -o faulthandler_timeout=420)
TMP=$PWD/.pytest-tmp
mkdir -p "$TMP"

minutes() { printf '%dm%02ds' $(($1 / 60)) $(($1 % 60)); }

limited() {  # LIMIT COMMAND...: start it in the background, in a process group of its own
  timeout --signal=INT --kill-after=60 "$@" &
}

# timeout's process groups do not get the terminal's Ctrl-C: pass it on, and start no more.
running=() interrupted=""
trap 'interrupted=1; kill -INT "${running[@]}" 2>/dev/null || true' INT TERM

finish() {  # PID NAME LIMIT: wait for a limited command; its status, said aloud if it hung
  local pid=$1 name=$2 limit=$3 status=0
  while :; do
    status=0
    wait "$pid" || status=$?
    kill -0 "$pid" 2>/dev/null || break  # (wait returns early when a signal is trapped)
  done
  if [ "$status" -eq 124 ] || [ "$status" -eq 137 ]; then
    echo "== $name: STOPPED after $limit: a hang, see its output; processes left:"
    ps -eo pid,pgid,etimes,args | grep -E "[c]elery|[p]ytest|[r]edis-server|[p]ostgres -D" | cut -c1-200 || true
  fi
  return "$status"
}

compat_log=$(mktemp)
compat_start=$(date +%s)
nice -n 10 timeout --signal=INT --kill-after=60 35m "$VENV/bin/python" -m pytest \
  --basetemp="$TMP/compat" tests/celery_compat >"$compat_log" 2>&1 &
compat=$!
running+=("$compat")

start=$SECONDS
echo "== pytest, $RUNNERS processes: all but the tests marked alone and tests/celery_compat"
limited 32m "${PYTEST[@]}" -n "$RUNNERS" --dist loadgroup --basetemp="$TMP/parallel" \
  --ignore=tests/celery_compat -m "not alone"
running+=($!)
status=0
finish $! "pytest (parallel)" 32m || status=$?
parallel="$(minutes $((SECONDS - start))), status $status"

start=$SECONDS
alone_status=0
if [ -z "$interrupted" ]; then
  echo "== pytest, the tests marked alone, one at a time"
  limited 10m "${PYTEST[@]}" --basetemp="$TMP/alone" --ignore=tests/celery_compat -m alone
  running+=($!)
  finish $! "pytest (alone)" 10m || alone_status=$?
  if [ "$alone_status" -eq 5 ]; then alone_status=0; fi  # 5: no test is marked alone
fi
alone="$(minutes $((SECONDS - start))), status $alone_status"

start=$SECONDS
django_status=0
if [ -z "$interrupted" ]; then
  echo "== pytest, the Django tests once more, on MySQL (MariaDB): Django's other database"
  RESILIENT_TEST_DJANGO_DB=mysql limited 5m "${PYTEST[@]}" --basetemp="$TMP/django-mysql" \
    tests/contrib/django
  running+=($!)
  finish $! "pytest (Django on MySQL)" 5m || django_status=$?
fi
django_mysql="$(minutes $((SECONDS - start))), status $django_status"

start=$SECONDS
mysqldb_status=0
if [ -z "$interrupted" ]; then
  echo "== pytest, the MySQL store's tests once more through mysqlclient (mysql+mysqldb://)"
  RESILIENT_TEST_MYSQL_URL="${RESILIENT_TEST_MYSQL_URL:-mysql+pymysql://root@127.0.0.1:3306/test}"
  RESILIENT_TEST_MYSQL_URL="mysql+mysqldb://${RESILIENT_TEST_MYSQL_URL#*://}" \
    limited 8m "${PYTEST[@]}" -n "$RUNNERS" --basetemp="$TMP/mysqldb" -m "not alone" \
    -k "mariadb or mysql" tests/unit tests/integration tests/e2e/test_kill_mid_task.py \
    tests/e2e/test_poison.py tests/e2e/test_partitions.py tests/e2e/test_held_rows.py \
    tests/e2e/test_store_outage.py
  running+=($!)
  finish $! "pytest (mysqlclient)" 8m || mysqldb_status=$?
fi
mysqldb="$(minutes $((SECONDS - start))), status $mysqldb_status"

compat_status=0
finish "$compat" "pytest tests/celery_compat" 35m >>"$compat_log" || compat_status=$?
compat_took=$(minutes $(($(stat -c %Y "$compat_log") - compat_start)))
echo "== pytest tests/celery_compat (Celery's integration suite, run beside the rest)"
cat "$compat_log"
echo "== pytest times: parallel $parallel; alone $alone; Django on MySQL $django_mysql;" \
  "mysqlclient $mysqldb;" \
  "celery_compat $compat_took, status $compat_status (beside them)"
if [ -n "$interrupted" ]; then exit 130; fi
for s in "$status" "$alone_status" "$django_status" "$mysqldb_status" "$compat_status"; do
  if [ "$s" -ne 0 ]; then exit "$s"; fi
done
