//! GGUF checkpoints (llama.cpp's format) read as the HF checkpoint they were converted from.
//!
//! A `.gguf` file holds the weights (dense or in llama.cpp's block formats), the model's
//! hyper-parameters and its tokenizer as metadata. tallow reads it as a model dir:
//! [`model_dir`] writes, once per file, a small dir in the cache with the `config.json`,
//! `tokenizer.json` and `tokenizer_config.json` transformers would build from the file (see
//! [`config`] and [`tokenizer`]) and a `model.gguf` link to the file itself; [`Weights`]
//! (`crate::io::weights`) reads the tensors from that link under their HF names, dequantized to
//! the requested dtype, undoing llama.cpp's conversion (the rotary row order of Llama's q / k).
//! Every command that takes a model path therefore takes a `.gguf` too (docs/gguf.md).
//!
//! [`Weights`]: crate::io::weights::Weights

pub mod config;
pub mod quants;
pub mod spm;
pub mod tokenizer;
pub mod write;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};

use crate::error::{ModelError, Result};

/// The link a GGUF model dir holds to its file.
pub const LINK: &str = "model.gguf";

/// An open GGUF file: its metadata and tensor table (the tensors are read on demand).
pub struct GgufFile {
    pub path: PathBuf,
    pub content: Content,
}

