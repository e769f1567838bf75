"""gitrun.core.patch against real ``git diff`` output: parse, apply strictly, refuse clearly."""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from gitrun.core.errors import GateRejected, PatchError
from gitrun.core.patch import (
    FilePatch,
    Hunk,
    apply_file_patch,
    changed_line_count,
    parse_patch,
    touched_paths,
)

_IDENTITY = ("-c", "user.name=Test", "-c", "user.email=test@example.invalid")
_CONFIG = ("-c", "core.autocrlf=false", "-c", "commit.gpgsign=false", "-c", "core.fileMode=true")


def _hermetic_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(
        HOME=str(home),
        XDG_CONFIG_HOME=str(home / ".config"),
        GIT_CONFIG_NOSYSTEM="1",
        LC_ALL="C",
    )
    return env


class Repo:
    """A throwaway git repository driven through the real git CLI."""

    def __init__(self, base: Path) -> None:
        self.root = base / "repo"
        self.root.mkdir()
        (base / "git-home").mkdir()
        self.env = _hermetic_env(base / "git-home")
        self.git("init", "-q", "-b", "main")

    def git(self, *args: str) -> bytes:
        done = subprocess.run(
            ["git", *_IDENTITY, *_CONFIG, *args],
            cwd=self.root,
            env=self.env,
            capture_output=True,
            check=True,
            timeout=30,
        )
        return done.stdout

    def write(self, path: str, data: bytes | None, *, executable: bool = False) -> None:
        target = self.root / path
        if data is None:
            target.unlink()
            return
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        target.chmod(0o755 if executable else 0o644)

    def commit(self, files: Mapping[str, bytes]) -> None:
        for path, data in files.items():
            self.write(path, data)
        self.git("add", "-A")
        self.git("commit", "-q", "-m", "old")

    def diff(self, *args: str) -> str:
        out = self.git("diff", "--no-color", "--no-ext-diff", *args)
        return out.decode("utf-8", "surrogateescape")


@pytest.fixture
def repo(tmp_path: Path) -> Repo:
    return Repo(tmp_path)


def apply_all(files: Mapping[str, bytes], patches: tuple[FilePatch, ...]) -> dict[str, bytes]:
    """What the runtime does with a tree: apply each file patch to its old blob."""
    result = dict(files)
    for fp in patches:
        old = files.get(fp.old_path) if fp.old_path is not None else None
        new = apply_file_patch(old, fp)
        if fp.old_path is not None:
            del result[fp.old_path]
        if fp.new_path is not None and new is not None:
            result[fp.new_path] = new
    return result


def refusal(text: str) -> str:
    with pytest.raises(PatchError) as caught:
        parse_patch(text)
    return str(caught.value)


def refusal_to_apply(old: bytes | None, text: str) -> str:
    (fp,) = parse_patch(text)
    with pytest.raises(PatchError) as caught:
        apply_file_patch(old, fp)
    return str(caught.value)


LONG = b"".join(b"def f%d():\n    return %d\n\n" % (i, i) for i in range(30))

SIMPLE = """\
diff --git a/f.txt b/f.txt
index 1111111..2222222 100644
--- a/f.txt
+++ b/f.txt
@@ -1,3 +1,3 @@
 one
-two
+TWO
 three
"""


# --- real git diff round trips ------------------------------------------------------------


def test_a_modified_file_round_trips_through_git_diff(repo: Repo) -> None:
    repo.commit({"src/m.py": LONG})
    new = LONG.replace(b"return 3\n", b"return 33\n").replace(b"def f20", b"def g20") + b"# end\n"
    repo.write("src/m.py", new)
    (fp,) = parse_patch(repo.diff())
    assert (fp.old_path, fp.new_path, fp.new_mode, fp.old_mode) == (
        "src/m.py",
        "src/m.py",
        None,
        0o100644,
    )
    assert len(fp.hunks) == 3
    assert apply_file_patch(LONG, fp) == new


def test_a_new_file_added_with_intent_to_add_is_created(repo: Repo) -> None:
    repo.commit({"keep": b"k\n"})
    repo.write("new.txt", b"hello\nworld\n")
    repo.git("add", "-N", "new.txt")
    (fp,) = parse_patch(repo.diff())
    assert (fp.old_path, fp.new_path, fp.path, fp.new_mode) == (
        None,
        "new.txt",
        "new.txt",
        0o100644,
    )
    assert apply_file_patch(None, fp) == b"hello\nworld\n"


