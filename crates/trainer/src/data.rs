//! JSONL and parquet datasets (local files, or the shards of a hub dataset's split) -> token
//! ids and target masks.
//!
//! One JSON object per line (or parquet row), in one of these formats:
//! - text:              `{"text": "..."}`: every token after the first is trained.
//! - prompt_completion: `{"prompt": "...", "completion": "..."}`: only completion tokens are trained.
//! - messages:          `{"messages": [{"role": "...", "content": "..."}, ...]}`: rendered with the
//!   model's chat template; only assistant turns are trained.
//!
//! The rules match the Python reference that writes `tests/fixtures/reference/*.json` token for
//! token (see `tests/data_parity.rs`); change both together.

use crate::error::{json_type, DataError, RowError};
use serde::{Deserialize, Serialize};
use serde_json::Value as Json;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use tallow_hub::{DatasetSplit, ShardFormat};
use tallow_text::{Message, TextTokenizer};

crate::config::choice::choices! {
    /// The shape of the rows of a JSONL file.
    #[derive(Default)]
    pub enum Format {
        /// Pick from the keys of the file's first row.
        #[default]
        Auto = "auto",
        /// `{"text": ...}`: every token after the first is trained.
        Text = "text",
        /// `{"prompt": ..., "completion": ...}`: only the completion is trained.
        PromptCompletion = "prompt_completion",
        /// `{"messages": [...]}`: rendered with the chat template; only assistant turns are trained.
        Messages = "messages",
        /// `{"instruction", "input", "output"}` (Stanford Alpaca): the instruction and input
        /// through [`AlpacaPrompt`] are the prompt, the output the trained completion.
        Alpaca = "alpaca",
        /// `{"conversations": [{"from": "human" | "gpt" | "system", "value"}, ...]}`: the
        /// messages format under ShareGPT's names.
        Sharegpt = "sharegpt",
        /// `{"prompt", "chosen", "rejected"}`, strings or TRL's conversational lists: a
        /// preference pair for `train.method = "dpo" | "orpo"` ([`crate::preference`]).
        Preference = "preference",
    }
}

impl Format {
    /// The format a row's keys call for: `text`, then `prompt` + `completion`, then
    /// `messages`, then `instruction` + `output` (Alpaca), then `conversations` (ShareGPT).
    fn detect(row: &serde_json::Map<String, Json>) -> Option<Format> {
        if row.contains_key("text") {
            Some(Format::Text)
        } else if row.contains_key("prompt") && row.contains_key("completion") {
            Some(Format::PromptCompletion)
        } else if row.contains_key("chosen") || row.contains_key("rejected") {
            Some(Format::Preference)
        } else if row.contains_key("messages") {
            Some(Format::Messages)
        } else if row.contains_key("instruction") && row.contains_key("output") {
            Some(Format::Alpaca)
        } else if row.contains_key("conversations") {
            Some(Format::Sharegpt)
        } else {
            None
        }
    }
}

impl FromStr for Format {
    type Err = DataError;

    /// The exact name (`--format prompt_completion`); an unknown one lists [`Format::NAMES`].
    fn from_str(s: &str) -> Result<Self, DataError> {
        Format::from_name(s).ok_or_else(|| DataError::UnknownFormat(s.to_string()))
    }
}

/// Rows are cut to this many tokens unless `data.max_seq_len` / `--max-seq-len` says otherwise:
/// the default of the training config's `[data]` section, of [`DataOptions`] and of
/// `tallow eval`, so an eval with defaults cuts rows as a training run with defaults does.
pub const DEFAULT_MAX_SEQ_LEN: usize = 1024;

/// How rows become examples.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataOptions {
    pub format: Format,
    /// Rows are cut to this many tokens; a row left with no target is skipped.
    pub max_seq_len: usize,
    /// Append the EOS id to text, prompt_completion and alpaca rows (not doubled when the
    /// tokenizer already adds it). Messages rows take their end-of-turn tokens from the chat
    /// template.
    pub add_eos: bool,
    /// The prompt of an Alpaca row.
    #[serde(default)]
    pub alpaca: AlpacaPrompt,
    /// Preference rows: keep only the last this many prompt tokens (0: all).
    #[serde(default)]
    pub max_prompt_len: usize,
    /// Preference rows: which TRL trainer's tokenization they follow (DPO's or ORPO's).
    #[serde(default)]
    pub pair_rule: PairRule,
}

/// How a preference pair becomes token ids: as TRL 0.23's `DPOTrainer.tokenize_row` or as its
/// `ORPOTrainer.tokenize_row`, which differ in BOS, EOS and the prompt / completion boundary
/// (see [`preference_pair`]; `tests/tests/preference.rs` checks both against TRL's ids).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PairRule {
    #[default]
    Dpo,
    Orpo,
}

impl Default for DataOptions {
    fn default() -> Self {
        Self {
            format: Format::Auto,
            max_seq_len: DEFAULT_MAX_SEQ_LEN,
            add_eos: true,
            alpaca: AlpacaPrompt::default(),
            max_prompt_len: 0,
            pair_rule: PairRule::Dpo,
        }
    }
}

/// Stanford Alpaca's prompt for a row with an input (`data.alpaca_prompt`).
pub const ALPACA_PROMPT: &str = "Below is an instruction that describes a task, paired with an \
input that provides further context. Write a response that appropriately completes the \
request.\n\n### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n";

/// Stanford Alpaca's prompt for a row whose input is absent or empty
/// (`data.alpaca_prompt_no_input`).
pub const ALPACA_PROMPT_NO_INPUT: &str = "Below is an instruction that describes a task. Write a \
response that appropriately completes the request.\n\n### Instruction:\n{instruction}\n\n\
### Response:\n";

/// How an Alpaca row's `instruction` and `input` become the prompt: `{instruction}` and
/// `{input}` replaced in `with_input`, or `{instruction}` in `without_input` when the input is
/// absent or empty (Stanford Alpaca's templates by default, as Axolotl's `alpaca` type).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AlpacaPrompt {
    pub with_input: String,
    pub without_input: String,
}

