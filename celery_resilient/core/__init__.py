"""Layer 2, pure logic and codecs: states, work keys, messages, identity, liveness, and the
decisions of a take and of the sweeps.

Nothing here needs a Celery app's runtime or the store; every layer above may import it.
"""
