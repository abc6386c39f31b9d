//! Preference tuning: DPO (sigmoid and IPO losses) and ORPO on adapters, with TRL's definitions
//! (TRL 0.23 `DPOTrainer.dpo_loss`, `ORPOTrainer.odds_ratio_loss`).
//!
//! A pair is two examples of the data pipeline, chosen then rejected, each the prompt (not
//! trained) and a completion (its tokens are the targets). A micro-batch of m pairs is one
//! batch of 2m rows, the m chosen rows then the m rejected ones (TRL's concatenated forward).
//! Log-probs are sums over a completion's tokens; IPO and ORPO use their per-token means.
//!
//! - DPO: margin = (pi_c - pi_r) - (ref_c - ref_r), with `ref` the same model with its
//!   adapters off ([`tallow_model::nn::linear::adapters_off`], PEFT's `disable_adapter()`), computed
//!   in the step without a graph or once before training (`preference.precompute_ref`).
//!   sigmoid: -(1 - ls) log sigmoid(beta margin) - ls log sigmoid(-beta margin);
//!   ipo: (margin - 1 / (2 beta))^2 on mean log-probs. Rewards: beta (pi - ref).
//! - ORPO: log_odds = (c - r) - (log(1 - e^c) - log(1 - e^r)) on mean log-probs;
//!   loss = NLL - lambda log sigmoid(log_odds), the NLL over the chosen rows' every token after
//!   the first (prompt included, as TRL's ORPO computes it). Rewards: lambda * mean log-prob.
//!
//! Normalization across micro-batches: a step's loss is the pair-weighted mean over all its
//! pairs (and the NLL the mean over all its chosen tokens), so `grad_accum` x m equals one
//! micro-batch of the step's pairs, as for supervised runs (TRL averages per micro-batch, the
//! same when micro-batches hold equally many pairs).

use candle_core::{DType, Device, Tensor};
use tallow_model::nn::linear::adapters_off;
use tallow_model::nn::no_grad::{self, no_grad};
use tallow_model::{lm_head_nll, CausalLM, Targets};

use crate::batch::{Batch, Row};
use crate::config::{Method, PreferenceLoss, TrainConfig};
use crate::data::Example;
use crate::error::TrainError;

/// The metrics of a step or an evaluation, TRL's names, in the order of [`Metrics::values`].
pub const METRIC_NAMES: [&str; 9] = [
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
    "nll_loss",
    "log_odds_ratio",
    "log_odds_chosen",
];

/// The objective of a preference run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Objective {
    Dpo {
        beta: f64,
        loss: PreferenceLoss,
        label_smoothing: f64,
    },
    Orpo {
        lambda: f64,
    },
}

impl Objective {
    /// The objective `cfg` trains, None for a supervised run.
    pub fn of(cfg: &TrainConfig) -> Option<Objective> {
        let p = &cfg.preference;
        match cfg.train.method {
            Method::Dpo => Some(Objective::Dpo {
                beta: p.beta,
                loss: p.loss,
                label_smoothing: p.label_smoothing,
            }),
            Method::Orpo => Some(Objective::Orpo { lambda: p.lambda }),
            Method::Lora | Method::Full => None,
        }
    }

    /// Whether the loss needs the reference model's log-probs.
    pub fn needs_reference(&self) -> bool {
        matches!(self, Objective::Dpo { .. })
    }

    /// Whether log-probs are per-token means (IPO, ORPO) rather than sums.
    fn averages(&self) -> bool {
        matches!(
            self,
            Objective::Dpo {
                loss: PreferenceLoss::Ipo,
                ..
            } | Objective::Orpo { .. }
        )
    }

    /// Which metrics the objective reports (ORPO adds its NLL and odds).
    pub fn reports(&self, name: &str) -> bool {
        match self {
            Objective::Dpo { .. } => {
                !matches!(name, "nll_loss" | "log_odds_ratio" | "log_odds_chosen")
            }
            Objective::Orpo { .. } => true,
        }
    }
}

/// A micro-batch of pairs on the device.
pub struct PairBatch {
    /// 2m rows: the chosen rows, then the rejected ones.
    pub batch: Batch,
    /// One target set per row: the completion tokens of that row only.
    row_targets: Vec<Targets>,
    /// ORPO: every token after the first of the chosen rows (padding excluded).
    chosen_all: Targets,
    /// Completion tokens per row, (2m) f32.
    lens: Tensor,
    pub pairs: usize,
}