def test_a_staged_new_executable_is_created_with_its_mode(repo: Repo) -> None:
    repo.commit({"keep": b"k\n"})
    repo.write("run.sh", b"#!/bin/sh\necho hi\n", executable=True)
    repo.git("add", "run.sh")
    (fp,) = parse_patch(repo.diff("--cached"))
    assert fp.new_mode == 0o100755
    assert apply_file_patch(None, fp) == b"#!/bin/sh\necho hi\n"


def test_an_empty_new_file_is_created_without_hunks(repo: Repo) -> None:
    repo.commit({"keep": b"k\n"})
    repo.write("empty", b"")
    repo.git("add", "empty")
    (fp,) = parse_patch(repo.diff("--cached", "--no-renames"))
    assert fp.hunks == ()
    assert (fp.old_path, fp.new_path) == (None, "empty")
    assert apply_file_patch(None, fp) == b""


def test_deleted_files_are_deleted_even_when_empty(repo: Repo) -> None:
    files = {"gone.txt": b"a\nb\n", "empty": b"", "odd": b"no newline"}
    repo.commit(files)
    for path in files:
        repo.write(path, None)
    patches = parse_patch(repo.diff())
    assert sorted(fp.path for fp in patches) == sorted(files)
    assert all(fp.new_path is None for fp in patches)
    assert apply_all(files, patches) == {}


def test_a_mode_change_alone_keeps_the_content_and_reports_the_new_mode(repo: Repo) -> None:
    repo.commit({"tool": b"x\n"})
    repo.write("tool", b"x\n", executable=True)
    (fp,) = parse_patch(repo.diff())
    assert (fp.hunks, fp.old_mode, fp.new_mode) == ((), 0o100644, 0o100755)
    assert apply_file_patch(b"x\n", fp) == b"x\n"


def test_a_mode_change_with_an_edit_applies_both(repo: Repo) -> None:
    repo.commit({"tool": b"x\n"})
    repo.write("tool", b"y\n", executable=True)
    (fp,) = parse_patch(repo.diff())
    assert fp.new_mode == 0o100755
    assert apply_file_patch(b"x\n", fp) == b"y\n"


def test_a_pure_rename_keeps_the_content_under_the_new_path(repo: Repo) -> None:
    repo.commit({"old name.txt": LONG})
    (repo.root / "sub").mkdir()
    repo.git("mv", "old name.txt", "sub/new name.txt")
    (fp,) = parse_patch(repo.diff("--cached", "-M"))
    assert (fp.old_path, fp.new_path, fp.hunks, fp.is_rename) == (
        "old name.txt",
        "sub/new name.txt",
        (),
        True,
    )
    assert apply_all({"old name.txt": LONG}, (fp,)) == {"sub/new name.txt": LONG}


def test_a_rename_with_edits_applies_the_hunks_to_the_old_content(repo: Repo) -> None:
    repo.commit({"a.py": LONG})
    repo.git("mv", "a.py", "b.py")
    new = LONG.replace(b"return 7\n", b"return 70\n")
    repo.write("b.py", new)
    repo.git("add", "b.py")
    (fp,) = parse_patch(repo.diff("--cached", "-M"))
    assert (fp.old_path, fp.new_path, len(fp.hunks)) == ("a.py", "b.py", 1)
    assert apply_all({"a.py": LONG}, (fp,)) == {"b.py": new}


def test_crlf_content_is_patched_byte_exactly(repo: Repo) -> None:
    old = b"one\r\ntwo\r\nthree\r\n"
    new = b"one\r\n2\r\nthree\r\nfour"
    repo.commit({"win.txt": old})
    repo.write("win.txt", new)
    (fp,) = parse_patch(repo.diff())
    assert apply_file_patch(old, fp) == new
    with pytest.raises(PatchError, match="does not match line 1"):
        apply_file_patch(old.replace(b"\r\n", b"\n"), fp)


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (b"a\nb", b"a\nc"),
        (b"a\nb", b"a\nb\n"),
        (b"a\nb\n", b"a\nb"),
        (b"x", b"y"),
        (b"a\nb\nc\nd\ne\nf", b"A\nb\nc\nd\ne\nf"),
        (b"a\nb\nc\nd\ne\nf", b"a\nb\nc\nd\ne\nF"),
    ],
)
def test_a_missing_newline_at_end_of_file_round_trips_on_either_side(
    repo: Repo, old: bytes, new: bytes
) -> None:
    repo.commit({"f": old})
    repo.write("f", new)
    (fp,) = parse_patch(repo.diff())
    assert apply_file_patch(old, fp) == new