/// A read error of `path`: Candle's message without the backtrace it may carry.
fn bad(path: &Path, msg: impl std::fmt::Display) -> ModelError {
    let msg = msg.to_string();
    ModelError::BadGguf {
        path: path.to_path_buf(),
        msg: msg.lines().next().unwrap_or("").trim().to_string(),
    }
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<Self> {
        let mut f = std::fs::File::open(path).map_err(|source| ModelError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let content = Content::read(&mut f).map_err(|e| bad(path, e))?;
        Ok(Self {
            path: path.to_path_buf(),
            content,
        })
    }

    /// `general.architecture`.
    pub fn arch(&self) -> Result<&str> {
        self.string("general.architecture")?
            .ok_or_else(|| bad(&self.path, "no `general.architecture` in its metadata"))
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.content.metadata.get(key)
    }

    fn wrong_type(&self, key: &str, want: &str) -> ModelError {
        ModelError::Config {
            path: self.path.clone(),
            key: key.to_string(),
            msg: format!(
                "expected {want}, found {:?}",
                self.get(key).map(Value::value_type)
            ),
        }
    }

    pub fn string(&self, key: &str) -> Result<Option<&str>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(_) => Err(self.wrong_type(key, "a string")),
        }
    }

    /// An integer of any width.
    pub fn int(&self, key: &str) -> Result<Option<i64>> {
        let v = match self.get(key) {
            None => return Ok(None),
            Some(v) => v,
        };
        let n = match v {
            Value::U8(x) => *x as i64,
            Value::I8(x) => *x as i64,
            Value::U16(x) => *x as i64,
            Value::I16(x) => *x as i64,
            Value::U32(x) => *x as i64,
            Value::I32(x) => *x as i64,
            Value::U64(x) => *x as i64,
            Value::I64(x) => *x,
            _ => return Err(self.wrong_type(key, "an integer")),
        };
        Ok(Some(n))
    }

    pub fn float(&self, key: &str) -> Result<Option<f64>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::F32(x)) => Ok(Some(*x as f64)),
            Some(Value::F64(x)) => Ok(Some(*x)),
            Some(_) => match self.int(key) {
                Ok(n) => Ok(n.map(|n| n as f64)),
                Err(_) => Err(self.wrong_type(key, "a number")),
            },
        }
    }

    pub fn bool(&self, key: &str) -> Result<Option<bool>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(_) => Err(self.wrong_type(key, "a boolean")),
        }
    }

    /// An array of strings.
    pub fn strings(&self, key: &str) -> Result<Option<Vec<&str>>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| match v {
                    Value::String(s) => Ok(s.as_str()),
                    _ => Err(self.wrong_type(key, "an array of strings")),
                })
                .collect::<Result<Vec<_>>>()
                .map(Some),
            Some(_) => Err(self.wrong_type(key, "an array of strings")),
        }
    }

    /// An array of integers.
    pub fn ints(&self, key: &str) -> Result<Option<Vec<i64>>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| match v {
                    Value::I32(x) => Ok(*x as i64),
                    Value::U32(x) => Ok(*x as i64),
                    Value::I64(x) => Ok(*x),
                    Value::U64(x) => Ok(*x as i64),
                    Value::U8(x) => Ok(*x as i64),
                    Value::I8(x) => Ok(*x as i64),
                    Value::U16(x) => Ok(*x as i64),
                    Value::I16(x) => Ok(*x as i64),
                    _ => Err(self.wrong_type(key, "an array of integers")),
                })
                .collect::<Result<Vec<_>>>()
                .map(Some),
            Some(_) => Err(self.wrong_type(key, "an array of integers")),
        }
    }

    /// An array of numbers.
    pub fn floats(&self, key: &str) -> Result<Option<Vec<f64>>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| match v {
                    Value::F32(x) => Ok(*x as f64),
                    Value::F64(x) => Ok(*x),
                    _ => Err(self.wrong_type(key, "an array of numbers")),
                })
                .collect::<Result<Vec<_>>>()
                .map(Some),
            Some(_) => Err(self.wrong_type(key, "an array of numbers")),
        }
    }

    pub fn has_tensor(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }

    /// The row-major shape of tensor `name` (GGUF lists dimensions innermost first).
    pub fn shape(&self, name: &str) -> Option<Vec<usize>> {
        self.content
            .tensor_infos
            .get(name)
            .map(|t| t.shape.dims().to_vec())
    }

    /// The dtype a tensor holds without dequantizing: f32 / f16 / bf16 as stored, f32 for the
    /// block formats (what they dequantize to).
    pub fn dtype(&self, name: &str) -> Option<DType> {
        self.content
            .tensor_infos
            .get(name)
            .map(|t| match t.ggml_dtype {
                GgmlDType::F16 => DType::F16,
                GgmlDType::BF16 => DType::BF16,
                _ => DType::F32,
            })
    }

    /// The stored type of tensor `name` (F32, Q4K, ...).
    pub fn format(&self, name: &str) -> Option<GgmlDType> {
        self.content.tensor_infos.get(name).map(|t| t.ggml_dtype)
    }

    /// The `tokenizer.*` keys, in the order llama.cpp's converter writes them (for an export
    /// of a model read from this file).
    pub fn tokenizer_keys(&self) -> Vec<(String, Value)> {
        const ORDER: [&str; 20] = [
            "model",
            "pre",
            "tokens",
            "scores",
            "token_type",
            "merges",
            "bos_token_id",
            "eos_token_id",
            "unknown_token_id",
            "seperator_token_id",
            "padding_token_id",
            "cls_token_id",
            "mask_token_id",
            "add_bos_token",
            "add_eos_token",
            "add_unk_token",
            "add_sep_token",
            "add_pad_token",
            "add_cls_token",
            "add_mask_token",
        ];
        let llama = self.string("tokenizer.ggml.model").ok().flatten() == Some("llama")
            && self.string("general.architecture").ok().flatten() == Some("llama");
        let rank = |k: &str| -> (usize, String) {
            let rest = k.strip_prefix("tokenizer.ggml.").unwrap_or(k);
            let r = match ORDER.iter().position(|o| *o == rest) {
                Some(i) => i + 1,
                // Llama's converter writes it before the vocabulary, Gemma's after it
                None if rest == "add_space_prefix" && llama => 0,
                None if k == "tokenizer.chat_template" => ORDER.len() + 1,
                None => ORDER.len() + 2,
            };
            (r, k.to_string())
        };
        let mut keys: Vec<(String, Value)> = self
            .content
            .metadata
            .iter()
            .filter(|(k, _)| k.starts_with("tokenizer."))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        keys.sort_by_key(|(k, _)| rank(k));
        keys
    }

    /// Tensor `name` as stored, on the CPU.
    fn read_q(&self, name: &str) -> Result<QTensor> {
        let mut f = std::fs::File::open(&self.path).map_err(|source| ModelError::Io {
            path: self.path.clone(),
            source,
        })?;
        self.content
            .tensor(&mut f, name, &Device::Cpu)
            .map_err(|e| bad(&self.path, format!("tensor `{name}`: {e}")))
    }

    /// Tensor `name` dequantized to f32 on the CPU.
    pub fn read_f32(&self, name: &str) -> Result<Tensor> {
        Ok(self
            .read_q(name)?
            .dequantize(&Device::Cpu)?
            .to_dtype(DType::F32)?)
    }

    /// The stored bytes of 2-D tensor `name` (row-major blocks) as a (rows, bytes per row) u8
    /// tensor on the CPU, with its type: rows can be reordered without dequantizing.
    pub fn read_block_rows(&self, name: &str) -> Result<(Tensor, GgmlDType)> {
        let q = self.read_q(name)?;
        let (rows, _) = q.shape().dims2()?;
        let bytes = q.data()?.to_vec();
        let per_row = bytes.len() / rows.max(1);
        Ok((
            Tensor::from_vec(bytes, (rows, per_row), &Device::Cpu)?,
            q.dtype(),
        ))
    }
}

