"""The analysis of the pre-registered DPPO vs GRPO study on SmolLM2 (docs/study-smollm2.md).

    python3 benches/study_smollm2.py runs/study [--budget 48] [--svg study.svg]

Reads each unit's runs `gS/metrics.jsonl` (GRPO, B steps) and `dS/metrics.jsonl` (DPPO, 2B
steps) under the study directory and prints, as the protocol fixes them: per seed the target
(GRPO's mean of its evaluations at B-8, B-4 and B), each arm's RL time to it (the RL time of
the first evaluation whose running mean of three reaches it; DPPO's curve cut at GRPO's RL
time for its B steps), their ratio GRPO / DPPO, the accuracies at equal time and at equal
steps; then the geometric mean of the ratios with a 95% bootstrap interval (10,000
resamples of the seeds, a seed DPPO did not reach entering at 1). RL time is the sum of
`timing_s/step` over the steps (evaluation, warm-up and checkpoints excluded). With --svg it
draws every curve against RL time.
"""

import argparse
import json
import math
import random
from pathlib import Path


def curve(path):
    """[(step, rl_time_s, accuracy)] of a run's evaluations on the grid, in step order."""
    rl, points = 0.0, []
    for line in open(path):
        d = json.loads(line)
        if "step" not in d:
            continue
        rl += d.get("timing_s/step", 0.0)
        if "eval/acc" in d and d["step"] > 0:
            points.append((d["step"], rl, d["eval/acc"]))
    return points


def time_to(points, target):
    """RL time of the first evaluation whose running mean of three reaches `target`."""
    for i in range(2, len(points)):
        if sum(p[2] for p in points[i - 2 : i + 1]) / 3 >= target:
            return points[i][1]
    return None


def mean_last3(points):
    return sum(p[2] for p in points[-3:]) / 3 if len(points) >= 3 else float("nan")


def geomean(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def svg(units, out):
    """Accuracy against RL time, GRPO solid and DPPO dashed, one colour per seed."""
    width, height, pad = 720, 420, 50
    t_max = max(p[1] for u in units for p in u["grpo"] + u["dppo"])
    x = lambda t: pad + (width - 2 * pad) * t / t_max
    y = lambda a: height - pad - (height - 2 * pad) * a
    colours = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#17becf"]
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'font-family="sans-serif" font-size="12">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<line x1="{pad}" y1="{y(0)}" x2="{width - pad}" y2="{y(0)}" stroke="black"/>',
        f'<line x1="{pad}" y1="{y(0)}" x2="{pad}" y2="{y(1)}" stroke="black"/>',
        f'<text x="{width / 2}" y="{height - 12}" text-anchor="middle">RL time (s)</text>',
        f'<text x="14" y="{height / 2}" transform="rotate(-90 14 {height / 2})" '
        f'text-anchor="middle">held-out greedy accuracy</text>',
    ]
    for a in (0.0, 0.2, 0.4, 0.6, 0.8, 1.0):
        parts.append(f'<text x="{pad - 6}" y="{y(a) + 4}" text-anchor="end">{a:.1f}</text>')
    for i, u in enumerate(units):
        c = colours[i % len(colours)]
        for arm, dash in (("grpo", ""), ("dppo", ' stroke-dasharray="6 4"')):
            pts = " ".join(f"{x(t):.1f},{y(a):.1f}" for _, t, a in u[arm])
            parts.append(f'<polyline points="{pts}" fill="none" stroke="{c}"{dash}/>')
        parts.append(
            f'<text x="{width - pad - 150}" y="{pad + 16 * i}" fill="{c}">seed {u["seed"]}</text>'
        )
    parts.append(
        f'<text x="{pad + 10}" y="{pad - 16}">GRPO solid, DPPO dashed (cut at GRPO\'s RL time)</text>'
    )
    parts.append("</svg>")
    Path(out).write_text("\n".join(parts) + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("study_dir")
    ap.add_argument("--budget", type=int, default=48)
    ap.add_argument("--svg")
    args = ap.parse_args()
    root, b = Path(args.study_dir), args.budget
    units = []
    for g in sorted(root.glob("g*/metrics.jsonl")):
        seed = g.parent.name[1:]
        d = root / f"d{seed}" / "metrics.jsonl"
        if not seed.isdigit() or not d.exists():
            continue
        grpo = [p for p in curve(g) if p[0] <= b]
        if [p[0] for p in grpo][-1:] != [b]:
            print(f"seed {seed}: GRPO has no evaluation at step {b}; skipped")
            continue
        acc = {s: a for s, _, a in grpo}
        target = sum(acc[b - k] for k in (8, 4, 0)) / 3
        t_grpo_total = grpo[-1][1]  # RL time through step B, where its last evaluation is
        dppo_all = curve(d)
        dppo = [p for p in dppo_all if p[1] <= t_grpo_total]
        t_g, t_d = time_to(grpo, target), time_to(dppo, target)
        ratio = t_g / t_d if t_d else None
        d_acc = {s: a for s, _, a in dppo_all}
        units.append(
            {
                "seed": seed,
                "grpo": grpo,
                "dppo": dppo,
                "target": target,
                "t_grpo_total": t_grpo_total,
                "t_g": t_g,
                "t_d": t_d,
                "ratio": ratio,
                "equal_time": (mean_last3(grpo), mean_last3(dppo)),
                "equal_steps": (
                    target,
                    sum(d_acc[b - k] for k in (8, 4, 0)) / 3 if b in d_acc else float("nan"),
                ),
                "dppo_steps_in_time": max((p[0] for p in dppo), default=0),
            }
        )
    if not units:
        raise SystemExit(f"no complete unit under {root}")
    print(f"B = {b}; {len(units)} unit(s)")
    print(
        "| seed | target (GRPO mean at B-8..B) | GRPO RL time for B steps | GRPO time to target "
        "| DPPO time to target | ratio GRPO / DPPO | DPPO steps within GRPO's time "
        "| acc. at equal time (GRPO, DPPO) | acc. at equal steps (GRPO, DPPO) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for u in units:
        t_d = f"{u['t_d']:.0f} s" if u["t_d"] else "not reached"
        ratio = f"{u['ratio']:.2f}x" if u["ratio"] else "not reached (1)"
        et, es = u["equal_time"], u["equal_steps"]
        print(
            f"| {u['seed']} | {100 * u['target']:.1f}% | {u['t_grpo_total']:.0f} s | {u['t_g']:.0f} s "
            f"| {t_d} | {ratio} | {u['dppo_steps_in_time']} | {100 * et[0]:.1f}%, {100 * et[1]:.1f}% "
            f"| {100 * es[0]:.1f}%, {100 * es[1]:.1f}% |"
        )
    ratios = [u["ratio"] or 1.0 for u in units]
    rng = random.Random(0)
    boots = sorted(
        geomean([rng.choice(ratios) for _ in ratios]) for _ in range(10_000)
    )
    lo, hi = boots[249], boots[9_749]
    print(
        f"geometric mean of the ratios: {geomean(ratios):.2f}x "
        f"(95% bootstrap interval {lo:.2f}-{hi:.2f}, {len(ratios)} seeds)"
    )
    if args.svg:
        svg(units, args.svg)
        print(f"wrote {args.svg}")


if __name__ == "__main__":
    main()