impl Default for AlpacaPrompt {
    fn default() -> Self {
        Self {
            with_input: ALPACA_PROMPT.into(),
            without_input: ALPACA_PROMPT_NO_INPUT.into(),
        }
    }
}

impl AlpacaPrompt {
    /// The prompt of one row.
    pub fn render(&self, instruction: &str, input: &str) -> String {
        if input.is_empty() {
            self.without_input.replace("{instruction}", instruction)
        } else {
            self.with_input
                .replace("{instruction}", instruction)
                .replace("{input}", input)
        }
    }
}

/// One training/eval row. `targets[i] == true` means token `i` is predicted from `ids[..i]` and its
/// NLL counts. `targets[0]` is always false. Both have the same length, at most `max_seq_len`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Example {
    pub ids: Vec<u32>,
    pub targets: Vec<bool>,
}

impl Example {
    /// Number of positions whose loss counts.
    pub fn n_targets(&self) -> usize {
        self.targets.iter().filter(|&&t| t).count()
    }
}

/// The examples of one JSONL file.
#[derive(Debug, Clone)]
pub struct Dataset {
    pub path: PathBuf,
    /// The format used (never `Auto`).
    pub format: Format,
    pub examples: Vec<Example>,
    /// Rows dropped because no target was left after truncation.
    pub skipped: usize,
    /// Rows read (examples + skipped).
    pub rows: usize,
    /// Hub dataset shards read (0 for a local file).
    pub shards: usize,
}

impl Dataset {
    /// Total number of tokens over all examples.
    pub fn n_tokens(&self) -> usize {
        self.examples.iter().map(|e| e.ids.len()).sum()
    }

    /// Total number of target positions over all examples.
    pub fn n_targets(&self) -> usize {
        self.examples.iter().map(Example::n_targets).sum()
    }
}

/// Reads and tokenizes the JSONL (or `.parquet`) file at `path`. Blank lines are ignored; any
/// malformed line is an error naming the file and its 1-based line number.
pub fn load_jsonl(
    path: &Path,
    tok: &TextTokenizer,
    opts: &DataOptions,
) -> Result<Dataset, DataError> {
    load_file(path, tok, opts, 0)
}

/// [`load_jsonl`] reading at most `max_rows` rows (0: all).
pub fn load_file(
    path: &Path,
    tok: &TextTokenizer,
    opts: &DataOptions,
    max_rows: usize,
) -> Result<Dataset, DataError> {
    let mut sink = RowSink::new(path.to_path_buf(), tok, opts, max_rows);
    let kind = if path.extension().is_some_and(|e| e == "parquet") {
        ShardFormat::Parquet
    } else {
        ShardFormat::JsonLines
    };
    read_file(path, path, kind, &mut sink)?;
    sink.finish()
}

/// The rows of one split of a whole hub dataset, shard after shard: each shard is downloaded
/// (or taken from the cache) only when the rows before it are used up, so with `max_rows`
/// (0: all) the shards past the last row read are never downloaded. Errors name the shard
/// (`hf://datasets/OWNER/NAME/PATH`) and its line or row.
pub fn load_hub_split(
    split: &DatasetSplit,
    tok: &TextTokenizer,
    opts: &DataOptions,
    max_rows: usize,
) -> Result<Dataset, DataError> {
    let name = PathBuf::from(split.name());
    let mut sink = RowSink::new(name, tok, opts, max_rows);
    for i in 0..split.files.len() {
        if sink.full() {
            break;
        }
        let shown = PathBuf::from(split.shard_name(i));
        let local = split.shard(i).map_err(|source| DataError::Shard {
            shard: shown.clone(),
            source: Box::new(source),
        })?;
        read_file(&local, &shown, split.format, &mut sink)?;
        sink.shards += 1;
    }
    sink.finish()
}

/// Pushes the rows of `local` (shown as `shown` in messages) into `sink`, stopping when it is
/// full. JSON lines are read line by line (`.gz` decompressed); parquet a row group at a time.
fn read_file(
    local: &Path,
    shown: &Path,
    format: ShardFormat,
    sink: &mut RowSink<'_>,
) -> Result<(), DataError> {
    match format {
        ShardFormat::Parquet => read_parquet(local, shown, sink),
        ShardFormat::JsonLines => read_json_lines(local, shown, sink),
    }
}

fn read_json_lines(local: &Path, shown: &Path, sink: &mut RowSink<'_>) -> Result<(), DataError> {
    use std::io::BufRead;
    let io = |source| DataError::Io {
        path: local.to_path_buf(),
        source,
    };
    let file = std::fs::File::open(local).map_err(io)?;
    let reader: Box<dyn std::io::Read> = if local.extension().is_some_and(|e| e == "gz") {
        Box::new(flate2::read::GzDecoder::new(file))
    } else {
        Box::new(file)
    };
    for (i, line) in std::io::BufReader::new(reader).lines().enumerate() {
        if sink.full() {
            break;
        }
        let line = line.map_err(io)?;
        let l = if i == 0 {
            line.trim_start_matches('\u{feff}')
        } else {
            &line
        };
        if l.trim().is_empty() {
            continue;
        }
        let parsed = serde_json::from_str::<Json>(l).map_err(|e| RowError::Json(e.to_string()));
        sink.push(parsed).map_err(|e| {
            e.at(|source| DataError::Row {
                path: shown.to_path_buf(),
                line: i + 1,
                source,
            })
        })?;
    }
    Ok(())
}

