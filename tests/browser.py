"""Headless Chromium (Debian's ``chromium``) for the HTML report tests: the DOM a page
has once loaded (scripts, had any run, would have changed it by then) and a screenshot."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

import pytest

CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser")) if p), None)
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None,
    reason="chromium is not installed (Debian: apt-get install chromium; .ci/run installs it)",
)


def _argv(profile: Path, *extra: str) -> list[str]:
    if CHROMIUM is None:
        raise RuntimeError("chromium is not installed")
    return [
        CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
        "--disable-extensions", "--disable-background-networking", "--disable-sync",
        f"--user-data-dir={profile}", "--virtual-time-budget=3000", *extra,
    ]  # fmt: skip


def rendered_dom(page: Path, profile: Path) -> str:
    """The page's DOM after load, serialised by the browser."""
    proc = subprocess.run(_argv(profile, "--dump-dom", page.resolve().as_uri()),
                          capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    if proc.returncode != 0 or "<html" not in proc.stdout:
        raise AssertionError(f"chromium failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return proc.stdout


def screenshot(page: Path, out: Path, profile: Path, height: int = 2400) -> Path:
    """A PNG of the page at 1200 pixels wide."""
    out.parent.mkdir(parents=True, exist_ok=True)
    argv = _argv(profile, f"--screenshot={out}", f"--window-size=1200,{height}",
                 "--hide-scrollbars", page.resolve().as_uri())  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    if proc.returncode != 0 or not out.is_file():
        raise AssertionError(f"chromium made no screenshot: {proc.stderr[-2000:]}")
    return out


@dataclass
class Node:
    tag: str
    attrs: dict[str, str]
    content: list[str | Node] = field(default_factory=list)

    def all_text(self) -> str:
        """The text content, in document order (as the DOM's textContent)."""
        return "".join(c if isinstance(c, str) else c.all_text() for c in self.content)

    def walk(self) -> list[Node]:
        out = [self]
        for c in self.content:
            if isinstance(c, Node):
                out += c.walk()
        return out

    def find(self, **attrs: str) -> list[Node]:
        """Every node (this one included) whose attributes include ``attrs``; ``cls`` is
        one class of the node's, ``tag`` its element name."""
        cls, tag = attrs.pop("cls", None), attrs.pop("tag", None)
        return [
            n for n in self.walk()
            if all(n.attrs.get(k) == v for k, v in attrs.items())
            and (tag is None or n.tag == tag)
            and (cls is None or cls in n.attrs.get("class", "").split())
        ]  # fmt: skip


VOID = {"meta", "br", "img", "input", "link", "hr", "area", "base", "col", "source", "wbr"}


class _Tree(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.root = Node("#document", {})
        self.stack = [self.root]

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        node = Node(tag, {k: v or "" for k, v in attrs})
        self.stack[-1].content.append(node)
        if tag not in VOID:
            self.stack.append(node)

    def handle_endtag(self, tag: str) -> None:
        for i in range(len(self.stack) - 1, 0, -1):
            if self.stack[i].tag == tag:
                del self.stack[i:]
                return

    def handle_data(self, data: str) -> None:
        self.stack[-1].content.append(data)


def parse(html_text: str) -> Node:
    tree = _Tree()
    tree.feed(html_text)
    tree.close()
    return tree.root
