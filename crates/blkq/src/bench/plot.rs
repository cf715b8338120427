//! Plots of `blkq bench`: what a sweep measured, drawn as an SVG (plotters' SVG backend, no
//! font or system library: text is laid out with plotters' built-in estimate and left to the
//! SVG viewer's fonts).
//!
//! One chart: x = the swept parameter, one evenly spaced category per value (depths and job
//! counts are usually powers of two), y = IOPS (or any numeric key of the JSON line), one
//! line per variant (wake algorithm, pool policy, scheduler...), a point at the mean of the
//! repeats and an error bar over them (min..max, or mean ± one standard deviation).
//!
//! Two ways in: `blkq bench --plot FILE.svg` plots the runs of that invocation (its sweep and
//! rows), and `blkq bench plot --x KEY --series KEY --out FILE.svg [RUNS.jsonl...]` plots
//! `--json` lines collected from any number of invocations.

use std::io::BufRead;
use std::ops::Range;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use plotters::coord::ranged1d::{KeyPointHint, NoDefaultFormatting, Ranged, ValueFormatter};
use plotters::prelude::*;
use serde_json::Value;

/// `blkq bench plot` options.
#[derive(Args, Debug, Clone)]
pub struct PlotArgs {
    /// The JSON key on the x axis, e.g. queue_depth, jobs, hw_queues, bs, policy (dotted for
    /// nested keys). Numeric values are sorted, others keep the order they first appear in.
    #[arg(long)]
    pub x: String,
    /// JSON key(s) whose values name the lines, comma-separated, e.g. wake or
    /// sched,sched_lock (values joined with "/"). Default: one line.
    #[arg(long)]
    pub series: Option<String>,
    /// The JSON key plotted, e.g. iops, bw_bytes, lat_ns.p99, tag_wait.max_ns.
    #[arg(long, default_value = "iops")]
    pub y: String,
    /// Error bars over the runs sharing a point: minmax or sd (mean ± one stddev).
    #[arg(long, value_enum, default_value_t = ErrBars::Minmax)]
    pub err: ErrBars,
    /// Only the lines whose KEY has VALUE (repeatable), e.g. --filter jobs=16.
    #[arg(long, value_name = "KEY=VALUE")]
    pub filter: Vec<String>,
    /// Chart title (default: "Y against X").
    #[arg(long)]
    pub title: Option<String>,
    /// Where to write the SVG.
    #[arg(long, value_name = "FILE.svg")]
    pub out: PathBuf,
    /// Files of `blkq bench --json` lines (default: stdin). Lines that are not JSON objects
    /// (headers, tables) are skipped.
    pub inputs: Vec<PathBuf>,
}

/// What the error bars span.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ErrBars {
    /// From the smallest to the largest run.
    Minmax,
    /// Mean ± one sample standard deviation.
    Sd,
}

/// One line of a chart: the runs measured at each x category (empty: not measured there).
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Series {
    pub(super) name: String,
    pub(super) points: Vec<Vec<f64>>,
}

/// A chart to draw.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct PlotData {
    pub(super) title: String,
    pub(super) x_desc: String,
    pub(super) y_desc: String,
    /// The x categories, left to right.
    pub(super) ticks: Vec<String>,
    pub(super) series: Vec<Series>,
}

/// Runs `blkq bench plot`.
pub fn run(a: &PlotArgs) -> Result<()> {
    let mut lines = vec![];
    if a.inputs.is_empty() {
        for l in std::io::stdin().lock().lines() {
            lines.push(l.context("reading stdin")?);
        }
    } else {
        for p in &a.inputs {
            let text =
                std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
            lines.extend(text.lines().map(str::to_string));
        }
    }
    let data = from_json_lines(&lines, a)?;
    write_svg(&data, &a.out, a.err)
}

/// The value of a dotted key (`lat_ns.p99`) in a JSON object.
fn lookup<'v>(v: &'v Value, key: &str) -> Option<&'v Value> {
    key.split('.').try_fold(v, |v, k| v.get(k))
}

/// A JSON value as a category name: strings bare, null as "default".
fn category(v: Option<&Value>) -> String {
    match v {
        None | Some(Value::Null) => "default".to_string(),
        Some(Value::String(s)) => s.clone(),
        Some(v) => v.to_string(),
    }
}

