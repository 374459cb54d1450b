"""The broker side of recovery: a Redis fetch that never leaves a message unaccounted for.

kombu's Redis transport pops a message (BRPOP) and records it as unacknowledged in a later
round trip; a worker killed between the two loses it, and one killed after it leaves the
message to the visibility timeout (an hour by default). ``transport`` moves each message in
one server-side step from its queue into kombu's own ``unacked`` hash and into a *holding*
owned by the worker incarnation; ``holdings`` gives a gone incarnation's holding back to its
queues as soon as the store says that incarnation is gone. Queue keys, message format and
the ``unacked`` bookkeeping stay kombu's, so plain workers, Flower and redis-cli see
nothing new.
"""
