"""The default store: the working directory for workers, a temporary file in eager mode."""

from __future__ import annotations

from pathlib import Path

import pytest

from celery_resilient.runtime.config import ResilientConfig


def test_a_worker_app_defaults_to_the_working_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = ResilientConfig.from_mapping({})
    assert cfg.store_url == f"sqlite:///{tmp_path / 'celery-resilient.sqlite3'}"


def test_an_eager_app_defaults_to_a_fresh_temporary_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    first = ResilientConfig.from_mapping({"task_always_eager": True}).store_url
    second = ResilientConfig.from_mapping({"task_always_eager": True}).store_url
    assert first.startswith("sqlite:///") and second.startswith("sqlite:///")
    assert str(tmp_path) not in first and first != second
    assert ResilientConfig.from_mapping(
        {"task_always_eager": True, "resilient_store_url": "sqlite:///x.db"}
    ).store_url == "sqlite:///x.db"