/// Rows of a parquet file (`.parquet`), read one row group at a time; columns as in the JSONL
/// formats (`text`, `prompt` + `completion`, or `messages` as a list of role/content structs).
fn read_parquet(local: &Path, shown: &Path, sink: &mut RowSink<'_>) -> Result<(), DataError> {
    use parquet::file::reader::{FileReader, SerializedFileReader};
    let bad = |message: String| DataError::Parquet {
        path: shown.to_path_buf(),
        message,
    };
    let file = std::fs::File::open(local).map_err(|source| DataError::Io {
        path: local.to_path_buf(),
        source,
    })?;
    let reader = SerializedFileReader::new(file).map_err(|e| bad(e.to_string()))?;
    for group in 0..reader.metadata().num_row_groups() {
        let rg = reader
            .get_row_group(group)
            .map_err(|e| bad(format!("row group {group}: {e}")))?;
        let rows = rg
            .get_row_iter(None)
            .map_err(|e| bad(format!("row group {group}: {e}")))?;
        for (row, parsed) in rows.enumerate() {
            if sink.full() {
                return Ok(());
            }
            let parsed = parsed
                .map(|r| r.to_json_value())
                .map_err(|e| RowError::Json(format!("cannot decode the row: {e}")));
            sink.push(parsed).map_err(|e| {
                e.at(|source| DataError::ParquetRow {
                    path: shown.to_path_buf(),
                    group,
                    row,
                    source,
                })
            })?;
        }
    }
    Ok(())
}

/// The row loop shared by JSONL and parquet files and hub shards: the format is fixed by the
/// first row, then each row is tokenized (or skipped when truncation leaves no target), until
/// `max_rows` rows were read.
struct RowSink<'a> {
    /// The data as the user named it (a file, or the hub dataset), for whole-data errors.
    path: PathBuf,
    tok: &'a TextTokenizer,
    opts: &'a DataOptions,
    format: Format,
    examples: Vec<Example>,
    skipped: usize,
    n_rows: usize,
    /// 0: no limit.
    max_rows: usize,
    /// Hub shards read (0 for a local file).
    shards: usize,
}

/// A row failed: either with a row-level error (to be located by the caller) or a whole-file one.
enum PushError {
    Row(RowError),
    File(DataError),
}

impl PushError {
    fn at(self, locate: impl FnOnce(RowError) -> DataError) -> DataError {
        match self {
            PushError::Row(e) => locate(e),
            PushError::File(e) => e,
        }
    }
}

impl<'a> RowSink<'a> {
    fn new(path: PathBuf, tok: &'a TextTokenizer, opts: &'a DataOptions, max_rows: usize) -> Self {
        Self {
            path,
            tok,
            opts,
            format: opts.format,
            examples: Vec::new(),
            skipped: 0,
            n_rows: 0,
            max_rows,
            shards: 0,
        }
    }

    /// `max_rows` rows were read.
    fn full(&self) -> bool {
        self.max_rows > 0 && self.n_rows >= self.max_rows
    }

    fn push(&mut self, parsed: Result<Json, RowError>) -> Result<(), PushError> {
        let row = parsed.map_err(PushError::Row)?;
        if self.n_rows == 0 {
            self.format = resolve_format(&row, self.format).map_err(PushError::Row)?;
            check_supported(self.format, self.tok, self.opts).map_err(|source| {
                PushError::File(DataError::Unsupported {
                    data: self.path.clone(),
                    model_dir: self.tok.dir().to_path_buf(),
                    source,
                })
            })?;
        }
        self.n_rows += 1;
        if self.format == Format::Preference {
            // A pair: chosen then rejected, side by side in `examples`.
            match preference_pair(&row, self.tok, self.opts).map_err(PushError::Row)? {
                Some((chosen, rejected)) => self.examples.extend([chosen, rejected]),
                None => self.skipped += 1,
            }
            return Ok(());
        }
        match tokenize_row(&row, self.format, self.tok, self.opts).map_err(PushError::Row)? {
            Some(example) => self.examples.push(example),
            None => self.skipped += 1,
        }
        Ok(())
    }

    fn finish(self) -> Result<Dataset, DataError> {
        if self.n_rows == 0 {
            return Err(DataError::EmptyFile { path: self.path });
        }
        Ok(Dataset {
            path: self.path,
            format: self.format,
            examples: self.examples,
            skipped: self.skipped,
            rows: self.n_rows,
            shards: self.shards,
        })
    }
}

/// `format`, or for `Format::Auto` the format the row's keys call for.
fn resolve_format(row: &Json, format: Format) -> Result<Format, RowError> {
    if format != Format::Auto {
        return Ok(format);
    }
    let obj = row.as_object().ok_or(RowError::NotObject(json_type(row)))?;
    Format::detect(obj).ok_or_else(|| {
        let keys: Vec<String> = obj.keys().map(|k| format!("{k:?}")).collect();
        RowError::UndetectedFormat {
            keys: keys.join(", "),
        }
    })
}

/// Fails up front, before any row, when the format needs what the tokenizer lacks.
fn check_supported(
    format: Format,
    tok: &TextTokenizer,
    opts: &DataOptions,
) -> Result<(), RowError> {
    match format {
        Format::Messages | Format::Sharegpt if tok.chat_template().is_none() => {
            Err(RowError::NoChatTemplate)
        }
        Format::Preference if opts.add_eos && tok.eos_id().is_none() => Err(RowError::NoEos),
        Format::Text | Format::PromptCompletion | Format::Alpaca
            if opts.add_eos && tok.eos_id().is_none() =>
        {
            Err(RowError::NoEos)
        }
        _ => Ok(()),
    }
}

