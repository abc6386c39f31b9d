//! `tallow generate`: load a model (+ adapter), generate after one prompt, stream the text.
//! Also the loading, decoding-option and streaming pieces `tallow chat` shares.

use std::io::Write;
use std::path::Path;

use anyhow::{bail, Context, Result};
use tallow_model::{
    generate, CausalLM, GenerateOptions, Generation, GenerationConfig, SamplingParams,
};
use tallow_text::{Message, TextTokenizer};

use crate::args::{DecodeArgs, GenerateArgs};
use crate::device::{dtype_name, parse_device, parse_dtype};
use crate::model;

/// transformers' GenerationConfig defaults, used when neither a flag nor generation_config.json
/// gives a value (max_new_tokens: tallow's own; transformers' default is max_length = 20).
const DEFAULT_MAX_NEW_TOKENS: usize = 128;
const DEFAULT_TOP_K: usize = 50;

/// A loaded model with its tokenizer and resolved decoding options.
pub struct Session {
    pub model: CausalLM,
    pub tok: TextTokenizer,
    pub opts: GenerateOptions,
}

/// Loads the model, tokenizer and adapter and resolves the decoding options (flag, else
/// generation_config.json, else transformers' default).
pub fn load(a: &DecodeArgs) -> Result<Session> {
    let device = parse_device(&a.device)?;
    let dtype = parse_dtype(&a.dtype, &device)?;
    let model_dir = model::dir(&a.model)?;
    let tok = TextTokenizer::from_model_dir(&model_dir)?;
    let opts = model::options(
        a.quantize,
        a.double_quant,
        dtype,
        &device,
        &a.ignore_config_keys,
    );
    let (model, _) = model::load(&model_dir, &opts, a.adapter.as_deref())?;
    let gc = GenerationConfig::from_dir(&model_dir, &model.config.eos_token_ids)?;
    // transformers: sampling only when do_sample is true; then temperature defaults to 1.0.
    let temperature = a.temperature.unwrap_or(if gc.do_sample == Some(true) {
        gc.temperature.unwrap_or(1.0)
    } else {
        0.0
    });
    let sampling = SamplingParams {
        temperature,
        top_k: a.top_k.or(gc.top_k).unwrap_or(DEFAULT_TOP_K),
        top_p: a.top_p.or(gc.top_p).unwrap_or(1.0),
        repetition_penalty: a
            .repetition_penalty
            .or(gc.repetition_penalty)
            .unwrap_or(1.0),
        seed: a.seed,
    };
    sampling.validate()?;
    let opts = GenerateOptions {
        max_new_tokens: a
            .max_new_tokens
            .or(gc.max_new_tokens)
            .unwrap_or(DEFAULT_MAX_NEW_TOKENS),
        stop_ids: gc.eos_token_ids,
        sampling,
        use_cache: !a.no_cache,
    };
    eprintln!(
        "{}{}: {} on {}, {}, {}",
        model_dir.display(),
        a.adapter
            .as_ref()
            .map(|p| format!(" + {}", p.display()))
            .unwrap_or_default(),
        dtype_name(dtype),
        if device.is_cuda() { "cuda" } else { "cpu" },
        if opts.sampling.is_greedy() {
            "greedy".to_string()
        } else {
            let s = &opts.sampling;
            format!(
                "sampling (temperature {}, top-k {}, top-p {}, seed {})",
                s.temperature, s.top_k, s.top_p, s.seed
            )
        },
        if opts.use_cache {
            "KV cache"
        } else {
            "no cache"
        }
    );
    Ok(Session { model, tok, opts })
}

impl Session {
    /// Generates after `prompt_ids` through a [`Streamer`] (printing the text as it completes
    /// when `print`): the generation and its whole text.
    pub fn generate_streamed(
        &self,
        prompt_ids: &[u32],
        print: bool,
    ) -> Result<(Generation, String)> {
        let mut streamer = Streamer::new(&self.tok, &self.opts.stop_ids, print);
        let g = generate(&self.model, prompt_ids, &self.opts, |id| {
            streamer
                .push(id)
                .map_err(|e| tallow_model::ModelError::Invalid(e.to_string()))
        })?;
        Ok((g, streamer.finish()?))
    }
}

/// Prints generated text as it completes: decodes the whole generated id list each time and
/// prints the new suffix, holding back a trailing U+FFFD (a character whose bytes are split over
/// tokens, completed by a later one). Stop ids are not printed.
pub struct Streamer<'a> {
    tok: &'a TextTokenizer,
    stop: &'a [u32],
    ids: Vec<u32>,
    printed: String,
    out: Option<std::io::Stdout>,
}

