//! One description of a decoder's tensors (names as HF writes them, shapes, biases, norms),
//! derived from [`DecoderConfig`]: loading (`CausalLM::from_weights`), parameter naming
//! (`DecoderLayer::linears`, PEFT keys), parameter counting ([`DecoderConfig::num_params`]),
//! random test models ([`DecoderConfig::hf_tensor_shapes`]) and the memory estimate
//! (`tallow_trainer::estimate`) all read it, so a family that changes a shape changes it here
//! once.

use crate::config::DecoderConfig;
use crate::error::{ModelError, Result};

/// The seven linear layers of a Llama-layout decoder layer (Llama, Qwen, Mistral), by their
/// path inside it, in HF's order.
pub const LINEAR_PATHS: [&str; 7] = [
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
];

/// The four linear layers of a Phi-3 decoder layer (`DecoderConfig::fused_projections`):
/// `qkv_proj` is q, k and v stacked ((H + 2 KV) D rows), `gate_up_proj` gate and up (2 I rows).
pub const FUSED_LINEAR_PATHS: [&str; 4] = [
    "self_attn.qkv_proj",
    "self_attn.o_proj",
    "mlp.gate_up_proj",
    "mlp.down_proj",
];

/// One linear layer of a decoder layer: `weight` (out, inp), and `bias` (out) when `bias`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinearSpec {
    /// Path inside the layer, e.g. `self_attn.q_proj`.
    pub path: &'static str,
    pub out: usize,
    pub inp: usize,
    pub bias: bool,
}

impl LinearSpec {
    /// The module name PEFT targets: `q_proj`.
    pub fn module(&self) -> &'static str {
        module_name(self.path)
    }
}

/// `self_attn.q_proj` -> `q_proj`.
pub fn module_name(path: &str) -> &str {
    path.rsplit('.').next().unwrap_or(path)
}

