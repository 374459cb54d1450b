"""Another project's test suite, taken from the sdist of the version installed here.

``pip download`` goes through the environment's index configuration; nothing of the other
project is copied into this repository. A failed download fails the test (no skip).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Sequence
from pathlib import Path

import pytest


def unpacked_sdist(distribution: str, package: str, where: Path,
                   needs: Sequence[str] = ()) -> Path:
    """The unpacked sdist of the installed ``distribution``, its ``package`` removed (the
    installed copy is the one under test); ``needs``: modules its suite imports."""
    missing = [m for m in needs if importlib.util.find_spec(m) is None]
    if missing:
        pytest.fail(f"{distribution}'s test suite needs {', '.join(missing)}: install the "
                    "test dependency group")
    version = importlib.metadata.version(distribution)
    got = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
         "--disable-pip-version-check", "-q", "-d", str(where), f"{distribution}=={version}"],
        capture_output=True, text=True, timeout=300, check=False)
    sdists = list(where.glob("*.tar.gz"))
    if got.returncode != 0 or len(sdists) != 1:
        pytest.fail(f"could not download the {distribution} {version} sdist "
                    f"(pip exit {got.returncode}):\n{got.stdout}\n{got.stderr}")
    with tarfile.open(sdists[0]) as archive:
        archive.extractall(where, filter="data")
    tree = where / sdists[0].name.removesuffix(".tar.gz")
    shutil.rmtree(tree / package)
    return tree
