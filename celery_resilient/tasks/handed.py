"""Another name for :mod:`celery_resilient.tasks.handed_claims`, kept for imports by this one.

Importing it gives that very module, not a copy of its names: what is set or patched through
either name is the same object.
"""

from __future__ import annotations

import sys

from celery_resilient.tasks import handed_claims

sys.modules[__name__] = handed_claims
