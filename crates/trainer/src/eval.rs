//! `tallow eval`: token-weighted mean NLL over every target of a dataset.
//!
//! loss = (sum of target-token NLL over all rows) / (number of target tokens), i.e. not a mean of
//! per-row or per-batch means, so the batch size and padding do not change it.
//!
//! The forward runs inside [`tallow_model::nn::no_grad`]: trainable weights (LoRA A/B, or every
//! weight in full fine-tuning) enter it detached, so Candle records no graph and each
//! intermediate is freed as soon as it is used. Evaluating a batch therefore needs less memory
//! than a training forward of the same batch, and the trainer evaluates at its training
//! micro-batch: evaluation cannot be what runs out of memory.

use candle_core::DType;
use tallow_model::nn::no_grad::{self, no_grad};
use tallow_model::{lm_head_nll, CausalLM};

use crate::batch::Batch;
use crate::data::Example;

/// The result of evaluating a dataset.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EvalResult {
    /// Mean NLL per target token (nats).
    pub loss: f64,
    /// exp(loss)
    pub perplexity: f64,
    pub nll_sum: f64,
    /// Target tokens.
    pub tokens: usize,
    /// Rows evaluated.
    pub rows: usize,
    /// Input tokens (targets and context).
    pub input_tokens: usize,
}

/// Evaluates `examples` in batches of `batch_size` (in file order), padding with `pad_id`,
/// without an autograd graph. `progress` is called with the number of rows done after each batch.
pub fn evaluate(
    model: &CausalLM,
    examples: &[Example],
    batch_size: usize,
    pad_id: u32,
    mut progress: impl FnMut(usize),
) -> tallow_model::Result<EvalResult> {
    let batch_size = batch_size.max(1);
    // Summed on the device, read once at the end (`crate::host`).
    let mut nll_total: Option<candle_core::Tensor> = None;
    let mut tokens = 0;
    let mut input_tokens = 0;
    let mut done = 0;
    for chunk in examples.chunks(batch_size) {
        let refs: Vec<&Example> = chunk.iter().collect();
        let batch = Batch::new(&refs, pad_id, model.device())?;
        let nll = no_grad(|| {
            // padding marked (a LongRoPE model picks each row's factors by its own length)
            let hidden = model.forward_hidden(&batch.input_ids, batch.segments.as_deref())?; // (B, T, C)
            let head = no_grad::enter(model.lm_head_weight()); // (V, C)
            let cap = model.config.variant.final_logit_softcapping;
            lm_head_nll(&hidden, &head, &batch.targets, cap) // () summed over targets
        })?;
        debug_assert!(!nll.track_op(), "evaluation recorded a graph");
        let nll = nll.to_dtype(DType::F64)?;
        nll_total = Some(match nll_total {
            Some(acc) => (acc + nll)?,
            None => nll,
        });
        tokens += batch.targets.count;
        input_tokens += batch.tokens;
        done += chunk.len();
        progress(done);
    }
    let nll_sum = match &nll_total {
        Some(t) => crate::host::read(t)?[0],
        None => 0.0,
    };
    let loss = if tokens > 0 {
        nll_sum / tokens as f64
    } else {
        f64::NAN
    };
    Ok(EvalResult {
        loss,
        perplexity: loss.exp(),
        nll_sum,
        tokens,
        rows: examples.len(),
        input_tokens,
    })
}
