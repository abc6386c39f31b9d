//! `tallow bench`: a grid of training configs, each run for a few steps in its own `tallow train`
//! process (so each cell's peaks start clean), with the measured peak per phase next to the
//! estimate, tokens/s, and out-of-memory cells reported rather than fatal.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};
use serde::Serialize;
use tallow_trainer::config::TrainConfig;
use tallow_trainer::estimate::estimate_per_rank;
use tallow_trainer::memory::{human_bytes, parse_bytes};

use crate::args::BenchArgs;

/// Measured peak bytes per phase of one cell (max over its steps).
#[derive(Debug, Clone, Default, Serialize)]
pub struct Phases {
    pub load: Option<u64>,
    pub forward: Option<u64>,
    pub backward: Option<u64>,
    pub optimizer: Option<u64>,
}

/// One cell's result (one element of `--json`).
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    /// The cell's grid values, key -> value as written on the command line.
    pub config: BTreeMap<String, String>,
    pub measured_peak_bytes: Option<u64>,
    pub estimated_peak_bytes: u64,
    /// (estimated - measured) / measured.
    pub estimate_error: Option<f64>,
    pub tokens_per_s: Option<f64>,
    pub oom: bool,
    /// The phase that ran out of memory.
    pub oom_phase: Option<String>,
    pub phases: Phases,
    /// The estimate per phase, as `estimated_peak_bytes`: what the memory pool holds (on CUDA
    /// less the context and cuBLAS workspace the estimate adds outside it).
    pub estimated_phases: tallow_trainer::estimate::PhaseBytes,
    pub steps: usize,
    /// Why the cell failed, when it did for another reason than memory.
    pub error: Option<String>,
}

/// `key=v1,v2` -> (key, [v1, v2]).
fn parse_axis(spec: &str) -> Result<(String, Vec<String>)> {
    let Some((k, vs)) = spec.split_once('=') else {
        bail!("--grid {spec}: expected SECTION.KEY=V1,V2,... (e.g. --grid lora.rank=8,64)");
    };
    let vals: Vec<String> = vs
        .split(',')
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty())
        .collect();
    if vals.is_empty() {
        bail!("--grid {spec}: no values after `=`");
    }
    Ok((k.trim().to_string(), vals))
}

/// Every combination of the axes, the first axis varying slowest.
fn cells(axes: &[(String, Vec<String>)]) -> Vec<Vec<(String, String)>> {
    let mut out = vec![vec![]];
    for (k, vals) in axes {
        out = out
            .into_iter()
            .flat_map(|cell: Vec<(String, String)>| {
                vals.iter().map(move |v| {
                    let mut c = cell.clone();
                    c.push((k.clone(), v.clone()));
                    c
                })
            })
            .collect();
    }
    out
}

pub fn run(a: BenchArgs) -> Result<()> {
    if a.steps == 0 {
        bail!("--steps 0: a cell needs at least one step (2 or more for the steady state)");
    }
    let axes = a
        .grid
        .iter()
        .map(|g| parse_axis(g))
        .collect::<Result<Vec<_>>>()?;
    let limit = match &a.memory_limit {
        Some(l) => Some(parse_bytes(l).map_err(|e| anyhow::anyhow!("--memory-limit {e}"))?),
        None => None,
    };
    // Every cell's config is checked before any runs: an unknown key or a value that does not
    // parse stops the bench; a combination that is not valid (nf4 with full fine-tuning) is
    // reported as a failed cell and the grid goes on.
    let grid = cells(&axes);
    let mut configs = vec![];
    for cell in &grid {
        let mut sets = a.sets.clone();
        sets.extend(cell.iter().map(|(k, v)| format!("{k}={v}")));
        match TrainConfig::load(&a.config, &sets) {
            Ok(cfg) => configs.push(Ok(cfg)),
            Err(e @ tallow_trainer::config::ConfigError::Invalid { .. }) => {
                configs.push(Err(e.to_string()))
            }
            Err(e) => return Err(e).with_context(|| format!("grid cell {}", describe_cell(cell))),
        }
    }
    let Some(first) = configs.iter().find_map(|c| c.as_ref().ok()) else {
        bail!("no cell of the grid is a valid config (see the messages above)");
    };
    let model = crate::estimate::model_config(first)?;
    let tmp;
    let work = match &a.work_dir {
        Some(w) => w.clone(),
        None => {
            tmp = TempDir::new()?;
            tmp.0.clone()
        }
    };
    let exe = std::env::current_exe().context("cannot find the tallow binary itself")?;
    let mut rows = vec![];
    for (i, (cell, cfg)) in grid.iter().zip(&configs).enumerate() {
        eprintln!(
            "[{}/{}] {}",
            i + 1,
            grid.len(),
            if cell.is_empty() {
                "(the config as it is)".to_string()
            } else {
                describe_cell(cell)
            }
        );
        let cell_dir = work.join(format!("cell-{i}"));
        let row = match cfg {
            Ok(cfg) => run_cell(
                &exe,
                &cell_dir,
                cell,
                cfg,
                &model,
                a.steps,
                limit,
                a.nproc as usize,
            )?,
            Err(e) => invalid_row(cell, e),
        };
        // In our own temp dir, a cell's run (its final checkpoint: a full fine-tuning's is
        // three copies of the weights) goes once measured, so the disk holds one cell's at a
        // time; `--work-dir` keeps every cell's.
        if a.work_dir.is_none() {
            let _ = std::fs::remove_dir_all(&cell_dir);
        }
        eprintln!("    {}", row_summary(&row));
        rows.push(row);
    }
    let json = serde_json::to_string_pretty(&rows)? + "\n";
    if a.json {
        print!("{json}");
    } else if a.csv {
        print!("{}", to_csv(&rows));
    } else {
        print!("{}", to_markdown(&rows));
    }
    // One run, every format: the cells are the expensive part.
    for (path, text) in [
        (&a.export_json, json),
        (&a.export_csv, to_csv(&rows)),
        (&a.export_markdown, to_markdown(&rows)),
    ] {
        if let Some(p) = path {
            tallow_model::io::write_atomic(p, text.as_bytes())
                .with_context(|| format!("writing {}", p.display()))?;
        }
    }
    if let Some(p) = &a.plot {
        crate::plot::write_svg(p, &rows).with_context(|| format!("--plot {}", p.display()))?;
        eprintln!("plot: {}", p.display());
    }
    Ok(())
}

