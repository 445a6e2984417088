//! An SVG of a run (written by hand: no plotting crate to build): reward, held-out accuracy,
//! and where each step's time went.

use std::fmt::Write;

use serde_json::Value;

const W: f64 = 360.0;
const H: f64 = 220.0;
const PAD: f64 = 36.0;

/// One series: a name, a colour and (step, value) points.
struct Series<'a> {
    name: &'a str,
    colour: &'a str,
    points: Vec<(f64, f64)>,
}

/// The SVG of the metrics lines of a run (one JSON object per step).
pub fn render(lines: &[Value]) -> String {
    let series = |key: &str, name: &'static str, colour: &'static str| Series {
        name,
        colour,
        points: lines
            .iter()
            .filter_map(|l| Some((l.get("step")?.as_f64()?, l.get(key)?.as_f64()?)))
            .collect(),
    };
    let panels = [
        (
            "reward",
            vec![series("reward/mean", "reward/mean", "#1f77b4")],
        ),
        (
            "held-out accuracy",
            vec![series("eval/acc", "eval/acc", "#2ca02c")],
        ),
        (
            "seconds per step",
            vec![
                series("timing_s/step", "step", "#333333"),
                series("timing_s/gen", "gen", "#ff7f0e"),
                series("timing_s/train", "train", "#d62728"),
            ],
        ),
    ];
    let mut svg = String::new();
    let total_w = W * panels.len() as f64;
    let _ = write!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{total_w}" height="{H}" font-family="sans-serif" font-size="11">"#
    );
    for (i, (title, lines)) in panels.iter().enumerate() {
        panel(&mut svg, i as f64 * W, title, lines);
    }
    svg.push_str("</svg>\n");
    svg
}

fn panel(svg: &mut String, x0: f64, title: &str, series: &[Series]) {
    let all = series.iter().flat_map(|s| s.points.iter());
    let (mut x_max, mut y_max) = (1f64, 0f64);
    for &(x, y) in all {
        x_max = x_max.max(x);
        y_max = y_max.max(y);
    }
    let y_max = if y_max > 0.0 { y_max * 1.05 } else { 1.0 };
    let px = |x: f64| x0 + PAD + (W - 2.0 * PAD) * x / x_max;
    let py = |y: f64| H - PAD - (H - 2.0 * PAD) * y / y_max;
    let _ = write!(
        svg,
        r##"<text x="{}" y="16" text-anchor="middle">{title}</text><rect x="{}" y="{}" width="{}" height="{}" fill="none" stroke="#999"/><text x="{}" y="{}">0</text><text x="{}" y="{}">{y_max:.3}</text><text x="{}" y="{}" text-anchor="end">step {x_max}</text>"##,
        x0 + W / 2.0,
        x0 + PAD,
        PAD,
        W - 2.0 * PAD,
        H - 2.0 * PAD,
        x0 + 4.0,
        H - PAD,
        x0 + 4.0,
        PAD + 4.0,
        x0 + W - PAD,
        H - PAD + 14.0,
    );
    for (j, s) in series.iter().enumerate() {
        let pts: Vec<String> = s
            .points
            .iter()
            .map(|&(x, y)| format!("{:.1},{:.1}", px(x), py(y)))
            .collect();
        let _ = write!(
            svg,
            r#"<polyline fill="none" stroke="{}" stroke-width="1.5" points="{}"/><text x="{}" y="{}" fill="{}">{}</text>"#,
            s.colour,
            pts.join(" "),
            x0 + PAD + 4.0,
            PAD + 14.0 + 12.0 * j as f64,
            s.colour,
            s.name
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn renders_every_series_as_a_polyline() {
        let lines: Vec<Value> = (1..=4)
            .map(|s| {
                json!({"step": s, "reward/mean": 0.1 * s as f64, "timing_s/step": 1.0,
                            "timing_s/gen": 0.6, "timing_s/train": 0.3, "eval/acc": 0.5})
            })
            .collect();
        let svg = render(&lines);
        assert!(svg.starts_with("<svg") && svg.ends_with("</svg>\n"));
        assert_eq!(svg.matches("<polyline").count(), 5);
        // The reward's last point sits at the right edge and near the top.
        assert!(svg.contains(&format!("{:.1},", W - PAD)));
    }
}
