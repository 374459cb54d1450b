"""Framework integrations: :mod:`celery_resilient.contrib.django` and ``.flask``.

Each is imported only by projects that use that framework; the core never imports them.
"""
