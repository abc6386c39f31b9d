//! Turning examples into model inputs: right-padded (B, T) token ids plus the positions whose next
//! token is a target. Padding never changes a result: attention is causal, so a real token never
//! sees the padding after it, and padded positions are never targets.
//!
//! Packing (`data.pack = true`) concatenates several examples into one row of at most
//! `max_seq_len` tokens; each keeps its own segment id, so attention stays inside it and its
//! positions restart at 0 (see `tallow_model::nn::ops::attention_mask`).

use candle_core::{Device, Tensor};
use tallow_model::Targets;

use crate::data::Example;

/// One model input row: an example, or several packed together.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    pub ids: Vec<u32>,
    pub targets: Vec<bool>,
    /// Segment id of each token (all 0 for an unpacked row).
    pub segments: Vec<u32>,
}

impl Row {
    pub fn n_targets(&self) -> usize {
        self.targets.iter().filter(|&&t| t).count()
    }
}

impl From<&Example> for Row {
    fn from(e: &Example) -> Self {
        Row {
            ids: e.ids.clone(),
            targets: e.targets.clone(),
            segments: vec![0; e.ids.len()],
        }
    }
}

/// Greedily packs examples, in order, into rows of at most `max_len` tokens.
pub fn pack(examples: &[Example], max_len: usize) -> Vec<Row> {
    let mut rows = Vec::new();
    let mut cur = Row {
        ids: vec![],
        targets: vec![],
        segments: vec![],
    };
    let mut seg = 0u32;
    for e in examples {
        if !cur.ids.is_empty() && cur.ids.len() + e.ids.len() > max_len {
            rows.push(std::mem::replace(
                &mut cur,
                Row {
                    ids: vec![],
                    targets: vec![],
                    segments: vec![],
                },
            ));
            seg = 0;
        }
        cur.ids.extend_from_slice(&e.ids);
        cur.targets.extend_from_slice(&e.targets);
        cur.segments.extend(std::iter::repeat_n(seg, e.ids.len()));
        seg += 1;
    }
    if !cur.ids.is_empty() {
        rows.push(cur);
    }
    rows
}

/// One batch on the device.
pub struct Batch {
    /// (B, T) u32
    pub input_ids: Tensor,
    pub targets: Targets,
    /// B rows of T segment ids, when any row is packed or padded (padding: `u32::MAX`).
    pub segments: Option<Vec<Vec<u32>>>,
    /// Real (non-padding) tokens in the batch.
    pub tokens: usize,
}

impl Batch {
    /// The tokens that are not padding, B rows of T (transformers' `attention_mask`); None when
    /// nothing is padded.
    pub fn valid(&self) -> Option<Vec<Vec<bool>>> {
        self.segments.as_ref().map(|rows| {
            rows.iter()
                .map(|r| r.iter().map(|&s| s != u32::MAX).collect())
                .collect()
        })
    }

    /// Pads `examples` on the right with `pad_id` to the longest one.
    pub fn new(examples: &[&Example], pad_id: u32, device: &Device) -> tallow_model::Result<Self> {
        let rows: Vec<Row> = examples.iter().map(|e| Row::from(*e)).collect();
        Self::from_rows(&rows.iter().collect::<Vec<_>>(), pad_id, device)
    }

    /// Pads rows on the right with `pad_id` (padding gets a segment of its own).
    pub fn from_rows(rows: &[&Row], pad_id: u32, device: &Device) -> tallow_model::Result<Self> {
        let t = rows.iter().map(|r| r.ids.len()).max().unwrap_or(0);
        let mut ids = Vec::with_capacity(rows.len());
        let mut tgt = Vec::with_capacity(rows.len());
        let mut segs = Vec::with_capacity(rows.len());
        for r in rows {
            let mut row = r.ids.clone();
            row.resize(t, pad_id);
            let mut tg = r.targets.clone();
            tg.resize(t, false);
            let mut sg = r.segments.clone();
            sg.resize(t, u32::MAX);
            ids.push(row);
            tgt.push(tg);
            segs.push(sg);
        }
        // Segment ids go to the model when rows are packed or padded: padding is a segment of its
        // own, so a LongRoPE model (Phi-3) picks each row's rotary factors by the row's own
        // length (`tallow_model` `Rotary::tables_for_segments`). Real tokens never attend to
        // padding either way (it comes after them).
        let packed = rows
            .iter()
            .any(|r| r.segments.iter().any(|&s| s != 0) || r.ids.len() < t);
        let flat: Vec<u32> = ids.iter().flatten().copied().collect();
        Ok(Self {
            input_ids: Tensor::from_vec(flat, (rows.len(), t), device)?,
            targets: Targets::new(&ids, &tgt, device)?,
            segments: packed.then_some(segs),
            tokens: rows.iter().map(|r| r.ids.len()).sum(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ex(n: usize) -> Example {
        Example {
            ids: (0..n as u32).collect(),
            targets: (0..n).map(|i| i > 0).collect(),
        }
    }

    #[test]
    fn pack_fills_rows_without_splitting_examples() {
        let rows = pack(&[ex(3), ex(4), ex(2), ex(5)], 8);
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[0].segments, vec![0, 0, 0, 1, 1, 1, 1]);
        assert_eq!(rows[1].segments, vec![0, 0, 1, 1, 1, 1, 1]);
        assert_eq!(rows[0].n_targets() + rows[1].n_targets(), 2 + 3 + 1 + 4);
    }

    #[test]
    fn batch_pads_and_marks_packed_rows() {
        let rows = pack(&[ex(3), ex(2)], 8);
        let plain = Row::from(&ex(2));
        let b = Batch::from_rows(&[&rows[0], &plain], 0, &Device::Cpu).unwrap();
        assert_eq!(b.input_ids.dims(), &[2, 5]);
        assert_eq!(b.tokens, 7);
        assert_eq!(b.targets.count, 2 + 1 + 1);
        assert!(b.segments.is_some());
    }

    /// Padding is marked as a segment of its own (rows of one length need no ids).
    #[test]
    fn batch_marks_padding() {
        let (a, b) = (Row::from(&ex(3)), Row::from(&ex(2)));
        let padded = Batch::from_rows(&[&a, &b], 0, &Device::Cpu).unwrap();
        let segs = padded.segments.unwrap();
        assert_eq!(segs, vec![vec![0, 0, 0], vec![0, 0, u32::MAX]]);
        let even = Batch::from_rows(&[&a, &a], 0, &Device::Cpu).unwrap();
        assert!(even.segments.is_none());
    }
}