impl PairBatch {
    /// `pairs` as (chosen, rejected) rows, padded with `pad`.
    pub fn new(pairs: &[(&Row, &Row)], pad: u32, device: &Device) -> Result<Self, TrainError> {
        let rows: Vec<Row> = pairs
            .iter()
            .map(|(c, _)| (*c).clone())
            .chain(pairs.iter().map(|(_, r)| (*r).clone()))
            .collect();
        let refs: Vec<&Row> = rows.iter().collect();
        let batch = Batch::from_rows(&refs, pad, device)?;
        let t = rows.iter().map(|r| r.ids.len()).max().unwrap_or(0);
        let ids: Vec<Vec<u32>> = rows
            .iter()
            .map(|r| {
                let mut v = r.ids.clone();
                v.resize(t, pad);
                v
            })
            .collect();
        let padded = |r: &Row| {
            let mut v = r.targets.clone();
            v.resize(t, false);
            v
        };
        let none = vec![false; t];
        let mut row_targets = Vec::with_capacity(rows.len());
        for (i, r) in rows.iter().enumerate() {
            let only: Vec<Vec<bool>> = (0..rows.len())
                .map(|j| if j == i { padded(r) } else { none.clone() })
                .collect();
            row_targets.push(Targets::new(&ids, &only, device)?);
        }
        let m = pairs.len();
        let chosen_all: Vec<Vec<bool>> = (0..rows.len())
            .map(|j| {
                (0..t)
                    .map(|k| j < m && k >= 1 && k < rows[j].ids.len())
                    .collect()
            })
            .collect();
        let lens: Vec<f32> = rows.iter().map(|r| r.n_targets() as f32).collect();
        Ok(PairBatch {
            batch,
            row_targets,
            chosen_all: Targets::new(&ids, &chosen_all, device)?,
            lens: Tensor::from_vec(lens, rows.len(), device)?,
            pairs: m,
        })
    }

    /// Tokens the step's ORPO NLL averages over (the chosen rows' tokens after the first).
    pub fn chosen_tokens(&self) -> usize {
        self.chosen_all.count
    }
}

/// Summed log-probs of each row's completion tokens, (2m) in f32; with a graph unless inside
/// [`no_grad`].
fn row_logps(model: &CausalLM, hidden: &Tensor, pb: &PairBatch) -> Result<Tensor, TrainError> {
    let head = no_grad::enter(model.lm_head_weight());
    let cap = model.config.variant.final_logit_softcapping;
    let rows = pb
        .row_targets
        .iter()
        .map(|t| {
            Ok(lm_head_nll(hidden, &head, t, cap)?
                .to_dtype(DType::F32)?
                .neg()?)
        })
        .collect::<Result<Vec<_>, TrainError>>()?;
    Ok(Tensor::stack(&rows, 0)?) // (2m)
}

/// The reference log-probs of a micro-batch: the model with its adapters off, no graph. (2m)
pub fn reference_logps(model: &CausalLM, pb: &PairBatch) -> Result<Tensor, TrainError> {
    let b = &pb.batch;
    no_grad(|| {
        adapters_off(|| {
            let hidden = model.forward_hidden(&b.input_ids, b.segments.as_deref())?; // (2m, T, C)
            row_logps(model, &hidden, pb)
        })
    })
    .map(|t| t.detach())
}

/// log sigmoid(x): the value computed stably as min(x, 0) - log(1 + e^-|x|), the gradient
/// attached exactly as sigmoid(-x). (Through min and abs, Candle's autograd would give the
/// kinks at x = 0 a one-sided slope: 1 instead of 1/2 at margin 0, which is every DPO pair's
/// margin at the first step from a fresh adapter.) Device-generic ops only:
/// value.detach() + (x - x.detach()) * sigmoid(-x).detach(), whose value is the value exactly.
fn log_sigmoid(x: &Tensor) -> candle_core::Result<Tensor> {
    let x0 = x.detach();
    let soft = (x0.abs()?.neg()?.exp()? + 1.0)?.log()?;
    let value = (x0.minimum(0f32)? - soft)?;
    let slope = (x0.exp()? + 1.0)?.recip()?; // sigmoid(-x)
    value + (x - &x0)?.mul(&slope)?
}

/// What one micro-batch adds to its step.
pub struct MicroLoss {
    /// This micro-batch's share of the step loss (with a graph in training).
    pub loss: Tensor,
    /// The metric sums over its pairs, [`METRIC_NAMES`] order, detached (9) f64; `nll_loss`
    /// is a sum over tokens.
    pub sums: Tensor,
}

