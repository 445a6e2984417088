#!/usr/bin/env python3
"""Prints the headline comparison table of `dppo run` directories (one per algorithm, same
seed and budget): RL seconds per step, time to reach the first run's final held-out
accuracy, final accuracy and the mean fraction of completions trained.

Usage: scripts/compare_runs.py runs/cmp-grpo runs/cmp-dppo runs/cmp-cppo runs/cmp-greso
The first directory is the baseline whose final accuracy the others race to.
"""

import json
import sys
from pathlib import Path


def load(run):
    run = Path(run)
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run / "summary.json").read_text())
    return steps, summary


def time_to(steps, target):
    """RL seconds until the periodic held-out accuracy first reaches `target`."""
    elapsed = 0.0
    for s in steps:
        elapsed += s["timing_s/step"]
        if s.get("eval/acc", -1.0) >= target:
            return elapsed, s["step"]
    return None, None


def main():
    runs = [(Path(r).name, *load(r)) for r in sys.argv[1:]]
    base_name, base_steps, base_summary = runs[0]
    target = base_summary["eval_after"]
    base_time, _ = time_to(base_steps, target)
    print(f"Target: {base_name}'s final held-out accuracy, {100 * target:.1f}%.\n")
    print(
        "| run | algorithm | RL s/step | speed-up per step | time to target (step) "
        "| speed-up to target | held-out before -> after | completions trained |"
    )
    print("|---|---|---|---|---|---|---|---|")
    base_per_step = sum(s["timing_s/step"] for s in base_steps) / len(base_steps)
    for name, steps, summary in runs:
        per_step = sum(s["timing_s/step"] for s in steps) / len(steps)
        trained = sum(s["prune/completions_kept"] for s in steps) / len(steps)
        t, at = time_to(steps, target)
        reach = f"{t:.1f} s (step {at})" if t is not None else "not reached"
        speed = f"{base_time / t:.2f}x" if t is not None and base_time else "-"
        print(
            f"| {name} | {summary['algorithm']} | {per_step:.3f} | {base_per_step / per_step:.2f}x "
            f"| {reach} | {speed} "
            f"| {100 * summary['eval_before']:.1f}% -> {100 * summary['eval_after']:.1f}% "
            f"| {100 * trained:.1f}% |"
        )


if __name__ == "__main__":
    main()