impl<'a> Streamer<'a> {
    /// `print`: write to stdout as tokens arrive (false: only collect).
    pub fn new(tok: &'a TextTokenizer, stop: &'a [u32], print: bool) -> Self {
        Self {
            tok,
            stop,
            ids: Vec::new(),
            printed: String::new(),
            out: print.then(std::io::stdout),
        }
    }

    pub fn push(&mut self, id: u32) -> Result<()> {
        if self.stop.contains(&id) {
            return Ok(());
        }
        self.ids.push(id);
        let text = self.tok.decode(&self.ids)?;
        if text.ends_with('\u{FFFD}') {
            return Ok(());
        }
        self.emit(text)
    }

    fn emit(&mut self, text: String) -> Result<()> {
        // Decoding can rewrite earlier text (cleanup of spaces before punctuation): print only
        // an extension of what is already out.
        if let Some(new) = text.strip_prefix(self.printed.as_str()) {
            if let Some(out) = self.out.as_mut() {
                out.write_all(new.as_bytes())?;
                out.flush()?;
            }
            self.printed = text;
        }
        Ok(())
    }

    /// Prints what was held back and returns the whole text.
    pub fn finish(mut self) -> Result<String> {
        let text = self.tok.decode(&self.ids)?;
        self.emit(text.clone())?;
        Ok(text)
    }
}

/// One stderr line of timings: prefill and decode apart.
pub fn report(prompt_tokens: usize, g: &Generation) {
    let decode_tokens = g.ids.len().saturating_sub(1);
    let rate = |n: usize, s: f64| if s > 0.0 { n as f64 / s } else { 0.0 };
    eprintln!(
        "prompt {prompt_tokens} tokens: prefill {:.3} s ({:.1} tokens/s); decode {decode_tokens} \
         tokens in {:.3} s ({:.1} tokens/s); {}; KV cache {:.2} MiB",
        g.prefill_secs,
        rate(prompt_tokens, g.prefill_secs),
        g.decode_secs,
        rate(decode_tokens, g.decode_secs),
        if g.stopped {
            "stopped at a stop token"
        } else {
            "reached max_new_tokens"
        },
        g.cache_bytes as f64 / (1 << 20) as f64,
    );
}

/// Renders `messages` with the model's chat template and the assistant header after them.
pub fn chat_prompt(tok: &TextTokenizer, messages: &[Message], flag: &str) -> Result<Vec<u32>> {
    let Some(template) = tok.chat_template() else {
        bail!(
            "{flag}: {} has no chat template (chat_template.jinja or `chat_template` in \
             tokenizer_config.json); use a chat model, or generate from a plain --prompt",
            tok.dir().display()
        );
    };
    let text = template.render(messages, true)?;
    // As transformers' apply_chat_template(tokenize=True): the template writes the special tokens.
    Ok(tok.encode(&text, false)?)
}

fn read_prompt(path: &Path) -> Result<String> {
    let mut text = std::fs::read_to_string(path)
        .with_context(|| format!("--prompt-file {}: cannot read", path.display()))?;
    if text.ends_with('\n') {
        text.pop();
        if text.ends_with('\r') {
            text.pop();
        }
    }
    Ok(text)
}

pub fn run(a: GenerateArgs) -> Result<()> {
    let prompt = match (&a.prompt, &a.prompt_file) {
        (Some(p), None) => p.clone(),
        (None, Some(f)) => read_prompt(f)?,
        _ => bail!("give exactly one of --prompt TEXT or --prompt-file FILE"),
    };
    let s = load(&a.decode)?;
    let prompt_ids = if a.chat {
        chat_prompt(&s.tok, &[Message::new("user", prompt)], "--chat")?
    } else {
        // As `tokenizer(prompt)` in transformers: special tokens added (e.g. BOS).
        s.tok.encode(&prompt, true)?
    };
    if prompt_ids.is_empty() {
        bail!("the prompt encodes to no tokens: give a non-empty --prompt");
    }
    let (g, text) = s.generate_streamed(&prompt_ids, !a.json)?;
    if a.json {
        let decode_tokens = g.ids.len().saturating_sub(1);
        let out = serde_json::json!({
            "prompt_ids": prompt_ids,
            "generated_ids": g.ids,
            "text": text,
            "stopped": g.stopped,
            "prefill_s": g.prefill_secs,
            "decode_s": g.decode_secs,
            "prefill_tokens_per_s": prompt_ids.len() as f64 / g.prefill_secs.max(1e-9),
            "decode_tokens_per_s": decode_tokens as f64 / g.decode_secs.max(1e-9),
        });
        println!("{out}");
    } else {
        println!();
    }
    report(prompt_ids.len(), &g);
    Ok(())
}
