"""A user's task module as docs/testing.md's "Unit-testing your tasks" shows it.

No store URL is set, as in a project that relies on the default; the tests give it one.
"""

from __future__ import annotations

from celery import Celery

from celery_resilient import Resilient, ResumableTask

app = Celery("shop", broker="memory://", set_as_current=False)
app.conf.update(task_always_eager=True, task_store_eager_result=False)
Resilient(app)

charged: list[str] = []


@app.task(base=ResumableTask, bind=True, shared=False, name="shop.charge")
def charge(self: ResumableTask, order: str) -> str:
    state = self.checkpoint.load(default={"charged": False})
    if not state["charged"]:
        charged.append(order)
        state["charged"] = True
        self.checkpoint.save(state)
    return f"charged {order}"
