//! PNG plots of a replay: cache-hit rate and latency against concurrency, one line per arm.

use super::drive::Arm;
use super::report::Summary;
use crate::eval::plot::{legend, marked_line, register_font, FONT};
use anyhow::{anyhow, Result};
use plotters::prelude::*;
use std::path::Path;

fn color(arm: Arm) -> RGBColor {
    match arm {
        Arm::Baseline => RGBColor(90, 90, 90),
        Arm::Amortize => RGBColor(0, 114, 178),
        Arm::Forget => RGBColor(213, 94, 0),
        Arm::Repair => RGBColor(0, 158, 115),
    }
}

/// One panel: `y(row)` against concurrency, a line per arm.
struct Panel<'a> {
    title: &'a str,
    y_label: &'a str,
    y: fn(&Summary) -> f64,
}

fn draw<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    rows: &[Summary],
    panel: &Panel<'_>,
) -> Result<()>
where
    DB::ErrorType: 'static,
{
    let mut cs: Vec<usize> = rows.iter().map(|r| r.concurrency).collect();
    cs.sort_unstable();
    cs.dedup();
    let mut arms: Vec<Arm> = Vec::new();
    for r in rows {
        if !arms.contains(&r.arm) {
            arms.push(r.arm);
        }
    }
    let ys: Vec<f64> = rows.iter().map(panel.y).filter(|v| v.is_finite()).collect();
    let top = ys.iter().copied().fold(0.0_f64, f64::max) * 1.15 + 1e-9;
    let n = cs.len() as i32;
    let err = |e: DrawingAreaErrorKind<DB::ErrorType>| anyhow!("drawing: {e}");
    let mut chart = ChartBuilder::on(area)
        .caption(panel.title, (FONT, 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(-1..n, 0.0..top)
        .map_err(err)?;
    let labels = cs.clone();
    chart
        .configure_mesh()
        .x_labels(cs.len() + 2)
        .x_label_formatter(&|x| {
            usize::try_from(*x)
                .ok()
                .and_then(|i| labels.get(i))
                .map_or(String::new(), |c| c.to_string())
        })
        .x_desc("concurrency C (sessions in flight)")
        .y_desc(panel.y_label)
        .label_style((FONT, 14))
        .axis_desc_style((FONT, 15))
        .draw()
        .map_err(err)?;
    for arm in arms {
        let pts: Vec<(i32, f64)> = cs
            .iter()
            .enumerate()
            .filter_map(|(i, &c)| {
                let r = rows.iter().find(|r| r.arm == arm && r.concurrency == c)?;
                let v = (panel.y)(r);
                v.is_finite().then_some((i as i32, v))
            })
            .collect();
        marked_line(&mut chart, pts, color(arm), arm.name())?;
    }
    legend(&mut chart)
}

fn render(path: &Path, rows: &[Summary], panels: &[Panel<'_>]) -> Result<()> {
    register_font()?;
    let width = 640 * panels.len() as u32;
    let root = BitMapBackend::new(path, (width, 460)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow!("drawing: {e}"))?;
    let areas = root.split_evenly((1, panels.len()));
    for (a, p) in areas.iter().zip(panels) {
        draw(a, rows, p)?;
    }
    root.present()
        .map_err(|e| anyhow!("writing {}: {e}", path.display()))?;
    Ok(())
}

/// Writes `replay_cache_hit.png` and `replay_latency.png` into `dir`.
///
/// # Errors
/// Drawing or writing fails.
pub fn plots(dir: &Path, rows: &[Summary], title: &str) -> Result<()> {
    let hit = format!("Cache-hit rate, {title}");
    render(
        &dir.join("replay_cache_hit.png"),
        rows,
        &[Panel {
            title: &hit,
            y_label: "cached / prompt tokens (%)",
            y: |r| 100.0 * r.cache_hit_rate,
        }],
    )?;
    let all = format!("E2E p50, all turns, {title}");
    let edit = format!("E2E p50, edit turns, {title}");
    render(
        &dir.join("replay_latency.png"),
        rows,
        &[
            Panel {
                title: &all,
                y_label: "ms",
                y: |r| r.e2e_p50_ms,
            },
            Panel {
                title: &edit,
                y_label: "ms",
                y: |r| r.e2e_p50_ms_edit_turns,
            },
        ],
    )
}
