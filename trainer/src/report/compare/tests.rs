//! The comparison's numbers on hand-made metrics, checked by hand.

use super::*;

/// `metrics.jsonl` text: one line per (seconds, completions kept, eval/acc) from step 1.
fn metrics(steps: &[(f64, f64, Option<f64>)]) -> String {
    let line = |(i, &(seconds, kept, acc)): (usize, &(f64, f64, Option<f64>))| {
        let mut v = serde_json::json!({"step": i + 1, "timing_s/step": seconds,
            "prune/completions_kept": kept, "reward/mean": 0.5});
        if let Some(acc) = acc {
            v["eval/acc"] = acc.into();
        }
        v.to_string() + "\n"
    };
    steps.iter().enumerate().map(line).collect()
}

fn run(dir: &str, algorithm: &str, after: f64, steps: &[(f64, f64, Option<f64>)]) -> Run {
    let summary = serde_json::json!({"algorithm": algorithm, "eval_before": 0.25,
        "eval_after": after, "steps": steps.len()});
    Run::parse(Path::new(dir), &metrics(steps), &summary.to_string()).unwrap()
}

fn points(accs: &[f64]) -> Vec<EvalPoint> {
    let point = |(i, &acc): (usize, &f64)| EvalPoint {
        seconds: (i + 1) as f64,
        step: 10 * (i as u64 + 1),
        acc,
    };
    accs.iter().enumerate().map(point).collect()
}

#[test]
fn time_to_is_the_first_trailing_mean_at_the_target() {
    let p = points(&[0.25, 0.5, 0.375, 0.75]);
    assert_eq!(time_to(&p, 0.5, 1), Some((2.0, 20)));
    assert_eq!(time_to(&p, 0.75, 1), Some((4.0, 40)));
    // A hair above a value reached still counts (a run reaches its own value).
    assert_eq!(time_to(&p, 0.5 + 1e-13, 1), Some((2.0, 20)));
    assert_eq!(time_to(&p, 0.8, 1), None);
    // Window 2 means: 0.375, 0.4375, 0.5625; the single 0.5 at step 20 is not enough.
    assert_eq!(time_to(&p, 0.5, 2), Some((4.0, 40)));
    // With fewer evaluations than the window, the window is all of them (the mean
    // `tail_mean` gives), so a run reaches its own mean target at its last evaluation.
    assert_eq!(time_to(&p, tail_mean(&p, WINDOW), WINDOW), Some((4.0, 40)));
    assert_eq!(time_to(&p, 0.47, WINDOW), None);
    let mut ten = vec![0.5; 9];
    ten.extend([1.0, 1.0]);
    // Means of 10: 0.55 (steps 10..100), 0.6 (20..110).
    let p = points(&ten);
    assert_eq!(time_to(&p, 0.55, WINDOW), Some((10.0, 100)));
    assert_eq!(time_to(&p, 0.56, WINDOW), Some((11.0, 110)));
    assert_eq!(time_to(&p, 0.61, WINDOW), None);
}

#[test]
fn tail_mean_averages_the_last_window_or_all() {
    let p = points(&[0.25, 0.5, 0.375, 0.75]);
    assert_eq!(tail_mean(&p, 2), 0.5625);
    assert_eq!(tail_mean(&p, WINDOW), 0.46875);
    assert!(tail_mean(&[], WINDOW).is_nan());
}

#[test]
fn table_reproduces_the_time_to_accuracy_numbers() {
    let mut base_accs = vec![0.25, 0.25];
    base_accs.extend([0.5; 8]);
    base_accs.extend([0.75, 0.5]);
    let base: Vec<_> = base_accs.iter().map(|&a| (0.5, 0.5, Some(a))).collect();
    let mut fast = vec![(0.25, 0.25, Some(0.5))];
    fast.extend([(0.25, 0.125, Some(0.75)); 11]);
    // Evaluated every other step: RL time runs on through the steps in between.
    let sparse = [
        (1.0, 1.0, None),
        (1.0, 1.0, Some(0.25)),
        (1.0, 1.0, None),
        (1.0, 1.0, Some(0.5)),
    ];
    let runs = [
        run("runs/grpo", "grpo", 0.5, &base),
        run("runs/dppo", "dppo", 0.75, &fast),
        run("runs/cppo/", "cppo", 0.5, &sparse),
    ];
    let header = "| run | algorithm | RL s/step | speed-up per step | time to last-eval target \
        (step) | speed-up | time to mean target (step) | speed-up | held-out before -> last | \
        mean of last 10 | completions trained |\n|---|---|---|---|---|---|---|---|---|---|---|";
    let want = format!(
        "Targets: grpo's last evaluation, 50.0%, and the mean of its last 10 evaluations, \
         52.5%.\n\n{header}\n\
         | grpo | grpo | 0.500 | 1.00x | 1.5 s (step 3) | 1.00x | 6.0 s (step 12) | 1.00x | 25.0% -> 50.0% | 52.5% | 50.0% |\n\
         | dppo | dppo | 0.250 | 2.00x | 0.2 s (step 1) | 6.00x | 2.5 s (step 10) | 2.40x | 25.0% -> 75.0% | 75.0% | 13.5% |\n\
         | cppo | cppo | 1.000 | 0.50x | 4.0 s (step 4) | 0.38x | not reached | - | 25.0% -> 50.0% | 37.5% | 100.0% |\n"
    );
    assert_eq!(table(&runs), want);
}

