"""Flask integration: ``Resilient(celery).init_app(flask_app)``, the Flask extension pattern.

Every ``RESILIENT_*`` key of ``flask_app.config`` becomes the Celery setting of the same name
in lower case (``RESILIENT_STORE_URL`` -> ``resilient_store_url``), the settings are validated
at once (an unknown or invalid key raises :class:`ConfigurationError` naming it), and the
runtime is registered as ``flask_app.extensions["celery_resilient"]``. See ``docs/flask.md``.
"""

from __future__ import annotations

import re

from flask import Flask

from celery_resilient.errors import ConfigurationError
from celery_resilient.runtime.config import PREFIX, ResilientConfig
from celery_resilient.runtime.runtime import Runtime

EXTENSION_NAME = "celery_resilient"
CONFIG_PREFIX = PREFIX.upper()  # RESILIENT_


def init_app(rt: Runtime, flask_app: Flask) -> None:
    """Copy ``RESILIENT_*`` settings from ``flask_app`` into the Celery app and register."""
    if not isinstance(flask_app, Flask):
        raise ConfigurationError(
            f"init_app() takes a Flask application, not {type(flask_app).__name__}")
    owner = flask_app.extensions.get(EXTENSION_NAME)
    if owner is not None and owner is not rt:
        raise ConfigurationError(
            f"Flask app {flask_app.name!r} is already bound to the celery-resilient runtime of "
            f"Celery app {owner.app.main!r}")
    written = {key.lower(): key for key in flask_app.config
               if isinstance(key, str) and key.startswith(CONFIG_PREFIX)}
    settings = {lower: flask_app.config[key] for lower, key in written.items()}
    try:  # fail here, at startup, naming the key as the Flask config spells it
        ResilientConfig.from_mapping({**dict(rt.app.conf), **settings})
    except ConfigurationError as exc:
        raise ConfigurationError(_as_written(str(exc), written)) from None
    rt.app.conf.update(settings)
    flask_app.extensions[EXTENSION_NAME] = rt


def _as_written(message: str, written: dict[str, str]) -> str:
    """``message`` with each Celery setting name the Flask config gave spelt as given there."""
    if not written:
        return message
    names = "|".join(sorted(map(re.escape, written), key=len, reverse=True))
    message = re.sub(rf"\b({names})\b", lambda m: written[m[1]], message)
    head, sep, known = message.partition("known settings: ")
    if sep and any(repr(key) in head for key in written.values()):  # a Flask key is unknown
        known = re.sub(rf"\b{PREFIX}\w+", lambda m: m[0].upper(), known)
    return head + sep + known
