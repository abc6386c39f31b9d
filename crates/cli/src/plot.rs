//! `tallow bench --plot FILE.svg`: peak memory (measured and estimated) and tokens/s per cell, as
//! a self-contained SVG (written by hand: no plotting dependency for two bar charts).

use std::fmt::Write as _;
use std::path::Path;

use anyhow::{bail, Result};

use crate::bench::Row;

const W: f64 = 960.0;
const PANEL_H: f64 = 260.0;
const LEFT: f64 = 80.0;
const RIGHT: f64 = 20.0;
const TOP: f64 = 40.0;
const GAP: f64 = 70.0;

fn esc(t: &str) -> String {
    t.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// A "nice" axis maximum (1, 2 or 5 times a power of ten) at or above `v`.
fn nice_max(v: f64) -> f64 {
    if v <= 0.0 {
        return 1.0;
    }
    let p = 10f64.powf(v.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * p)
        .find(|&m| m >= v)
        .unwrap_or(10.0 * p)
}

/// One bar panel: `series` = (legend, colour, value per cell).
fn panel(
    svg: &mut String,
    y0: f64,
    title: &str,
    unit: &str,
    series: &[(&str, &str, Vec<Option<f64>>)],
    oom: &[bool],
) {
    let n = oom.len().max(1);
    let max = series
        .iter()
        .flat_map(|s| s.2.iter().flatten())
        .fold(0f64, |a, &b| a.max(b));
    let top = nice_max(max);
    let plot_w = W - LEFT - RIGHT;
    let slot = plot_w / n as f64;
    let bar = (slot * 0.8) / series.len() as f64;
    let _ = writeln!(
        svg,
        r#"<text x="{LEFT}" y="{}" font-size="14" font-weight="bold">{}</text>"#,
        y0 - 12.0,
        esc(title)
    );
    // Axis and gridlines at 0, 1/4, ..., top.
    for i in 0..=4 {
        let v = top * i as f64 / 4.0;
        let y = y0 + PANEL_H - PANEL_H * i as f64 / 4.0;
        let _ = writeln!(
            svg,
            r##"<line x1="{LEFT}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="#ddd"/><text x="{:.1}" y="{:.1}" font-size="11" text-anchor="end">{}</text>"##,
            W - RIGHT,
            LEFT - 6.0,
            y + 4.0,
            if v >= 100.0 {
                format!("{v:.0}")
            } else {
                format!("{v:.1}")
            }
        );
    }
    let _ = writeln!(
        svg,
        r#"<text x="16" y="{:.1}" font-size="11" transform="rotate(-90 16 {:.1})" text-anchor="middle">{}</text>"#,
        y0 + PANEL_H / 2.0,
        y0 + PANEL_H / 2.0,
        esc(unit)
    );
    for (k, (_, colour, values)) in series.iter().enumerate() {
        for (i, v) in values.iter().enumerate() {
            let Some(v) = v else { continue };
            let h = PANEL_H * v / top;
            let x = LEFT + slot * i as f64 + slot * 0.1 + bar * k as f64;
            let _ = writeln!(
                svg,
                r#"<rect class="bar" x="{x:.1}" y="{:.1}" width="{:.1}" height="{h:.1}" fill="{colour}"><title>{v:.1}</title></rect>"#,
                y0 + PANEL_H - h,
                bar.max(1.0)
            );
        }
    }
    for (i, &o) in oom.iter().enumerate() {
        if o {
            let x = LEFT + slot * (i as f64 + 0.5);
            let _ = writeln!(
                svg,
                r##"<text x="{x:.1}" y="{:.1}" font-size="12" fill="#c00" text-anchor="middle">OOM</text>"##,
                y0 + PANEL_H - 6.0
            );
        }
    }
    // Legend.
    for (k, (name, colour, _)) in series.iter().enumerate() {
        let x = W - RIGHT - 180.0 * (series.len() - k) as f64;
        let _ = writeln!(
            svg,
            r#"<rect x="{x:.1}" y="{:.1}" width="12" height="12" fill="{colour}"/><text x="{:.1}" y="{:.1}" font-size="12">{}</text>"#,
            y0 - 24.0,
            x + 16.0,
            y0 - 14.0,
            esc(name)
        );
    }
}

/// The chart of a bench run: peak memory per cell (measured next to estimated), then tokens/s.
pub fn render(rows: &[Row]) -> String {
    let n = rows.len().max(1);
    let lines = rows
        .iter()
        .map(|r| r.config.len().max(1))
        .max()
        .unwrap_or(1);
    let height = TOP + 2.0 * PANEL_H + GAP + 24.0 + 12.0 * lines as f64;
    let mut svg = String::new();
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{height}" viewBox="0 0 {W} {height}" font-family="sans-serif">"#
    );
    let _ = writeln!(svg, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let mib = |b: Option<u64>| b.map(|b| b as f64 / (1u64 << 20) as f64);
    let oom: Vec<bool> = rows.iter().map(|r| r.oom).collect();
    panel(
        &mut svg,
        TOP,
        "peak memory per cell",
        "MiB",
        &[
            (
                "measured peak",
                "#3b6fb6",
                rows.iter().map(|r| mib(r.measured_peak_bytes)).collect(),
            ),
            (
                "estimated peak",
                "#f0a030",
                rows.iter()
                    .map(|r| mib(Some(r.estimated_peak_bytes)))
                    .collect(),
            ),
        ],
        &oom,
    );
    let y1 = TOP + PANEL_H + GAP;
    panel(
        &mut svg,
        y1,
        "training throughput per cell",
        "tokens/s",
        &[(
            "tokens/s",
            "#4a9a5a",
            rows.iter().map(|r| r.tokens_per_s).collect(),
        )],
        &oom,
    );
    // Cell labels under the bars: one line per grid key (key=value), centred on the cell.
    let slot = (W - LEFT - RIGHT) / n as f64;
    for (i, r) in rows.iter().enumerate() {
        let x = LEFT + slot * (i as f64 + 0.5);
        let y = y1 + PANEL_H + 16.0;
        let mut lines: Vec<String> = r
            .config
            .iter()
            .map(|(k, v)| format!("{}={v}", k.rsplit('.').next().unwrap_or(k)))
            .collect();
        if lines.is_empty() {
            lines.push("(config)".into());
        }
        let _ = write!(
            svg,
            r#"<text class="label" x="{x:.1}" y="{y:.1}" font-size="10" text-anchor="middle">"#
        );
        for (j, l) in lines.iter().enumerate() {
            let _ = write!(
                svg,
                r#"<tspan x="{x:.1}" dy="{}">{}</tspan>"#,
                if j == 0 { 0 } else { 12 },
                esc(l)
            );
        }
        let _ = writeln!(svg, "</text>");
    }
    svg += "</svg>\n";
    svg
}

/// Writes the chart; only `.svg` is supported.
pub fn write_svg(path: &Path, rows: &[Row]) -> Result<()> {
    match path.extension().and_then(|e| e.to_str()) {
        Some(e) if e.eq_ignore_ascii_case("svg") => {}
        _ => bail!("the chart is written as SVG: give a file name ending in .svg"),
    }
    tallow_model::io::write_atomic(path, render(rows).as_bytes())?;
    Ok(())
}