def test_paths_with_spaces_tabs_quotes_and_non_ascii_are_unquoted(repo: Repo) -> None:
    names = ["with space.txt", "tab\there", 'quote"d', "back\\slash", "caf\u00e9/\u00fc.txt"]
    files = dict.fromkeys(names, b"old\n")
    repo.commit(files)
    for name in names:
        repo.write(name, b"new\n")
    patches = parse_patch(repo.diff())
    assert sorted(fp.path for fp in patches) == sorted(names)
    assert apply_all(files, patches) == dict.fromkeys(names, b"new\n")


def test_a_plain_diff_without_a_diff_git_line_is_accepted(repo: Repo) -> None:
    repo.commit({"f.txt": b"one\ntwo\n"})
    repo.write("f.txt", b"one\n2\n")
    text = repo.diff()
    plain = "".join(
        line
        for line in text.splitlines(keepends=True)
        if line.startswith(("---", "+++", "@@", " ", "-", "+"))
    )
    assert plain.startswith("--- a/f.txt\n+++ b/f.txt\n")
    (fp,) = parse_patch(plain)
    assert apply_file_patch(b"one\ntwo\n", fp) == b"one\n2\n"


def test_a_plain_diff_can_create_and_delete_with_dev_null() -> None:
    created, deleted = parse_patch(
        "--- /dev/null\n+++ b/n\n@@ -0,0 +1 @@\n+hi\n--- a/d\n+++ /dev/null\n@@ -1 +0,0 @@\n-bye\n"
    )
    assert apply_file_patch(None, created) == b"hi\n"
    assert apply_file_patch(b"bye\n", deleted) is None


def test_a_blank_context_line_whose_space_was_stripped_still_applies() -> None:
    text = "--- a/f\n+++ b/f\n@@ -1,3 +1,3 @@\n a\n\n-b\n+c\n"
    (fp,) = parse_patch(text)
    assert apply_file_patch(b"a\n\nb\n", fp) == b"a\n\nc\n"


def test_zero_context_hunks_apply_at_their_exact_lines(repo: Repo) -> None:
    old = b"1\n2\n3\n4\n5\n6\n"
    new = b"0\n1\n3\n4\n5\n6\n7\n"
    repo.commit({"six": old})
    repo.write("six", new)
    (fp,) = parse_patch(repo.diff("-U0"))
    assert len(fp.hunks) == 3
    assert apply_file_patch(old, fp) == new


def test_a_symlink_is_created_with_its_mode(repo: Repo) -> None:
    repo.commit({"keep": b"k\n"})
    (repo.root / "link").symlink_to("keep")
    repo.git("add", "link")
    (fp,) = parse_patch(repo.diff("--cached"))
    assert fp.new_mode == 0o120000
    assert apply_file_patch(None, fp) == b"keep"


def test_touched_paths_and_changed_line_count_cover_every_file(repo: Repo) -> None:
    files = {"a": b"1\n2\n", "b": b"x\n", "c": LONG}
    repo.commit(files)
    repo.write("a", b"1\n3\n4\n")
    repo.write("b", None)
    repo.git("mv", "c", "d")
    repo.git("add", "-A")
    patches = parse_patch(repo.diff("--cached", "-M"))
    assert touched_paths(patches) == ("a", "b", "c", "d")
    assert changed_line_count(patches) == 4  # -2 +3 +4 in a, -x in b
    assert apply_all(files, patches) == {"a": b"1\n3\n4\n", "d": LONG}