impl DecoderConfig {
    /// The paths of the linears of every decoder layer: [`LINEAR_PATHS`], or Phi-3's
    /// [`FUSED_LINEAR_PATHS`].
    pub fn linear_paths(&self) -> &'static [&'static str] {
        if self.fused_projections {
            &FUSED_LINEAR_PATHS
        } else {
            &LINEAR_PATHS
        }
    }

    /// The linears of every decoder layer, in [`DecoderConfig::linear_paths`] order.
    pub fn layer_linears(&self) -> Vec<LinearSpec> {
        let (c, i) = (self.hidden_size, self.intermediate_size);
        let q = self.num_attention_heads * self.head_dim;
        let kv = self.num_key_value_heads * self.head_dim;
        let shapes: Vec<(usize, usize, bool)> = if self.fused_projections {
            vec![
                (q + 2 * kv, c, self.qkv_bias),
                (c, q, self.o_bias),
                (2 * i, c, self.mlp_bias),
                (c, i, self.mlp_bias),
            ]
        } else {
            vec![
                (q, c, self.qkv_bias),
                (kv, c, self.qkv_bias),
                (kv, c, self.qkv_bias),
                (c, q, self.o_bias),
                (i, c, self.mlp_bias),
                (i, c, self.mlp_bias),
                (c, i, self.mlp_bias),
            ]
        };
        self.linear_paths()
            .iter()
            .zip(shapes)
            .map(|(path, (out, inp, bias))| LinearSpec {
                path,
                out,
                inp,
                bias,
            })
            .collect()
    }

    /// The module names LoRA can target on this model (PEFT's names): `q_proj`, ... or Phi-3's
    /// `qkv_proj`, `o_proj`, `gate_up_proj`, `down_proj`; a mixture of experts adds its router
    /// (`gate`) and its experts' linears (Mixtral's `w1`, `w3`, `w2`), and lists the dense
    /// MLP's only when some layer has one.
    pub fn lora_modules(&self) -> Vec<&'static str> {
        let mut mods: Vec<&'static str> = Vec::new();
        let mut add = |m: &'static str| {
            if !mods.contains(&m) {
                mods.push(m)
            }
        };
        let any_dense = (0..self.num_hidden_layers).any(|l| !self.is_sparse(l));
        for p in self.linear_paths() {
            if any_dense || !p.starts_with("mlp.") {
                add(module_name(p));
            }
        }
        if let Some(moe) = &self.moe {
            for (n, _, _) in moe.expert_linears(self.hidden_size) {
                add(n);
            }
            add("gate");
            if moe.shared_expert_size.is_some() {
                add("shared_expert_gate");
            }
        }
        mods
    }

    /// Whether decoder layer `layer` has a sparse (mixture-of-experts) feed-forward.
    pub fn is_sparse(&self, layer: usize) -> bool {
        self.moe.as_ref().is_some_and(|m| m.is_sparse(layer))
    }

    /// The path of layer `layer`'s feed-forward inside it: `mlp`, or Mixtral's
    /// `block_sparse_moe` (transformers 4.57's names, which tallow keeps).
    pub fn mlp_path(&self, layer: usize) -> &'static str {
        match &self.moe {
            Some(m) if m.is_sparse(layer) => m.names.block,
            _ => "mlp",
        }
    }

    /// The modules of this model that LoRA targets `targets` name, in layer order.
    ///
    /// Every name must be a linear of this model, with one exception: the seven Llama-layout
    /// names together (tallow's default `lora.targets`, and what `"all-linear"` expands to)
    /// mean every linear layer, which on Phi-3 is its four and on Mixtral the attention's four
    /// and the experts' `w1`, `w3`, `w2` (the router stays untargeted, as PEFT leaves it when
    /// a list does not name `gate`). A partial list naming q/k/v or gate/up separately is
    /// refused on Phi-3, naming its modules: it has no separate q_proj, and a LoRA on the
    /// fused `qkv_proj` is a different adapter from one on q alone. PEFT itself errors when a
    /// target matches no module.
    pub fn resolve_lora_targets<S: AsRef<str>>(&self, targets: &[S]) -> Result<Vec<&'static str>> {
        let mods = self.lora_modules();
        let names: Vec<&str> = targets.iter().map(AsRef::as_ref).collect();
        let every_llama = LINEAR_PATHS.iter().all(|p| names.contains(&module_name(p)));
        if every_llama && (self.fused_projections || self.moe.is_some()) {
            let extra: Vec<&str> = names
                .iter()
                .copied()
                .filter(|n| !LINEAR_PATHS.iter().any(|p| module_name(p) == *n))
                .collect();
            return Ok(mods
                .into_iter()
                .filter(|m| !["gate", "shared_expert_gate"].contains(m) || extra.contains(m))
                .collect());
        }
        if let Some(bad) = names.iter().find(|n| !mods.contains(n)) {
            let fused = if self.fused_projections {
                " (q/k/v are one fused `qkv_proj` and gate/up one `gate_up_proj`, as PEFT names \
                 them; \"all-linear\" targets all four)"
            } else {
                ""
            };
            return Err(ModelError::Invalid(format!(
                "LoRA target `{bad}` is not a linear layer of this {} model; it has {}{fused}",
                self.arch.hf_class(),
                mods.join(", ")
            )));
        }
        Ok(mods.into_iter().filter(|m| names.contains(m)).collect())
    }

    /// Which linears an adapter of LoRA targets `targets` (module names, as
    /// [`DecoderConfig::resolve_lora_targets`]) and PEFT's `target_parameters` `params` wraps.
    ///
    /// `params` name transformers 5's fused expert tensors ([`EXPERT_PARAMETERS`], or a
    /// dot-suffix of one as PEFT matches them): with them the routed experts are adapted by
    /// tensor, not by module name, and `targets` wraps the other linears (the attention, a
    /// dense layer's MLP, Qwen2-MoE's shared expert), as PEFT 0.21 on transformers 5, where
    /// the experts are no modules, does.
    pub fn lora_plan<S: AsRef<str>, P: AsRef<str>>(
        &self,
        targets: &[S],
        params: &[P],
    ) -> Result<LoraPlan> {
        let modules = self.resolve_lora_targets(targets)?;
        if params.is_empty() {
            return Ok(LoraPlan {
                modules,
                experts: None,
            });
        }
        let Some(moe) = &self.moe else {
            return Err(ModelError::Invalid(format!(
                "LoRA target_parameters {:?} name the fused expert tensors of a mixture of                  experts; this {} model has no experts (leave target_parameters out)",
                params.iter().map(AsRef::as_ref).collect::<Vec<_>>(),
                self.arch.hf_class()
            )));
        };
        let (gate_up, down) = parse_expert_parameters(params).map_err(ModelError::Invalid)?;
        Ok(LoraPlan {
            modules,
            experts: Some(ExpertTargets {
                gate_up,
                down,
                names: moe.names,
            }),
        })
    }

    /// The norm weights of every decoder layer: (path inside the layer, length).
    pub fn layer_norms(&self) -> Vec<(&'static str, usize)> {
        let mut v = Vec::with_capacity(6);
        if self.qk_norm {
            v.push(("self_attn.q_norm.weight", self.head_dim));
            v.push(("self_attn.k_norm.weight", self.head_dim));
        }
        v.push(("input_layernorm.weight", self.hidden_size));
        v.push(("post_attention_layernorm.weight", self.hidden_size));
        if self.variant.sandwich_norms {
            v.push(("pre_feedforward_layernorm.weight", self.hidden_size));
            v.push(("post_feedforward_layernorm.weight", self.hidden_size));
        }
        v
    }

    /// Every tensor of an HF checkpoint of this config, with its name and shape, in file order
    /// (what `CausalLM::from_weights` reads): for tools and self-tests that make random models.
    pub fn hf_tensor_shapes(&self) -> Vec<(String, Vec<usize>)> {
        let hs = self.hidden_size;
        let mut out = vec![(
            "model.embed_tokens.weight".to_string(),
            vec![self.vocab_size, hs],
        )];
        for l in 0..self.num_hidden_layers {
            let p = format!("model.layers.{l}");
            for (path, s) in self.linears_at(l) {
                out.push((format!("{p}.{path}.weight"), vec![s.out, s.inp]));
                if s.bias {
                    out.push((format!("{p}.{path}.bias"), vec![s.out]));
                }
            }
            for (n, len) in self.layer_norms() {
                out.push((format!("{p}.{n}"), vec![len]));
            }
        }
        out.push(("model.norm.weight".into(), vec![hs]));
        if !self.tie_word_embeddings {
            out.push(("lm_head.weight".into(), vec![self.vocab_size, hs]));
        }
        out
    }

    /// Number of parameters of the full model (embeddings counted once when tied).
    pub fn num_params(&self) -> usize {
        self.hf_tensor_shapes()
            .iter()
            .map(|(_, s)| s.iter().product::<usize>())
            .sum()
    }

    /// Elements of the decoder linears' weights (biases excluded), all layers: what NF4
    /// quantizes.
    pub fn linear_weight_elems(&self) -> usize {
        (0..self.num_hidden_layers)
            .flat_map(|l| self.linears_at(l))
            .map(|(_, s)| s.out * s.inp)
            .sum()
    }

    /// The layout's linears of layer `layer` ([`DecoderConfig::layer_linears`]) less the
    /// dense MLP's on a sparse layer: the ones that load by their [`LinearSpec::path`].
    pub fn plain_linears_at(&self, layer: usize) -> Vec<LinearSpec> {
        let sparse = self.is_sparse(layer);
        self.layer_linears()
            .into_iter()
            .filter(|s| !(sparse && s.path.starts_with("mlp.")))
            .collect()
    }

    /// Every linear of decoder layer `layer` with its path inside the layer, as
    /// `DecoderLayer::linears` lists them: [`DecoderConfig::layer_linears`] (less the dense MLP's
    /// on a sparse layer), then the router and each expert's linears, whose [`LinearSpec`]
    /// carries the module name as its path (`gate`, `gate_proj`, Mixtral's `w1`). What the
    /// estimate counts per layer.
    pub fn linears_at(&self, layer: usize) -> Vec<(String, LinearSpec)> {
        let mut v: Vec<(String, LinearSpec)> = self
            .plain_linears_at(layer)
            .into_iter()
            .map(|s| (s.path.to_string(), s))
            .collect();
        let Some(moe) = self.moe.as_ref().filter(|m| m.is_sparse(layer)) else {
            return v;
        };
        let b = moe.names.block;
        let spec = |path: &'static str, out: usize, inp: usize| LinearSpec {
            path,
            out,
            inp,
            bias: false,
        };
        v.push((
            format!("{b}.gate"),
            spec("gate", moe.num_experts, self.hidden_size),
        ));
        for e in 0..moe.num_experts {
            for (n, o, i) in moe.expert_linears(self.hidden_size) {
                v.push((format!("{b}.experts.{e}.{n}"), spec(n, o, i)));
            }
        }
        if let Some(size) = moe.shared_expert_size {
            for (n, o, i) in moe.names.linears(size, self.hidden_size) {
                v.push((format!("{b}.shared_expert.{n}"), spec(n, o, i)));
            }
            let gate = spec("shared_expert_gate", 1, self.hidden_size);
            v.push((format!("{b}.shared_expert_gate"), gate));
        }
        v
    }
}

