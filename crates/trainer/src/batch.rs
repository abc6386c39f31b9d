//! Turning examples into model inputs: right-padded (B, T) token ids plus the positions whose next
//! token is a target. Padding never changes a result: attention is causal, so a real token never
//! sees the padding after it, and padded positions are never targets.

use candle_core::{Device, Tensor};
use tallow_model::Targets;

use crate::data::Example;

/// One batch on the device.
pub struct Batch {
    /// (B, T) u32
    pub input_ids: Tensor,
    pub targets: Targets,
    /// Real (non-padding) tokens in the batch.
    pub tokens: usize,
}

impl Batch {
    /// Pads `examples` on the right with `pad_id` to the longest one.
    pub fn new(examples: &[&Example], pad_id: u32, device: &Device) -> tallow_model::Result<Self> {
        let t = examples.iter().map(|e| e.ids.len()).max().unwrap_or(0);
        let mut ids = Vec::with_capacity(examples.len());
        let mut tgt = Vec::with_capacity(examples.len());
        for e in examples {
            let mut row = e.ids.clone();
            row.resize(t, pad_id);
            let mut tg = e.targets.clone();
            tg.resize(t, false);
            ids.push(row);
            tgt.push(tg);
        }
        let flat: Vec<u32> = ids.iter().flatten().copied().collect();
        Ok(Self {
            input_ids: Tensor::from_vec(flat, (examples.len(), t), device)?,
            targets: Targets::new(&ids, &tgt, device)?,
            tokens: examples.iter().map(|e| e.ids.len()).sum(),
        })
    }
}