_LINES = [b"a", b"b", b"", b"a\r", b"\xc3\xa9", b"\xe9", b" x", b"-- a", b"++ b", b"\\ z", b"@@ q"]
_CONTENT = st.one_of(
    st.none(),
    st.builds(
        lambda lines, eol: b"\n".join(lines) + (b"\n" if eol and lines else b""),
        st.lists(st.sampled_from(_LINES), max_size=10),
        st.booleans(),
    ),
)


@settings(derandomize=True, max_examples=60, deadline=None, database=None)
@given(
    old=_CONTENT,
    new=_CONTENT,
    context=st.sampled_from(["0", "1", "3"]),
    algorithm=st.sampled_from(["myers", "patience", "histogram"]),
)
@example(old=b"a", new=b"a\n", context="3", algorithm="myers")
@example(old=None, new=b"", context="3", algorithm="myers")
@example(old=b"a\r\nb\r\n", new=None, context="0", algorithm="myers")
def test_applying_a_real_git_diff_yields_the_new_content(
    old: bytes | None, new: bytes | None, context: str, algorithm: str
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        git = Repo(Path(tmp))
        if old is not None:
            git.write("f", old)
            git.git("add", "f")
        if new is None and old is not None:
            git.write("f", None)
        elif new is not None:
            git.write("f", new)
            git.git("add", "-N", "f")
        text = git.diff(f"-U{context}", f"--diff-algorithm={algorithm}", "--no-renames")
    if old == new:
        assert text == ""
        return
    (fp,) = parse_patch(text)
    assert apply_file_patch(old, fp) == new
    assert changed_line_count([fp]) == sum(o != " " for h in fp.hunks for o, _ in h.lines)


# --- refusals -----------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["", "\n", "\n\n  \n"])
def test_an_empty_patch_is_refused(text: str) -> None:
    assert "patch is empty" in refusal(text)


def test_text_that_is_not_a_diff_is_refused_with_its_line() -> None:
    message = refusal("\nplease apply this:\n" + SIMPLE)
    assert "patch line 2" in message
    assert "unexpected line outside a file patch" in message


@pytest.mark.parametrize("flag", [(), ("--binary",)])
def test_a_binary_diff_is_refused(repo: Repo, flag: tuple[str, ...]) -> None:
    repo.commit({"blob.bin": b"\x00\x01\x02"})
    repo.write("blob.bin", b"\x00\x01\x03")
    text = repo.diff(*flag)
    assert "binary" in text.lower()
    message = refusal(text)
    assert "binary patches are not supported" in message
    assert "blob.bin" in message


@pytest.mark.parametrize(
    "header",
    [
        "@@ -1,3 +1,3",
        "@@ -a,3 +1,3 @@",
        "@@ 1,3 1,3 @@",
        "@@@ -1,3 -1,3 +1,3 @@@",
        "@@ -1,3 +1,3 @@x",
    ],
)
def test_a_malformed_hunk_header_is_refused(header: str) -> None:
    message = refusal(SIMPLE.replace("@@ -1,3 +1,3 @@", header))
    assert "patch line 5 (f.txt): malformed hunk header" in message


def test_a_hunk_shorter_than_its_header_is_refused() -> None:
    message = refusal(SIMPLE.replace("@@ -1,3 +1,3 @@", "@@ -1,4 +1,4 @@"))
    assert "ends early: 1 old and 1 new line(s) missing" in message
    assert "patch line 10 (f.txt)" in message


def test_a_hunk_longer_than_its_header_is_refused() -> None:
    message = refusal(SIMPLE.replace("@@ -1,3 +1,3 @@", "@@ -1,2 +1,2 @@"))
    assert "patch line 9 (f.txt)" in message
    assert "more lines than its header says" in message
    message = refusal(SIMPLE.replace("@@ -1,3 +1,3 @@", "@@ -1,3 +1,2 @@"))
    assert "more new lines than its header says" in message


def test_a_garbage_line_inside_a_hunk_is_refused() -> None:
    message = refusal(SIMPLE.replace("+TWO\n", "+TWO\n*** three\n"))
    assert "patch line 9 (f.txt): unexpected line inside hunk" in message


def test_the_same_path_patched_twice_is_refused(repo: Repo) -> None:
    repo.commit({"f.txt": b"one\n"})
    repo.write("f.txt", b"two\n")
    text = repo.diff()
    message = refusal(text + text)
    assert "patch line 8 (f.txt): f.txt is patched twice (first at patch line 1)" in message
    rename_onto = "diff --git a/g b/f.txt\nsimilarity index 100%\nrename from g\nrename to f.txt\n"
    assert "patched twice" in refusal(SIMPLE + rename_onto)


def test_a_hunk_whose_context_does_not_match_is_refused() -> None:
    message = refusal_to_apply(b"one\ntwo\nTHREE\n", SIMPLE)
    assert "f.txt: hunk 1 @@ -1,3 +1,3 @@ (patch line 5) does not match line 3" in message
    assert "b'three\\n'" in message
    assert "b'THREE\\n'" in message


def test_a_hunk_whose_removed_line_does_not_match_is_refused() -> None:
    assert "does not match line 2" in refusal_to_apply(b"one\n2\nthree\n", SIMPLE)


def test_a_hunk_at_the_wrong_line_is_refused_without_searching(repo: Repo) -> None:
    repo.commit({"m.py": LONG})
    repo.write("m.py", LONG.replace(b"return 20\n", b"return 21\n"))
    text = repo.diff()
    assert "does not match line" in refusal_to_apply(b"# shifted\n" + LONG, text)


def test_a_hunk_past_the_end_of_the_file_is_refused() -> None:
    text = "--- a/f\n+++ b/f\n@@ -5,0 +6 @@\n+x\n"
    assert "starts after the end of the file (2 lines)" in refusal_to_apply(b"a\nb\n", text)


def test_patching_a_missing_file_is_refused() -> None:
    message = refusal_to_apply(None, SIMPLE)
    assert "f.txt (patch line 1): the patch changes f.txt, which does not exist" in message


def test_creating_an_existing_file_is_refused(repo: Repo) -> None:
    repo.commit({"keep": b"k\n"})
    repo.write("n", b"x\n")
    repo.git("add", "-N", "n")
    assert "creates a file that already exists" in refusal_to_apply(b"", repo.diff())


def test_a_delete_that_leaves_lines_behind_is_refused(repo: Repo) -> None:
    repo.commit({"d": b"a\nb\n"})
    repo.write("d", None)
    message = refusal_to_apply(b"a\nb\nc\n", repo.diff())
    assert "deletes the file but leaves 1 line(s)" in message
    assert "leaves 1 line(s)" in refusal_to_apply(
        b"x\n", "diff --git a/e b/e\ndeleted file mode 100644\n"
    )


def test_a_newline_at_end_of_file_mismatch_is_refused(repo: Repo) -> None:
    repo.commit({"f": b"a\nb"})
    repo.write("f", b"a\nc\n")
    message = refusal_to_apply(b"a\nb\n", repo.diff())
    assert "only the newline at end of file differs" in message
    plain = "--- a/f\n+++ b/f\n@@ -1,2 +1,2 @@\n a\n-b\n+c\n"
    assert "does not match line 2" in refusal_to_apply(b"a\nb", plain)


def test_a_no_newline_marker_that_would_join_lines_is_refused() -> None:
    text = "--- a/f\n+++ b/f\n@@ -1 +1 @@\n-a\n+A\n\\ No newline at end of file\n"
    assert "would lose its newline and join the next line" in refusal_to_apply(b"a\nb\n", text)


def test_lines_added_after_a_last_line_without_newline_are_refused() -> None:
    text = "--- a/f\n+++ b/f\n@@ -1,0 +2 @@\n+b\n"
    assert "line 1 would lose its newline" in refusal_to_apply(b"a", text)


def test_misplaced_no_newline_markers_are_refused() -> None:
    before = "--- a/f\n+++ b/f\n@@ -1 +1 @@\n\\ No newline at end of file\n-a\n+b\n"
    assert "before any hunk line" in refusal(before)
    after = "--- a/f\n+++ b/f\n@@ -1,2 +1,2 @@\n a\n\\ No newline at end of file\n-b\n+c\n"
    assert "line after '\\ No newline at end of file'" in refusal(after)
    twice = "--- a/f\n+++ b/f\n@@ -1 +1 @@\n-a\n\\ x\n\\ x\n+b\n"
    assert "repeated" in refusal(twice)
    early = "--- a/f\n+++ b/f\n@@ -1 +1 @@\n-a\n\\ x\n+b\n@@ -3 +3 @@\n-c\n+d\n"
    assert "is not the last hunk" in refusal(early)


def test_overlapping_or_inconsistent_hunks_are_refused() -> None:
    hunks = "@@ -3 +3 @@\n-c\n+C\n@@ -1 +1 @@\n-a\n+A\n"
    assert "overlaps or precedes the hunk before it" in refusal("--- a/f\n+++ b/f\n" + hunks)
    shifted = "--- a/f\n+++ b/f\n@@ -1 +1,2 @@\n-a\n+A\n+B\n@@ -3 +3 @@\n-c\n+C\n"
    assert "new start that the hunks before it do not give" in refusal(shifted)


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        (
            "diff --git a/x b/y\nsimilarity index 90%\ncopy from x\ncopy to y\n",
            "copies are not supported",
        ),
        (
            "diff --git a/s b/s\nindex 1..2 160000\n--- a/s\n+++ b/s\n@@ -1 +1 @@\n-a\n+b\n",
            "submodule",
        ),
        ("diff --git a/x b/x\nold mode 100644\nnew mode 100777\n", "unsupported file mode"),
        ("--- a/../etc/passwd\n+++ b/../etc/passwd\n@@ -1 +1 @@\n-a\n+b\n", "unsafe path"),
        ("--- a/.git/config\n+++ b/.git/config\n@@ -1 +1 @@\n-a\n+b\n", "unsafe path"),
        ("--- a//abs\n+++ b//abs\n@@ -1 +1 @@\n-a\n+b\n", "unsafe path"),
        ("--- x\n+++ x\n@@ -1 +1 @@\n-a\n+b\n", "no leading directory to strip"),
        ("diff --git a/x b/x\n--- x/x\n+++ b/x\n@@ -1 +1 @@\n-a\n+b\n", "lacks the 'a/' prefix"),
        ("--- /dev/null\n+++ /dev/null\n@@ -0,0 +1 @@\n+a\n", "both creates and deletes"),
        ("--- a/x\n+++ b/y\n@@ -1 +1 @@\n-a\n+b\n", "differ without a rename"),
        ("diff --git a/x b/x\n--- a/x\n+++ b/y\n@@ -1 +1 @@\n-a\n+b\n", "disagree on the new path"),
        (
            "diff --git a/x b/x\nnew file mode 100644\n--- a/x\n+++ b/x\n@@ -1 +1 @@\n-a\n+b\n",
            "'new file mode' but '---' names a file",
        ),
        ("diff --git a/x b/y\nrename from x\n", "unpaired"),
        ("diff --git a/x b/x\nrename from x\nrename to x\n", "renames a path to itself"),
        ("diff --git a/x b/x\n--- a/x\n+++ b/x\n", "without any hunk"),
        ("diff --git a/x b/x\n@@ -1 +1 @@\n-a\n+b\n", "hunk without a '---'/'+++' header"),
        ("diff --git a/x b/x\nindex 1..2 100644\n", "changes nothing"),
        ("diff --git a/x b/x\nindex zz\n", "malformed index line"),
        ("diff --git a/x b/x\n--- a/x\nfoo\n", "'---' line not followed by a '+++' line"),
        ("diff --git a/x b/y b/z\nnew mode 100755\n", "cannot tell the old path"),
    ],
)
def test_unsupported_or_inconsistent_headers_are_refused(text: str, problem: str) -> None:
    message = refusal(text)
    assert problem in message
    assert message.startswith("patch-does-not-apply: patch line ")


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ('"a/x\\qy"', "bad escape in quoted path"),
        ('"a/xy', "unterminated quoted path"),
        ('"a/\\377"', "is not UTF-8"),
        ('"a/x" junk', "text after a quoted path"),
        ('"a/x\\000y"', "unsafe path"),
    ],
)
def test_bad_quoted_paths_are_refused(name: str, problem: str) -> None:
    plus = name.replace("a/", "b/", 1)
    assert problem in refusal(f"--- {name}\n+++ {plus}\n@@ -1 +1 @@\n-a\n+b\n")


