//! What every family's `config.json` shares: the keys all of them read ([`CommonKeys`], HF's
//! names word for word), the rotary settings in both transformers layouts, the checks, and
//! [`CommonKeys::into_config`], the one place a [`DecoderConfig`] is built.

use std::path::Path;

use serde::Deserialize;

use crate::config::hf_keys::Refusals;
use crate::config::{Activation, Arch, DecoderConfig, RopeScaling, Variant};
use crate::error::{ModelError, Result};

/// The `config.json` keys every family reads, with HF's defaults (a family with another
/// default for `max_position_embeddings` gives it in [`FamilyShape`]).
#[derive(Debug, Clone, Deserialize)]
pub struct CommonKeys {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: Option<usize>,
    #[serde(default = "silu")]
    pub hidden_act: String,
    #[serde(default)]
    pub max_position_embeddings: Option<usize>,
    #[serde(default = "eps")]
    pub rms_norm_eps: f64,
    /// transformers 4 layout; transformers 5 writes `rope_parameters` instead.
    #[serde(default)]
    pub rope_theta: Option<f64>,
    #[serde(default)]
    pub rope_scaling: Option<serde_json::Value>,
    #[serde(default)]
    pub rope_parameters: Option<serde_json::Value>,
    #[serde(default)]
    pub layer_types: Option<Vec<String>>,
    #[serde(default)]
    pub attention_dropout: f64,
    /// Absent: the family's default ([`FamilyShape::tie_word_embeddings`]).
    #[serde(default)]
    pub tie_word_embeddings: Option<bool>,
    #[serde(default)]
    pub bos_token_id: Option<u32>,
    #[serde(default)]
    pub eos_token_id: TokenIds,
}

fn silu() -> String {
    "silu".into()
}

fn eps() -> f64 {
    1e-6
}

/// What a family decides beyond the common keys: its layer types, head size, biases, norms.
#[derive(Debug, Clone)]
pub struct FamilyShape {
    /// The `layer_types` entries it runs.
    pub layer_types: &'static [&'static str],
    /// `head_dim` when the config gives one; else hidden_size / num_attention_heads.
    pub head_dim: Option<usize>,
    /// HF's default `max_position_embeddings` for the family.
    pub max_position_embeddings: usize,
    pub qkv_bias: bool,
    pub o_bias: bool,
    pub mlp_bias: bool,
    pub qk_norm: bool,
    pub sliding_window: Option<usize>,
    /// HF's default `tie_word_embeddings` for the family (when config.json leaves it out).
    pub tie_word_embeddings: bool,
    /// Where the family leaves the Llama layout (`Variant::default()` for a Llama-like one).
    pub variant: Variant,
}

/// What a family adds beyond the Llama layout (`Family::extras`; none by default): Phi-3's
/// fused projections, its partial rotary embedding and LongRoPE's original context.
#[derive(Debug, Clone, Default)]
pub struct FamilyExtras {
    /// q/k/v in one `qkv_proj`, gate/up in one `gate_up_proj`.
    pub fused_projections: bool,
    /// The rotary settings the family reads beyond the shared ones; None: a whole-head rotary
    /// table of the shared types only (default, llama3, linear).
    pub rope: Option<RopeExtras>,
    /// Gemma 3: the sliding layers' own rotary table (None: one table for every layer).
    pub local_rope: Option<LocalRope>,
    /// The family's default `rope_theta` when neither layout gives one (None: 10000).
    pub default_rope_theta: Option<f64>,
    /// A mixture of experts (Qwen3-MoE, Mixtral): its sparse blocks.
    pub moe: Option<crate::config::Moe>,
}

/// Gemma 3's second rotary table, for its `sliding_attention` layers: theta only, never
/// scaled (transformers 4.57 builds it from a config copy with `rope_theta =
/// rope_local_base_freq` and `rope_scaling = default`; 5.x reads
/// `rope_parameters.sliding_attention`). The full-attention layers keep `rope_theta` and
/// `rope_scaling` (5.x: `rope_parameters.full_attention`).
#[derive(Debug, Clone, Copy)]
pub struct LocalRope {
    /// The top-level `rope_local_base_freq` (transformers 4 layout), None when absent.
    pub rope_local_base_freq: Option<f64>,
    /// Its default in the family's config class.
    pub default: f64,
}

