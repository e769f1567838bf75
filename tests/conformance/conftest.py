"""The one fixture of the conformance suite: ``stores``, parametrised over every implementation."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from conformance.stores import IMPLEMENTATIONS, Stores


@pytest.fixture(params=IMPLEMENTATIONS, ids=[impl.name for impl in IMPLEMENTATIONS])
def stores(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Stores]:
    """The three stores of one implementation, on a fresh backing store."""
    impl: type[Stores] = request.param
    made = impl(tmp_path)
    try:
        yield made
    finally:
        made.close()