/// Whether a GGUF tensor type is one of llama.cpp's block formats (Q4_K, Q8_0, ...), rather than
/// plain floats: what `model.quantize = "keep"` keeps.
pub fn is_block_format(t: GgmlDType) -> bool {
    !matches!(t, GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16)
}

/// Bytes of `n` values in format `t` (n a multiple of its block).
pub fn format_bytes(t: GgmlDType, n: usize) -> u64 {
    (n / t.block_size() * t.type_size()) as u64
}

/// The decoder linear weights of GGUF file `path` that it stores in a block format: HF name ->
/// bytes stored (for the estimate of `model.quantize = "keep"`; reads the header only).
pub fn block_bytes(path: &Path) -> Result<std::collections::BTreeMap<String, u64>> {
    let file = GgufFile::open(path)?;
    let arch = file.arch()?.to_string();
    let layers = file.int(&format!("{arch}.block_count"))?.unwrap_or(0) as usize;
    Ok(tensor_names(&arch, layers)
        .into_iter()
        .filter(|(hf, _)| hf.starts_with("model.layers.") && hf.ends_with("_proj.weight"))
        .filter_map(|(hf, g)| {
            let info = file.content.tensor_infos.get(&g)?;
            is_block_format(info.ggml_dtype)
                .then(|| (hf, format_bytes(info.ggml_dtype, info.shape.elem_count())))
        })
        .collect())
}

/// How architecture `arch`'s tensors are named in GGUF: HF name -> GGUF name, for `layers`
/// decoder layers (every name llama.cpp's converter writes for the dense families tallow reads).
pub fn tensor_names(arch: &str, layers: usize) -> HashMap<String, String> {
    let mut m: HashMap<String, String> = [
        ("model.embed_tokens.weight", "token_embd.weight"),
        ("model.norm.weight", "output_norm.weight"),
        ("lm_head.weight", "output.weight"),
    ]
    .into_iter()
    .map(|(a, b)| (a.to_string(), b.to_string()))
    .collect();
    let mut per_layer = vec![
        ("input_layernorm.weight", "attn_norm.weight"),
        ("self_attn.o_proj.weight", "attn_output.weight"),
        ("self_attn.o_proj.bias", "attn_output.bias"),
        ("mlp.down_proj.weight", "ffn_down.weight"),
    ];
    if is_gemma(arch) {
        // Gemma's sandwich norms: one after attention, one before and one after the MLP
        per_layer.extend([
            (
                "post_attention_layernorm.weight",
                "post_attention_norm.weight",
            ),
            ("pre_feedforward_layernorm.weight", "ffn_norm.weight"),
            ("post_feedforward_layernorm.weight", "post_ffw_norm.weight"),
        ]);
    } else {
        per_layer.push(("post_attention_layernorm.weight", "ffn_norm.weight"));
    }
    if arch == "phi3" {
        // Phi-3's fused projections, stored fused
        per_layer.extend([
            ("self_attn.qkv_proj.weight", "attn_qkv.weight"),
            ("mlp.gate_up_proj.weight", "ffn_up.weight"),
        ]);
    } else {
        per_layer.extend([
            ("self_attn.q_proj.weight", "attn_q.weight"),
            ("self_attn.k_proj.weight", "attn_k.weight"),
            ("self_attn.v_proj.weight", "attn_v.weight"),
            ("self_attn.q_proj.bias", "attn_q.bias"),
            ("self_attn.k_proj.bias", "attn_k.bias"),
            ("self_attn.v_proj.bias", "attn_v.bias"),
            ("self_attn.q_norm.weight", "attn_q_norm.weight"),
            ("self_attn.k_norm.weight", "attn_k_norm.weight"),
            ("mlp.gate_proj.weight", "ffn_gate.weight"),
            ("mlp.up_proj.weight", "ffn_up.weight"),
        ]);
    }
    for i in 0..layers {
        for (hf, gg) in &per_layer {
            m.insert(format!("model.layers.{i}.{hf}"), format!("blk.{i}.{gg}"));
        }
    }
    m
}