/// The loss of a micro-batch whose policy forward gave `hidden` (2m, T, C). `reference`: the
/// reference log-probs (2m), for DPO. `step_pairs` / `step_chosen_tokens`: the step's pairs and
/// ORPO NLL tokens, which the shares are normalized by.
pub fn micro_loss(
    objective: &Objective,
    model: &CausalLM,
    hidden: &Tensor,
    pb: &PairBatch,
    reference: Option<&Tensor>,
    step_pairs: usize,
    step_chosen_tokens: usize,
) -> Result<MicroLoss, TrainError> {
    let m = pb.pairs;
    let mut logps = row_logps(model, hidden, pb)?; // (2m)
    let mut reference = reference.cloned();
    if objective.averages() {
        logps = (logps / &pb.lens)?;
        reference = reference.map(|r| r / &pb.lens).transpose()?;
    }
    let (pc, pr) = (logps.narrow(0, 0, m)?, logps.narrow(0, m, m)?);
    let zeros = Tensor::zeros(m, DType::F32, hidden.device())?;
    let (losses, chosen_r, rejected_r, nll_sum, ratio, log_odds) = match *objective {
        Objective::Dpo {
            beta,
            loss,
            label_smoothing,
        } => {
            let r = reference
                .ok_or_else(|| TrainError::Invalid("DPO needs the reference log-probs".into()))?;
            let (rc, rr) = (r.narrow(0, 0, m)?, r.narrow(0, m, m)?);
            let margin = ((&pc - &pr)? - (&rc - &rr)?)?; // (m)
            let losses = match loss {
                PreferenceLoss::Sigmoid => {
                    let pos = log_sigmoid(&(&margin * beta)?)?;
                    let neg = log_sigmoid(&(&margin * -beta)?)?;
                    ((pos * -(1.0 - label_smoothing))? - (neg * label_smoothing)?)?
                }
                PreferenceLoss::Ipo => (&margin - 1.0 / (2.0 * beta))?.sqr()?,
            };
            let chosen_r = ((pc.detach() - rc)? * beta)?;
            let rejected_r = ((pr.detach() - rr)? * beta)?;
            let none = Tensor::zeros((), DType::F32, hidden.device())?;
            (losses, chosen_r, rejected_r, none, zeros.clone(), zeros)
        }
        Objective::Orpo { lambda } => {
            // log(1 - e^x) for x < 0.
            let log1m_exp =
                |x: &Tensor| -> candle_core::Result<Tensor> { (x.exp()?.neg()? + 1.0)?.log() };
            let log_odds = ((&pc - &pr)? - (log1m_exp(&pc)? - log1m_exp(&pr)?)?)?; // (m)
            let ratio = log_sigmoid(&log_odds)?;
            let head = no_grad::enter(model.lm_head_weight());
            let cap = model.config.variant.final_logit_softcapping;
            let nll = lm_head_nll(hidden, &head, &pb.chosen_all, cap)?.to_dtype(DType::F32)?;
            // The NLL's share of the step's token mean, minus lambda times the ratio's share of
            // the step's pair mean, is written below as per-pair terms plus the NLL.
            let losses = (&ratio * -lambda)?;
            let chosen_r = (pc.detach() * lambda)?;
            let rejected_r = (pr.detach() * lambda)?;
            (
                losses,
                chosen_r,
                rejected_r,
                nll,
                ratio.detach(),
                log_odds.detach(),
            )
        }
    };
    let mut loss = (losses.sum_all()? / step_pairs as f64)?;
    if let Objective::Orpo { .. } = objective {
        loss = (loss + (&nll_sum / step_chosen_tokens.max(1) as f64)?)?;
    }
    let acc = chosen_r.gt(&rejected_r)?.to_dtype(DType::F32)?;
    let margins = (&chosen_r - &rejected_r)?;
    let sums = Tensor::stack(
        &[
            chosen_r.sum_all()?,
            rejected_r.sum_all()?,
            acc.sum_all()?,
            margins.sum_all()?,
            pc.detach().sum_all()?,
            pr.detach().sum_all()?,
            nll_sum.detach(),
            ratio.sum_all()?,
            log_odds.sum_all()?,
        ],
        0,
    )?
    .to_dtype(DType::F64)?;
    Ok(MicroLoss { loss, sums })
}

