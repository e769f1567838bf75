"""The git handles the layers above the adapter hold and hand back, without looking inside.

The engine and the app reach git through the stores' contracts and the adapter's
functions; where they keep a repository, a commit or a tree between two such calls, they
name its type from here, so pygit2 stays imported only in ``store/`` and ``adapter/``
(tests/test_seams.py). Anything that reads inside one belongs below the engine.
"""

from __future__ import annotations

from typing import TypeAlias

import pygit2

Repository: TypeAlias = pygit2.Repository
Commit: TypeAlias = pygit2.Commit
Tree: TypeAlias = pygit2.Tree
Oid: TypeAlias = pygit2.Oid

__all__ = ["Commit", "Oid", "Repository", "Tree"]