/// Groups `--json` lines into a chart: x categories from `a.x`, lines from `a.series`, the
/// values of `a.y` per (line, category).
pub(super) fn from_json_lines(lines: &[String], a: &PlotArgs) -> Result<PlotData> {
    let filters = a
        .filter
        .iter()
        .map(|f| {
            f.split_once('=')
                .with_context(|| format!("--filter {f:?}: expected KEY=VALUE"))
        })
        .collect::<Result<Vec<_>>>()?;
    let series_keys: Vec<&str> = a
        .series
        .as_deref()
        .map(|s| s.split(',').map(str::trim).collect())
        .unwrap_or_default();
    // (series, x, y) in input order.
    let mut rows: Vec<(String, String, f64)> = vec![];
    for (n, line) in lines.iter().enumerate() {
        let line = line.trim();
        if !line.starts_with('{') {
            continue;
        }
        let v: Value =
            serde_json::from_str(line).with_context(|| format!("line {}: not JSON", n + 1))?;
        if !filters
            .iter()
            .all(|(k, want)| category(lookup(&v, k)) == *want)
        {
            continue;
        }
        let Some(x) = lookup(&v, &a.x) else {
            bail!("line {}: no key {:?}", n + 1, a.x);
        };
        let Some(y) = lookup(&v, &a.y).and_then(Value::as_f64) else {
            bail!("line {}: no numeric key {:?}", n + 1, a.y);
        };
        let name = if series_keys.is_empty() {
            a.y.clone()
        } else {
            series_keys
                .iter()
                .map(|k| category(lookup(&v, k)))
                .collect::<Vec<_>>()
                .join("/")
        };
        rows.push((name, category(Some(x)), y));
    }
    if rows.is_empty() {
        bail!("no bench JSON lines to plot");
    }
    let mut ticks: Vec<String> = vec![];
    let mut names: Vec<String> = vec![];
    for (s, x, _) in &rows {
        if !ticks.contains(x) {
            ticks.push(x.clone());
        }
        if !names.contains(s) {
            names.push(s.clone());
        }
    }
    if ticks.iter().all(|t| t.parse::<f64>().is_ok()) {
        ticks.sort_by(|p, q| {
            let (p, q) = (
                p.parse::<f64>().unwrap_or(0.0),
                q.parse::<f64>().unwrap_or(0.0),
            );
            p.total_cmp(&q)
        });
    }
    let series = names
        .into_iter()
        .map(|name| {
            let mut points = vec![vec![]; ticks.len()];
            for (s, x, y) in &rows {
                if *s == name {
                    if let Some(i) = ticks.iter().position(|t| t == x) {
                        points[i].push(*y);
                    }
                }
            }
            Series { name, points }
        })
        .collect();
    Ok(PlotData {
        title: a
            .title
            .clone()
            .unwrap_or_else(|| format!("{} against {}", a.y, a.x)),
        x_desc: a.x.clone(),
        y_desc: a.y.clone(),
        ticks,
        series,
    })
}

/// A point: (mean, bar low, bar high) of the runs, or None without runs.
pub(super) fn point(v: &[f64], err: ErrBars) -> Option<(f64, f64, f64)> {
    if v.is_empty() {
        return None;
    }
    let (m, sd) = super::stats::mean_sd(v);
    Some(match err {
        ErrBars::Minmax => (
            m,
            v.iter().copied().fold(f64::INFINITY, f64::min),
            v.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        ),
        ErrBars::Sd => (m, m - sd, m + sd),
    })
}

/// The x axis: `n` evenly spaced categories, category i centred at i, labelled with its name.
struct Categories(Vec<String>);

impl Ranged for Categories {
    type FormatOption = NoDefaultFormatting;
    type ValueType = f64;

    fn map(&self, value: &f64, limit: (i32, i32)) -> i32 {
        let n = self.0.len().max(1) as f64;
        let w = f64::from(limit.1 - limit.0);
        limit.0 + ((value + 0.5) / n * w).round() as i32
    }

    fn key_points<H: KeyPointHint>(&self, hint: H) -> Vec<f64> {
        let step = self.0.len().div_ceil(hint.max_num_points().max(1)).max(1);
        (0..self.0.len()).step_by(step).map(|i| i as f64).collect()
    }

    fn range(&self) -> Range<f64> {
        -0.5..self.0.len() as f64 - 0.5
    }
}

impl ValueFormatter<f64> for Categories {
    fn format_ext(&self, value: &f64) -> String {
        let i = value.round();
        if i >= 0.0 {
            self.0.get(i as usize).cloned().unwrap_or_default()
        } else {
            String::new()
        }
    }
}

