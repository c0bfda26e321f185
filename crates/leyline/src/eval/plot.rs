//! PNG plots of the benchmarks and of `leyline verify`. Text is drawn with DejaVu Sans
//! compiled into the binary (no system fonts needed).

use anyhow::{anyhow, Result};
use plotters::prelude::*;
use std::path::Path;
use std::sync::OnceLock;

/// The font family every plot uses, once [`register_font`] has run.
pub const FONT: &str = "sans-serif";

/// Registers the embedded DejaVu Sans as [`FONT`] (once per process).
///
/// # Errors
/// The font does not load.
pub fn register_font() -> Result<()> {
    static DONE: OnceLock<bool> = OnceLock::new();
    let ok = *DONE.get_or_init(|| {
        plotters::style::register_font(FONT, FontStyle::Normal, dejavu::sans::regular()).is_ok()
    });
    if ok {
        Ok(())
    } else {
        Err(anyhow!("the embedded DejaVu Sans font did not load"))
    }
}

/// One repair setting on the Pareto plot.
pub struct ParetoPoint {
    /// The line it belongs to (the repair rule).
    pub line: String,
    /// Its label next to the marker (the token count).
    pub label: String,
    /// Recomputed share of FORGET's downstream tokens, 0..=1.
    pub share: f64,
    /// Agreement with the exact edited context, 0..=1.
    pub agree: f64,
}

const LINE_COLORS: [RGBColor; 4] = [
    RGBColor(0, 114, 178),
    RGBColor(0, 158, 115),
    RGBColor(213, 94, 0),
    RGBColor(204, 121, 167),
];

fn err<E: std::error::Error + Send + Sync>(e: DrawingAreaErrorKind<E>) -> anyhow::Error {
    anyhow!("drawing: {e}")
}

/// Draws `pts` as one line with a marker at each point, shown as `label` in the legend.
///
/// # Errors
/// Drawing fails.
pub fn marked_line<'a, DB, X, Y>(
    chart: &mut ChartContext<'a, DB, Cartesian2d<X, Y>>,
    pts: Vec<(X::ValueType, Y::ValueType)>,
    color: RGBColor,
    label: &str,
) -> Result<()>
where
    DB: DrawingBackend + 'a,
    X: Ranged,
    Y: Ranged,
    X::ValueType: Clone + 'static,
    Y::ValueType: Clone + 'static,
{
    let style = color.stroke_width(3);
    chart
        .draw_series(LineSeries::new(pts.clone(), style))
        .map_err(err)?
        .label(label)
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], style));
    chart
        .draw_series(pts.into_iter().map(|p| Circle::new(p, 5, color.filled())))
        .map_err(err)?;
    Ok(())
}

/// Draws the legend of the labelled lines in the lower right corner.
///
/// # Errors
/// Drawing fails.
pub fn legend<'a, DB, X, Y>(chart: &mut ChartContext<'a, DB, Cartesian2d<X, Y>>) -> Result<()>
where
    DB: DrawingBackend + 'a,
    X: Ranged,
    Y: Ranged,
{
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .label_font((FONT, 15))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(err)?;
    Ok(())
}

/// Writes the repair Pareto plot to `path`: agreement against recomputed share, one line per
/// rule through its settings in order of share.
///
/// # Errors
/// Drawing or writing fails.
pub fn pareto(path: &Path, title: &str, y_label: &str, points: &[ParetoPoint]) -> Result<()> {
    register_font()?;
    let mut lines: Vec<&str> = Vec::new();
    for p in points {
        if !lines.contains(&p.line.as_str()) {
            lines.push(&p.line);
        }
    }
    let x_max = points.iter().map(|p| p.share).fold(0.0_f64, f64::max) * 1.1 + 1e-3;
    let y_min = points.iter().map(|p| p.agree).fold(1.0_f64, f64::min);
    let y_lo = (y_min - 0.05).max(0.0);
    let root = BitMapBackend::new(path, (760, 520)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, (FONT, 20))
        .margin(14)
        .x_label_area_size(44)
        .y_label_area_size(64)
        .build_cartesian_2d(0.0..x_max, y_lo..1.005)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("recomputed downstream tokens / FORGET's")
        .y_desc(y_label)
        .label_style((FONT, 14))
        .axis_desc_style((FONT, 15))
        .draw()
        .map_err(err)?;
    for (i, line) in lines.iter().enumerate() {
        let color = LINE_COLORS[i % LINE_COLORS.len()];
        let mut pts: Vec<&ParetoPoint> = points.iter().filter(|p| p.line == *line).collect();
        pts.sort_by(|a, b| a.share.total_cmp(&b.share));
        let xy: Vec<(f64, f64)> = pts.iter().map(|p| (p.share, p.agree)).collect();
        marked_line(&mut chart, xy, color, line)?;
        chart
            .draw_series(
                pts.iter().map(|p| {
                    Text::new(p.label.clone(), (p.share, p.agree), (FONT, 13).into_font())
                }),
            )
            .map_err(err)?;
    }
    legend(&mut chart)?;
    root.present()
        .map_err(|e| anyhow!("writing {}: {e}", path.display()))?;
    Ok(())
}