/// A family's top-level rotary keys that transformers 5 also keeps in `rope_parameters`.
#[derive(Debug, Clone, Copy)]
pub struct RopeExtras {
    /// `partial_rotary_factor` (top level; 1.0 when absent).
    pub partial_rotary_factor: f64,
    /// `original_max_position_embeddings` (top level), LongRoPE's pretraining context.
    pub original_max_position_embeddings: Option<usize>,
}

impl CommonKeys {
    /// Checks the shared keys and builds the decoder's config with the family's `shape`.
    /// `family` names it in messages. Every refused value goes into `refusals`; None when one
    /// leaves nothing to build (sizes of zero), else the config (which the caller discards if
    /// anything was refused).
    pub fn into_config(
        self,
        arch: Arch,
        family: &str,
        shape: FamilyShape,
        extras: FamilyExtras,
        refusals: &mut Refusals,
    ) -> Option<DecoderConfig> {
        let path = refusals.path().to_path_buf();
        let path = path.as_path();
        // A family with its own activation key (Gemma 2's `hidden_activation`) has checked it;
        // its modeling code never reads `hidden_act`.
        if shape.variant.act == Activation::Silu {
            refusals.take(check_act(&self.hidden_act, path));
        }
        let kv = self.num_key_value_heads.unwrap_or(self.num_attention_heads);
        refusals.take(check_heads(
            self.hidden_size,
            self.num_attention_heads,
            kv,
            path,
        ))?;
        refusals.take(check_attention_dropout(self.attention_dropout, path));
        let types = refusals
            .take(layer_types(
                &self.layer_types,
                self.num_hidden_layers,
                shape.layer_types,
                family,
                path,
            ))
            .unwrap_or_else(|| vec!["full_attention".to_string()]);
        let max_position_embeddings = self
            .max_position_embeddings
            .unwrap_or(shape.max_position_embeddings);
        let ctx = RopeContext {
            extras: extras.rope,
            max_position_embeddings,
        };
        // Gemma 3: the full-attention layers' table from the shared keys (5.x: their entry of
        // the per-type `rope_parameters`), the sliding layers' from `local_rope`.
        let global_types = match extras.local_rope {
            Some(_) => vec!["full_attention".to_string()],
            None => types.clone(),
        };
        let default_theta = extras.default_rope_theta.unwrap_or(DEFAULT_THETA);
        let (rope_theta, rope_scaling, partial) = refusals
            .take(rope(
                self.rope_theta,
                &self.rope_scaling,
                &self.rope_parameters,
                &global_types,
                default_theta,
                &ctx,
                path,
            ))
            .unwrap_or((default_theta, None, 1.0));
        let mut variant = shape.variant;
        if let Some(local) = extras.local_rope {
            variant.rope_local_base_freq = refusals
                .take(local_rope_theta(local, &self.rope_parameters, &ctx, path))
                .or(Some(local.default));
        }
        let head_dim = shape
            .head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads);
        let rotary_dim = refusals
            .take(rotary_dim(head_dim, partial, rope_scaling.as_ref(), path))
            .unwrap_or(head_dim);
        Some(DecoderConfig {
            arch,
            vocab_size: self.vocab_size,
            hidden_size: self.hidden_size,
            intermediate_size: self.intermediate_size,
            num_hidden_layers: self.num_hidden_layers,
            num_attention_heads: self.num_attention_heads,
            num_key_value_heads: kv,
            head_dim,
            rms_norm_eps: self.rms_norm_eps,
            rope_theta,
            rope_scaling,
            max_position_embeddings,
            qkv_bias: shape.qkv_bias,
            o_bias: shape.o_bias,
            mlp_bias: shape.mlp_bias,
            qk_norm: shape.qk_norm,
            fused_projections: extras.fused_projections,
            rotary_dim,
            tie_word_embeddings: self
                .tie_word_embeddings
                .unwrap_or(shape.tie_word_embeddings),
            sliding_window: shape.sliding_window,
            variant,
            moe: extras.moe,
            bos_token_id: self.bos_token_id,
            eos_token_ids: self.eos_token_id.into_vec(),
            text_tower: false,
            prequantized: None,
            stored_blocks: None,
            keys: Default::default(),
            raw: serde_json::Value::Null,
        })
    }
}

/// A family key that must keep the value that leaves the model a plain decoder: refused by
/// name otherwise (`msg` says what tallow lacks).
pub fn refuse(key: &str, msg: &str, path: &Path) -> ModelError {
    ModelError::Config {
        path: path.to_path_buf(),
        key: key.into(),
        msg: msg.into(),
    }
}

