//! Reading HF-layout checkpoints: `model.safetensors`, or shards listed by
//! `model.safetensors.index.json`. Files are memory-mapped; a tensor is read (and converted to the
//! requested dtype) only when asked for, so loading never holds two copies of the model.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::quantized::GgmlDType;
use candle_core::safetensors::{Load, MmapedSafetensors};
use candle_core::{DType, Device, Tensor};

use super::gguf::{self, GgufFile};
use crate::error::{ModelError, Result};

/// A tensor in a GGUF block format: its bytes (rows in HF's order), format and shape.
pub type BlockRows = (Vec<u8>, GgmlDType, Vec<usize>);

/// The safetensors files of one checkpoint, with a name -> (file, stored name) routing table
/// (the stored name differs for an image-text model's text tower, [`Weights::text_tower`]);
/// or the GGUF file of a GGUF model dir (`crate::io::gguf`), its tensors routed by HF name.
pub struct Weights {
    dir: PathBuf,
    files: Vec<(PathBuf, MmapedSafetensors)>,
    routing: HashMap<String, (usize, String)>,
    gguf: Option<Gguf>,
}

/// A GGUF file read under HF names: HF name -> GGUF name, the head counts whose rotary row
/// order llama.cpp changed in q / k (Llama only), and the architecture (Gemma's norms are stored
/// as 1 + w).
struct Gguf {
    file: GgufFile,
    names: HashMap<String, String>,
    rotary_heads: Option<(usize, usize)>,
    arch: String,
}

impl Gguf {
    fn open(path: &Path) -> Result<Self> {
        let file = GgufFile::open(path)?;
        let arch = file.arch()?.to_string();
        let int = |k: &str| -> Result<usize> {
            Ok(file.int(&format!("{arch}.{k}"))?.unwrap_or(0) as usize)
        };
        let layers = int("block_count")?;
        let heads = int("attention.head_count")?;
        let kv = file
            .int(&format!("{arch}.attention.head_count_kv"))?
            .map_or(heads, |n| n as usize);
        let names = gguf::tensor_names(&arch, layers)
            .into_iter()
            .filter(|(_, g)| file.has_tensor(g))
            .collect();
        Ok(Self {
            rotary_heads: (arch == "llama").then_some((heads, kv)),
            file,
            names,
            arch,
        })
    }

    fn stored(&self, dir: &Path, name: &str) -> Result<&str> {
        self.names
            .get(name)
            .map(String::as_str)
            .ok_or_else(|| ModelError::MissingTensor {
                dir: dir.to_path_buf(),
                name: name.to_string(),
                hint: format!(" ({})", self.file.path.display()),
            })
    }

    /// `name` dequantized to f32 on the CPU, in the HF row order.
    fn read(&self, dir: &Path, name: &str) -> Result<Tensor> {
        let stored = self.stored(dir, name)?;
        let mut t = self.file.read_f32(stored)?;
        if gguf::norm_stored_plus_one(&self.arch, stored) {
            t = (t - 1.0)?;
        }
        self.hf_rows(&t, stored)
    }

    /// Rows of GGUF tensor `stored` (values, or a row's blocks as bytes) in HF's order.
    fn hf_rows(&self, t: &Tensor, stored: &str) -> Result<Tensor> {
        match self.rotary_heads {
            Some((heads, kv)) => gguf::rotary_rows(t, stored, heads, kv, false),
            None => Ok(t.clone()),
        }
    }
}

