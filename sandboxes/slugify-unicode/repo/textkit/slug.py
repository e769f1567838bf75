"""URL slugs."""

import re

_NON_WORD = re.compile(r"[^a-z0-9]+")


def slugify(text: str, separator: str = "-") -> str:
    """Turn *text* into a lowercase URL slug.

    Runs of characters other than ASCII letters and digits become a single
    *separator*; leading and trailing separators are stripped.

    >>> slugify("Hello, World!")
    'hello-world'
    """
    text = text.lower()
    text = text.encode("ascii", "ignore").decode("ascii")
    return _NON_WORD.sub(separator, text).strip(separator)
