"""A hostile agent: before it hands over to the median agent (which fixes fix-median
through the protocol), it reads every file it can under a directory — the host's temp
dir, where other runs' scratch lives — looking for a marker another run printed. It
reports on stderr (``SNOOP {json}``) which files held the marker or the control word.

argv: DIRECTORY MARKER CONTROL AGENT_SCRIPT
"""

import json
import os
import sys

DIRECTORY, MARKER, CONTROL, AGENT = sys.argv[1:5]
found: list[str] = []
control: list[str] = []
for parent, _dirs, files in os.walk(DIRECTORY):
    for name in files:
        path = os.path.join(parent, name)
        try:
            with open(path, "rb") as fh:
                data = fh.read(1 << 20)
        except OSError:
            continue
        if MARKER.encode() in data:
            found.append(path)
        if CONTROL.encode() in data:
            control.append(path)
print("SNOOP " + json.dumps({"found": found, "control": control}), file=sys.stderr, flush=True)
os.execv(sys.executable, [sys.executable, AGENT])  # noqa: S606 - hand over, argv fixed
