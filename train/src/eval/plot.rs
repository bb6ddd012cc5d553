//! PNG plots of a report: tau against the DDTree budget per drafter, and the acceptance-length
//! histogram (chain and the largest budget side by side).
//!
//! Drawn with plotters' bitmap backend; text goes through ab_glyph with a TrueType font found on
//! the machine (`--font`, else common DejaVu / Liberation / Noto paths). Without one the plots
//! are still drawn, without any text, and a warning says so.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::{register_font, FontStyle};

use super::error::EvalError;
use super::replay::Verify;
use super::report::EvalReport;

const FONT: &str = "sans-serif";
const FONT_CANDIDATES: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/usr/share/fonts/liberation/LiberationSans-Regular.ttf",
    "/usr/share/fonts/truetype/noto/NotoSans-Regular.ttf",
    "/usr/share/fonts/noto/NotoSans-Regular.ttf",
    "/usr/share/fonts/truetype/freefont/FreeSans.ttf",
    "/Library/Fonts/Arial.ttf",
    "C:\\Windows\\Fonts\\arial.ttf",
];
const COLORS: &[RGBColor] = &[
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(255, 127, 14),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
];

/// Registers a font once per process; returns whether text can be drawn.
fn font_ready(preferred: Option<&Path>) -> bool {
    static READY: OnceLock<bool> = OnceLock::new();
    *READY.get_or_init(|| {
        let candidates = preferred
            .map(Path::to_path_buf)
            .into_iter()
            .chain(FONT_CANDIDATES.iter().map(PathBuf::from));
        for path in candidates {
            let Ok(bytes) = std::fs::read(&path) else {
                continue;
            };
            let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
            if register_font(FONT, FontStyle::Normal, bytes).is_ok() {
                return true;
            }
        }
        tracing::warn!(
            "no TrueType font found (pass --font FILE.ttf); plots are drawn without text"
        );
        false
    })
}

fn color(i: usize) -> RGBColor {
    COLORS[i % COLORS.len()]
}

fn draw_err(path: &Path) -> impl Fn(String) -> EvalError + '_ {
    move |message| EvalError::Output {
        path: path.to_path_buf(),
        message,
    }
}

/// tau per drafter: one line over the DDTree budgets (log2 axis), the chain's tau as a dashed
/// line of the same colour. Offline numbers when present, else live ones.
pub fn tau_vs_budget(
    report: &EvalReport,
    path: &Path,
    font: Option<&Path>,
) -> Result<(), EvalError> {
    let text = font_ready(font);
    let err = draw_err(path);
    let offline = report.drafters.iter().any(|d| d.offline.is_some());
    // Per drafter: name, chain tau, (log2 budget, tau) points.
    type Series = (String, Option<f64>, Vec<(f64, f64)>);
    let series: Vec<Series> = report
        .drafters
        .iter()
        .map(|d| {
            let tau = |v: Verify| -> Option<f64> {
                if offline {
                    d.offline.as_ref().and_then(|o| o.tau(v))
                } else {
                    d.live.iter().find(|r| r.mode == v.label()).map(|r| r.tau)
                }
            };
            let points = report
                .budgets
                .iter()
                .filter_map(|&b| tau(Verify::DDTree { budget: b }).map(|t| ((b as f64).log2(), t)))
                .collect();
            (d.name.clone(), tau(Verify::Chain), points)
        })
        .collect();
    let xs: Vec<f64> = report.budgets.iter().map(|&b| (b as f64).log2()).collect();
    let (x0, x1) = (
        xs.iter().copied().fold(f64::INFINITY, f64::min).min(2.0) - 0.3,
        xs.iter()
            .copied()
            .fold(f64::NEG_INFINITY, f64::max)
            .max(3.0)
            + 0.3,
    );
    let y_max = series
        .iter()
        .flat_map(|(_, c, p)| c.iter().copied().chain(p.iter().map(|q| q.1)))
        .fold(2.0f64, f64::max)
        * 1.1;
    let root = BitMapBackend::new(path, (1000, 620)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
    let mut builder = ChartBuilder::on(&root);
    builder
        .margin(20)
        .x_label_area_size(50)
        .y_label_area_size(60);
    if text {
        let what = if offline {
            "offline round replay"
        } else {
            "live decoding"
        };
        builder.caption(
            format!(
                "tau vs DDTree budget ({what}; dashed: chain)  target {}",
                report.target.source
            ),
            (FONT, 22),
        );
    }
    let mut chart = builder
        .build_cartesian_2d(x0..x1, 1.0f64..y_max)
        .map_err(|e| err(e.to_string()))?;
    {
        let mut mesh = chart.configure_mesh();
        mesh.light_line_style(WHITE.mix(0.0));
        if text {
            mesh.x_desc("DDTree budget (draft nodes)")
                .y_desc("tau (tokens per round)")
                .x_labels(xs.len().max(2) * 2)
                .x_label_formatter(&|x| {
                    let b = 2f64.powf(*x);
                    if (b - b.round()).abs() < 1e-6 {
                        format!("{}", b.round())
                    } else {
                        String::new()
                    }
                })
                .label_style((FONT, 16));
        } else {
            mesh.x_labels(0).y_labels(0);
        }
        mesh.draw().map_err(|e| err(e.to_string()))?;
    }
    for (i, (name, chain, points)) in series.iter().enumerate() {
        let c = color(i);
        let line = chart
            .draw_series(LineSeries::new(points.clone(), c.stroke_width(3)))
            .map_err(|e| err(e.to_string()))?;
        if text {
            line.label(name.clone()).legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 24, y)], c.stroke_width(3))
            });
        }
        chart
            .draw_series(points.iter().map(|&p| Circle::new(p, 5, c.filled())))
            .map_err(|e| err(e.to_string()))?;
        if let Some(t) = chain {
            chart
                .draw_series(DashedLineSeries::new(
                    vec![(x0, *t), (x1, *t)],
                    10,
                    6,
                    c.stroke_width(2),
                ))
                .map_err(|e| err(e.to_string()))?;
        }
    }
    if text {
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .label_font((FONT, 18))
            .background_style(WHITE.mix(0.9))
            .border_style(BLACK)
            .draw()
            .map_err(|e| err(e.to_string()))?;
    }
    root.present().map_err(|e| err(e.to_string()))
}