/// A y-axis number: 1.5M, 250K, 12.5, 0.0023.
fn yfmt(y: f64) -> String {
    let a = y.abs();
    if a >= 1e6 {
        format!("{:.2}M", y / 1e6)
    } else if a >= 1e4 {
        format!("{:.0}K", y / 1e3)
    } else if a >= 1e3 {
        format!("{:.1}K", y / 1e3)
    } else if a >= 10.0 || a == 0.0 {
        format!("{y:.0}")
    } else {
        format!("{y:.3}")
    }
}

/// Draws `d` as an SVG document.
pub(super) fn render_svg(d: &PlotData, err: ErrBars) -> Result<String> {
    if d.ticks.is_empty() || d.series.is_empty() {
        bail!("nothing to plot");
    }
    let pts: Vec<Vec<Option<(f64, f64, f64)>>> = d
        .series
        .iter()
        .map(|s| s.points.iter().map(|v| point(v, err)).collect())
        .collect();
    let top = pts
        .iter()
        .flatten()
        .flatten()
        .map(|p| p.2.max(p.0))
        .filter(|y| y.is_finite())
        .fold(0.0f64, f64::max);
    let top = if top > 0.0 { top * 1.1 } else { 1.0 };
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (900, 540)).into_drawing_area();
        root.fill(&WHITE).map_err(plot_err)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(&d.title, ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(48)
            .y_label_area_size(72)
            .build_cartesian_2d(Categories(d.ticks.clone()), 0.0..top)
            .map_err(plot_err)?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(d.ticks.len())
            .x_desc(&d.x_desc)
            .y_desc(&d.y_desc)
            .label_style(("sans-serif", 14))
            .axis_desc_style(("sans-serif", 15))
            .y_label_formatter(&|y| yfmt(*y))
            .draw()
            .map_err(plot_err)?;
        let k = d.series.len() as f64;
        for (i, (s, p)) in d.series.iter().zip(&pts).enumerate() {
            let color = Palette99::pick(i).to_rgba();
            // Lines side by side are shifted a little so their error bars do not overlap.
            let dx = (i as f64 - (k - 1.0) / 2.0) * 0.03;
            let xy: Vec<(f64, (f64, f64, f64))> = p
                .iter()
                .enumerate()
                .filter_map(|(x, p)| p.map(|p| (x as f64 + dx, p)))
                .collect();
            chart
                .draw_series(LineSeries::new(
                    xy.iter().map(|&(x, (m, _, _))| (x, m)),
                    color.stroke_width(2),
                ))
                .map_err(plot_err)?
                .label(&s.name)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
            chart
                .draw_series(
                    xy.iter()
                        .map(|&(x, (m, _, _))| Circle::new((x, m), 3, color.filled())),
                )
                .map_err(plot_err)?;
            chart
                .draw_series(xy.iter().filter(|&&(_, (_, lo, hi))| hi > lo).map(
                    |&(x, (m, lo, hi))| ErrorBar::new_vertical(x, lo.max(0.0), m, hi, color, 8),
                ))
                .map_err(plot_err)?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .label_font(("sans-serif", 14))
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()
            .map_err(plot_err)?;
        root.present().map_err(plot_err)?;
    }
    Ok(svg)
}

fn plot_err<E: std::fmt::Display>(e: E) -> anyhow::Error {
    anyhow::anyhow!("plot: {e}")
}