/// PEFT's `target_parameters` names of transformers 5's fused expert tensors (its
/// `*Experts` module, `mlp.experts` in every MoE family): `gate_up_proj` (E, 2 I, C), gate
/// rows then up rows, and `down_proj` (E, C, I).
pub const EXPERT_PARAMETERS: [&str; 2] = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"];

/// `target_parameters` as (gate_up, down): each entry one of [`EXPERT_PARAMETERS`] or a
/// dot-suffix of one (`experts.down_proj`, `down_proj`: PEFT matches a parameter whose full
/// name ends with `.` + the entry), none twice.
pub fn parse_expert_parameters<P: AsRef<str>>(
    params: &[P],
) -> std::result::Result<(bool, bool), String> {
    let mut hit = [false; 2];
    for p in params.iter().map(AsRef::as_ref) {
        let k = EXPERT_PARAMETERS
            .iter()
            .position(|full| !p.is_empty() && (*full == p || full.ends_with(&format!(".{p}"))))
            .ok_or_else(|| {
                format!(
                    "LoRA target_parameters has `{p}`: tallow adapts the fused expert tensors {}                      (every sparse layer's; a layer-specific name is not supported)",
                    EXPERT_PARAMETERS.join(" and ")
                )
            })?;
        if hit[k] {
            return Err(format!(
                "LoRA target_parameters names `{}` twice",
                EXPERT_PARAMETERS[k]
            ));
        }
        hit[k] = true;
    }
    Ok((hit[0], hit[1]))
}

