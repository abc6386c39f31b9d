//! The config's own enums: `model.dtype`, `model.quantize`, `train.method` and `lora.targets`.
//! Their names are declared once, with [`choices!`]; `data.format`, `train.optimizer` and
//! `train.schedule` are declared the same way beside the code that uses them
//! ([`crate::data::Format`], [`crate::optim::OptimizerKind`], [`crate::schedule::Schedule`]).

use candle_core::DType;
use serde::{Deserialize, Serialize};

use super::choice::choices;
use super::LORA_TARGETS;

choices! {
    /// `model.dtype`: storage and compute dtype of the frozen base weights.
    #[derive(Default)]
    pub enum ModelDtype {
        /// 32-bit float.
        F32 = "f32",
        /// IEEE half precision.
        F16 = "f16",
        /// bfloat16 (the default).
        #[default]
        Bf16 = "bf16",
    }
}

impl ModelDtype {
    /// The Candle dtype.
    pub fn to_dtype(self) -> DType {
        match self {
            ModelDtype::F32 => DType::F32,
            ModelDtype::F16 => DType::F16,
            ModelDtype::Bf16 => DType::BF16,
        }
    }
}

choices! {
    /// `model.attention`: how the forward computes attention (training, eval).
    #[derive(Default)]
    pub enum Attention {
        /// Blocks of queries, nothing T x T kept: activation memory O(T) (the default).
        #[default]
        Chunked = "chunked",
        /// HF's eager attention: every layer keeps its (T, T) scores and probabilities.
        Eager = "eager",
    }
}

impl From<Attention> for tallow_model::AttentionImpl {
    fn from(a: Attention) -> Self {
        match a {
            Attention::Chunked => Self::Chunked,
            Attention::Eager => Self::Eager,
        }
    }
}

choices! {
    /// `model.quantize`: how the frozen linear weights inside the decoder layers are stored.
    #[derive(Default)]
    pub enum Quantize {
        /// In `model.dtype`.
        #[default]
        None = "none",
        /// 4-bit NormalFloat, bitsandbytes layout (QLoRA); embeddings, norms and lm_head stay in
        /// `model.dtype`.
        Nf4 = "nf4",
        /// A GGUF checkpoint's weights in llama.cpp's block formats (Q4_K, Q8_0, ...) kept as
        /// the file stores them and dequantized for each matmul (LoRA over a quantized GGUF in
        /// its footprint, docs/gguf.md); its plain-float tensors load in `model.dtype`. Only for
        /// a GGUF `model.path`.
        Keep = "keep",
    }
}

impl Quantize {
    /// Whether the decoder linears are stored quantized, hence frozen (LoRA only).
    pub fn freezes_base(self) -> bool {
        self != Quantize::None
    }
}

choices! {
    /// An entry of `train.log`: where the run's metrics go.
    pub enum LogSink {
        /// `output_dir/metrics.jsonl`, one JSON object per logged step and evaluation.
        Jsonl = "jsonl",
        /// TensorBoard event files under `output_dir/tensorboard/` ([`crate::tensorboard`]).
        Tensorboard = "tensorboard",
    }
}

choices! {
    /// `train.method`: which weights are trained.
    #[derive(Default)]
    pub enum Method {
        /// Low-rank adapters on `lora.targets`; the base stays frozen.
        #[default]
        Lora = "lora",
        /// Every weight of the model.
        Full = "full",
        /// Direct Preference Optimization (Rafailov et al. 2023) on LoRA / DoRA adapters, the
        /// reference being the same weights with the adapters off ([`crate::preference`]).
        Dpo = "dpo",
        /// Odds Ratio Preference Optimization (Hong et al. 2024) on LoRA / DoRA adapters: no
        /// reference model.
        Orpo = "orpo",
    }
}

impl Method {
    /// Whether the run trains adapters (`[lora]`) on a frozen base: every method but `full`.
    pub fn adapters(self) -> bool {
        self != Method::Full
    }

    /// Whether the run trains on preference pairs (`dpo`, `orpo`).
    pub fn preference(self) -> bool {
        matches!(self, Method::Dpo | Method::Orpo)
    }
}

