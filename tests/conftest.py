"""Shared pytest setup: the reference fixtures and the `gpu` marker. Nothing model-specific belongs here."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

_REPO_ROOT = str(Path(__file__).resolve().parents[1])
if _REPO_ROOT not in sys.path:  # `tests.fixtures` must import however pytest was launched
    sys.path.insert(0, _REPO_ROOT)

from tests.fixtures import ReferenceUnavailable, TtsFixtures, load_tts_fixtures  # noqa: E402

# Building the reference venv and fixtures can take minutes on a fresh machine; that cost lands in the setup of
# whichever test first asks for it, so such tests get a timeout that covers it unless they chose their own.
_FIXTURE_BUILD_TIMEOUT_S = 1800


@pytest.fixture(scope="session")
def tts_fixtures() -> TtsFixtures:
    try:
        return load_tts_fixtures()
    except ReferenceUnavailable as exc:
        reason = str(exc)
    # A missing reference must not pass silently as a green run: skipping is an explicit opt-in.
    if os.environ.get("OMNILOOP_SKIP_PARITY") == "1":
        pytest.skip(f"OMNILOOP_SKIP_PARITY=1: {reason}")
    pytest.fail(f"{reason}\n(set OMNILOOP_SKIP_PARITY=1 to skip parity tests on a machine without the reference)",
                pytrace=False)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "tts_fixtures" in getattr(item, "fixturenames", ()) and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(_FIXTURE_BUILD_TIMEOUT_S))
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if gpu_items and not _cuda_available():
        skip = pytest.mark.skip(reason="marked gpu: needs a CUDA device and torch.cuda.is_available() is False")
        for item in gpu_items:
            item.add_marker(skip)


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()