impl Weights {
    /// Opens `dir/model.safetensors` or the shards named by `dir/model.safetensors.index.json`.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let linked = dir.join(gguf::LINK);
        if linked.exists() {
            // the file the link names, so that messages name the user's file
            let file = std::fs::canonicalize(&linked).unwrap_or(linked);
            return Ok(Self {
                dir: dir.to_path_buf(),
                files: Vec::new(),
                routing: HashMap::new(),
                gguf: Some(Gguf::open(&file)?),
            });
        }
        let single = dir.join("model.safetensors");
        let index = dir.join("model.safetensors.index.json");
        let paths = if index.exists() {
            let text = std::fs::read_to_string(&index).map_err(|source| ModelError::Io {
                path: index.clone(),
                source,
            })?;
            let json: serde_json::Value =
                serde_json::from_str(&text).map_err(|source| ModelError::Json {
                    path: index.clone(),
                    source,
                })?;
            let map = json
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| ModelError::Config {
                    path: index.clone(),
                    key: "weight_map".into(),
                    msg: "missing or not an object".into(),
                })?;
            let mut shards: Vec<String> = map
                .values()
                .filter_map(|v| v.as_str().map(str::to_string))
                .collect();
            shards.sort();
            shards.dedup();
            shards.into_iter().map(|s| dir.join(s)).collect()
        } else if single.exists() {
            vec![single]
        } else {
            return Err(ModelError::NoWeights {
                dir: dir.to_path_buf(),
            });
        };
        Self::from_files(dir, &paths)
    }

    /// Opens an explicit list of safetensors files (e.g. an adapter file).
    pub fn from_files(dir: &Path, paths: &[PathBuf]) -> Result<Self> {
        let mut files = Vec::with_capacity(paths.len());
        let mut routing = HashMap::new();
        for path in paths {
            if !path.exists() {
                return Err(ModelError::Io {
                    path: path.clone(),
                    source: std::io::Error::new(std::io::ErrorKind::NotFound, "file not found"),
                });
            }
            // SAFETY: the file is memory-mapped read-only; tallow never writes into a checkpoint
            // it reads, and outputs are written to a temp file and renamed.
            let st = unsafe { MmapedSafetensors::new(path) }.map_err(|e| {
                ModelError::BadSafetensors {
                    path: path.clone(),
                    msg: e.to_string(),
                }
            })?;
            for (name, _) in st.tensors() {
                routing.insert(name.clone(), (files.len(), name));
            }
            files.push((path.clone(), st));
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            files,
            routing,
            gguf: None,
        })
    }

    /// The text tower of an image-text checkpoint (`Gemma3ForConditionalGeneration`), named as
    /// its `*ForCausalLM` would be: `language_model.model.*` (transformers <= 4.49 saves, as
    /// on the Hub) or `model.language_model.*` (later saves) read as `model.*`,
    /// `language_model.lm_head.*` as `lm_head.*`. Everything else (the vision tower, the
    /// projector) is dropped: never read, never counted.
    pub fn text_tower(mut self) -> Self {
        let prefixes = [
            ("language_model.model.", "model."),
            ("model.language_model.", "model."),
            ("language_model.lm_head.", "lm_head."),
            ("lm_head.", "lm_head."),
        ];
        self.routing = self
            .routing
            .into_values()
            .filter_map(|(file, stored)| {
                let (from, to) = prefixes.iter().find(|(p, _)| stored.starts_with(p))?;
                Some((format!("{to}{}", &stored[from.len()..]), (file, stored)))
            })
            .collect();
        self
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn contains(&self, name: &str) -> bool {
        match &self.gguf {
            Some(g) => g.names.contains_key(name),
            None => self.routing.contains_key(name),
        }
    }

    pub fn names(&self) -> Box<dyn Iterator<Item = &str> + '_> {
        match &self.gguf {
            Some(g) => Box::new(g.names.keys().map(String::as_str)),
            None => Box::new(self.routing.keys().map(String::as_str)),
        }
    }

    /// The on-disk shape of a tensor, without reading it.
    pub fn shape(&self, name: &str) -> Result<Vec<usize>> {
        if let Some(g) = &self.gguf {
            let stored = g.stored(&self.dir, name)?;
            return Ok(g.file.shape(stored).unwrap_or_default());
        }
        let (_, st, name) = self.file_of(name)?;
        Ok(st.get(name)?.shape().to_vec())
    }

    /// Reads `name`, checks its shape, converts it to `dtype` and puts it on `device`.
    pub fn load(
        &self,
        name: &str,
        shape: &[usize],
        dtype: DType,
        device: &Device,
    ) -> Result<Tensor> {
        if let Some(g) = &self.gguf {
            let t = g.read(&self.dir, name)?;
            if t.dims() != shape {
                return Err(ModelError::ShapeMismatch {
                    path: g.file.path.clone(),
                    name: name.to_string(),
                    expected: shape.to_vec(),
                    found: t.dims().to_vec(),
                });
            }
            return Ok(t.to_dtype(dtype)?.to_device(device)?);
        }
        let (path, st, stored) = self.file_of(name)?;
        let view = st.get(stored)?;
        if view.shape() != shape {
            return Err(ModelError::ShapeMismatch {
                path: path.to_path_buf(),
                name: name.to_string(),
                expected: shape.to_vec(),
                found: view.shape().to_vec(),
            });
        }
        // Convert on the CPU first when the device is not the CPU: an f32 checkpoint loaded as
        // bf16 then never occupies f32 space on the GPU.
        let t = view.load(&Device::Cpu)?.to_dtype(dtype)?;
        Ok(t.to_device(device)?)
    }

    /// Reads `name` as stored (no dtype conversion, no shape check) onto `device`: the parts of a
    /// quantized weight (u8 codes, f32 scales, a u8 JSON state).
    pub fn load_raw(&self, name: &str, device: &Device) -> Result<Tensor> {
        if let Some(g) = &self.gguf {
            return Ok(g.read(&self.dir, name)?.to_device(device)?);
        }
        let (_, st, name) = self.file_of(name)?;
        Ok(st.get(name)?.load(device)?)
    }

    /// `name` as a GGUF file stores it when that is a block format (Q4_K, Q8_0, ...): its
    /// row-major bytes with rows in HF's order, the format and the shape. None when it is plain
    /// floats, or the checkpoint is not a GGUF file. For `crate::kernels::ggml`.
    pub fn block_rows(&self, name: &str) -> Result<Option<BlockRows>> {
        let Some(g) = &self.gguf else {
            return Ok(None);
        };
        let stored = g.stored(&self.dir, name)?;
        match g.file.format(stored) {
            Some(f) if gguf::is_block_format(f) => {}
            _ => return Ok(None),
        }
        let (rows, format) = g.file.read_block_rows(stored)?; // (out, bytes per row)
        let bytes = g.hf_rows(&rows, stored)?.flatten_all()?.to_vec1::<u8>()?;
        let shape = g.file.shape(stored).unwrap_or_default();
        Ok(Some((bytes, format, shape)))
    }

    /// The path of the file holding `name` (for messages).
    pub fn path_of(&self, name: &str) -> PathBuf {
        PathBuf::from(self.file_name(name))
    }

    /// The stored dtype of `name`, without reading it.
    pub fn dtype(&self, name: &str) -> Result<DType> {
        if let Some(g) = &self.gguf {
            let stored = g.stored(&self.dir, name)?;
            return Ok(g.file.dtype(stored).unwrap_or(DType::F32));
        }
        let (path, st, stored) = self.file_of(name)?;
        let view = st.get(stored)?;
        DType::try_from(view.dtype()).map_err(|e| ModelError::BadSafetensors {
            path: path.to_path_buf(),
            msg: format!("tensor `{name}`: {e}"),
        })
    }

    /// The file holding `name` (for messages), or the directory when it is not there.
    pub fn file_name(&self, name: &str) -> String {
        if let Some(g) = &self.gguf {
            return g.file.path.display().to_string();
        }
        match self.routing.get(name) {
            Some((i, _)) => self.files[*i].0.display().to_string(),
            None => self.dir.display().to_string(),
        }
    }

    /// The file of `name`, and its name in that file.
    fn file_of(&self, name: &str) -> Result<(&Path, &MmapedSafetensors, &str)> {
        match self.routing.get(name) {
            Some((i, stored)) => Ok((&self.files[*i].0, &self.files[*i].1, stored.as_str())),
            None => {
                let prefix = name.rsplit_once('.').map(|(p, _)| p).unwrap_or(name);
                let near: Vec<&str> = self
                    .names()
                    .filter(|n| n.starts_with(prefix))
                    .take(4)
                    .collect();
                let hint = if near.is_empty() {
                    String::new()
                } else {
                    format!(" (found nearby: {})", near.join(", "))
                };
                Err(ModelError::MissingTensor {
                    dir: self.dir.clone(),
                    name: name.to_string(),
                    hint,
                })
            }
        }
    }
}