/// Draws `d` into the SVG file `path`.
pub(super) fn write_svg(d: &PlotData, path: &std::path::Path, err: ErrBars) -> Result<()> {
    let svg = render_svg(d, err)?;
    std::fs::write(path, svg).with_context(|| format!("writing {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Five runs each of two wake algorithms at three queue depths, `blkq bench --json`
    /// lines as a sweep script collects them, with a header line between.
    fn runs() -> Vec<String> {
        let mut v = vec!["## counter vs legacy".to_string()];
        for (wake, base) in [("counter", 100_000u64), ("legacy", 80_000)] {
            for qd in [16u64, 2, 4] {
                for rep in 0..5u64 {
                    v.push(format!(
                        "{{\"device\":\"null:1G\",\"queue_depth\":{qd},\"wake\":\"{wake}\",\
                         \"repeat\":{rep},\"iops\":{},\"lat_ns\":{{\"p99\":{}}},\"jobs\":4}}",
                        base * qd + rep * 1000,
                        1000 + rep
                    ));
                }
            }
        }
        v
    }

    fn args(x: &str, series: Option<&str>) -> PlotArgs {
        PlotArgs {
            x: x.into(),
            series: series.map(Into::into),
            y: "iops".into(),
            err: ErrBars::Minmax,
            filter: vec![],
            title: None,
            out: PathBuf::new(),
            inputs: vec![],
        }
    }

    /// JSON lines group into sorted numeric categories, one line per series value, the
    /// repeats at each point; error bars span them.
    #[test]
    fn json_lines_group_into_series() {
        let d = from_json_lines(&runs(), &args("queue_depth", Some("wake"))).unwrap();
        assert_eq!(d.ticks, ["2", "4", "16"]);
        assert_eq!(d.title, "iops against queue_depth");
        let names: Vec<_> = d.series.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["counter", "legacy"]);
        assert_eq!(d.series[0].points[0].len(), 5);
        assert_eq!(
            point(&d.series[0].points[0], ErrBars::Minmax),
            Some((202_000.0, 200_000.0, 204_000.0))
        );
        let (m, lo, hi) = point(&d.series[1].points[2], ErrBars::Sd).unwrap();
        assert_eq!(m, 1_282_000.0);
        assert!((hi - m - (2.5e6f64).sqrt()).abs() < 1e-6 && (m - lo - (hi - m)).abs() < 1e-6);
        // Nested y, a filter, no series key.
        let mut a = args("wake", None);
        a.y = "lat_ns.p99".into();
        a.filter = vec!["queue_depth=4".into()];
        let d = from_json_lines(&runs(), &a).unwrap();
        assert_eq!(d.ticks, ["counter", "legacy"]);
        assert_eq!(d.series.len(), 1);
        assert_eq!(
            d.series[0].points[1],
            [1000.0, 1001.0, 1002.0, 1003.0, 1004.0]
        );
        // Missing keys and empty input are errors, not panics.
        assert!(from_json_lines(&runs(), &args("nope", None)).is_err());
        assert!(from_json_lines(&["# nothing".into()], &args("jobs", None)).is_err());
        assert!(from_json_lines(&["{bad".into()], &args("jobs", None)).is_err());
    }

    /// The plot of a fixed JSONL input is an SVG document with one line (polyline) per
    /// series, plus its legend sample, each series' name, and error bars.
    #[test]
    fn plot_writes_an_svg_with_one_path_per_series() {
        let d = from_json_lines(&runs(), &args("queue_depth", Some("wake"))).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("wake.svg");
        write_svg(&d, &out, ErrBars::Minmax).unwrap();
        let svg = std::fs::read_to_string(&out).unwrap();
        assert!(svg.starts_with("<svg"), "{}", &svg[..svg.len().min(200)]);
        assert!(svg.trim_end().ends_with("</svg>"));
        // One data line (the 2-px polylines; axes, ticks and legend samples are 1 px) per
        // series, each in its own colour, which its legend sample repeats.
        let lines: Vec<&str> = svg
            .lines()
            .filter(|l| l.starts_with("<polyline") && l.contains("stroke-width=\"2\""))
            .collect();
        assert_eq!(lines.len(), d.series.len(), "{svg}");
        let stroke = |l: &str| l.split("stroke=\"").nth(1).unwrap()[..7].to_string();
        assert_ne!(stroke(lines[0]), stroke(lines[1]));
        for l in &lines {
            let legend = format!("stroke=\"{}\" stroke-width=\"1\"", stroke(l));
            assert!(svg.contains(&legend), "no legend sample for {l}");
        }
        for name in [
            "counter",
            "legacy",
            "queue_depth",
            "iops against queue_depth",
            "16",
        ] {
            assert!(svg.contains(&format!(">{name}<")) || svg.contains(&format!(">\n{name}\n<")));
        }
        assert!(svg.matches("<circle").count() >= 6);
        // A single category and a single run (no error bar) draw too.
        let one = PlotData {
            title: "t".into(),
            x_desc: "x".into(),
            y_desc: "y".into(),
            ticks: vec!["only".into()],
            series: vec![Series {
                name: "s".into(),
                points: vec![vec![5.0]],
            }],
        };
        assert!(render_svg(&one, ErrBars::Sd).unwrap().starts_with("<svg"));
        let empty = PlotData {
            series: vec![],
            ..one
        };
        assert!(render_svg(&empty, ErrBars::Sd).is_err());
    }
}
