"""The ``celery -A proj resilient`` commands, one module per concern: ``schema`` (migrate),
``inspection`` (status, work, work show, schedule), ``recovery`` (recover), ``retention``
(prune) and ``actions`` (cancel, retry, forget). Each parses, calls :mod:`celery_resilient.ops`
and prints; the group that holds them is :mod:`celery_resilient.cli`."""