/// The routed experts' tensors PEFT's `target_parameters` adapts (transformers 5's layout):
/// per expert, one LoRA on the fused `gate_up_proj` (A (r, C), B (2 I, r): the gate and up
/// projections share A, each takes its half of B's rows) and one on `down_proj`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpertTargets {
    pub gate_up: bool,
    pub down: bool,
    /// The family's expert linear names, to tell gate, up and down apart.
    pub names: crate::config::MoeNames,
}

/// Which linears of a decoder layer an adapter wraps ([`DecoderConfig::lora_plan`]): the one
/// answer attaching, naming, saving and the estimate use.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraPlan {
    /// Module names: every linear with one of them, but the routed experts' when `experts`
    /// is set.
    pub modules: Vec<&'static str>,
    /// PEFT's `target_parameters` on the fused expert tensors.
    pub experts: Option<ExpertTargets>,
}

/// The module name of a routed expert's linear at `path` inside a layer
/// (`mlp.experts.3.gate_proj` -> `gate_proj`); None for any other linear.
fn routed_expert_module(path: &str) -> Option<&str> {
    let (_, rest) = path.split_once(".experts.")?;
    let (e, n) = rest.split_once('.')?;
    e.parse::<usize>().ok().map(|_| n)
}

impl LoraPlan {
    /// Whether the linear at `path` (inside a decoder layer, `self_attn.q_proj`,
    /// `mlp.experts.3.gate_proj`) carries an adapter.
    pub fn wraps(&self, path: &str) -> bool {
        match (&self.experts, routed_expert_module(path)) {
            (Some(x), Some(n)) => {
                (x.gate_up && (n == x.names.gate || n == x.names.up))
                    || (x.down && n == x.names.down)
            }
            _ => self.modules.contains(&module_name(path)),
        }
    }