/// Tokenizes one parsed row. `Ok(None)` means the row was skipped: no target left after cutting
/// to `opts.max_seq_len`. With `Format::Auto` the row's own keys pick the format.
pub fn tokenize_row(
    value: &Json,
    format: Format,
    tok: &TextTokenizer,
    opts: &DataOptions,
) -> Result<Option<Example>, RowError> {
    let format = resolve_format(value, format)?;
    let row = value
        .as_object()
        .ok_or(RowError::NotObject(json_type(value)))?;
    let (mut ids, mut targets) = match format {
        Format::Text => {
            let text = string_key(row, "text", format)?;
            let mut ids = tok.encode(text, true)?;
            push_eos(&mut ids, tok, opts)?;
            // Every token after the first is predicted.
            let targets = (0..ids.len()).map(|i| i >= 1).collect();
            (ids, targets)
        }
        Format::PromptCompletion => {
            let prompt = string_key(row, "prompt", format)?;
            let completion = string_key(row, "completion", format)?;
            prompt_completion(prompt, completion, tok, opts)?
        }
        Format::Alpaca => {
            let instruction = string_key(row, "instruction", format)?;
            let input = match row.get("input") {
                None | Some(Json::Null) => "",
                Some(_) => string_key(row, "input", format)?,
            };
            let output = string_key(row, "output", format)?;
            prompt_completion(&opts.alpaca.render(instruction, input), output, tok, opts)?
        }
        Format::Messages => messages_example(parse_messages(row)?, tok)?,
        Format::Sharegpt => messages_example(parse_sharegpt(row)?, tok)?,
        Format::Preference => {
            return Err(RowError::MethodMismatch(
                "a preference row (prompt / chosen / rejected) is a pair, not one sequence: \
                 train on it with train.method = \"dpo\" or \"orpo\", or evaluate it with \
                 `tallow eval --format preference`"
                    .into(),
            ))
        }
        Format::Auto => unreachable!("resolved above"),
    };

    ids.truncate(opts.max_seq_len);
    targets.truncate(opts.max_seq_len);
    if let Some(first) = targets.first_mut() {
        *first = false; // nothing predicts the first token
    }
    let example = Example { ids, targets };
    Ok((example.n_targets() > 0).then_some(example))
}

/// A prompt and its completion: the joined string tokenized once (not prompt ids + completion
/// ids, so the boundary token merges as it would at inference), EOS appended, the prompt's own
/// token count marking where targets start.
fn prompt_completion(
    prompt: &str,
    completion: &str,
    tok: &TextTokenizer,
    opts: &DataOptions,
) -> Result<(Vec<u32>, Vec<bool>), RowError> {
    let mut ids = tok.encode(&format!("{prompt}{completion}"), true)?;
    push_eos(&mut ids, tok, opts)?;
    let start = tok.encode(prompt, true)?.len().max(1);
    let targets = (0..ids.len()).map(|i| i >= start).collect();
    Ok((ids, targets))
}

/// Messages row: the rendered conversation, with each assistant turn's tokens as targets.
///
/// Turn `i`'s span is `[a, b)` with `a` = token count of `render(messages[..i], gen_prompt=true)`
/// (the context plus the assistant header) and `b` = token count of `render(messages[..=i])`, so the
/// header is not trained and whatever the template puts after the content (e.g. `<|im_end|>`) is.
fn messages_example(
    messages: Vec<Message>,
    tok: &TextTokenizer,
) -> Result<(Vec<u32>, Vec<bool>), RowError> {
    let template = tok.chat_template().ok_or(RowError::NoChatTemplate)?;
    let n_tokens = |msgs: &[Message], gen: bool| -> Result<usize, RowError> {
        Ok(tok.encode(&template.render(msgs, gen)?, false)?.len())
    };

    let ids = tok.encode(&template.render(&messages, false)?, false)?;
    let mut targets = vec![false; ids.len()];
    for (i, m) in messages.iter().enumerate() {
        if m.role != "assistant" {
            continue;
        }
        let a = n_tokens(&messages[..i], true)?;
        let b = n_tokens(&messages[..=i], false)?.min(ids.len());
        for t in targets.iter_mut().take(b).skip(a) {
            *t = true;
        }
    }
    Ok((ids, targets))
}