/// The metrics of a step or evaluation from the summed values of its micro-batches (`sums`,
/// read from the device), its pairs and its ORPO NLL tokens.
#[derive(Debug, Clone, PartialEq)]
pub struct Metrics {
    pub values: Vec<(&'static str, f64)>,
}

impl Metrics {
    pub fn from_sums(
        objective: &Objective,
        sums: &[f64],
        pairs: usize,
        chosen_tokens: usize,
    ) -> Metrics {
        let values = METRIC_NAMES
            .iter()
            .zip(sums)
            .filter(|(name, _)| objective.reports(name))
            .map(|(&name, &s)| {
                let n = if name == "nll_loss" {
                    chosen_tokens
                } else {
                    pairs
                };
                (name, s / n.max(1) as f64)
            })
            .collect();
        Metrics { values }
    }

    pub fn get(&self, name: &str) -> Option<f64> {
        self.values
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| *v)
    }
}

/// The pairs of a data set: examples 2i (chosen) and 2i + 1 (rejected), as rows.
pub fn pairs(examples: &[Example]) -> Vec<(Row, Row)> {
    examples
        .chunks_exact(2)
        .map(|p| (Row::from(&p[0]), Row::from(&p[1])))
        .collect()
}

/// The tokens ORPO's NLL averages over for these pairs: each chosen row's tokens after the
/// first.
pub fn chosen_tokens<'a>(pairs: impl IntoIterator<Item = (&'a Row, &'a Row)>) -> usize {
    pairs
        .into_iter()
        .map(|(c, _)| c.ids.len().saturating_sub(1))
        .sum()
}

/// The loss and metrics of `pairs` under `objective`, without a graph (the reference with the
/// adapters off), in micro-batches of `micro_batch` pairs: what the trainer's evaluations and
/// `tallow eval --format preference` report. One host read.
pub fn evaluate(
    objective: &Objective,
    model: &CausalLM,
    examples: &[Example],
    micro_batch: usize,
    pad: u32,
) -> Result<(f64, Metrics), TrainError> {
    let device = model.device();
    let owned = pairs(examples);
    let pairs: Vec<(&Row, &Row)> = owned.iter().map(|(c, r)| (c, r)).collect();
    let batches = pairs
        .chunks(micro_batch.max(1))
        .map(|c| PairBatch::new(c, pad, device))
        .collect::<Result<Vec<_>, _>>()?;
    let tokens: usize = batches.iter().map(PairBatch::chosen_tokens).sum();
    let mut total: Option<Tensor> = None;
    for pb in &batches {
        let reference = if objective.needs_reference() {
            Some(reference_logps(model, pb)?)
        } else {
            None
        };
        let part = no_grad(|| -> Result<Tensor, TrainError> {
            let b = &pb.batch;
            let hidden = model.forward_hidden(&b.input_ids, b.segments.as_deref())?;
            let ml = micro_loss(
                objective,
                model,
                &hidden,
                pb,
                reference.as_ref(),
                pairs.len(),
                tokens,
            )?;
            let loss = ml.loss.to_dtype(DType::F64)?.reshape(1)?;
            Ok(Tensor::cat(&[loss, ml.sums], 0)?)
        })?;
        total = Some(match total {
            Some(t) => (t + part)?,
            None => part,
        });
    }
    let read = match &total {
        Some(t) => crate::host::read(t)?,
        None => vec![f64::NAN; 1 + METRIC_NAMES.len()],
    };
    Ok((
        read[0],
        Metrics::from_sums(objective, &read[1..], pairs.len(), tokens),
    ))
}

/// The file `preference.precompute_ref` caches the reference log-probs in.
pub const REFERENCE_CACHE: &str = "reference-logps.safetensors";

/// What a reference cache must match: the base model, its storage and the tokenized rows
/// (FNV-1a over the settings and every row's ids and targets).
pub fn cache_fingerprint(cfg: &TrainConfig, rows: &[Row]) -> String {
    let mut h: u64 = 0xcbf29ce484222325;
    let mut eat = |bytes: &[u8]| {
        for b in bytes {
            h ^= *b as u64;
            h = h.wrapping_mul(0x100000001b3);
        }
    };
    eat(cfg.model.path.to_string_lossy().as_bytes());
    eat(cfg.model.dtype.name().as_bytes());
    eat(cfg.model.quantize.name().as_bytes());
    eat(&[cfg.model.double_quant as u8]);
    for r in rows {
        eat(&(r.ids.len() as u64).to_le_bytes());
        for (id, t) in r.ids.iter().zip(&r.targets) {
            eat(&id.to_le_bytes());
            eat(&[*t as u8]);
        }
    }
    format!("{h:016x}")
}

