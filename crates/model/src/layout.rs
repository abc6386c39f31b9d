//! One description of a decoder's tensors (names as HF writes them, shapes, biases, norms),
//! derived from [`DecoderConfig`]: loading (`CausalLM::from_weights`), parameter naming
//! (`DecoderLayer::linears`, PEFT keys), parameter counting ([`DecoderConfig::num_params`]),
//! random test models ([`DecoderConfig::hf_tensor_shapes`]) and the memory estimate
//! (`tallow_trainer::estimate`) all read it, so a family that changes a shape changes it here
//! once.

use crate::config::DecoderConfig;

/// The seven linear layers of a decoder layer, by their path inside it, in HF's order.
pub const LINEAR_PATHS: [&str; 7] = [
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
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
    /// The linears of every decoder layer, in [`LINEAR_PATHS`] order.
    pub fn layer_linears(&self) -> [LinearSpec; 7] {
        let (c, i) = (self.hidden_size, self.intermediate_size);
        let q = self.num_attention_heads * self.head_dim;
        let kv = self.num_key_value_heads * self.head_dim;
        let shapes = [
            (q, c, self.qkv_bias),
            (kv, c, self.qkv_bias),
            (kv, c, self.qkv_bias),
            (c, q, self.o_bias),
            (i, c, self.mlp_bias),
            (i, c, self.mlp_bias),
            (c, i, self.mlp_bias),
        ];
        std::array::from_fn(|k| LinearSpec {
            path: LINEAR_PATHS[k],
            out: shapes[k].0,
            inp: shapes[k].1,
            bias: shapes[k].2,
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
            for s in self.layer_linears() {
                out.push((format!("{p}.{}.weight", s.path), vec![s.out, s.inp]));
                if s.bias {
                    out.push((format!("{p}.{}.bias", s.path), vec![s.out]));
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
        let per_layer: usize = self.layer_linears().iter().map(|s| s.out * s.inp).sum();
        per_layer * self.num_hidden_layers
    }
}

#[cfg(test)]
mod tests {
    use crate::layout::{module_name, LINEAR_PATHS};
    use crate::peft::LINEAR_MODULES;

    /// PEFT's target names are the module part of the layout's paths, in the same order.
    #[test]
    fn peft_modules_are_the_layout_linears() {
        let m: Vec<&str> = LINEAR_PATHS.iter().map(|p| module_name(p)).collect();
        assert_eq!(m, LINEAR_MODULES);
    }
}
