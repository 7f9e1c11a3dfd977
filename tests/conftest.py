"""Shared test helpers: where the repository and the team's reference traces are."""
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
SHARED_FIXTURES = REPO_ROOT.parent / "shared" / "fixtures"


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def shared_fixtures() -> Path:
    """../shared/fixtures beside the clone; tests that need it skip in a user's clone."""
    if not SHARED_FIXTURES.is_dir():
        pytest.skip(f"{SHARED_FIXTURES} not found: the reference traces live beside the team's clones, not in the repository")
    return SHARED_FIXTURES