choices! {
    /// `preference.loss`: DPO's loss on the reward margin, as TRL's `loss_type`.
    #[derive(Default)]
    pub enum PreferenceLoss {
        /// -log sigmoid(beta * margin), with `label_smoothing` (the DPO paper's; the default).
        #[default]
        Sigmoid = "sigmoid",
        /// (margin - 1 / (2 beta))^2 on per-token mean log-probs (IPO, Azar et al. 2023).
        Ipo = "ipo",
    }
}

/// The string that makes `lora.targets` every linear layer of [`LORA_TARGETS`] (PEFT's
/// `target_modules = "all-linear"`).
pub const ALL_LINEAR: &str = "all-linear";

/// `lora.targets`: the string [`ALL_LINEAR`] or a list of names from [`LORA_TARGETS`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "TargetsRepr", into = "TargetsRepr")]
pub enum LoraTargets {
    /// These module names, as written.
    List(Vec<String>),
    /// Every name of [`LORA_TARGETS`].
    AllLinear,
}

impl Default for LoraTargets {
    fn default() -> Self {
        LoraTargets::List(LORA_TARGETS.iter().map(|s| s.to_string()).collect())
    }
}

impl LoraTargets {
    /// The module names; `AllLinear` expands to [`LORA_TARGETS`].
    pub fn names(&self) -> Vec<&str> {
        match self {
            LoraTargets::List(list) => list.iter().map(String::as_str).collect(),
            LoraTargets::AllLinear => LORA_TARGETS.to_vec(),
        }
    }
}

/// How `lora.targets` is written in TOML.
#[derive(Serialize, Deserialize)]
#[serde(untagged)]
enum TargetsRepr {
    Name(String),
    List(Vec<String>),
}

impl TryFrom<TargetsRepr> for LoraTargets {
    type Error = String;

    fn try_from(repr: TargetsRepr) -> Result<Self, String> {
        match repr {
            TargetsRepr::Name(s) if s == ALL_LINEAR => Ok(LoraTargets::AllLinear),
            TargetsRepr::Name(s) => Err(format!(
                "expected \"{ALL_LINEAR}\" or a list of module names, found the string {s:?}"
            )),
            TargetsRepr::List(list) => Ok(LoraTargets::List(list)),
        }
    }
}

impl From<LoraTargets> for TargetsRepr {
    fn from(t: LoraTargets) -> Self {
        match t {
            LoraTargets::List(list) => TargetsRepr::List(list),
            LoraTargets::AllLinear => TargetsRepr::Name(ALL_LINEAR.into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dtype_names_and_candle_dtypes() {
        let want = [
            (ModelDtype::F32, "f32", DType::F32),
            (ModelDtype::F16, "f16", DType::F16),
            (ModelDtype::Bf16, "bf16", DType::BF16),
        ];
        assert_eq!(ModelDtype::ALL.len(), want.len());
        for (dtype, name, dt) in want {
            assert_eq!(dtype.name(), name);
            assert_eq!(dtype.to_dtype(), dt);
        }
        assert_eq!(ModelDtype::default(), ModelDtype::Bf16);
        assert_eq!(Quantize::NAMES, ["none", "nf4", "keep"]);
        assert_eq!(Method::NAMES, ["lora", "full", "dpo", "orpo"]);
        assert_eq!(
            (Quantize::default(), Method::default()),
            (Quantize::None, Method::Lora)
        );
    }

    #[test]
    fn targets_repr() {
        let all: LoraTargets = serde_json::from_str("\"all-linear\"").unwrap();
        assert_eq!(all, LoraTargets::AllLinear);
        assert_eq!(serde_json::to_string(&all).unwrap(), "\"all-linear\"");
        assert_eq!(all.names(), LORA_TARGETS.to_vec());
        let e = serde_json::from_str::<LoraTargets>("\"q_proj\"")
            .unwrap_err()
            .to_string();
        assert!(e.contains("expected \"all-linear\" or a list"), "{e}");
        let list: LoraTargets = serde_json::from_str("[\"v_proj\"]").unwrap();
        assert_eq!(list.names(), ["v_proj"]);
    }
}
