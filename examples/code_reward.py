#!/usr/bin/env python3
"""A reward process for `reward.command = ["python3", "examples/code_reward.py"]`: a code
task scored by running the label's unit tests against the completion.

dppo starts it once and writes one request per line on its stdin (the JSON of OpenRLHF's
remote reward protocol: "query", "prompts", "labels", plus "completions", "data_sources",
"extra_info"); it answers each with one line, {"rewards": [...], "extra_logs": {...}}.
Anything it prints to stderr shows in dppo's output. Standard library only.

Each label is a list of Python assert statements (or {"tests": [...]}). A completion
scores the fraction of its tests that pass, each test run in a fresh interpreter with a
timeout, so that a completion that loops or crashes scores 0 on that test and cannot hang
the run. A fenced ```python block in the completion is used when there is one.
"""

import json
import re
import subprocess
import sys

TIMEOUT_S = 5.0
FENCE = re.compile(r"```(?:python)?\n(.*?)```", re.DOTALL)


def program(completion):
    """The code of a completion: its first fenced block, else the whole text."""
    block = FENCE.search(completion)
    return block.group(1) if block else completion


def passes(code, test):
    """Whether `test` passes after `code` runs, in a fresh interpreter with a timeout."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", f"{code}\n{test}\n"],
            capture_output=True,
            timeout=TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        return False
    return done.returncode == 0


def score(completion, label):
    """(fraction of tests passed, whether every test passed)."""
    tests = label["tests"] if isinstance(label, dict) else label
    code = program(completion)
    passed = sum(passes(code, t) for t in tests)
    fraction = passed / len(tests) if tests else 0.0
    return fraction, float(passed == len(tests))


def main():
    for line in sys.stdin:
        if not line.strip():
            continue
        body = json.loads(line)
        parts = [score(c, label) for c, label in zip(body["completions"], body["labels"])]
        answer = {
            "rewards": [fraction for fraction, _ in parts],
            "extra_logs": {"all_pass": [all_pass for _, all_pass in parts]},
        }
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