/// `eos_token_id` is an int, a list of ints, or null in HF configs.
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(untagged)]
pub enum TokenIds {
    One(u32),
    Many(Vec<u32>),
    #[default]
    None,
}

impl TokenIds {
    pub fn into_vec(self) -> Vec<u32> {
        match self {
            TokenIds::One(i) => vec![i],
            TokenIds::Many(v) => v,
            TokenIds::None => vec![],
        }
    }
}

/// transformers' default `rope_theta` for Llama, Mistral, Qwen2 and Qwen3.
pub const DEFAULT_THETA: f64 = 10000.0;

/// The rotary settings, read from either layout transformers writes:
/// - transformers 4: top-level `rope_theta` and `rope_scaling` (null, or an object with
///   `rope_type`, or the older `type`, and the type's parameters);
/// - transformers 5: `rope_parameters`, one object with `rope_type`, `rope_theta` and the
///   type's parameters, or one such object per layer type
///   (`{"full_attention": {...}, "sliding_attention": {...}}`).
///
/// `layer_types` are the layer types this model has (each one's parameters must agree:
/// tallow runs one rotary table). When both layouts are present they must agree. Returns the
/// theta, the scaling and the partial rotary factor (1 unless the family reads one, `ctx`).
pub fn rope(
    rope_theta: Option<f64>,
    rope_scaling: &Option<serde_json::Value>,
    rope_parameters: &Option<serde_json::Value>,
    layer_types: &[String],
    default_theta: f64,
    ctx: &RopeContext,
    path: &Path,
) -> Result<(f64, Option<RopeScaling>, f64)> {
    let top_partial = ctx.extras.map_or(1.0, |e| e.partial_rotary_factor);
    let legacy_scaling = match rope_scaling {
        Some(v) if !v.is_null() => Some(rope_object(v, "rope_scaling", ctx, path)?),
        _ => None,
    };
    let legacy = (
        rope_theta
            .or(legacy_scaling.as_ref().and_then(|r| r.theta))
            .unwrap_or(default_theta),
        legacy_scaling.and_then(|r| r.scaling),
        top_partial,
    );
    let Some(params) = rope_parameters.as_ref().filter(|v| !v.is_null()) else {
        return Ok(legacy);
    };
    let err = |msg: String| ModelError::Config {
        path: path.to_path_buf(),
        key: "rope_parameters".into(),
        msg,
    };
    let is_single = params.as_object().is_some_and(|o| {
        o.contains_key("rope_type") || o.contains_key("type") || o.contains_key("rope_theta")
    });
    let parsed = if is_single {
        rope_object(params, "rope_parameters", ctx, path)?
    } else {
        // One object per layer type: the types this model has must all agree.
        let obj = params
            .as_object()
            .ok_or_else(|| err(format!("expected an object, found {params}")))?;
        let mut seen: Option<(String, RopeObject)> = None;
        for t in layer_types {
            let v = obj.get(t).ok_or_else(|| {
                err(format!(
                    "no rotary parameters for layer type `{t}` (has: {})",
                    obj.keys().cloned().collect::<Vec<_>>().join(", ")
                ))
            })?;
            let r = rope_object(v, &format!("rope_parameters.{t}"), ctx, path)?;
            match &seen {
                Some((first, r0)) if *r0 != r => {
                    return Err(err(format!(
                        "layer types `{first}` and `{t}` have different rotary parameters; \
                         tallow runs one rotary table for every layer of this family"
                    )))
                }
                Some(_) => {}
                None => seen = Some((t.clone(), r)),
            }
        }
        seen.map(|(_, r)| r)
            .ok_or_else(|| err("the model has no layer types".into()))?
    };
    let theta = parsed.theta.or(rope_theta).unwrap_or(default_theta);
    // transformers 5 reads the fraction inside `rope_parameters` (its config copies the
    // top-level key there when it saves); 4.57 reads the top-level key.
    let partial = parsed.partial_rotary_factor.unwrap_or(top_partial);
    if partial != top_partial {
        return Err(err(format!(
            "`partial_rotary_factor` {partial} here and {top_partial} at the top level \
             (transformers 4 reads that one) disagree; remove the stale one"
        )));
    }
    let new = (theta, parsed.scaling, partial);
    let has_legacy = rope_theta.is_some() || rope_scaling.as_ref().is_some_and(|v| !v.is_null());
    if has_legacy && new != legacy {
        return Err(err(format!(
            "this key (transformers 5) and `rope_theta` / `rope_scaling` (transformers 4) \
             disagree: theta {} with {:?} here, theta {} with {:?} there; remove the stale one",
            new.0, new.1, legacy.0, legacy.1
        )));
    }
    Ok(new)
}

