//! SVG charts written by hand (no plotting crate to build): panels of line series with round
//! tick values, axis titles and legends. `metrics.svg` of a run and `dppo compare`'s overlay
//! of several runs are both a [`Figure`].

use std::fmt::Write;

use serde_json::Value;

/// Width of one panel in pixels.
const W: f64 = 380.0;
/// Height of one panel in pixels.
const H: f64 = 250.0;
/// Margins of the plot area inside a panel: room for the title, tick labels and axis titles.
const LEFT: f64 = 60.0;
const RIGHT: f64 = 16.0;
const TOP: f64 = 44.0;
const BOTTOM: f64 = 44.0;
/// Height of one line of legend entries.
const LEGEND_LINE: f64 = 18.0;
/// About how many ticks an axis gets.
const TICKS: usize = 5;

/// Distinct colours (matplotlib's tab10), in the order series and runs take them.
pub const PALETTE: [&str; 10] = [
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
    "#bcbd22", "#17becf",
];

/// One line: its legend name, colour and (x, y) points in drawing order.
pub struct Series {
    /// Name in the legend.
    pub name: String,
    /// SVG colour of the line and its legend entry.
    pub colour: &'static str,
    /// Points in data units.
    pub points: Vec<(f64, f64)>,
}

/// One chart: a title, axis titles and its series, with a legend when `legend` is set.
pub struct Panel {
    /// Title above the plot area.
    pub title: String,
    /// Title under the x axis (quantity and unit).
    pub x_title: String,
    /// Title beside the y axis.
    pub y_title: String,
    /// The lines drawn.
    pub series: Vec<Series>,
    /// Whether the panel shows its own legend (for panels with several series).
    pub legend: bool,
}

/// Panels in a grid of `columns`, under a legend of `legend` (name, colour) entries shared
/// by every panel (empty: none).
pub struct Figure {
    /// The charts, row by row.
    pub panels: Vec<Panel>,
    /// Panels per row.
    pub columns: usize,
    /// Entries of the figure-wide legend above the panels.
    pub legend: Vec<(String, &'static str)>,
}

/// Tick values of an axis and the decimals their labels need.
#[derive(Debug, PartialEq)]
pub struct Ticks {
    /// Round values from the axis' low end to its high end, evenly spaced.
    pub values: Vec<f64>,
    /// Digits after the decimal point that show the spacing exactly.
    pub decimals: usize,
}

impl Ticks {
    /// The label of tick `value`.
    pub fn label(&self, value: f64) -> String {
        // `+ 0.0` turns -0 into 0.
        format!("{:.*}", self.decimals, value + 0.0)
    }

    fn lo(&self) -> f64 {
        self.values[0]
    }