    /// Whether the adapter at `path` takes its A from the linear listed before it: a routed
    /// expert's up projection under a `gate_up_proj` target, whose one adapter covers gate
    /// and up.
    pub fn shares_a(&self, path: &str) -> bool {
        match (&self.experts, routed_expert_module(path)) {
            (Some(x), Some(n)) => x.gate_up && n == x.names.up,
            _ => false,
        }
    }

    /// The canonical `target_parameters` (as PEFT writes them), empty without.
    pub fn parameters(&self) -> Vec<&'static str> {
        match &self.experts {
            Some(x) => EXPERT_PARAMETERS
                .iter()
                .zip([x.gate_up, x.down])
                .filter_map(|(p, on)| on.then_some(*p))
                .collect(),
            None => Vec::new(),
        }
    }

    /// What it wraps, for messages: `q_proj,k_proj,...` and the parameters.
    pub fn describe(&self) -> String {
        let mut v: Vec<&str> = self.modules.clone();
        v.extend(self.parameters());
        v.join(",")
    }
}

#[cfg(test)]
mod tests {
    use crate::config::layout::{module_name, FUSED_LINEAR_PATHS, LINEAR_PATHS};
    use crate::config::DecoderConfig;
    use crate::peft::{FUSED_MODULES, KNOWN_MODULES, LINEAR_MODULES};

    /// PEFT's target names are the module part of the layout's paths, in the same order.
    #[test]
    fn peft_modules_are_the_layout_linears() {
        let m: Vec<&str> = LINEAR_PATHS.iter().map(|p| module_name(p)).collect();
        assert_eq!(m, LINEAR_MODULES);
        let f: Vec<&str> = FUSED_LINEAR_PATHS.iter().map(|p| module_name(p)).collect();
        assert_eq!(f, FUSED_MODULES);
        for name in LINEAR_MODULES.iter().chain(&FUSED_MODULES) {
            assert!(KNOWN_MODULES.contains(name), "{name}");
        }
    }

    fn phi3() -> DecoderConfig {
        let text = include_str!("../../../../benchmarks/models/phi-3.5-mini-instruct.json");
        DecoderConfig::from_json_str(text, std::path::Path::new("phi3.json")).unwrap()
    }

    /// Phi-3's fused shapes: qkv_proj (H + 2 KV) D rows, gate_up_proj 2 I rows; its parameter
    /// count is Phi-3.5-mini's published 3.82 B.
    #[test]
    fn phi3_layout_has_the_fused_projections() {
        let c = phi3();
        let l = c.layer_linears();
        let got: Vec<(&str, usize, usize)> = l.iter().map(|s| (s.path, s.out, s.inp)).collect();
        assert_eq!(
            got,
            vec![
                ("self_attn.qkv_proj", 3 * 3072, 3072),
                ("self_attn.o_proj", 3072, 3072),
                ("mlp.gate_up_proj", 2 * 8192, 3072),
                ("mlp.down_proj", 3072, 8192),
            ]
        );
        assert_eq!(c.num_params(), 3_821_079_552);
    }

    /// All seven Llama names (the default, "all-linear") mean Phi-3's four; a partial list of
    /// unfused names is refused, naming the fused ones.
    #[test]
    fn phi3_lora_targets() {
        let c = phi3();
        assert_eq!(
            c.resolve_lora_targets(&LINEAR_MODULES).unwrap(),
            FUSED_MODULES.to_vec()
        );
        assert_eq!(
            c.resolve_lora_targets(&["down_proj", "qkv_proj"]).unwrap(),
            vec!["qkv_proj", "down_proj"]
        );
        let e = c
            .resolve_lora_targets(&["q_proj", "v_proj"])
            .unwrap_err()
            .to_string();
        for n in [
            "`q_proj`",
            "Phi3ForCausalLM",
            "qkv_proj, o_proj, gate_up_proj, down_proj",
        ] {
            assert!(e.contains(n), "{n} not in {e}");
        }
        assert!(c.resolve_lora_targets(&["gate_proj"]).is_err());
    }