def test_a_quoted_path_with_a_tab_is_unquoted() -> None:
    text = 'diff --git "a/x\\ty" "b/x\\ty"\n--- "a/x\\ty"\n+++ "b/x\\ty"\n@@ -1 +1 @@\n-a\n+b\n'
    (fp,) = parse_patch(text)
    assert fp.path == "x\ty"


def test_a_crlf_mangled_patch_is_refused() -> None:
    message = refusal(SIMPLE.replace("\n", "\r\n"))
    assert "carriage return (CRLF-mangled patch?)" in message


def test_a_hunk_built_by_hand_with_wrong_counts_is_refused() -> None:
    with pytest.raises(PatchError, match="holds 1 old and 2 new lines"):
        Hunk(1, 2, 1, 2, ((" ", b"a"), ("+", b"b")))
    with pytest.raises(PatchError, match="origins must be"):
        Hunk(1, 1, 1, 1, (("?", b"a"),))
    with pytest.raises(PatchError, match="needs a path"):
        FilePatch(None, None, ())


def test_patch_errors_are_gate_rejections_naming_the_rule() -> None:
    with pytest.raises(GateRejected) as caught:
        parse_patch("")
    assert caught.value.rule == "patch-does-not-apply"
    assert str(caught.value).startswith("patch-does-not-apply: ")


