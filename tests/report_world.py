"""A run whose every text an attacker chose, for the HTML report tests: guarded-config with
markup planted in a file name, a file's contents, an exec command and its output, after
a step the gate refuses; a long file so a diff is collapsed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from conftest import SANDBOXES

LONG_LINES = 120
# Each would change the page if it ran or were parsed as markup.
TITLE_SCRIPT = "<script>document.title='pwned'</script>"
PLANTED_NAME = "appcfg/<img src=x onerror=\"document.title='pwned-img'\">.txt"
PLANTED_TAG = '<b id="planted">bold</b>'
EXEC_COMMAND = (
    f'echo "{TITLE_SCRIPT}"; echo "<iframe id=evil></iframe>" >&2; seq 1 {LONG_LINES} >&2; '
    "printf '%s\\n' '<style>body{display:none}</style>' > 'appcfg/<script>notes.txt'"
)
EXTRA_POLICY = """
[policy.exec]
allow = ["*"]
max_timeout_seconds = 30
"""

PLAN = """schema = 1

[[step]]
kind = "apply_patch"
patch_file = "patches/naive-rename-default-key.diff"
description = "Naive fix the gate refuses"

[[step]]
kind = "write_file"
path = {name}
content_file = "planted.txt"
description = {tag}

[[step]]
kind = "exec"
command = {command}
description = "Run a command that prints markup"

[[step]]
kind = "apply_patch"
patch_file = "patches/fix-loader-legacy-keys.diff"
description = "Correct fix"
"""


def hostile_task(dest: Path) -> Path:
    """A copy of guarded-config whose plan plants markup everywhere an agent can."""
    shutil.copytree(SANDBOXES / "guarded-config", dest)
    task = dest / "task.toml"
    text = task.read_text().replace(
        'allowed_actions = ["write_file", "delete_file", "apply_patch"]',
        'allowed_actions = ["write_file", "delete_file", "apply_patch", "exec"]',
    )
    task.write_text(text.replace("[verifier]", EXTRA_POLICY.lstrip() + "\n[verifier]", 1))
    body = "".join(f"line {i} {PLANTED_TAG}\n" for i in range(LONG_LINES))
    (dest / "planted.txt").write_text(f"{TITLE_SCRIPT}\n{PLANTED_TAG}\n{body}")
    # a JSON string is a TOML basic string (the same escapes)
    plan = PLAN.format(name=json.dumps(PLANTED_NAME), tag=json.dumps("Plant " + PLANTED_TAG),
                       command=json.dumps(EXEC_COMMAND))  # fmt: skip
    (dest / "plan.toml").write_text(plan)
    return dest