#[test]
fn svg_overlays_one_line_per_run_and_panel_with_a_legend() {
    let steps = [(1.0, 1.0, Some(0.5)), (1.0, 1.0, Some(0.75))];
    let runs = [
        run("runs/grpo", "grpo", 0.5, &steps),
        run("runs/dppo", "dppo", 0.5, &steps),
    ];
    let svg = svg(&runs);
    assert_eq!(svg.matches("<polyline").count(), 4 * runs.len());
    for (name, colour) in [("grpo", PALETTE[0]), ("dppo", PALETTE[1])] {
        assert!(svg.contains(&format!(">{name}</text>")), "{name}");
        assert_eq!(svg.matches(&format!("stroke=\"{colour}\"")).count(), 5);
    }
    assert_eq!(svg.matches(">RL seconds</text>").count(), 2);
}

#[test]
fn reward_is_drawn_as_means_of_blocks_of_steps() {
    let points: Vec<_> = (1..=5).map(|s| (s as f64, s as f64 * 0.25)).collect();
    assert_eq!(
        block_means(&points, 2),
        [(1.5, 0.375), (3.5, 0.875), (5.0, 1.25)]
    );
    assert_eq!(block_means(&points, 1), points);
    let steps = [(1.0, 1.0, Some(0.5)); 250];
    let svg = svg(&[run("runs/a", "dppo", 0.5, &steps)]);
    assert_eq!(
        svg.matches(">mean reward (means of 3 steps)</text>")
            .count(),
        2
    );
}

/// A run whose last step had no periodic evaluation (fewer steps than `eval.every`, or
/// `eval.every = 0`) ends with its final one, at its last step.
#[test]
fn the_final_evaluation_ends_a_run_without_one_at_its_last_step() {
    let short = run(
        "runs/s",
        "dppo",
        0.75,
        &[(1.0, 1.0, None), (2.0, 1.0, None)],
    );
    let want = [EvalPoint {
        seconds: 3.0,
        step: 2,
        acc: 0.75,
    }];
    assert_eq!(short.evals(), want);
    let steps = [(1.0, 1.0, Some(0.5)), (2.0, 1.0, None)];
    let periodic = run("runs/p", "dppo", 0.75, &steps);
    assert_eq!(periodic.evals().len(), 2);
    assert_eq!(periodic.evals()[1], want[0]);
    let ends_on_one = run("runs/e", "dppo", 0.75, &[(1.0, 1.0, Some(0.5))]);
    assert_eq!(ends_on_one.evals().len(), 1);
}

#[test]
fn bad_runs_are_errors_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let err = Run::load(dir.path()).unwrap_err().to_string();
    let path = dir.path().join("metrics.jsonl");
    assert!(err.contains(&path.display().to_string()), "{err}");
    let summary = r#"{"algorithm": "dppo", "eval_before": 0.1, "eval_after": 0.2}"#;
    let err = |metrics: &str| {
        let e = Run::parse(Path::new("runs/x"), metrics, summary).unwrap_err();
        e.to_string()
    };
    assert_eq!(
        err("{\"step\": 1, \"prune/completions_kept\": 1.0, \"eval/acc\": 0.5}\n"),
        "runs/x/metrics.jsonl: line 1: no number timing_s/step"
    );
    assert_eq!(err(""), "runs/x/metrics.jsonl: no RL step");
    let metrics = metrics(&[(1.0, 1.0, Some(0.5))]);
    let e = Run::parse(Path::new("runs/x"), &metrics, "{}").unwrap_err();
    assert_eq!(e.to_string(), "runs/x/summary.json: no string algorithm");
}