# --- patches as git apply reads them: mail, signature, diff -ruN, bytes ---------------------


def _git_apply(tmp: Path, files: Mapping[str, bytes], patch: bytes) -> dict[str, bytes]:
    """What the real ``git apply`` makes of ``patch`` on ``files`` (the reference)."""
    tmp.mkdir()
    ref = Repo(tmp)
    ref.commit({**files, ".keep": b""})
    (tmp / "p.diff").write_bytes(patch)
    ref.git("apply", str(tmp / "p.diff"))
    return _files(ref.root)


def _files(root: Path) -> dict[str, bytes]:
    out = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_file() and not rel.startswith(".git/") and rel != ".keep":
            out[rel] = path.read_bytes()
    return out


def _gnu_diff(tmp: Path, old: Mapping[str, bytes], new: Mapping[str, bytes]) -> bytes:
    """Real ``diff -ruN`` output between two directories named unlike a/ and b/."""
    for side, files in (("orig", old), ("fixed", new)):
        (tmp / side).mkdir()
        for rel, data in files.items():
            (tmp / side / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp / side / rel).write_bytes(data)
    done = subprocess.run(
        ["diff", "-ruN", "orig", "fixed"], cwd=tmp, capture_output=True, check=False, timeout=30
    )
    assert done.returncode == 1, done.stderr
    return done.stdout