    fn hi(&self) -> f64 {
        self.values[self.values.len() - 1]
    }
}

/// About `count` round ticks (1, 2 or 5 times a power of ten apart) covering `lo..=hi`: the
/// first at or below `lo`, the last at or above `hi`, so the axis ends on labelled values.
pub fn nice_ticks(lo: f64, hi: f64, count: usize) -> Ticks {
    let (lo, hi) = if hi > lo {
        (lo, hi)
    } else {
        match lo {
            0.0 => (0.0, 1.0),
            _ => (lo - lo.abs() * 0.1, lo + lo.abs() * 0.1),
        }
    };
    let raw = (hi - lo) / count.saturating_sub(1).max(1) as f64;
    let exponent = raw.log10().floor() as i32;
    let (multiple, exponent) = match raw / 10f64.powi(exponent) {
        f if f < 1.5 => (1.0, exponent),
        f if f < 3.0 => (2.0, exponent),
        f if f < 7.0 => (5.0, exponent),
        _ => (1.0, exponent + 1),
    };
    let step = multiple * 10f64.powi(exponent);
    // The tolerance keeps a bound that is a tick up to rounding from adding another.
    let first = (lo / step + 1e-9).floor() as i64;
    let last = (hi / step - 1e-9).ceil() as i64;
    Ticks {
        values: (first..=last).map(|k| k as f64 * step).collect(),
        decimals: (-exponent).max(0) as usize,
    }
}

impl Figure {
    /// The SVG document.
    pub fn to_svg(&self) -> String {
        let columns = self.columns.max(1);
        let rows = self.panels.len().div_ceil(columns);
        let width = W * columns as f64;
        let mut body = String::new();
        let legend_h = legend(&mut body, 0.0, 0.0, width, &self.legend);
        for (i, panel) in self.panels.iter().enumerate() {
            let x0 = W * (i % columns) as f64;
            let y0 = legend_h + H * (i / columns) as f64;
            panel.draw(&mut body, x0, y0);
        }
        format!(
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{}" font-family="sans-serif" font-size="11"><rect width="100%" height="100%" fill="white"/>{body}</svg>
"#,
            legend_h + H * rows as f64
        )
    }
}

impl Panel {
    fn draw(&self, svg: &mut String, x0: f64, y0: f64) {
        let points = || self.series.iter().flat_map(|s| s.points.iter());
        let (x_ticks, y_ticks) = (axis(points().map(|p| p.0)), axis(points().map(|p| p.1)));
        let (left, right) = (x0 + LEFT, x0 + W - RIGHT);
        let (top, bottom) = (y0 + TOP, y0 + H - BOTTOM);
        let px =
            |x: f64| left + (right - left) * (x - x_ticks.lo()) / (x_ticks.hi() - x_ticks.lo());
        let py =
            |y: f64| bottom - (bottom - top) * (y - y_ticks.lo()) / (y_ticks.hi() - y_ticks.lo());
        let _ = write!(
            svg,
            r#"<text x="{}" y="{}" text-anchor="middle" font-size="13">{}</text>"#,
            x0 + W / 2.0,
            y0 + 18.0,
            escape(&self.title)
        );
        for &x in &x_ticks.values {
            let _ = write!(
                svg,
                r##"<line x1="{0:.1}" y1="{top}" x2="{0:.1}" y2="{bottom}" stroke="#e4e4e4"/><text x="{0:.1}" y="{1}" text-anchor="middle">{2}</text>"##,
                px(x),
                bottom + 14.0,
                x_ticks.label(x)
            );
        }
        for &y in &y_ticks.values {
            let _ = write!(
                svg,
                r##"<line x1="{left}" y1="{0:.1}" x2="{right}" y2="{0:.1}" stroke="#e4e4e4"/><text x="{1}" y="{0:.1}" dy="0.32em" text-anchor="end">{2}</text>"##,
                py(y),
                left - 5.0,
                y_ticks.label(y)
            );
        }
        let _ = write!(
            svg,
            r##"<rect x="{left}" y="{top}" width="{}" height="{}" fill="none" stroke="#888"/><text x="{}" y="{}" text-anchor="middle">{}</text><text transform="translate({},{}) rotate(-90)" text-anchor="middle">{}</text>"##,
            right - left,
            bottom - top,
            (left + right) / 2.0,
            y0 + H - 8.0,
            escape(&self.x_title),
            x0 + 14.0,
            (top + bottom) / 2.0,
            escape(&self.y_title)
        );
        for s in &self.series {
            let pts: Vec<String> = s
                .points
                .iter()
                .map(|&(x, y)| format!("{:.1},{:.1}", px(x), py(y)))
                .collect();
            let _ = write!(
                svg,
                r#"<polyline fill="none" stroke="{}" stroke-width="1.5" stroke-linejoin="round" points="{}"/>"#,
                s.colour,
                pts.join(" ")
            );
        }
        if self.legend {
            let entries: Vec<_> = self
                .series
                .iter()
                .map(|s| (s.name.clone(), s.colour))
                .collect();
            legend(svg, left, y0 + 20.0, right - left, &entries);
        }
    }
}

/// The ticks of an axis over `values` (0 to 1 when there are none).
fn axis(values: impl Iterator<Item = f64>) -> Ticks {
    let (lo, hi) = values
        .filter(|v| v.is_finite())
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
            (lo.min(v), hi.max(v))
        });
    if lo > hi {
        nice_ticks(0.0, 1.0, TICKS)
    } else {
        nice_ticks(lo, hi, TICKS)
    }
}

/// Draws legend entries (a short line in the colour, then the name) from (`x`, `y`) in rows
/// that fit `width`, on a white backing; returns the height used.
fn legend(svg: &mut String, x: f64, y: f64, width: f64, entries: &[(String, &str)]) -> f64 {
    if entries.is_empty() {
        return 0.0;
    }
    let mut placed = Vec::with_capacity(entries.len());
    let (mut cx, mut row, mut widest) = (8.0, 0.0, 0f64);
    for (name, colour) in entries {
        // About 6.5 px per character at font-size 11, plus the swatch and a gap.
        let w = 30.0 + 6.5 * name.chars().count() as f64;
        if cx + w > width && cx > 8.0 {
            (cx, row) = (8.0, row + 1.0);
        }
        placed.push((cx, row, name, colour));
        cx += w;
        widest = widest.max(cx);
    }
    let height = LEGEND_LINE * (row + 1.0) + 6.0;
    let _ = write!(
        svg,
        r#"<rect x="{x}" y="{y}" width="{}" height="{height}" fill="white" fill-opacity="0.85"/>"#,
        widest.min(width)
    );
    for (cx, row, name, colour) in placed {
        let ly = y + 3.0 + LEGEND_LINE * (row + 0.5);
        let _ = write!(
            svg,
            r#"<line x1="{}" y1="{ly}" x2="{}" y2="{ly}" stroke="{colour}" stroke-width="3"/><text x="{}" y="{ly}" dy="0.32em">{}</text>"#,
            x + cx,
            x + cx + 18.0,
            x + cx + 22.0,
            escape(name)
        );
    }
    height
}