/// Gemma 3's sliding-layer theta: `rope_parameters.sliding_attention` (transformers 5; its
/// type must be `default`) or the top-level `rope_local_base_freq` (4.57), which must agree
/// when both are there; the class default when neither is. A single-object `rope_parameters`
/// is refused: transformers 5's Gemma 3 reads one object per layer type.
fn local_rope_theta(
    local: LocalRope,
    rope_parameters: &Option<serde_json::Value>,
    ctx: &RopeContext,
    path: &Path,
) -> Result<f64> {
    let err = |key: &str, msg: String| ModelError::Config {
        path: path.to_path_buf(),
        key: key.into(),
        msg,
    };
    let Some(params) = rope_parameters.as_ref().filter(|v| !v.is_null()) else {
        return Ok(local.rope_local_base_freq.unwrap_or(local.default));
    };
    let Some(v) = params.get("sliding_attention") else {
        return Err(err(
            "rope_parameters",
            "Gemma 3 needs one object per layer type (`full_attention`, `sliding_attention`); \
             found none for `sliding_attention`"
                .into(),
        ));
    };
    let r = rope_object(v, "rope_parameters.sliding_attention", ctx, path)?;
    if r.scaling.is_some() {
        return Err(err(
            "rope_parameters.sliding_attention",
            format!(
                "scaling {:?} on the sliding layers is not supported (Gemma 3 scales the \
                 full-attention layers only; transformers 4 cannot express it)",
                r.scaling
            ),
        ));
    }
    let theta = r
        .theta
        .or(local.rope_local_base_freq)
        .unwrap_or(local.default);
    if let Some(top) = local.rope_local_base_freq {
        if top != theta {
            return Err(err(
                "rope_parameters",
                format!(
                    "`sliding_attention` theta {theta} here and `rope_local_base_freq` {top} \
                     (transformers 4) disagree; remove the stale one"
                ),
            ));
        }
    }
    Ok(theta)
}

/// One rotary-parameter object: `rope_type` (or `type`; absent = default), an optional
/// `rope_theta`, and the type's own numbers.
#[derive(Debug, Clone, PartialEq)]
pub struct RopeObject {
    pub theta: Option<f64>,
    pub scaling: Option<RopeScaling>,
    /// `partial_rotary_factor` inside the object (transformers 5), for a family that reads it.
    pub partial_rotary_factor: Option<f64>,
}

/// What [`rope`] needs to know of the config beyond the rotary keys.
#[derive(Debug, Clone, Copy)]
pub struct RopeContext {
    /// The family's own rotary keys (Phi-3); None: whole-head tables of the shared types.
    pub extras: Option<RopeExtras>,
    /// LongRoPE's attention factor reads it.
    pub max_position_embeddings: usize,
}

fn rope_object(
    v: &serde_json::Value,
    key: &str,
    ctx: &RopeContext,
    path: &Path,
) -> Result<RopeObject> {
    let err = |msg: String| ModelError::Config {
        path: path.to_path_buf(),
        key: key.into(),
        msg,
    };
    let obj = v
        .as_object()
        .ok_or_else(|| err(format!("expected an object, found {v}")))?;
    let kind = match obj.get("rope_type").or_else(|| obj.get("type")) {
        Some(t) => t
            .as_str()
            .ok_or_else(|| err(format!("`rope_type` must be a string, found {t}")))?,
        None if key == "rope_scaling" => return Err(err("no `rope_type`".into())),
        None => "default",
    };
    let num = |k: &str| {
        obj.get(k)
            .and_then(|x| x.as_f64())
            .ok_or_else(|| err(format!("`{kind}` scaling needs a number `{k}`")))
    };
    let theta = match obj.get("rope_theta") {
        None => None,
        Some(t) => Some(
            t.as_f64()
                .ok_or_else(|| err(format!("`rope_theta` must be a number, found {t}")))?,
        ),
    };
    // transformers 5 keeps a partial rotary fraction here; the other families rotate
    // the whole head, Phi-3 reads it.
    let mut partial_rotary_factor = None;
    if let Some(f) = obj.get("partial_rotary_factor") {
        match (ctx.extras, f.as_f64()) {
            (Some(_), Some(x)) => partial_rotary_factor = Some(x),
            (None, Some(1.0)) => {}
            _ => {
                return Err(err(format!(
                    "`partial_rotary_factor` {f} is not supported (tallow rotates the whole head)"
                )))
            }
        }
    }
    let scaling = match kind {
        "default" => None,
        "llama3" => Some(RopeScaling::Llama3 {
            factor: num("factor")?,
            low_freq_factor: num("low_freq_factor")?,
            high_freq_factor: num("high_freq_factor")?,
            original_max_position_embeddings: num("original_max_position_embeddings")?,
        }),
        "linear" => Some(RopeScaling::Linear {
            factor: num("factor")?,
        }),
        // `su` is LongRoPE's older name (transformers' Phi3Config renames it).
        "longrope" | "su" if ctx.extras.is_some() => Some(longrope(obj, ctx, &err)?),
        other => {
            return Err(err(format!(
                "rope type `{other}` (transformers rescales the rotary frequencies with it) is \
                 not supported (supported: default, llama3, linear)"
            )))
        }
    };
    Ok(RopeObject {
        theta,
        scaling,
        partial_rotary_factor,
    })
}