/// Fraction of rounds accepting k drafts, k = 0..=L, drafters as grouped bars; chain on the
/// left, the largest DDTree budget on the right (offline results only).
pub fn acceptance_histogram(
    report: &EvalReport,
    path: &Path,
    font: Option<&Path>,
    budget: Option<usize>,
) -> Result<(), EvalError> {
    let text = font_ready(font);
    let err = draw_err(path);
    let tree = budget
        .or_else(|| report.budgets.iter().copied().max())
        .map(|budget| Verify::DDTree { budget });
    let panels: Vec<Verify> = std::iter::once(Verify::Chain).chain(tree).collect();
    let root = BitMapBackend::new(path, (560 * panels.len() as u32, 520)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
    let areas = root.split_evenly((1, panels.len()));
    for (area, verify) in areas.iter().zip(&panels) {
        histogram_panel(report, area, *verify, text).map_err(&err)?;
    }
    root.present().map_err(|e| err(e.to_string()))
}

fn histogram_panel(
    report: &EvalReport,
    area: &DrawingArea<BitMapBackend<'_>, Shift>,
    verify: Verify,
    text: bool,
) -> Result<(), String> {
    let hists: Vec<(String, Vec<f64>)> = report
        .drafters
        .iter()
        .filter_map(|d| {
            let m = d.offline.as_ref()?.mode(verify)?;
            let total = m.rounds.max(1) as f64;
            Some((
                d.name.clone(),
                m.histogram.iter().map(|&c| c as f64 / total).collect(),
            ))
        })
        .collect();
    let depth = hists.iter().map(|(_, h)| h.len()).max().unwrap_or(1);
    let y_max = hists
        .iter()
        .flat_map(|(_, h)| h.iter().copied())
        .fold(0.1f64, f64::max)
        .min(1.0)
        // Headroom for the legend above the tallest bar.
        * (1.15 + 0.06 * hists.len() as f64);
    let mut builder = ChartBuilder::on(area);
    builder
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(55);
    if text {
        builder.caption(
            format!("accepted drafts per round, {}", verify.label()),
            (FONT, 20),
        );
    }
    let mut chart = builder
        .build_cartesian_2d(-0.5f64..depth as f64 - 0.5, 0.0f64..y_max)
        .map_err(|e| e.to_string())?;
    {
        let mut mesh = chart.configure_mesh();
        mesh.disable_x_mesh().light_line_style(WHITE.mix(0.0));
        if text {
            mesh.x_desc("accepted drafts (tau - 1)")
                .y_desc("fraction of rounds")
                .x_labels(depth)
                .x_label_formatter(&|x| format!("{}", x.round()))
                .label_style((FONT, 14));
        } else {
            mesh.x_labels(0).y_labels(0);
        }
        mesh.draw().map_err(|e| e.to_string())?;
    }
    let n = hists.len().max(1) as f64;
    let width = 0.8 / n;
    for (i, (name, h)) in hists.iter().enumerate() {
        let c = color(i);
        let left = -0.4 + i as f64 * width;
        let bars = chart
            .draw_series(h.iter().enumerate().map(|(k, &f)| {
                let x = k as f64 + left;
                Rectangle::new([(x, 0.0), (x + width * 0.95, f)], c.filled())
            }))
            .map_err(|e| e.to_string())?;
        if text {
            bars.label(name.clone())
                .legend(move |(x, y)| Rectangle::new([(x, y - 6), (x + 14, y + 6)], c.filled()));
        }
    }
    if text {
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .label_font((FONT, 16))
            .background_style(WHITE.mix(0.9))
            .border_style(BLACK)
            .draw()
            .map_err(|e| e.to_string())?;
    }
    Ok(())
}
