"""The one fixture of the conformance suite: ``stores``, parametrised over every implementation."""

from __future__ import annotations

from pathlib import Path

import pytest

from conformance.stores import IMPLEMENTATIONS, Stores


@pytest.fixture(params=IMPLEMENTATIONS, ids=[impl.name for impl in IMPLEMENTATIONS])
def stores(request: pytest.FixtureRequest, tmp_path: Path) -> Stores:
    """The three stores of one implementation, on a fresh backing store."""
    impl: type[Stores] = request.param
    return impl(tmp_path)
