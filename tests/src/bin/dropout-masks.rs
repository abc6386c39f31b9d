//! Dev tool: the LoRA dropout masks tallow draws for the dropout parity fixture, written for
//! `scripts/make_dropout_fixtures.py` to inject into PEFT.
//!
//!   cargo run -p tallow-tests --bin dropout-masks
//!
//! For each tiny fixture model M: the keep flags of every mask of micro-batch 0 of step 0 of a
//! run with `lora.init = tests/fixtures/adapters/M-peft`, `lora.dropout = DROPOUT_P`,
//! `train.seed = DROPOUT_SEED`, the 4 text rows in one micro-batch (see
//! `tallow_tests::dropout_keep_masks`), to `tests/fixtures/reference/dropout-M-masks.safetensors`.

use tallow_tests::*;

fn main() {
    for model in MODELS {
        let reference = reference_json(model);
        let rows = reference_rows(&reference, "text");
        let t = rows.iter().map(|(ids, _)| ids.len()).max().unwrap();
        let masks = dropout_keep_masks(
            &model_dir(model),
            &fixtures().join(format!("adapters/{model}-peft")),
            DROPOUT_P,
            DROPOUT_SEED,
            rows.len(),
            t,
        );
        let out = fixtures().join(format!("reference/dropout-{model}-masks.safetensors"));
        candle_core::safetensors::save(&masks, &out).unwrap();
        println!(
            "{}: {} masks, {} rows x {t} tokens",
            out.display(),
            masks.len(),
            rows.len()
        );
    }
}