def _format_patch(repo: Repo, commits: list[Mapping[str, bytes | None]]) -> bytes:
    """Real ``git format-patch --stdout`` output of one commit per mapping."""
    for number, change in enumerate(commits, 1):
        for path, data in change.items():
            repo.write(path, data)
        repo.git("add", "-A")
        repo.git("commit", "-q", "-m", f"change {number}\n\n- a dash line\n+ a plus line\n")
    return repo.git("format-patch", "--stdout", f"HEAD~{len(commits)}")


def test_git_format_patch_mail_is_applied_as_git_apply_applies_it(repo: Repo) -> None:
    base = {"a.txt": b"one\ntwo\n", "gone.txt": b"bye\n", "src/m.py": LONG}
    repo.commit(base)
    mail = _format_patch(
        repo,
        [
            {"a.txt": b"one\n2\n", "new.txt": b"hi\n"},
            {"gone.txt": None, "src/m.py": LONG.replace(b"return 4\n", b"return 44\n")},
        ],
    )
    assert mail.startswith(b"From ")
    assert b"\n-- \n" in mail
    assert b"Subject: [PATCH 1/2]" in mail
    patches = parse_patch(mail)
    assert apply_all(base, patches) == _git_apply(repo.root.parent / "ref", base, mail)
    assert apply_all(base, patches)["a.txt"] == b"one\n2\n"