    fn real(name: &str, text: &str) -> DecoderConfig {
        DecoderConfig::from_json_str(text, std::path::Path::new(name)).unwrap()
    }

    /// The mixtures of experts count their routers and every expert: the parameter counts equal
    /// transformers 4.57's model built from the same config.json (on the meta device:
    /// Qwen3-30B-A3B 30_532_122_624, Mixtral-8x7B 46_702_792_704). Counting one dense MLP per
    /// layer instead gives 1.5 B and 7.2 B.
    #[test]
    fn moe_parameter_counts_are_transformers() {
        let q = real(
            "qwen3-30b-a3b.json",
            include_str!("../../../../benchmarks/models/qwen3-30b-a3b.json"),
        );
        assert_eq!(q.num_params(), 30_532_122_624);
        let m = real(
            "mixtral.json",
            include_str!("../../../../benchmarks/models/mixtral-8x7b-instruct-v0.1.json"),
        );
        assert_eq!(m.num_params(), 46_702_792_704);
        // every layer sparse: no dense MLP names, the router and Mixtral's expert names
        assert_eq!(
            m.lora_modules(),
            vec!["q_proj", "k_proj", "v_proj", "o_proj", "w1", "w3", "w2", "gate"]
        );
        assert_eq!(
            m.resolve_lora_targets(&LINEAR_MODULES).unwrap(),
            vec!["q_proj", "k_proj", "v_proj", "o_proj", "w1", "w3", "w2"]
        );
        let l = m.linears_at(3);
        assert_eq!(l.len(), 4 + 1 + 8 * 3);
        assert_eq!(l[4].0, "block_sparse_moe.gate");
        assert_eq!(l[5].0, "block_sparse_moe.experts.0.w1");
        assert!(m.resolve_lora_targets(&["gate_proj"]).is_err());
    }

    #[test]
    fn target_parameters_wrap_the_routed_experts_only() {
        let m = real(
            "mixtral.json",
            include_str!("../../../../benchmarks/models/mixtral-8x7b-instruct-v0.1.json"),
        );
        // the seven Llama names + gate_up: attention by name, experts' w1 and w3 by tensor
        let plan = m.lora_plan(&LINEAR_MODULES, &["gate_up_proj"]).unwrap();
        assert_eq!(plan.parameters(), ["mlp.experts.gate_up_proj"]);
        assert!(plan.wraps("self_attn.q_proj"));
        assert!(plan.wraps("block_sparse_moe.experts.7.w1"));
        assert!(plan.wraps("block_sparse_moe.experts.7.w3"));
        assert!(!plan.wraps("block_sparse_moe.experts.7.w2"));
        assert!(!plan.wraps("block_sparse_moe.gate"));
        assert!(plan.shares_a("block_sparse_moe.experts.7.w3"));
        assert!(!plan.shares_a("block_sparse_moe.experts.7.w1"));
        // down alone, attention by name
        let plan = m
            .lora_plan(&["q_proj"], &["mlp.experts.down_proj"])
            .unwrap();
        assert!(plan.wraps("block_sparse_moe.experts.0.w2"));
        assert!(!plan.wraps("block_sparse_moe.experts.0.w1"));
        assert!(!plan.shares_a("block_sparse_moe.experts.0.w3"));
        // Qwen3-MoE: the names still wrap what is not a routed expert
        let q = real(
            "qwen3-30b-a3b.json",
            include_str!("../../../../benchmarks/models/qwen3-30b-a3b.json"),
        );
        let plan = q.lora_plan(&["gate_proj"], &["down_proj"]).unwrap();
        assert!(!plan.wraps("mlp.experts.1.gate_proj"));
        assert!(plan.wraps("mlp.experts.1.down_proj"));
        assert!(plan.wraps("mlp.shared_expert.gate_proj"));
        // refused: a dense model, a name that is no fused expert tensor
        let e = phi3()
            .lora_plan(&["o_proj"], &["gate_up_proj"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("has no experts"), "{e}");
        let e = m.lora_plan(&["q_proj"], &["w1"]).unwrap_err().to_string();
        assert!(e.contains("`w1`"), "{e}");
    }
}
