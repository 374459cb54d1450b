"""A small celery-resilient app: a resumable import, a notify step, a ledger-kept payment."""
