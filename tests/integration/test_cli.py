"""``celery -A proj resilient migrate/status`` as an operator runs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from celery_resilient import SchemaError
from celery_resilient.store.sql import Store


def _celery(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "celery", "-A", "tests.e2e.proj", *args],
                          env={**os.environ, **env}, cwd=cwd, capture_output=True, text=True,
                          timeout=60, check=False)


def test_migrate_then_status(pg_url: str, table_prefix: str, tmp_path: Path,
                             request: pytest.FixtureRequest) -> None:
    env = {"RESILIENT_STORE_URL": pg_url, "RESILIENT_TABLE_PREFIX": table_prefix,
           "RESILIENT_EFFECT_LOG": str(tmp_path / "effects.jsonl")}
    store = Store(pg_url, table_prefix)
    with pytest.raises(SchemaError, match="resilient migrate"):
        store.ensure_schema(migrate_if_needed=False)

    done = _celery(["resilient", "migrate"], env, request.config.rootpath)
    assert done.returncode == 0, done.stderr
    assert "at revision" in done.stdout and "postgres@" in done.stdout
    store.ensure_schema(migrate_if_needed=False)  # now current: no error

    status = _celery(["resilient", "status", "--json"], env, request.config.rootpath)
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["work"] == {}
    store.dispose()