/// A `longrope` object: `short_factor` and `long_factor` lists, and the original context, from
/// the object (transformers 5) or the family's top-level key (4.57). `factor` and
/// `attention_factor` are refused: 4.57's Phi3Config takes no other keys, and tallow derives
/// the attention factor as both versions do without them.
fn longrope(
    obj: &serde_json::Map<String, serde_json::Value>,
    ctx: &RopeContext,
    err: &dyn Fn(String) -> ModelError,
) -> Result<RopeScaling> {
    let list = |k: &str| -> Result<Vec<f64>> {
        obj.get(k)
            .and_then(|x| x.as_array())
            .and_then(|a| a.iter().map(|x| x.as_f64()).collect::<Option<Vec<f64>>>())
            .ok_or_else(|| err(format!("`longrope` scaling needs a list of numbers `{k}`")))
    };
    for k in ["factor", "attention_factor"] {
        if obj.get(k).is_some_and(|v| !v.is_null()) {
            return Err(err(format!(
                "`longrope` with `{k}` is not supported: tallow takes the attention factor \
                 from max_position_embeddings / original_max_position_embeddings, as \
                 transformers does when the key is absent"
            )));
        }
    }
    let top = ctx.extras.and_then(|e| e.original_max_position_embeddings);
    let here = match obj.get("original_max_position_embeddings") {
        None => None,
        Some(v) => Some(v.as_u64().ok_or_else(|| {
            err(format!(
                "`original_max_position_embeddings` must be a positive integer, found {v}"
            ))
        })? as usize),
    };
    let original = match (here, top) {
        (Some(a), Some(b)) if a != b => {
            return Err(err(format!(
                "`original_max_position_embeddings` {a} here and {b} at the top level disagree; \
                 remove the stale one"
            )))
        }
        (Some(a), _) | (None, Some(a)) => a,
        (None, None) => {
            return Err(err(
                "`longrope` scaling needs `original_max_position_embeddings`".into(),
            ))
        }
    };
    if original < 2 {
        return Err(err(format!(
            "`original_max_position_embeddings` {original} must be at least 2"
        )));
    }
    // transformers' `_compute_longrope_parameters`: factor = max / original, and the attention
    // factor sqrt(1 + ln(factor) / ln(original)) when factor > 1, else 1.
    let factor = ctx.max_position_embeddings as f64 / original as f64;
    let attention_factor = if factor <= 1.0 {
        1.0
    } else {
        (1.0 + factor.ln() / (original as f64).ln()).sqrt()
    };
    Ok(RopeScaling::LongRope {
        short_factor: list("short_factor")?,
        long_factor: list("long_factor")?,
        original_max_position_embeddings: original,
        attention_factor,
    })
}