/// A preference row as two examples, chosen then rejected, each the prompt's tokens (not
/// trained) followed by the completion's (trained). Conversational rows (`prompt` a list of
/// messages ending with a user turn, `chosen` / `rejected` lists with the assistant's turn) are
/// rendered first as TRL's `maybe_apply_chat_template`: the prompt with the generation header,
/// each completion as the text the template adds after the prompt. Then, by `opts.pair_rule`,
/// TRL 0.23's tokenization:
/// - DPO (`DPOTrainer.tokenize_row`): prompt and completion tokenized apart without special
///   tokens (so no BOS: TRL's choice for decoder-only models), EOS appended to each completion
///   (`data.add_eos`), even one that already ends with it;
/// - ORPO (`ORPOTrainer.tokenize_row`): see [`orpo_pair_part`].
///
/// Truncation: the prompt keeps its last `max_prompt_len` tokens (when set), then each
/// completion is cut to fit `max_seq_len`; a prompt that leaves no room is `Ok(None)` (skipped
/// and counted).
fn preference_pair(
    value: &Json,
    tok: &TextTokenizer,
    opts: &DataOptions,
) -> Result<Option<(Example, Example)>, RowError> {
    let row = value
        .as_object()
        .ok_or(RowError::NotObject(json_type(value)))?;
    let f = Format::Preference;
    for key in ["prompt", "chosen", "rejected"] {
        if !row.contains_key(key) {
            return Err(RowError::MissingKey {
                key,
                format: f.name(),
            });
        }
    }
    let (prompt, chosen, rejected) = match &row["prompt"] {
        Json::String(_) => (
            string_key(row, "prompt", f)?.to_string(),
            string_key(row, "chosen", f)?.to_string(),
            string_key(row, "rejected", f)?.to_string(),
        ),
        Json::Array(_) => {
            let template = tok.chat_template().ok_or(RowError::NoChatTemplate)?;
            let prompt = message_list(row, "prompt")?;
            if let Some(last) = prompt.last().filter(|m| m.role != "user") {
                return Err(RowError::PromptLastRole {
                    role: last.role.clone(),
                });
            }
            let prompt_text = template.render(&prompt, true)?;
            let joined = |key: &'static str| -> Result<String, RowError> {
                let mut all = prompt.clone();
                all.extend(message_list(row, key)?);
                Ok(template.render(&all, false)?)
            };
            let (pc, pr) = (joined("chosen")?, joined("rejected")?);
            // The prompt is the part the prompt-plus-chosen text shares with it (a template may
            // render the generation header differently), as TRL does.
            let common = prompt_text
                .char_indices()
                .zip(pc.chars())
                .find(|((_, a), b)| a != b)
                .map_or(prompt_text.len().min(pc.len()), |((i, _), _)| i);
            let prompt = prompt_text[..common].to_string();
            let rejected = pr.get(common..).unwrap_or_default().to_string();
            (prompt, pc[common..].to_string(), rejected)
        }
        other => {
            return Err(RowError::WrongType {
                key: "prompt".into(),
                expected: "a string or a list of {\"role\", \"content\"} messages",
                found: json_type(other),
            })
        }
    };
    if chosen == rejected {
        return Err(RowError::IdenticalPair);
    }
    let eos = || tok.eos_id().ok_or(RowError::NoEos);
    // (prompt ids, completion ids) of the chosen and of the rejected sequence.
    let (chosen, rejected) = match opts.pair_rule {
        PairRule::Dpo => {
            let prompt_ids = tok.encode(&prompt, false)?;
            let part = |completion: &str| -> Result<(Vec<u32>, Vec<u32>), RowError> {
                let mut c = tok.encode(completion, false)?;
                // TRL's DPO appends EOS to every completion, even one whose text already ends
                // with it.
                if opts.add_eos {
                    c.push(eos()?);
                }
                Ok((prompt_ids.clone(), c))
            };
            (part(&chosen)?, part(&rejected)?)
        }
        PairRule::Orpo => (
            orpo_pair_part(&prompt, &chosen, tok, opts)?,
            orpo_pair_part(&prompt, &rejected, tok, opts)?,
        ),
    };
    let example = |(mut prompt_ids, mut c): (Vec<u32>, Vec<u32>)| -> Option<Example> {
        if opts.max_prompt_len > 0 && prompt_ids.len() > opts.max_prompt_len {
            prompt_ids.drain(..prompt_ids.len() - opts.max_prompt_len);
        }
        if prompt_ids.len() >= opts.max_seq_len {
            return None;
        }
        c.truncate(opts.max_seq_len - prompt_ids.len());
        let mut ids = prompt_ids;
        let mut targets = vec![false; ids.len()];
        ids.extend_from_slice(&c);
        targets.extend(std::iter::repeat_n(true, c.len()));
        targets[0] = false; // nothing predicts the first token
        Some(Example { ids, targets })
    };
    match (example(chosen), example(rejected)) {
        (Some(c), Some(r)) if c.n_targets() > 0 && r.n_targets() > 0 => Ok(Some((c, r))),
        _ => Ok(None),
    }
}

/// One side of a pair as TRL 0.23's `ORPOTrainer.tokenize_row` makes it (decoder-only): prompt
/// and completion tokenized together (`build_tokenized_answer`) and split after the prompt's own
/// tokens, one token earlier when the prompt's last token merged with the completion's first;
/// BOS prepended when the tokenizer has one and the prompt does not start with it
/// (`add_bos_token_if_needed`); EOS appended unless the completion already ends with it
/// (`add_eos_token_if_needed`, here under `data.add_eos`). (prompt ids, completion ids).
fn orpo_pair_part(
    prompt: &str,
    completion: &str,
    tok: &TextTokenizer,
    opts: &DataOptions,
) -> Result<(Vec<u32>, Vec<u32>), RowError> {
    let full = tok.encode(&format!("{prompt}{completion}"), false)?;
    let own = tok.encode(prompt, false)?;
    let mut start = own.len().min(full.len());
    if full[..start] != own[..] {
        start = start.saturating_sub(1);
    }
    let (mut p, mut c) = (full[..start].to_vec(), full[start..].to_vec());
    if let Some(bos) = tok.bos_token().and_then(|b| tok.inner().token_to_id(b)) {
        if p.first() != Some(&bos) {
            p.insert(0, bos);
        }
    }
    if opts.add_eos {
        let eos = tok.eos_id().ok_or(RowError::NoEos)?;
        if c.last() != Some(&eos) {
            c.push(eos);
        }
    }
    Ok((p, c))
}

/// `row["messages"]` as a list of `{role, content}` with string values.
fn parse_messages(row: &serde_json::Map<String, Json>) -> Result<Vec<Message>, RowError> {
    message_list(row, "messages")
}

/// `row[key]` as a list of `{role, content}` with string values.
fn message_list(
    row: &serde_json::Map<String, Json>,
    key: &'static str,
) -> Result<Vec<Message>, RowError> {
    let list = match row.get(key) {
        None => {
            return Err(RowError::MissingKey {
                key,
                format: if key == "messages" {
                    "messages"
                } else {
                    "preference"
                },
            })
        }
        Some(Json::Array(list)) => list,
        Some(other) => {
            return Err(RowError::WrongType {
                key: key.into(),
                expected: "a list of {\"role\": str, \"content\": str}",
                found: json_type(other),
            })
        }
    };
    list.iter()
        .enumerate()
        .map(|(i, m)| {
            let field = |name: &str| -> Result<String, RowError> {
                match m.get(name) {
                    Some(Json::String(s)) => Ok(s.clone()),
                    other => Err(RowError::WrongType {
                        key: format!("{key}[{i}].{name}"),
                        expected: "a string",
                        found: other.map_or("nothing (key missing)", json_type),
                    }),
                }
            };
            if !m.is_object() {
                return Err(RowError::WrongType {
                    key: format!("{key}[{i}]"),
                    expected: "an object {\"role\": str, \"content\": str}",
                    found: json_type(m),
                });
            }
            Ok(Message {
                role: field("role")?,
                content: field("content")?,
            })
        })
        .collect()
}