fn describe_cell(cell: &[(String, String)]) -> String {
    cell.iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(" ")
}

fn row_summary(r: &Row) -> String {
    if let Some(e) = &r.error {
        return format!("failed: {e}");
    }
    let mut s = match r.measured_peak_bytes {
        Some(m) => format!(
            "peak {} measured, {} estimated",
            human_bytes(m),
            human_bytes(r.estimated_peak_bytes)
        ),
        None => format!("estimated {}", human_bytes(r.estimated_peak_bytes)),
    };
    if r.oom {
        s += &format!(
            ", OUT OF MEMORY in the {} phase",
            r.oom_phase.as_deref().unwrap_or("?")
        );
    }
    if let Some(t) = r.tokens_per_s {
        s += &format!(", {t:.1} tok/s");
    }
    s
}

/// The command that runs one cell: `tallow train` on the cell's config, quiet, with the
/// emulated memory limit and, for a data-parallel cell, `--nproc` (rank 0 writes the
/// metrics.jsonl the cell reads).
fn cell_command(exe: &Path, config: &Path, limit: Option<u64>, nproc: usize) -> Command {
    let mut cmd = Command::new(exe);
    cmd.arg("train").arg("--config").arg(config).arg("--quiet");
    if nproc > 1 {
        cmd.arg("--nproc").arg(nproc.to_string());
    }
    if let Some(l) = limit {
        cmd.arg("--memory-limit").arg(l.to_string());
    }
    cmd
}