/// Gemma's architectures, whose RMSNorm weights w scale by (1 + w): llama.cpp's converter
/// stores 1 + w (`GemmaModel.modify_tensors`: every tensor named `*norm.weight`), and a reader
/// takes the 1 off again (transformers' `GemmaTensorProcessor`).
pub fn is_gemma(arch: &str) -> bool {
    matches!(arch, "gemma" | "gemma2" | "gemma3")
}

/// llama.cpp's Gemma 2 / 3 query scale (`llama_model_gemma{2,3}::load_arch_hparams`), as the
/// `query_pre_attn_scalar` it amounts to: the head dim, or hidden / heads (`per_head`) for the
/// 27B models (Gemma 2: 46 layers, Gemma 3: 62). Import writes it, export checks against it.
pub(crate) fn gemma_query_scalar(
    arch: &str,
    layers: usize,
    per_head: usize,
    head_dim: usize,
) -> usize {
    let big = if arch == "gemma2" { 46 } else { 62 };
    if layers == big {
        per_head
    } else {
        head_dim
    }
}

/// llama.cpp's default Gemma sliding pattern: every 2nd (Gemma 2) or 6th (Gemma 3) layer global,
/// the others sliding.
pub(crate) fn gemma_pattern(arch: &str) -> usize {
    if arch == "gemma2" {
        2
    } else {
        6
    }
}

/// Whether GGUF tensor `name` of architecture `arch` is stored as 1 + w ([`is_gemma`]).
pub fn norm_stored_plus_one(arch: &str, name: &str) -> bool {
    is_gemma(arch) && name.ends_with("norm.weight")
}

/// llama.cpp's converter reorders the rows of Llama's q and k weights for its rotary kernel
/// (`LlamaModel.permute` in convert_hf_to_gguf.py): per head, the rows seen as (2, n), HF's two
/// rotary halves, become (n, 2), the halves interleaved. `to_llama_cpp` goes that way (export);
/// otherwise back (import, as transformers' GGUF loader does in `_reverse_permute_weights`).
/// Tensor `name` (its GGUF name) is reordered when it is a q weight (`heads` heads) or a k weight
/// (`kv_heads`), and returned as it is otherwise.
pub fn rotary_rows(
    w: &Tensor,
    name: &str,
    heads: usize,
    kv_heads: usize,
    to_llama_cpp: bool,
) -> Result<Tensor> {
    let heads = if name.ends_with("attn_q.weight") {
        heads
    } else if name.ends_with("attn_k.weight") {
        kv_heads
    } else {
        return Ok(w.clone());
    };
    let (rows, cols) = w.dims2()?;
    if heads == 0 || rows % (2 * heads) != 0 {
        return Err(ModelError::Invalid(format!(
            "`{name}`: cannot reorder the rotary rows of a ({rows}, {cols}) weight over {heads} heads"
        )));
    }
    let half = rows / heads / 2;
    // (rows, cols) -> (heads, 2, half, cols) or (heads, half, 2, cols) -> swap the middle two ->
    // (rows, cols)
    let w = match to_llama_cpp {
        true => w.reshape((heads, 2, half, cols))?,
        false => w.reshape((heads, half, 2, cols))?,
    };
    Ok(w.transpose(1, 2)?.contiguous()?.reshape((rows, cols))?)
}