/// `preference.precompute_ref`: the reference log-prob sum of every row (chosen and rejected
/// alternating, as `rows`), read from `output_dir/reference-logps.safetensors` when it was
/// written for these rows and this base, else computed in micro-batches of `micro_batch` pairs
/// (adapters off, no graph) and written there atomically (when `write`: rank 0 of a
/// data-parallel run; the other ranks compute the same values), so a resumed run reuses it.
pub fn reference_cache(
    cfg: &TrainConfig,
    model: &CausalLM,
    rows: &[Row],
    pad: u32,
    weights_moved: bool,
    write: bool,
    on_note: &mut dyn FnMut(String),
) -> Result<Vec<f32>, TrainError> {
    let path = cfg.train.output_dir.join(REFERENCE_CACHE);
    let fingerprint = cache_fingerprint(cfg, rows);
    if let Ok(bytes) = std::fs::read(&path) {
        if let Ok(st) = safetensors::SafeTensors::deserialize(&bytes) {
            let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes)
                .map_err(|e| TrainError::Invalid(format!("{}: {e}", path.display())))?;
            let same = meta
                .metadata()
                .as_ref()
                .and_then(|m| m.get("fingerprint"))
                .is_some_and(|f| *f == fingerprint);
            if let (true, Ok(view)) = (same, st.tensor("logps")) {
                let values: Vec<f32> = view
                    .data()
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect();
                if values.len() == rows.len() {
                    on_note(format!(
                        "reference log-probs of {} pairs read from {}",
                        rows.len() / 2,
                        path.display()
                    ));
                    return Ok(values);
                }
            }
        }
    }
    if weights_moved {
        return Err(TrainError::Resume(format!(
            "{} is missing or was written for other data or another base, and this full-weight \
             run's weights have moved since its start, so the reference cannot be recomputed; \
             start the run again (without --resume), or restore that file",
            path.display()
        )));
    }
    let device = model.device();
    let pairs: Vec<(&Row, &Row)> = rows.chunks_exact(2).map(|p| (&p[0], &p[1])).collect();
    let mut parts = Vec::new();
    for micro in pairs.chunks(cfg.train.micro_batch_size.max(1)) {
        let pb = PairBatch::new(micro, pad, device)?;
        let r = reference_logps(model, &pb)?; // (2m): chosen rows, then rejected
        let m = micro.len();
        // Interleave back to row order: chosen_i, rejected_i.
        parts.push(Tensor::stack(&[r.narrow(0, 0, m)?, r.narrow(0, m, m)?], 1)?.flatten_all()?);
    }
    let all = Tensor::cat(&parts, 0)?;
    let values: Vec<f32> = crate::host::read(&all)?.iter().map(|&v| v as f32).collect();
    if !write {
        return Ok(values);
    }
    let tensor = Tensor::from_vec(values.clone(), values.len(), &Device::Cpu)?;
    let meta = std::collections::HashMap::from([("fingerprint".to_string(), fingerprint)]);
    tallow_model::io::save_safetensors(&path, &[("logps".to_string(), tensor)], Some(meta))?;
    on_note(format!(
        "reference log-probs of {} pairs computed (adapters off) and cached in {}",
        pairs.len(),
        path.display()
    ));
    Ok(values)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// log_sigmoid's value and gradient against the closed forms log(1 / (1 + e^-x)) and
    /// 1 / (1 + e^x), at the kink x = 0 (where a min / abs construction gives slope 1) and away
    /// from it, including large |x| where the naive forms overflow.
    #[test]
    fn log_sigmoid_value_and_slope() -> candle_core::Result<()> {
        let xs = [-30.0f32, -2.0, -1e-3, 0.0, 1e-3, 2.0, 30.0];
        let x = candle_core::Var::from_slice(&xs, xs.len(), &Device::Cpu)?;
        let y = log_sigmoid(x.as_tensor())?;
        let g = y.sum_all()?.backward()?;
        let (ys, gs) = (y.to_vec1::<f32>()?, g.get(&x).unwrap().to_vec1::<f32>()?);
        for (i, &v) in xs.iter().enumerate() {
            let v = v as f64;
            let want_y = -(1.0 + (-v).exp()).ln();
            let want_g = 1.0 / (1.0 + v.exp());
            assert!(
                (ys[i] as f64 - want_y).abs() < 1e-6,
                "value at {v}: {}",
                ys[i]
            );
            assert!(
                (gs[i] as f64 - want_g).abs() < 1e-6,
                "slope at {v}: {}",
                gs[i]
            );
        }
        Ok(())
    }
}