/// `row["conversations"]` (ShareGPT) as messages: `from` "human" (or "user") is the user,
/// "gpt" (or "assistant") the assistant, "system" the system; `value` the content. Any other
/// `from` (tool calls, observations) is refused by name.
fn parse_sharegpt(row: &serde_json::Map<String, Json>) -> Result<Vec<Message>, RowError> {
    let list = match row.get("conversations") {
        None => {
            return Err(RowError::MissingKey {
                key: "conversations",
                format: "sharegpt",
            })
        }
        Some(Json::Array(list)) => list,
        Some(other) => {
            return Err(RowError::WrongType {
                key: "conversations".into(),
                expected: "a list of {\"from\": str, \"value\": str}",
                found: json_type(other),
            })
        }
    };
    list.iter()
        .enumerate()
        .map(|(i, m)| {
            let field = |name: &str| -> Result<&str, RowError> {
                match m.get(name) {
                    Some(Json::String(s)) => Ok(s),
                    other => Err(RowError::WrongType {
                        key: format!("conversations[{i}].{name}"),
                        expected: "a string",
                        found: other.map_or("nothing (key missing)", json_type),
                    }),
                }
            };
            let role = match field("from")? {
                "human" | "user" => "user",
                "gpt" | "assistant" => "assistant",
                "system" => "system",
                other => {
                    return Err(RowError::ShareGptRole {
                        at: format!("conversations[{i}].from"),
                        found: other.to_string(),
                    })
                }
            };
            Ok(Message {
                role: role.into(),
                content: field("value")?.to_string(),
            })
        })
        .collect()
}

/// `row[key]` as a string; missing or non-string is a row error.
fn string_key<'a>(
    row: &'a serde_json::Map<String, Json>,
    key: &'static str,
    format: Format,
) -> Result<&'a str, RowError> {
    match row.get(key) {
        Some(Json::String(s)) => Ok(s),
        None => Err(RowError::MissingKey {
            key,
            format: format.name(),
        }),
        Some(other) => Err(RowError::WrongType {
            key: key.into(),
            expected: "a string",
            found: json_type(other),
        }),
    }
}