/// The rotated dims of a head: int(head_dim * partial), as transformers computes it; even, and
/// with LongRoPE one short and one long factor per rotated pair.
fn rotary_dim(
    head_dim: usize,
    partial: f64,
    scaling: Option<&RopeScaling>,
    path: &Path,
) -> Result<usize> {
    let err = |key: &str, msg: String| ModelError::Config {
        path: path.to_path_buf(),
        key: key.into(),
        msg,
    };
    if !(partial > 0.0 && partial <= 1.0) {
        return Err(err(
            "partial_rotary_factor",
            format!("{partial} must be in (0, 1]"),
        ));
    }
    let dim = (head_dim as f64 * partial) as usize;
    if dim == 0 || !dim.is_multiple_of(2) {
        return Err(err(
            "partial_rotary_factor",
            format!(
                "{partial} of head_dim {head_dim} rotates {dim} dims; tallow needs an even, \
                 positive number"
            ),
        ));
    }
    if let Some(RopeScaling::LongRope {
        short_factor,
        long_factor,
        ..
    }) = scaling
    {
        for (k, l) in [("short_factor", short_factor), ("long_factor", long_factor)] {
            if l.len() != dim / 2 {
                return Err(err(
                    "rope_scaling",
                    format!(
                        "`{k}` has {} entries; the rotary dim {dim} needs {} (one per pair)",
                        l.len(),
                        dim / 2
                    ),
                ));
            }
        }
    }
    Ok(dim)
}

/// `layer_types` (transformers >= 4.56 writes it for some families, 5.x for most): one entry
/// per layer; `allowed` are the types this family runs. Absent: every layer `full_attention`.
pub fn layer_types(
    types: &Option<Vec<String>>,
    num_layers: usize,
    allowed: &[&str],
    family: &str,
    path: &Path,
) -> Result<Vec<String>> {
    let Some(types) = types else {
        return Ok(vec!["full_attention".to_string()]);
    };
    let err = |msg: String| ModelError::Config {
        path: path.to_path_buf(),
        key: "layer_types".into(),
        msg,
    };
    if types.len() != num_layers {
        return Err(err(format!(
            "has {} entries but num_hidden_layers is {num_layers}",
            types.len()
        )));
    }
    let mut distinct: Vec<String> = Vec::new();
    for t in types {
        if !allowed.contains(&t.as_str()) {
            return Err(err(format!(
                "layer type `{t}` is not supported by tallow's {family} (supported: {})",
                allowed.join(", ")
            )));
        }
        if !distinct.contains(t) {
            distinct.push(t.clone());
        }
    }
    Ok(distinct)
}

/// `head_dim` of a family whose config class has no such key but whose modeling code reads it
/// with `getattr` (Qwen2, Phi-3): accepted when it equals hidden_size / num_attention_heads,
/// which is what tallow computes for the family.
pub fn check_derived_head_dim(
    head_dim: Option<usize>,
    common: &CommonKeys,
    family: &str,
    refusals: &mut Refusals,
) {
    let derived = common
        .hidden_size
        .checked_div(common.num_attention_heads)
        .unwrap_or(0);
    if let Some(d) = head_dim.filter(|&d| d != derived) {
        refusals.push(
            "head_dim",
            format!(
                "{family}'s attention and rotary init read it in place of hidden_size / \
                 num_attention_heads ({derived}); tallow's {family} implements {derived} only, \
                 not {d}"
            ),
        );
    }
}

/// `attention_dropout`: transformers drops attention probabilities while training; tallow's
/// attention has no dropout, so only 0 is accepted.
pub fn check_attention_dropout(p: f64, path: &Path) -> Result<()> {
    if p != 0.0 {
        return Err(ModelError::Config {
            path: path.to_path_buf(),
            key: "attention_dropout".into(),
            msg: format!(
                "drops attention probabilities in training; {p} is not supported (tallow's \
                 attention has no dropout): set it to 0.0 (LoRA dropout is `lora.dropout` in \
                 the training config)"
            ),
        });
    }
    Ok(())
}

pub fn check_act(act: &str, path: &Path) -> Result<()> {
    if act != "silu" {
        return Err(ModelError::Config {
            path: path.to_path_buf(),
            key: "hidden_act".into(),
            msg: format!("the MLP's activation; `{act}` is not supported (only `silu`)"),
        });
    }
    Ok(())
}

pub fn check_heads(hidden: usize, heads: usize, kv: usize, path: &Path) -> Result<()> {
    let err = |key: &str, msg: String| ModelError::Config {
        path: path.to_path_buf(),
        key: key.into(),
        msg,
    };
    if heads == 0 || kv == 0 || hidden == 0 {
        return Err(err("num_attention_heads", "sizes must be positive".into()));
    }
    if !heads.is_multiple_of(kv) {
        return Err(err(
            "num_key_value_heads",
            format!("{kv} does not divide num_attention_heads {heads}"),
        ));
    }
    Ok(())
}
