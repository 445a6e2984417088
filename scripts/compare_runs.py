#!/usr/bin/env python3
"""Prints the headline comparison table of `dppo run` directories (one per algorithm, same
seed and budget): RL seconds per step, time to reach the first run's final held-out
accuracy, final accuracy and the mean fraction of completions trained.

Two readings of "final accuracy": the last evaluation (what summary.json's eval_after is),
and the mean of the last WINDOW periodic evaluations. The policy itself moves by a few
points from one evaluation to the next, so the second is the steadier target; time to it is
RL time until the trailing mean of WINDOW evaluations first reaches it.

Usage: scripts/compare_runs.py runs/cmp-grpo runs/cmp-dppo runs/cmp-cppo runs/cmp-greso
The first directory is the baseline whose final accuracy the others race to.
"""

import json
import sys
from pathlib import Path

WINDOW = 10


def load(run):
    run = Path(run)
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run / "summary.json").read_text())
    return steps, summary


def evals(steps):
    """(RL seconds elapsed, step, accuracy) of every periodic evaluation."""
    elapsed, out = 0.0, []
    for s in steps:
        elapsed += s["timing_s/step"]
        if "eval/acc" in s:
            out.append((elapsed, s["step"], s["eval/acc"]))
    return out


def time_to(points, target, window):
    """First (seconds, step) at which the mean of the last `window` evaluations >= target."""
    for i in range(window - 1, len(points)):
        accs = [a for _, _, a in points[i - window + 1 : i + 1]]
        if sum(accs) / window >= target - 1e-12:
            return points[i][0], points[i][1]
    return None, None


def tail_mean(points, window):
    accs = [a for _, _, a in points[-window:]]
    return sum(accs) / len(accs)


def main():
    runs = [(Path(r).name, *load(r)) for r in sys.argv[1:]]
    _, base_steps, base_summary = runs[0]
    base_points = evals(base_steps)
    target = base_summary["eval_after"]
    smooth_target = tail_mean(base_points, WINDOW)
    base_time, _ = time_to(base_points, target, 1)
    base_smooth, _ = time_to(base_points, smooth_target, WINDOW)
    base_per_step = sum(s["timing_s/step"] for s in base_steps) / len(base_steps)
    print(
        f"Targets: {runs[0][0]}'s last evaluation, {100 * target:.1f}%, and the mean of its "
        f"last {WINDOW} evaluations, {100 * smooth_target:.1f}%.\n"
    )
    print(
        "| run | algorithm | RL s/step | speed-up per step | time to last-eval target (step) "
        "| speed-up | time to mean target (step) | speed-up | held-out before -> last "
        f"| mean of last {WINDOW} | completions trained |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")

    def reach(t, at, base):
        if t is None:
            return "not reached | -"
        speed = f"{base / t:.2f}x" if base else "-"
        return f"{t:.1f} s (step {at}) | {speed}"

    for name, steps, summary in runs:
        points = evals(steps)
        per_step = sum(s["timing_s/step"] for s in steps) / len(steps)
        trained = sum(s["prune/completions_kept"] for s in steps) / len(steps)
        print(
            f"| {name} | {summary['algorithm']} | {per_step:.3f} | {base_per_step / per_step:.2f}x "
            f"| {reach(*time_to(points, target, 1), base_time)} "
            f"| {reach(*time_to(points, smooth_target, WINDOW), base_smooth)} "
            f"| {100 * summary['eval_before']:.1f}% -> {100 * summary['eval_after']:.1f}% "
            f"| {100 * tail_mean(points, WINDOW):.1f}% | {100 * trained:.1f}% |"
        )


if __name__ == "__main__":
    main()
