"""Print the transitions table of docs/architecture.md from celery_resilient.core.states.

Run after changing states.py and paste the output into the doc; tests/unit/test_states.py
fails until the two agree.
"""

from celery_resilient.core.states import TRANSITIONS

print("| transition | from | to | made by | why |")
print("|---|---|---|---|---|")
for t in TRANSITIONS:
    print(f"| `{t.name}` | {', '.join(t.sources)} | {t.target} | {t.who} | {t.why} |")
