#!/usr/bin/env bash
# The README's first command: kill a worker with SIGKILL mid-task and watch the work resume;
# then kill beat (missed slots caught up once) and lose a session's cache (context recovered).
# Creates .venv-demo, installs the repo with the Redis and Flask extras, starts Redis on
# 127.0.0.1:6379 if nothing answers there, then runs example_project/demo.py (exit status = its
# verdict).
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-$(command -v python3.11 || command -v python3)}"
VENV=.venv-demo
if [ ! -x "$VENV/bin/python" ]; then
    echo "creating $VENV with $PY"
    "$PY" -m venv "$VENV"
fi
echo "installing celery-resilient[redis,flask] into $VENV"
# kombu[redis]: kombu 5.7's Redis transport imports `packaging`, which only kombu's own redis
# extra pulls in (until the project's `redis` extra depends on celery[redis] itself).
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -e '.[redis,flask]' 'kombu[redis]' \
    2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)

redis_answers() {
    "$VENV/bin/python" - <<'PY'
import sys
import redis
try:
    sys.exit(0 if redis.Redis(host="127.0.0.1", port=6379, socket_connect_timeout=0.5).ping() else 1)
except redis.RedisError:
    sys.exit(1)
PY
}

if ! redis_answers; then
    if command -v redis-server >/dev/null; then
        echo "starting redis-server on 127.0.0.1:6379"
        redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no
        for _ in $(seq 50); do redis_answers && break; sleep 0.1; done
    fi
    # Otherwise the demo starts a redis-server of its own, or says plainly what is missing.
fi

exec "$VENV/bin/python" -m example_project.demo "$@"
