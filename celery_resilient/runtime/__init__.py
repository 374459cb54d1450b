"""Layer 4, the runtime wiring a Celery app to the store: settings, the ``Runtime`` every
layer above finds with ``Runtime.of(app)``, the main process's buffers, metrics."""