/// Appends EOS when `opts.add_eos`, unless the tokenizer's post-processor already ended with it.
fn push_eos(ids: &mut Vec<u32>, tok: &TextTokenizer, opts: &DataOptions) -> Result<(), RowError> {
    if !opts.add_eos {
        return Ok(());
    }
    let eos = tok.eos_id().ok_or(RowError::NoEos)?;
    if ids.last() != Some(&eos) {
        ids.push(eos);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tallow_text::test_util::*;

    const BOS: u32 = 1;
    const EOS: u32 = 2;

    fn tok(name: &str) -> TextTokenizer {
        TextTokenizer::from_model_dir(&model_dir(name, Some(&chat_config()))).unwrap()
    }

    fn opts(format: Format, max_seq_len: usize) -> DataOptions {
        DataOptions {
            format,
            max_seq_len,
            ..DataOptions::default()
        }
    }

    /// The message of the error that loading `path` gives.
    fn load_err(path: &Path, tok: &TextTokenizer, opts: &DataOptions) -> String {
        load_jsonl(path, tok, opts).unwrap_err().to_string()
    }

    /// Writes `lines` as a JSONL file in a fresh temp dir.
    fn jsonl(name: &str, lines: &[&str]) -> PathBuf {
        let path = temp_dir(name).join("data.jsonl");
        std::fs::write(&path, lines.join("\n")).unwrap();
        path
    }

    fn ex(ids: &[u32], targets: &[u8]) -> Example {
        Example {
            ids: ids.to_vec(),
            targets: targets.iter().map(|&t| t == 1).collect(),
        }
    }

    #[test]
    fn format_names_round_trip() {
        for f in [
            Format::Auto,
            Format::Text,
            Format::PromptCompletion,
            Format::Messages,
            Format::Alpaca,
            Format::Sharegpt,
        ] {
            assert_eq!(f.to_string().parse::<Format>().unwrap(), f);
        }
        let err = "chat".parse::<Format>().unwrap_err().to_string();
        assert!(
            err.contains("\"chat\"") && err.contains("prompt_completion"),
            "{err}"
        );
    }

    #[test]
    fn auto_detects_each_format_from_first_row() {
        let tok = tok("data-detect");
        for (line, want) in [
            (r#"{"text": "a b"}"#, Format::Text),
            (
                r#"{"prompt": "a", "completion": "b"}"#,
                Format::PromptCompletion,
            ),
            (
                r#"{"messages": [{"role": "user", "content": "a"}]}"#,
                Format::Messages,
            ),
            (
                r#"{"instruction": "a", "input": "", "output": "b"}"#,
                Format::Alpaca,
            ),
            (
                r#"{"conversations": [{"from": "human", "value": "a"}]}"#,
                Format::Sharegpt,
            ),
        ] {
            let path = jsonl("data-detect", &["", line]);
            let ds = load_jsonl(&path, &tok, &opts(Format::Auto, 32)).unwrap();
            assert_eq!(ds.format, want, "{line}");
        }
    }

    #[test]
    fn auto_unknown_keys_error_lists_keys_and_shapes() {
        let path = jsonl(
            "data-undetected",
            &["", "  ", r#"{"input": "a", "output": "b"}"#],
        );
        let err = load_err(&path, &tok("data-undetected"), &opts(Format::Auto, 32));
        assert!(err.contains("data.jsonl:3:"), "{err}");
        assert!(err.contains("\"input\", \"output\""), "{err}");
        assert!(
            err.contains("\"prompt\": str, \"completion\": str"),
            "{err}"
        );
    }

    #[test]
    fn text_targets_all_but_first_and_eos_appended_once() {
        let tok = tok("data-text");
        let o = opts(Format::Text, 32);
        let row = serde_json::json!({"text": "hello world"});
        assert_eq!(
            tokenize_row(&row, Format::Text, &tok, &o).unwrap(),
            Some(ex(&[BOS, 3, 4, EOS], &[0, 1, 1, 1]))
        );
        // Text already ending in EOS: not doubled.
        let row = serde_json::json!({"text": "hello </s>"});
        assert_eq!(
            tokenize_row(&row, Format::Text, &tok, &o).unwrap(),
            Some(ex(&[BOS, 3, EOS], &[0, 1, 1]))
        );
        let no_eos = DataOptions {
            add_eos: false,
            ..o
        };
        let row = serde_json::json!({"text": "hello world"});
        assert_eq!(
            tokenize_row(&row, Format::Text, &tok, &no_eos).unwrap(),
            Some(ex(&[BOS, 3, 4], &[0, 1, 1]))
        );
    }

    #[test]
    fn prompt_completion_targets_start_after_prompt() {
        let tok = tok("data-pc");
        let pc = |row: serde_json::Value| {
            tokenize_row(
                &row,
                Format::PromptCompletion,
                &tok,
                &opts(Format::Auto, 32),
            )
            .unwrap()
        };
        assert_eq!(
            pc(serde_json::json!({"prompt": "hello world ", "completion": "a b"})),
            Some(ex(&[BOS, 3, 4, 5, 6, EOS], &[0, 0, 0, 1, 1, 1]))
        );
        // An empty prompt still leaves position 0 untrained.
        assert_eq!(
            pc(serde_json::json!({"prompt": "", "completion": "a"})),
            Some(ex(&[BOS, 5, EOS], &[0, 1, 1]))
        );
    }

    #[test]
    fn messages_targets_cover_assistant_turns_and_their_eos() {
        let tok = tok("data-msgs");
        let row = serde_json::json!({"messages": [
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": "a b"},
            {"role": "user", "content": "world"},
            {"role": "assistant", "content": "c"},
        ]});
        // "<|user|> hello <|bot|> a b </s> <|user|> world <|bot|> c </s> " (no BOS: the chat
        // string is encoded without special tokens).
        assert_eq!(
            tokenize_row(&row, Format::Messages, &tok, &opts(Format::Messages, 32)).unwrap(),
            Some(ex(
                &[10, 3, 11, 5, 6, EOS, 10, 4, 11, 7, EOS],
                &[0, 0, 0, 1, 1, 1, 0, 0, 0, 1, 1]
            ))
        );
    }

    #[test]
    fn truncation_and_skip_counting() {
        let tok = tok("data-trunc");
        let path = jsonl(
            "data-trunc",
            &[
                r#"{"prompt": "hello world a ", "completion": "b"}"#, // targets from 4
                r#"{"prompt": "a ", "completion": "b c"}"#,           // targets from 2
                "",
            ],
        );
        let ds = load_jsonl(&path, &tok, &opts(Format::PromptCompletion, 3)).unwrap();
        assert_eq!(ds.skipped, 1);
        assert_eq!(ds.examples, vec![ex(&[BOS, 5, 6], &[0, 0, 1])]);
        assert_eq!((ds.n_tokens(), ds.n_targets()), (3, 1));
    }

    #[test]
    fn malformed_lines_name_file_and_line() {
        let tok = tok("data-bad");
        let cases: [(&str, Format, &str); 5] = [
            (r#"{"text": "a""#, Format::Auto, "not valid JSON"),
            (
                r#"{"text": 5}"#,
                Format::Text,
                "key `text` must be a string, found a number",
            ),
            (
                r#"{"prompt": "a"}"#,
                Format::PromptCompletion,
                "missing key `completion`",
            ),
            (
                r#"{"messages": [{"role": "user"}]}"#,
                Format::Messages,
                "messages[0].content",
            ),
            (
                r#"[1, 2]"#,
                Format::Text,
                "expected a JSON object, found an array",
            ),
        ];
        for (bad, format, want) in cases {
            let good = match format {
                Format::Messages => r#"{"messages": [{"role": "user", "content": "a"}]}"#,
                Format::PromptCompletion => r#"{"prompt": "a", "completion": "b"}"#,
                _ => r#"{"text": "a"}"#,
            };
            let path = jsonl("data-bad", &[good, "", bad]);
            let err = load_err(&path, &tok, &opts(format, 32));
            assert!(err.contains(&format!("{}:3: ", path.display())), "{err}");
            assert!(err.contains(want), "{err}");
        }
    }

    /// `max_rows` stops reading: a malformed line after the cap is never parsed; the rows
    /// read are counted (skipped ones included). A `.gz` JSONL file is decompressed.
    #[test]
    fn max_rows_and_gzip() {
        let tok = tok("data-maxrows");
        let lines = [
            r#"{"text": "hello world"}"#,
            "",
            r#"{"text": "a b"}"#,
            r#"{"text": "c"}"#,
            r#"{"text": "#,
        ];
        let path = jsonl("data-maxrows", &lines);
        let o = opts(Format::Auto, 32);
        let ds = load_file(&path, &tok, &o, 3).unwrap();
        assert_eq!((ds.rows, ds.examples.len(), ds.shards), (3, 3, 0));
        let err = load_file(&path, &tok, &o, 0).unwrap_err().to_string();
        assert!(err.contains("data.jsonl:5: not valid JSON"), "{err}");
        let ds = load_file(&path, &tok, &o, 1).unwrap();
        assert_eq!(ds.rows, 1);

        let gz = path.with_file_name("data.jsonl.gz");
        let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        std::io::Write::write_all(&mut enc, lines[..4].join("\n").as_bytes()).unwrap();
        std::fs::write(&gz, enc.finish().unwrap()).unwrap();
        let from_gz = load_file(&gz, &tok, &o, 0).unwrap();
        assert_eq!(from_gz.examples, ds_all(&path, &tok, &o, 3));
    }

    fn ds_all(path: &Path, tok: &TextTokenizer, o: &DataOptions, n: usize) -> Vec<Example> {
        load_file(path, tok, o, n).unwrap().examples
    }

    #[test]
    fn missing_and_empty_files_name_path() {
        let tok = tok("data-missing");
        let path = temp_dir("data-missing").join("nope.jsonl");
        let err = load_err(&path, &tok, &opts(Format::Auto, 8));
        assert!(err.contains("nope.jsonl"), "{err}");
        let path = jsonl("data-empty", &["", " "]);
        let err = load_err(&path, &tok, &opts(Format::Auto, 8));
        assert!(err.contains("data.jsonl has no rows"), "{err}");
    }

    #[test]
    fn add_eos_without_eos_token_says_how_to_fix() {
        let dir = model_dir("data-noeos", Some("{}"));
        let tok = TextTokenizer::from_model_dir(&dir).unwrap();
        let path = jsonl("data-noeos", &[r#"{"text": "a"}"#]);
        let err = load_err(&path, &tok, &opts(Format::Auto, 8));
        assert!(err.contains("add_eos = false"), "{err}");
        assert!(
            err.contains("eos_token") && err.contains("tokenizer_config.json"),
            "{err}"
        );
        let no_eos = DataOptions {
            add_eos: false,
            ..opts(Format::Auto, 8)
        };
        assert_eq!(load_jsonl(&path, &tok, &no_eos).unwrap().examples.len(), 1);
    }

    /// An Alpaca row is the prompt_completion row of its rendered prompt: Stanford's template
    /// with the input, the no-input one when the input is empty or absent, or the config's.
    #[test]
    fn alpaca_rows_are_prompt_completion_through_the_template() {
        let tok = tok("data-alpaca");
        let o = opts(Format::Auto, 256);
        let row = |v: serde_json::Value| tokenize_row(&v, Format::Auto, &tok, &o).unwrap();
        let pc = |prompt: String| row(serde_json::json!({"prompt": prompt, "completion": "world"}));
        let with_input = ALPACA_PROMPT
            .replace("{instruction}", "hello")
            .replace("{input}", "a b");
        assert!(with_input.contains("### Input:\na b\n\n### Response:\n"));
        assert_eq!(
            row(serde_json::json!({"instruction": "hello", "input": "a b", "output": "world"})),
            pc(with_input)
        );
        let without = ALPACA_PROMPT_NO_INPUT.replace("{instruction}", "hello");
        for input in [serde_json::json!(""), serde_json::Value::Null] {
            assert_eq!(
                row(serde_json::json!({"instruction": "hello", "input": input, "output": "world"})),
                pc(without.clone())
            );
        }
        assert_eq!(
            row(serde_json::json!({"instruction": "hello", "output": "world"})),
            pc(without)
        );
        let own = DataOptions {
            alpaca: AlpacaPrompt {
                with_input: "{instruction} | {input} ->".into(),
                without_input: "{instruction} ->".into(),
            },
            ..o.clone()
        };
        let v = serde_json::json!({"instruction": "hello", "input": "a b", "output": "world"});
        assert_eq!(
            tokenize_row(&v, Format::Alpaca, &tok, &own).unwrap(),
            pc("hello | a b ->".into())
        );
        // The output is what is trained.
        let e = row(v).unwrap();
        let n_out = tok.encode("world", false).unwrap().len();
        assert_eq!(e.n_targets(), n_out + 1, "output tokens + EOS");
        let err = tokenize_row(
            &serde_json::json!({"instruction": "hello", "input": "a"}),
            Format::Alpaca,
            &tok,
            &o,
        )
        .unwrap_err()
        .to_string();
        assert_eq!(err, "missing key `output` required by format alpaca");
    }

    /// A ShareGPT row is the messages row of its turns under the usual role names; another
    /// `from` is refused by name.
    #[test]
    fn sharegpt_rows_are_messages_rows() {
        let tok = tok("data-sharegpt");
        let o = opts(Format::Auto, 256);
        let share = serde_json::json!({"conversations": [
            {"from": "system", "value": "be brief"},
            {"from": "human", "value": "hello"},
            {"from": "gpt", "value": "a b"},
            {"from": "user", "value": "again"},
            {"from": "assistant", "value": "world"},
        ]});
        let msgs = serde_json::json!({"messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": "a b"},
            {"role": "user", "content": "again"},
            {"role": "assistant", "content": "world"},
        ]});
        let got = tokenize_row(&share, Format::Auto, &tok, &o)
            .unwrap()
            .unwrap();
        assert_eq!(
            Some(got.clone()),
            tokenize_row(&msgs, Format::Auto, &tok, &o).unwrap()
        );
        assert!(got.n_targets() > 0);
        let bad = serde_json::json!({"conversations": [
            {"from": "human", "value": "hello"},
            {"from": "observation", "value": "{}"},
        ]});
        let err = tokenize_row(&bad, Format::Sharegpt, &tok, &o)
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("conversations[1].from is `observation`"),
            "{err}"
        );
        let err = tokenize_row(
            &serde_json::json!({"conversations": [{"from": "human"}]}),
            Format::Sharegpt,
            &tok,
            &o,
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("conversations[0].value"), "{err}");
    }

    #[test]
    fn messages_without_chat_template_says_so() {
        let dir = model_dir("data-notpl", Some(r#"{"eos_token": "</s>"}"#));
        let tok = TextTokenizer::from_model_dir(&dir).unwrap();
        let path = jsonl(
            "data-notpl",
            &[r#"{"messages": [{"role": "user", "content": "a"}]}"#],
        );
        let err = load_err(&path, &tok, &opts(Format::Auto, 8));
        assert!(err.contains("no chat template"), "{err}");
        assert!(err.contains("chat_template.jinja"), "{err}");
        assert!(err.contains(&dir.display().to_string()), "{err}");
    }

    #[test]
    fn template_raise_exception_is_a_row_error() {
        let dir = model_dir("data-raise", Some(r#"{"eos_token": "</s>"}"#));
        write(
            &dir,
            "chat_template.jinja",
            "{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}\
             {% endif %}{% for m in messages %}{{ m.content }} {% endfor %}",
        );
        let tok = TextTokenizer::from_model_dir(&dir).unwrap();
        let path = jsonl(
            "data-raise",
            &[r#"{"messages": [{"role": "assistant", "content": "a"}]}"#],
        );
        let err = load_err(&path, &tok, &opts(Format::Auto, 8));
        assert!(err.contains("data.jsonl:1:"), "{err}");
        assert!(err.contains("first must be user"), "{err}");
    }
}