/// Runs one cell in its own process (`nproc` ranks: rank 0's peaks, beside the per-rank
/// estimate) and reads its metrics.jsonl.
#[allow(clippy::too_many_arguments)]
fn run_cell(
    exe: &Path,
    dir: &Path,
    cell: &[(String, String)],
    cfg: &TrainConfig,
    model: &tallow_model::DecoderConfig,
    steps: usize,
    limit: Option<u64>,
    nproc: usize,
) -> Result<Row> {
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir).with_context(|| format!("{}", dir.display()))?;
    // The cell's resolved config: a few steps, no warmup (the learning rate does not change
    // memory; a warmup longer than the run would not validate), no eval, checkpoint only at the
    // end.
    let mut c = cfg.clone();
    c.train.max_steps = steps;
    c.train.warmup_steps = 0;
    c.train.output_dir = dir.join("run");
    c.train.log_every = 1;
    c.train.eval_every = 0;
    c.train.save_every = 0;
    c.data.eval = None;
    let path = dir.join("config.toml");
    std::fs::write(&path, c.to_toml_string()).with_context(|| format!("{}", path.display()))?;
    let device = crate::estimate::device_kind(&c.train.device);
    let est = estimate_per_rank(model, &c, device, nproc);
    let out = cell_command(exe, &path, limit, nproc)
        .output()
        .with_context(|| format!("cannot run {}", exe.display()))?;
    let metrics = c.train.output_dir.join("metrics.jsonl");
    let text = std::fs::read_to_string(&metrics).unwrap_or_default();
    let mut phases = Phases::default();
    let mut oom_phase = None;
    let mut rates = vec![];
    let mut done = 0;
    let max = |a: &mut Option<u64>, v: Option<u64>| {
        if let Some(v) = v {
            *a = Some(a.map_or(v, |x| x.max(v)));
        }
    };
    for line in text.lines() {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        max(&mut phases.load, v["load_peak_bytes"].as_u64());
        if let Some(p) = v.get("peak_bytes") {
            max(&mut phases.forward, p["forward"].as_u64());
            max(&mut phases.backward, p["backward"].as_u64());
            max(&mut phases.optimizer, p["optimizer"].as_u64());
            done += 1;
            if let Some(r) = v["tokens_per_s"].as_f64() {
                rates.push(r);
            }
        }
        if let Some(o) = v.get("oom") {
            oom_phase = o["phase"].as_str().map(String::from);
            let p = o["peak_bytes"].as_u64();
            match oom_phase.as_deref() {
                Some("load") => max(&mut phases.load, p),
                Some("forward") => max(&mut phases.forward, p),
                Some("backward") => max(&mut phases.backward, p),
                Some("optimizer") => max(&mut phases.optimizer, p),
                _ => {}
            }
        }
    }
    let measured = [
        phases.load,
        phases.forward,
        phases.backward,
        phases.optimizer,
    ]
    .into_iter()
    .flatten()
    .max();
    let stderr = String::from_utf8_lossy(&out.stderr);
    let oom = oom_phase.is_some() || (!out.status.success() && stderr.contains("out of memory"));
    // The `error:` line with its indented `caused by:` lines: the cause says why (e.g. "error:
    // train.device" alone hides "this tallow was built without CUDA support").
    let error = (!out.status.success() && !oom).then(|| {
        let lines: Vec<&str> = stderr.lines().collect();
        match lines.iter().position(|l| l.starts_with("error:")) {
            Some(i) => std::iter::once(lines[i])
                .chain(
                    lines[i + 1..]
                        .iter()
                        .take_while(|l| l.starts_with(' '))
                        .map(|l| l.trim()),
                )
                .collect::<Vec<_>>()
                .join(" "),
            None => lines.last().copied().unwrap_or("failed").to_string(),
        }
    });
    // tokens/s: the steps after the first (which also allocates the optimizer state).
    let tokens_per_s = match rates.len() {
        0 => None,
        1 => Some(rates[0]),
        n => Some(rates[1..].iter().sum::<f64>() / (n - 1) as f64),
    };
    // On CUDA the pool does not see the context: compare pool with pool, the phases too.
    let estimated = est.total_bytes - est.outside_pool_bytes;
    let pool = |b: u64| b.saturating_sub(est.outside_pool_bytes);
    let estimated_phases = tallow_trainer::estimate::PhaseBytes {
        load: pool(est.phases.load),
        forward: pool(est.phases.forward),
        backward: pool(est.phases.backward),
        optimizer: pool(est.phases.optimizer),
    };
    Ok(Row {
        config: cell.iter().cloned().collect(),
        measured_peak_bytes: measured,
        estimated_peak_bytes: estimated,
        estimate_error: measured
            .filter(|_| !oom)
            .map(|m| (estimated as f64 - m as f64) / m as f64),
        tokens_per_s: if oom { None } else { tokens_per_s },
        oom,
        oom_phase,
        phases,
        estimated_phases,
        steps: done,
        error,
    })
}

/// A cell whose config is not valid: not run.
fn invalid_row(cell: &[(String, String)], error: &str) -> Row {
    Row {
        config: cell.iter().cloned().collect(),
        measured_peak_bytes: None,
        estimated_peak_bytes: 0,
        estimate_error: None,
        tokens_per_s: None,
        oom: false,
        oom_phase: None,
        phases: Phases::default(),
        estimated_phases: Default::default(),
        steps: 0,
        error: Some(error.lines().next().unwrap_or(error).to_string()),
    }
}

fn cell_name(r: &Row) -> String {
    if r.config.is_empty() {
        "(config)".into()
    } else {
        r.config
            .iter()
            .map(|(k, v)| format!("{}={v}", k.rsplit('.').next().unwrap_or(k)))
            .collect::<Vec<_>>()
            .join(" ")
    }
}

fn mib(b: Option<u64>) -> String {
    b.map_or("-".into(), |b| {
        format!("{:.1}", b as f64 / (1u64 << 20) as f64)
    })
}