def test_gnu_diff_ruN_output_creates_modifies_and_deletes_as_git_apply_does(
    tmp_path: Path,
) -> None:
    old = {"m.txt": b"1\n2\n3\n", "sub/gone.txt": b"x\ny\n", "keep": b"k\n"}
    new = {"m.txt": b"1\nTWO\n3\n", "sub/new file.txt": b"fresh\n", "keep": b"k\n"}
    text = _gnu_diff(tmp_path, old, new)
    assert b"diff -ruN orig/m.txt fixed/m.txt" in text
    assert b"1970-01-01" in text
    patches = parse_patch(text)
    gone = next(fp for fp in patches if fp.path == "sub/gone.txt")
    created = next(fp for fp in patches if fp.path == "sub/new file.txt")
    assert (gone.old_path, gone.new_path) == ("sub/gone.txt", None)
    assert (created.old_path, created.new_path) == (None, "sub/new file.txt")
    assert apply_all(old, patches) == new
    assert apply_all(old, patches) == _git_apply(tmp_path / "ref", old, text)


@pytest.mark.parametrize("tz", ["UTC", "America/New_York", "Asia/Kolkata"])
def test_an_epoch_dated_side_in_any_time_zone_is_an_absent_file(tmp_path: Path, tz: str) -> None:
    for side in ("a", "b"):
        (tmp_path / side).mkdir()
    (tmp_path / "a" / "gone.txt").write_bytes(b"x\n")
    (tmp_path / "b" / "new.txt").write_bytes(b"y\n")
    env = {**os.environ, "TZ": tz}
    done = subprocess.run(
        ["diff", "-ruN", "a", "b"],
        cwd=tmp_path,
        capture_output=True,
        env=env,
        timeout=30,
        check=False,
    )
    assert done.returncode == 1
    gone, new = parse_patch(done.stdout)
    assert (gone.path, gone.new_path, new.path, new.old_path) == ("gone.txt", None, "new.txt", None)
    assert apply_file_patch(b"x\n", gone) is None
    assert apply_file_patch(None, new) == b"y\n"


def test_an_epoch_date_on_a_file_that_has_lines_left_is_refused_not_emptied() -> None:
    text = "--- a/f\t2024-01-01 10:00:00 +0000\n+++ b/f\t1970-01-01 00:00:00 +0000\n"
    text += "@@ -1,2 +1 @@\n a\n-b\n"
    (fp,) = parse_patch(text)
    with pytest.raises(PatchError, match="deletes the file but leaves 1 line"):
        apply_file_patch(b"a\nb\n", fp)


def test_a_diff_r_without_N_is_refused_because_it_leaves_files_out(tmp_path: Path) -> None:
    for side in ("a", "b"):
        (tmp_path / side).mkdir()
    (tmp_path / "a" / "f").write_bytes(b"1\n")
    (tmp_path / "b" / "f").write_bytes(b"2\n")
    (tmp_path / "b" / "only").write_bytes(b"new\n")
    done = subprocess.run(
        ["diff", "-ru", "a", "b"], cwd=tmp_path, capture_output=True, check=False, timeout=30
    )
    message = refusal(done.stdout.decode())
    assert "made without -N" in message
    assert "Only in b: only" in message


def test_prose_around_a_diff_is_still_refused_where_no_mail_header_opens_it() -> None:
    assert "unexpected line outside a file patch" in refusal(SIMPLE + "\nthanks!\n")
    assert "unexpected line outside a file patch" in refusal("Here you go:\n" + SIMPLE)


def test_a_signature_does_not_hide_a_hunk_longer_than_its_header() -> None:
    text = SIMPLE.replace("@@ -1,3 +1,3 @@", "@@ -1,2 +1,2 @@") + "-- \n2.39.2\n"
    assert "more lines than its header says" in refusal(text)


def test_a_patch_that_is_not_utf8_applies_byte_exactly(repo: Repo) -> None:
    old = b"caf\xe9\r\nna\xefve\n"
    new = b"caf\xe9 au lait\r\nna\xefve\n\xff\n"
    repo.commit({"latin1.txt": old})
    repo.write("latin1.txt", new)
    raw = repo.git("diff", "--no-color")
    with pytest.raises(UnicodeDecodeError):
        raw.decode("utf-8")
    (fp,) = parse_patch(raw)
    assert apply_file_patch(old, fp) == new


def test_an_unquoted_path_that_is_not_utf8_is_refused() -> None:
    assert "is not UTF-8" in refusal(
        b"--- a/\xff\n+++ b/\xff\n@@ -1 +1 @@\n-a\n+b\n".decode("utf-8", "surrogateescape")
    )
