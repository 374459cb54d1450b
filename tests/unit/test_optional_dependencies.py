"""The base install works without any extra: every optional dependency is imported only
where it is used (Prometheus with ``resilient_metrics``, Redis/RedBeat for beat and the
context cache, Flask, Django, pytest-celery for the test nodes)."""

from __future__ import annotations

import subprocess
import sys

import pytest

OPTIONAL = ("prometheus_client", "flask", "django", "redbeat", "redis", "pytest_celery",
            "psycopg")

# Each optional module is made unimportable (None in sys.modules) before anything loads.
PRELUDE = "import sys\nfor name in {optional!r}:\n    sys.modules[name] = None\n"

SCRIPT = """
from celery import Celery

import celery_resilient
import celery_resilient.cli
import celery_resilient.signals
import celery_resilient.testing
import celery_resilient.worker.step
from celery_resilient import Resilient, ResumableTask

app = Celery("bare", broker="memory://", set_as_current=False)
app.conf.resilient_store_url = "sqlite:///{db}"
rt = Resilient(app)

@app.task(base=ResumableTask, bind=True)
def job(self, x):
    self.checkpoint.save({{"x": x}})
    return x * 2

app.conf.task_always_eager = True
assert job.delay(21).get() == 42
assert rt.config.metrics is False
print("ok")
"""


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=False)


def test_the_package_works_without_any_optional_dependency(tmp_path: object) -> None:
    code = PRELUDE.format(optional=OPTIONAL) + SCRIPT.format(db=f"{tmp_path}/bare.sqlite3")
    done = _run(code)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_metrics_without_prometheus_client_is_a_clear_configuration_error(
        tmp_path: object) -> None:
    code = PRELUDE.format(optional=("prometheus_client",)) + SCRIPT.format(
        db=f"{tmp_path}/m.sqlite3").replace(
        'rt = Resilient(app)', 'rt = Resilient(app)\napp.conf.resilient_metrics = True')
    done = _run(code)
    assert done.returncode != 0
    assert "resilient_metrics=True is invalid" in done.stderr
    assert "celery-resilient[prometheus]" in done.stderr


@pytest.mark.parametrize(("statement", "needs"), [
    ("from celery_resilient.beat import ResilientScheduler", "redbeat"),
    ("import celery_resilient.contrib.flask", "flask"),
    ("import celery_resilient.testing.plugin", "pytest_celery"),
])
def test_an_integration_names_its_missing_dependency(statement: str, needs: str) -> None:
    done = _run(PRELUDE.format(optional=(needs,)) + statement + "\n")
    assert done.returncode != 0 and needs in done.stderr, done.stderr