pub fn to_markdown(rows: &[Row]) -> String {
    let mut s = String::from(
        "| cell | load | forward | backward | optimizer | peak | estimate | error | tok/s | oom |\n\
         | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |\n",
    );
    for r in rows {
        let p = &r.phases;
        s += &format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
            cell_name(r),
            mib(p.load),
            mib(p.forward),
            mib(p.backward),
            mib(p.optimizer),
            mib(r.measured_peak_bytes),
            mib(Some(r.estimated_peak_bytes)),
            r.estimate_error
                .map_or("-".into(), |e| format!("{:+.1}%", 100.0 * e)),
            r.tokens_per_s.map_or("-".into(), |t| format!("{t:.1}")),
            if r.oom {
                format!("OOM ({})", r.oom_phase.as_deref().unwrap_or("?"))
            } else if let Some(e) = &r.error {
                format!("failed: {}", e.replace('|', "/"))
            } else {
                "no".into()
            }
        );
    }
    s + "\nMiB; peak = the largest phase, measured; estimate = `tallow estimate`'s peak.\n"
}

pub fn to_csv(rows: &[Row]) -> String {
    let keys: Vec<String> = rows
        .first()
        .map(|r| r.config.keys().cloned().collect())
        .unwrap_or_default();
    let mut s = keys.join(",");
    if !keys.is_empty() {
        s += ",";
    }
    s += "load_bytes,forward_bytes,backward_bytes,optimizer_bytes,measured_peak_bytes,\
          estimated_peak_bytes,estimate_error,tokens_per_s,oom,oom_phase,error\n";
    let o = |v: Option<u64>| v.map_or(String::new(), |v| v.to_string());
    let quote = |t: &str| {
        if t.contains([',', '"', '\n']) {
            format!("\"{}\"", t.replace('"', "\"\""))
        } else {
            t.to_string()
        }
    };
    for r in rows {
        for k in &keys {
            s += &quote(r.config.get(k).map_or("", |v| v.as_str()));
            s += ",";
        }
        let p = &r.phases;
        s += &format!(
            "{},{},{},{},{},{},{},{},{},{},{}\n",
            o(p.load),
            o(p.forward),
            o(p.backward),
            o(p.optimizer),
            o(r.measured_peak_bytes),
            r.estimated_peak_bytes,
            r.estimate_error
                .map_or(String::new(), |e| format!("{e:.4}")),
            r.tokens_per_s.map_or(String::new(), |t| format!("{t:.2}")),
            r.oom,
            r.oom_phase.as_deref().unwrap_or(""),
            quote(r.error.as_deref().unwrap_or(""))
        );
    }
    s
}

/// A temp dir removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> Result<TempDir> {
        let p = std::env::temp_dir().join(format!("tallow-bench-{}", std::process::id()));
        std::fs::create_dir_all(&p).with_context(|| format!("{}", p.display()))?;
        Ok(TempDir(p))
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grid_is_the_product_of_the_axes_first_axis_slowest() {
        let axes = vec![
            parse_axis("model.quantize=none,nf4").unwrap(),
            parse_axis("lora.rank=8,64,128").unwrap(),
        ];
        let c = cells(&axes);
        assert_eq!(c.len(), 6);
        assert_eq!(describe_cell(&c[0]), "model.quantize=none lora.rank=8");
        assert_eq!(describe_cell(&c[2]), "model.quantize=none lora.rank=128");
        assert_eq!(describe_cell(&c[3]), "model.quantize=nf4 lora.rank=8");
        assert!(parse_axis("lora.rank").is_err());
        assert!(parse_axis("lora.rank=").is_err());
        assert_eq!(cells(&[]).len(), 1, "no axis: the config itself");
    }

    /// A data-parallel bench runs each cell as `tallow train --nproc N`; one rank's does not
    /// pass the flag (the command of a cell is what it was before data parallelism).
    #[test]
    fn a_cell_runs_train_with_nproc_when_there_are_ranks() {
        let args = |limit, nproc| -> Vec<String> {
            cell_command(Path::new("tallow"), Path::new("c.toml"), limit, nproc)
                .get_args()
                .map(|a| a.to_string_lossy().into_owned())
                .collect()
        };
        assert_eq!(
            args(Some(800 << 20), 4),
            [
                "train",
                "--config",
                "c.toml",
                "--quiet",
                "--nproc",
                "4",
                "--memory-limit",
                "838860800"
            ]
        );
        assert_eq!(args(None, 1), ["train", "--config", "c.toml", "--quiet"]);
    }
}
