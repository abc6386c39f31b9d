//! Adapters on the linear layers: each kind in its own file ([`lora`], [`dora`]) implementing the
//! linear's `Adapter` trait (`crate::nn::linear`) and a [`kind::KindSpec`] (its name, PEFT's flag, a
//! fresh adapter, what it costs), registered once in [`AdapterKind`]; attaching, merging
//! ([`attach`]) and PEFT's file format ([`format`]) work through those two and never name a
//! kind.
//!
//! A new adapter kind: its file here, a variant of [`AdapterKind`] with its row in
//! [`AdapterKind::spec`]. The training config's `lora.kind`, the checkpoint, the estimate and
//! the model card follow (docs/architecture.md).

pub mod attach;
pub mod dora;
pub mod experts;
pub mod format;
pub mod kind;
pub mod lora;
pub mod names;

use kind::KindSpec;

use crate::config::layout::LoraPlan;

/// The adapter kinds: `lora.kind` in a training config, PEFT's `use_dora` in
/// adapter_config.json.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub enum AdapterKind {
    /// LoRA (PEFT's default).
    #[default]
    Lora,
    /// DoRA (PEFT's `use_dora`).
    Dora,
}

impl AdapterKind {
    pub const ALL: [AdapterKind; 2] = [AdapterKind::Lora, AdapterKind::Dora];
    /// The names, as `lora.kind` takes them.
    pub const NAMES: [&'static str; 2] = ["lora", "dora"];

    /// The kind's file: its [`KindSpec`].
    pub fn spec(self) -> &'static dyn KindSpec {
        match self {
            AdapterKind::Lora => &lora::LoraKind,
            AdapterKind::Dora => &dora::DoraKind,
        }
    }

    pub fn name(self) -> &'static str {
        self.spec().name()
    }

    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.name() == name)
    }

    /// The kind PEFT's `use_dora` flag names.
    pub fn from_use_dora(use_dora: bool) -> Self {
        Self::ALL
            .into_iter()
            .find(|k| k.spec().use_dora() == use_dora)
            .unwrap_or_default()
    }
}

impl serde::Serialize for AdapterKind {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

impl<'de> serde::Deserialize<'de> for AdapterKind {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        AdapterKind::from_name(&s).ok_or_else(|| {
            serde::de::Error::custom(format!(
                "unknown adapter kind `{s}` (one of {})",
                Self::NAMES.join(", ")
            ))
        })
    }
}

/// The modules LoRA can target, by their HF names (the module part of
/// [`crate::config::layout::LINEAR_PATHS`]).
pub const LINEAR_MODULES: [&str; 7] = [
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
];

/// Phi-3's fused linears, by PEFT's names (the module part of
/// [`crate::config::layout::FUSED_LINEAR_PATHS`]).
pub const FUSED_MODULES: [&str; 4] = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"];

/// Every module name LoRA can target on some family (a training config is checked against
/// these before the model is read; `DecoderConfig::resolve_lora_targets` then checks them
/// against the model).
pub const KNOWN_MODULES: [&str; 9] = [
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "qkv_proj",
    "gate_up_proj",
];

/// What adapter to attach: PEFT's `LoraConfig` fields that tallow supports.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraSpec {
    pub rank: usize,
    pub alpha: f64,
    pub dropout: f64,
    /// Module names (`q_proj`, ...).
    pub targets: Vec<String>,
    pub rslora: bool,
    /// LoRA or DoRA (PEFT's `use_dora`: a magnitude vector per output feature, Liu et al. 2024).
    pub kind: AdapterKind,
    /// PEFT's `target_parameters`: transformers 5's fused expert tensors of a mixture of
    /// experts (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`); empty: none
    /// ([`crate::config::layout::LoraPlan`]).
    pub target_parameters: Vec<String>,
}

impl LoraSpec {
    /// Which linears of `config`'s layers this adapter wraps. PEFT's fused-expert adapter
    /// (`ParamWrapper`) takes neither dropout nor DoRA, so a spec with `target_parameters`
    /// and either is refused, as PEFT refuses it.
    pub fn plan(&self, config: &crate::config::DecoderConfig) -> crate::error::Result<LoraPlan> {
        if !self.target_parameters.is_empty() {
            if self.dropout > 0.0 {
                return Err(crate::error::ModelError::Invalid(format!(
                    "LoRA target_parameters (the fused expert tensors) take no dropout, as in \
                     PEFT, whose fused-expert LoRA refuses lora_dropout != 0: set the dropout to 0 \
                     (found {})",
                    self.dropout
                )));
            }
            if self.kind != AdapterKind::Lora {
                return Err(crate::error::ModelError::Invalid(format!(
                    "LoRA target_parameters (the fused expert tensors) take plain LoRA only, as \
                     in PEFT; this adapter is {}",
                    self.kind.spec().label()
                )));
            }
        }
        config.lora_plan(&self.targets, &self.target_parameters)
    }

    /// alpha / r, or alpha / sqrt(r) with rsLoRA.
    pub fn scale(&self) -> f64 {
        if self.rslora {
            self.alpha / (self.rank as f64).sqrt()
        } else {
            self.alpha / self.rank as f64
        }
    }
}