/// The cache dir where a GGUF file's model dir goes: `$TALLOW_CACHE_DIR`, else
/// `$XDG_CACHE_HOME/tallow`, else `~/.cache/tallow`; under it `gguf/`.
fn cache_root() -> PathBuf {
    let base = std::env::var_os("TALLOW_CACHE_DIR")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("XDG_CACHE_HOME").map(|x| PathBuf::from(x).join("tallow")))
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/tallow")))
        .unwrap_or_else(|| std::env::temp_dir().join("tallow-cache"));
    base.join("gguf")
}

/// Whether `path` names a GGUF file (by its first four bytes, whatever its name).
pub fn is_gguf(path: &Path) -> bool {
    use std::io::Read;
    if !path.is_file() {
        return false;
    }
    let mut magic = [0u8; 4];
    std::fs::File::open(path)
        .and_then(|mut f| f.read_exact(&mut magic))
        .is_ok()
        && &magic == b"GGUF"
}

/// `path` as a model dir: the model dir of a GGUF file ([`model_dir`]), anything else as it is.
pub fn as_model_dir(path: &Path) -> Result<PathBuf> {
    if is_gguf(path) {
        model_dir(path)
    } else {
        Ok(path.to_path_buf())
    }
}

/// The model dir of GGUF file `path` (made on first use, then reused while the file is
/// unchanged: the dir's name carries the file's path, size and modification time). What it
/// holds is described in the module's doc; it is written atomically.
pub fn model_dir(path: &Path) -> Result<PathBuf> {
    model_dir_in(path, &cache_root())
}

/// [`model_dir`] under the cache dir `root` (its `gguf/`).
pub fn model_dir_in(path: &Path, root: &Path) -> Result<PathBuf> {
    let abs = std::fs::canonicalize(path).map_err(|source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let meta = std::fs::metadata(&abs).map_err(|source| ModelError::Io {
        path: abs.clone(),
        source,
    })?;
    let mtime = meta
        .modified()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos());
    let key = fnv1a(format!("{}\0{}\0{mtime}", abs.display(), meta.len()).as_bytes());
    let stem = abs
        .file_stem()
        .and_then(|s| s.to_str())
        .unwrap_or("model")
        .to_string();
    let dir = root.join(format!("{stem}-{key:016x}"));
    if dir.join("config.json").is_file() && dir.join(LINK).exists() {
        return Ok(dir);
    }
    let file = GgufFile::open(&abs)?;
    let config = config::hf_config(&file)?;
    let (tok, tok_config) = tokenizer::hf_tokenizer(&file)?;
    let staged = super::staging_dir(&dir)?;
    let json = |v: &serde_json::Value| serde_json::to_vec_pretty(v).unwrap_or_default();
    super::write_atomic(&staged.join("config.json"), &json(&config))?;
    super::write_atomic(&staged.join("tokenizer.json"), &json(&tok))?;
    super::write_atomic(&staged.join("tokenizer_config.json"), &json(&tok_config))?;
    link(&abs, &staged.join(LINK))?;
    // Ranks of a data-parallel run prepare the same dir at once: the first rename wins and the
    // others keep its (identical) dir rather than replacing it under a rank reading it.
    if std::fs::rename(&staged, &dir).is_err() && !dir.join("config.json").is_file() {
        super::replace_dir(&staged, &dir)?;
    }
    let _ = std::fs::remove_dir_all(&staged);
    Ok(dir)
}

#[cfg(unix)]
fn link(target: &Path, at: &Path) -> Result<()> {
    std::os::unix::fs::symlink(target, at).map_err(|source| ModelError::Io {
        path: at.to_path_buf(),
        source,
    })
}

#[cfg(not(unix))]
fn link(target: &Path, at: &Path) -> Result<()> {
    std::fs::hard_link(target, at).map_err(|source| ModelError::Io {
        path: at.to_path_buf(),
        source,
    })
}

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf29ce484222325u64, |h, b| {
        (h ^ *b as u64).wrapping_mul(0x100000001b3)
    })
}
