"""Reads a run's TensorBoard event files with TensorBoard's own reader (which checks the
record framing and every CRC) and prints {tag: {step: value}} as JSON on stdout.

Usage: python3 tests/tensorboard_reader.py <run_dir>/tensorboard
"""

import json
import sys
from pathlib import Path

from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader


def main():
    files = sorted(Path(sys.argv[1]).glob("events.out.tfevents.*"))
    if not files:
        sys.exit(f"no event file in {sys.argv[1]}")
    scalars, versions = {}, 0
    for path in files:
        for event in LegacyEventFileLoader(str(path)).Load():
            if event.file_version:
                versions += 1
            for value in event.summary.value:
                scalars.setdefault(value.tag, {})[str(event.step)] = value.simple_value
    if versions != len(files):
        sys.exit(f"{versions} version records in {len(files)} files")
    print(json.dumps(scalars))


if __name__ == "__main__":
    main()