/// `text` with the characters XML gives meaning to escaped.
fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// The SVG of the metrics lines of a run (one JSON object per step): reward, held-out
/// accuracy, and where each step's time went, against the step.
pub fn render(lines: &[Value]) -> String {
    let series = |key: &str, name: &str, colour: &'static str| Series {
        name: name.into(),
        colour,
        points: lines
            .iter()
            .filter_map(|l| Some((l.get("step")?.as_f64()?, l.get(key)?.as_f64()?)))
            .collect(),
    };
    let panel = |title: &str, y_title: &str, series: Vec<Series>| Panel {
        title: title.into(),
        x_title: "step".into(),
        y_title: y_title.into(),
        legend: series.len() > 1,
        series,
    };
    Figure {
        panels: vec![
            panel(
                "reward",
                "mean reward",
                vec![series("reward/mean", "reward/mean", PALETTE[0])],
            ),
            panel(
                "held-out accuracy",
                "accuracy",
                vec![series("eval/acc", "eval/acc", PALETTE[2])],
            ),
            panel(
                "time per step",
                "seconds",
                vec![
                    series("timing_s/step", "step", "#333333"),
                    series("timing_s/gen", "gen", PALETTE[1]),
                    series("timing_s/train", "train", PALETTE[3]),
                ],
            ),
        ],
        columns: 3,
        legend: Vec::new(),
    }
    .to_svg()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn labels(lo: f64, hi: f64) -> Vec<String> {
        let ticks = nice_ticks(lo, hi, TICKS);
        ticks.values.iter().map(|&v| ticks.label(v)).collect()
    }

    #[test]
    fn ticks_are_round_evenly_spaced_and_cover_the_data() {
        assert_eq!(labels(0.0, 1.0), ["0.0", "0.2", "0.4", "0.6", "0.8", "1.0"]);
        assert_eq!(labels(1.0, 2000.0), ["0", "500", "1000", "1500", "2000"]);
        assert_eq!(
            labels(0.53, 0.97),
            ["0.5", "0.6", "0.7", "0.8", "0.9", "1.0"]
        );
        assert_eq!(labels(0.021, 0.1), ["0.02", "0.04", "0.06", "0.08", "0.10"]);
        assert_eq!(
            labels(3.0, 117.4),
            ["0", "20", "40", "60", "80", "100", "120"]
        );
        assert_eq!(
            labels(-0.3, 0.25),
            ["-0.3", "-0.2", "-0.1", "0.0", "0.1", "0.2", "0.3"]
        );
        // A single value gets an axis around it.
        assert_eq!(
            labels(0.5, 0.5),
            ["0.44", "0.46", "0.48", "0.50", "0.52", "0.54", "0.56"]
        );
        assert_eq!(labels(0.0, 0.0), ["0.0", "0.2", "0.4", "0.6", "0.8", "1.0"]);
    }

    #[test]
    fn metrics_svg_has_every_series_ticks_and_axis_titles() {
        let lines: Vec<Value> = (1..=4)
            .map(|s| {
                json!({"step": s, "reward/mean": 0.1 * s as f64, "timing_s/step": 1.0,
                            "timing_s/gen": 0.6, "timing_s/train": 0.3, "eval/acc": 0.5})
            })
            .collect();
        let svg = render(&lines);
        assert!(svg.starts_with("<svg") && svg.ends_with("</svg>\n"));
        assert_eq!(svg.matches("<polyline").count(), 5);
        // Step ticks 1..4 under each panel, reward ticks 0.1..0.4, axis titles.
        assert_eq!(svg.matches(">3</text>").count(), 3);
        assert!(svg.contains(">0.4</text>") && svg.contains(">0.1</text>"));
        assert!(svg.contains(">mean reward</text>") && svg.contains(">seconds</text>"));
        // The time panel's legend names its series.
        assert!(svg.contains(">gen</text>") && svg.contains(">train</text>"));
        // The reward's last point sits at the right edge, top of the plot area.
        assert!(svg.contains(&format!("{:.1},{:.1}\"", W - RIGHT, TOP)));
    }

    #[test]
    fn figure_legend_names_and_escapes_every_entry() {
        let figure = Figure {
            panels: Vec::new(),
            columns: 2,
            legend: vec![("a&b".into(), PALETTE[0]), ("<c>".into(), PALETTE[1])],
        };
        let svg = figure.to_svg();
        assert!(svg.contains(">a&amp;b</text>") && svg.contains(">&lt;c&gt;</text>"));
    }
}
