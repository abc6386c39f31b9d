//! Which files of a dataset repo make a split, as the `datasets` library decides it
//! (`datasets.load_dataset("OWNER/NAME", name=CONFIG, split=SPLIT)`, datasets 4.4
//! `data_files.py` and `load.py`):
//!
//! 1. The README's YAML front matter `configs:`: each entry has a `config_name`, `data_files`
//!    (a pattern, a list of patterns, or a list of `{split, path}` where `path` is a pattern or a
//!    list) and/or `data_dir`, and may be marked `default: true`. Without a config name the
//!    default one is used: the only one, the one named `default`, or the one marked default.
//! 2. Otherwise (or for a config with neither `data_files` nor patterns) the default patterns,
//!    tried in order: the sharded `data/{split}-NNNNN-of-NNNNN*.*` (any split name), then split
//!    keywords in directory names (`train/`, `training-x/`, ...), then in file names
//!    (`train.jsonl`, `my-train-1.parquet`, ...), then everything (`**`) as `train`. Keywords:
//!    train/training, validation/valid/dev/val, test/testing/eval/evaluation.
//!
//! Patterns are fsspec globs (`*` within a path component, `**` as a whole component for any
//! number of directories, `?`, `[...]`); hidden files and dirs (`.x`), `__x__` dirs and
//! `README.md`, `config.json`, `dataset_info.json`, ... are skipped unless the pattern names
//! them. Each pattern's matches are sorted; the split's files are the patterns' matches in
//! order. The format is the most common data extension of the split's files (parquet first
//! on a tie), and only files of that format are kept; tallow reads parquet and JSON lines.

use serde_json::Value as Json;

/// `data/{split}-00000-of-00001*.*` (`SPLIT_PATTERN_SHARDED`).
const SHARDED: &str = "data/{split}-[0-9][0-9][0-9][0-9][0-9]-of-[0-9][0-9][0-9][0-9][0-9]*.*";

/// The default splits, in the order `datasets` lists them, with their keywords.
const SPLIT_KEYWORDS: [(&str, &[&str]); 3] = [
    ("train", &["train", "training"]),
    ("validation", &["validation", "valid", "dev", "val"]),
    ("test", &["test", "testing", "eval", "evaluation"]),
];

/// `NON_WORDS_CHARS`: what may separate a split keyword from the rest of a name.
const SEP: &str = "-._ 0-9";

/// `KEYWORDS_IN_DIR_NAME_BASE_PATTERNS` (fsspec >= 2023.12).
const DIR_PATTERNS: [&str; 4] = [
    "**/{keyword}/**",
    "**/{keyword}[{sep}]*/**",
    "**/*[{sep}]{keyword}/**",
    "**/*[{sep}]{keyword}[{sep}]*/**",
];

/// `KEYWORDS_IN_FILENAME_BASE_PATTERNS` (fsspec >= 2023.12).
const FILE_PATTERNS: [&str; 2] = ["**/{keyword}[{sep}]*", "**/*[{sep}]{keyword}[{sep}]*"];

/// `FILES_TO_IGNORE`: never data files, unless a pattern names them.
const FILES_TO_IGNORE: [&str; 6] = [
    "README.md",
    "config.json",
    "dataset_info.json",
    "dataset_infos.json",
    "dummy_data.zip",
    "dataset_dict.json",
];

/// The data file extensions `datasets` accepts (`ALL_ALLOWED_EXTENSIONS`, datasets 4.4): the
/// formats tallow reads, other tabular ones, then the image/audio/video/pdf/nifti folders'.
/// A file counts as a data file when one of its name's dot-suffixes is here.
const ALLOWED_EXTENSIONS: &str = ".csv .tsv .json .jsonl .ndjson .parquet .geoparquet .gpq \
.arrow .txt .tar .xml .hdf5 .h5 .blp .bmp .dib .bufr .cur .pcx .dcx .dds .ps .eps .fit .fits .fli \
.flc .ftc .ftu .gbr .gif .grib .png .apng .jp2 .j2k .jpc .jpf .jpx .j2c .icns .ico .im .iim .tif \
.tiff .jfif .jpe .jpg .jpeg .mpg .mpeg .msp .pcd .pxr .pbm .pgm .ppm .pnm .psd .bw .rgb .rgba .sgi \
.ras .tga .icb .vda .vst .webp .wmf .emf .xbm .xpm .BLP .BMP .DIB .BUFR .CUR .PCX .DCX .DDS .PS \
.EPS .FIT .FITS .FLI .FLC .FTC .FTU .GBR .GIF .GRIB .PNG .APNG .JP2 .J2K .JPC .JPF .JPX .J2C .ICNS \
.ICO .IM .IIM .TIF .TIFF .JFIF .JPE .JPG .JPEG .MPG .MPEG .MSP .PCD .PXR .PBM .PGM .PPM .PNM .PSD \
.BW .RGB .RGBA .SGI .RAS .TGA .ICB .VDA .VST .WEBP .WMF .EMF .XBM .XPM .aiff .au .avr .caf .flac \
.htk .svx .mat4 .mat5 .mpc2k .ogg .paf .pvf .raw .rf64 .sd2 .sds .ircam .voc .w64 .wav .nist \
.wavex .wve .xi .mp3 .opus .3gp .3g2 .avi .asf .flv .mp4 .mov .m4v .mkv .webm .f4v .wmv .wma .ogm \
.mxf .nut .AIFF .AU .AVR .CAF .FLAC .HTK .SVX .MAT4 .MAT5 .MPC2K .OGG .PAF .PVF .RAW .RF64 .SD2 \
.SDS .IRCAM .VOC .W64 .WAV .NIST .WAVEX .WVE .XI .MP3 .OPUS .3GP .3G2 .AVI .ASF .FLV .MP4 .MOV \
.M4V .MKV .WEBM .F4V .WMV .WMA .OGM .MXF .NUT .pdf .PDF .nii .nii.gz .NII .NII.GZ .zip";

/// The format of a split's files.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShardFormat {
    /// `.parquet` (`.geoparquet`, `.gpq`).
    Parquet,
    /// `.json`, `.jsonl`, `.ndjson`: JSON lines (one object per line).
    JsonLines,
}

/// The files of one split of one config, in reading order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SplitFiles {
    /// The config the files belong to (`None`: the repo has no `configs:` in its README).
    pub config: Option<String>,
    pub split: String,
    pub format: ShardFormat,
    /// Repo-relative paths.
    pub files: Vec<String>,
}

/// Why no files could be picked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DataFilesError {
    /// The split has no file; `found` are the splits there are.
    SplitNotFound {
        config: Option<String>,
        split: String,
        found: Vec<String>,
    },
    /// The config name is not one of the README's configs.
    ConfigNotFound {
        config: String,
        configs: Vec<String>,
    },
    /// Several configs and none is the default.
    ConfigMissing { configs: Vec<String> },
    /// A config name was given but the README declares no configs.
    NoConfigs { config: String },
    /// The repo has no data file at all.
    NoDataFiles,
    /// The split's patterns (the README's, or the default ones) match no data file.
    PatternsMatchNothing {
        split: String,
        patterns: Vec<String>,
    },
    /// The split's files are in a format tallow does not read.
    Unsupported {
        split: String,
        extension: String,
        files: Vec<String>,
    },
    /// The README's `configs:` could not be read.
    BadCard(String),
}

impl std::fmt::Display for DataFilesError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let cfg = |c: &Option<String>| match c {
            Some(c) => format!("config {c:?}"),
            None => "the default config".into(),
        };
        let list = |v: &[String]| {
            v.iter()
                .map(|s| format!("{s:?}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        match self {
            DataFilesError::SplitNotFound {
                config,
                split,
                found,
            } => write!(
                f,
                "{} has no files for split {split:?}; its splits: {} (set data.train_split / \
                 data.eval_split)",
                cfg(config),
                if found.is_empty() {
                    "none".into()
                } else {
                    list(found)
                }
            ),
            DataFilesError::ConfigNotFound { config, configs } => write!(
                f,
                "no config {config:?}; the dataset's configs: {} (set data.dataset_config)",
                list(configs)
            ),
            DataFilesError::ConfigMissing { configs } => write!(
                f,
                "the dataset has several configs and none is the default; pick one with \
                 data.dataset_config: {}",
                list(configs)
            ),
            DataFilesError::NoConfigs { config } => write!(
                f,
                "data.dataset_config is {config:?} but the dataset's README declares no \
                 `configs:`, so its one config is \"default\"; remove data.dataset_config"
            ),
            DataFilesError::NoDataFiles => f.write_str(
                "the dataset has no data files (parquet, JSON lines, ...) in its file list",
            ),
            DataFilesError::Unsupported {
                split,
                extension,
                files,
            } => write!(
                f,
                "split {split:?} is in {extension} files ({}); tallow reads parquet and JSON \
                 lines (.jsonl, .json) datasets",
                list(&files[..files.len().min(3)])
            ),
            DataFilesError::PatternsMatchNothing { split, patterns } => write!(
                f,
                "the data file patterns of split {split:?} ({}) match no data file",
                list(patterns)
            ),
            DataFilesError::BadCard(m) => write!(f, "README.md `configs:`: {m}"),
        }
    }
}

impl std::error::Error for DataFilesError {}

// ---------------------------------------------------------------------------------------------
// Globs (fsspec's `glob_translate`, fixed to recursive=True, include_hidden=True).

/// One piece of a translated glob.
#[derive(Debug, Clone)]
enum Tok {
    Lit(char),
    /// `*` inside a component: `[^/]*`.
    Star,
    /// `?`: `[^/]`.
    Any,
    /// `[...]`: a character class (may match `/` when negated, as the regex does).
    Class {
        negated: bool,
        items: Vec<(char, char)>,
    },
    /// A whole `*` component: `[^/]+`.
    Segment,
    /// A `**` component before the last: `(?:.+/)?`.
    AnySegments,
    /// A last `**` component: `.*`.
    Rest,
}

/// Translates a glob; `None` for a `**` that is not a whole component (fsspec's error).
fn translate(pattern: &str) -> Option<Vec<Tok>> {
    let parts: Vec<&str> = pattern.split('/').collect();
    let last = parts.len() - 1;
    let mut out = Vec::new();
    for (i, part) in parts.iter().enumerate() {
        if *part == "*" {
            out.push(Tok::Segment);
            if i < last {
                out.push(Tok::Lit('/'));
            }
            continue;
        }
        if *part == "**" {
            out.push(if i < last {
                Tok::AnySegments
            } else {
                Tok::Rest
            });
            continue;
        }
        if part.contains("**") {
            return None;
        }
        let chars: Vec<char> = part.chars().collect();
        let mut j = 0;
        while j < chars.len() {
            match chars[j] {
                '*' => {
                    // Consecutive stars are one.
                    if !matches!(out.last(), Some(Tok::Star)) {
                        out.push(Tok::Star);
                    }
                    j += 1;
                }
                '?' => {
                    out.push(Tok::Any);
                    j += 1;
                }
                '[' => match class(&chars, j) {
                    Some((tok, next)) => {
                        out.push(tok);
                        j = next;
                    }
                    None => {
                        out.push(Tok::Lit('['));
                        j += 1;
                    }
                },
                c => {
                    out.push(Tok::Lit(c));
                    j += 1;
                }
            }
        }
        if i < last {
            out.push(Tok::Lit('/'));
        }
    }
    Some(out)
}

/// The class starting at `chars[start] == '['`: the token and the index after its `]`, or
/// `None` when it is not closed (then `[` is literal, as in fnmatch).
fn class(chars: &[char], start: usize) -> Option<(Tok, usize)> {
    let mut j = start + 1;
    let negated = chars.get(j) == Some(&'!');
    if negated {
        j += 1;
    }
    // A `]` right after `[` or `[!` is a member.
    let first = j;
    let mut end = None;
    let mut k = j;
    while k < chars.len() {
        if chars[k] == ']' && k > first {
            end = Some(k);
            break;
        }
        k += 1;
    }
    let end = end?;
    let body = &chars[first..end];
    let mut items = Vec::new();
    let mut i = 0;
    while i < body.len() {
        if i + 2 < body.len() && body[i + 1] == '-' {
            items.push((body[i], body[i + 2]));
            i += 3;
        } else {
            items.push((body[i], body[i]));
            i += 1;
        }
    }
    Some((Tok::Class { negated, items }, end + 1))
}

fn matches_from(toks: &[Tok], s: &[char]) -> bool {
    let Some((tok, rest)) = toks.split_first() else {
        return s.is_empty();
    };
    match tok {
        Tok::Lit(c) => s.first() == Some(c) && matches_from(rest, &s[1..]),
        Tok::Any => s.first().is_some_and(|&c| c != '/') && matches_from(rest, &s[1..]),
        Tok::Class { negated, items } => {
            s.first()
                .is_some_and(|&c| items.iter().any(|&(a, b)| a <= c && c <= b) != *negated)
                && matches_from(rest, &s[1..])
        }
        Tok::Star | Tok::Segment => {
            let min = usize::from(matches!(tok, Tok::Segment));
            let run = s.iter().take_while(|&&c| c != '/').count();
            (min..=run).any(|n| matches_from(rest, &s[n..]))
        }
        Tok::AnySegments => {
            // Empty, or one or more characters ending at a '/'.
            matches_from(rest, s)
                || (1..s.len()).any(|n| s[n] == '/' && matches_from(rest, &s[n + 1..]))
        }
        Tok::Rest => true,
    }
}

/// Whether `path` (repo-relative, `/`-separated) matches the fsspec glob `pattern`.
pub fn glob_match(pattern: &str, path: &str) -> bool {
    let Some(toks) = translate(pattern) else {
        return false;
    };
    let s: Vec<char> = path.chars().collect();
    matches_from(&toks, &s)
}

fn basename(p: &str) -> &str {
    p.rsplit('/').next().unwrap_or(p)
}

/// `datasets`' hidden-file and special-dir checks: a matched path inside a `.x` part or under a
/// `__x` dir is skipped unless the pattern has as many such parts.
fn unrequested_hidden_or_special(path: &str, pattern: &str) -> bool {
    let hidden = |s: &str| {
        s.split('/')
            .filter(|p| p.starts_with('.') && !p.chars().all(|c| c == '.'))
            .count()
    };
    let special = |s: &str| {
        let parts: Vec<&str> = s.split('/').collect();
        parts[..parts.len().saturating_sub(1)]
            .iter()
            .filter(|p| p.starts_with("__"))
            .count()
    };
    hidden(path) != hidden(pattern) || special(path) != special(pattern)
}

fn allowed_extension(path: &str) -> bool {
    let exts: Vec<&str> = ALLOWED_EXTENSIONS.split_whitespace().collect();
    basename(path)
        .split('.')
        .skip(1)
        .any(|suffix| exts.contains(&format!(".{suffix}").as_str()))
}

/// `resolve_pattern`: the files matching `pattern` (relative to `dir`), sorted, without the
/// ignored, hidden and special ones; with `data_only`, only files with a data extension.
fn resolve_pattern(files: &[String], dir: &str, pattern: &str, data_only: bool) -> Vec<String> {
    let full = if dir.is_empty() {
        pattern.to_string()
    } else {
        format!("{}/{pattern}", dir.trim_end_matches('/'))
    };
    let pattern_base = basename(&full).to_string();
    let mut out: Vec<String> = files
        .iter()
        .filter(|f| glob_match(&full, f))
        .filter(|f| {
            let b = basename(f);
            !FILES_TO_IGNORE.contains(&b) || b == pattern_base
        })
        .filter(|f| !unrequested_hidden_or_special(f, &full))
        .filter(|f| !data_only || allowed_extension(f))
        .cloned()
        .collect();
    out.sort();
    out
}

/// `get_data_patterns`: split -> patterns, in `datasets`' split order; empty when no pattern
/// finds a file.
fn default_patterns(files: &[String], dir: &str) -> Vec<(String, Vec<String>)> {
    let found = |p: &str| !resolve_pattern(files, dir, p, false).is_empty();
    // 1. data/{split}-00000-of-00001*.*
    let any_split = SHARDED.replace("{split}", "*");
    let sharded = resolve_pattern(files, dir, &any_split, false);
    if !sharded.is_empty() {
        let mut splits: Vec<String> = Vec::new();
        for f in &sharded {
            if let Some(s) = sharded_split(basename(f)) {
                if !splits.contains(&s) {
                    splits.push(s);
                }
            }
        }
        let defaults: Vec<&str> = SPLIT_KEYWORDS.iter().map(|(s, _)| *s).collect();
        let mut ordered: Vec<String> = defaults
            .iter()
            .filter(|d| splits.iter().any(|s| s == *d))
            .map(|s| s.to_string())
            .collect();
        let mut rest: Vec<String> = splits
            .into_iter()
            .filter(|s| !defaults.contains(&s.as_str()))
            .collect();
        rest.sort();
        ordered.extend(rest);
        return ordered
            .into_iter()
            .map(|s| {
                let p = SHARDED.replace("{split}", &s);
                (s, vec![p])
            })
            .collect();
    }
    // 2. keywords in dir names, 3. in file names, 4. everything is train.
    let keyword_patterns = |bases: &[&str]| -> Vec<(String, Vec<String>)> {
        SPLIT_KEYWORDS
            .iter()
            .map(|(split, keywords)| {
                let pats = keywords
                    .iter()
                    .flat_map(|k| {
                        bases
                            .iter()
                            .map(move |b| b.replace("{keyword}", k).replace("{sep}", SEP))
                    })
                    .collect();
                (split.to_string(), pats)
            })
            .collect()
    };
    let all = vec![("train".to_string(), vec!["**".to_string()])];
    for table in [
        keyword_patterns(&DIR_PATTERNS),
        keyword_patterns(&FILE_PATTERNS),
        all,
    ] {
        let non_empty: Vec<(String, Vec<String>)> = table
            .into_iter()
            .filter(|(_, pats)| pats.iter().any(|p| found(p)))
            .collect();
        if !non_empty.is_empty() {
            return non_empty;
        }
    }
    Vec::new()
}

/// The split of a sharded file name `SPLIT-00000-of-00003.ext` (`string_to_dict` on the
/// basename: the longest prefix followed by `-NNNNN-of-NNNNN`).
fn sharded_split(base: &str) -> Option<String> {
    let b: Vec<char> = base.chars().collect();
    let digits = |from: usize| (from..from + 5).all(|i| b.get(i).is_some_and(char::is_ascii_digit));
    (1..b.len()).rev().find_map(|i| {
        let ok = b[i] == '-'
            && digits(i + 1)
            && b.get(i + 6..i + 10)
                .is_some_and(|s| s == ['-', 'o', 'f', '-'])
            && digits(i + 10);
        ok.then(|| b[..i].iter().collect())
    })
}

/// The files of `split` for these patterns (`DataFilesList.from_patterns` with the allowed
/// extensions), then the format (`infer_module_for_data_files_list`) and the files of that
/// format.
fn split_files(
    files: &[String],
    dir: &str,
    config: Option<String>,
    split: &str,
    patterns: &[String],
) -> Result<SplitFiles, DataFilesError> {
    let matched: Vec<String> = patterns
        .iter()
        .flat_map(|p| resolve_pattern(files, dir, p, true))
        .collect();
    if matched.is_empty() {
        return Err(DataFilesError::PatternsMatchNothing {
            split: split.to_string(),
            patterns: patterns.to_vec(),
        });
    }
    // Most common extension; ties: parquet, jsonl, json, csv, then by name (descending, as the
    // reverse sort in datasets does).
    let mut counts: Vec<(String, usize)> = Vec::new();
    for f in &matched {
        for suffix in basename(f).split('.').skip(1) {
            let ext = format!(".{}", suffix.to_lowercase());
            match counts.iter_mut().find(|(e, _)| *e == ext) {
                Some((_, n)) => *n += 1,
                None => counts.push((ext, 1)),
            }
        }
    }
    counts.sort_by(|(a, n), (b, m)| {
        let key = |e: &str, n: usize| {
            (
                n,
                e == ".parquet",
                e == ".jsonl",
                e == ".json",
                e == ".csv",
                e.to_string(),
            )
        };
        key(b, *m).cmp(&key(a, *n))
    });
    let module_exts = |ext: &str| -> Option<(&'static [&'static str], Option<ShardFormat>)> {
        const JSON: &[&str] = &[".json", ".jsonl", ".ndjson"];
        const PARQUET: &[&str] = &[".parquet", ".geoparquet", ".gpq"];
        if JSON.contains(&ext) {
            Some((JSON, Some(ShardFormat::JsonLines)))
        } else if PARQUET.contains(&ext) {
            Some((PARQUET, Some(ShardFormat::Parquet)))
        } else if allowed_extension(&format!("x{ext}")) && ext != ".zip" {
            Some((&[], None))
        } else {
            None
        }
    };
    let Some((ext, (exts, format))) = counts
        .iter()
        .find_map(|(e, _)| module_exts(e).map(|m| (e.clone(), m)))
    else {
        return Err(DataFilesError::NoDataFiles);
    };
    let Some(format) = format else {
        return Err(DataFilesError::Unsupported {
            split: split.to_string(),
            extension: ext,
            files: matched,
        });
    };
    let files = matched
        .into_iter()
        .filter(|f| {
            basename(f)
                .split('.')
                .skip(1)
                .any(|s| exts.contains(&format!(".{}", s.to_lowercase()).as_str()))
        })
        .collect();
    Ok(SplitFiles {
        config,
        split: split.to_string(),
        format,
        files,
    })
}

// ---------------------------------------------------------------------------------------------
// README `configs:`.

/// One entry of the README's `configs:`.
#[derive(Debug, Clone, PartialEq)]
struct CardConfig {
    name: String,
    /// split -> patterns (`None`: no `data_files`, the default patterns under `data_dir`).
    data_files: Option<Vec<(String, Vec<String>)>>,
    data_dir: Option<String>,
    default: bool,
}

/// The YAML front matter of a README (between the first two `---` lines), if any.
fn front_matter(readme: &str) -> Option<&str> {
    let text = readme.trim_start_matches('\u{feff}');
    let rest = text
        .strip_prefix("---\n")
        .or_else(|| text.strip_prefix("---\r\n"))?;
    let mut offset = 0;
    for line in rest.split_inclusive('\n') {
        if line.trim_end() == "---" {
            return Some(&rest[..offset]);
        }
        offset += line.len();
    }
    None
}

/// The configs of a README, `[]` when it has no `configs:`.
fn card_configs(readme: &str) -> Result<Vec<CardConfig>, DataFilesError> {
    let Some(yaml) = front_matter(readme) else {
        return Ok(Vec::new());
    };
    let bad = |m: String| DataFilesError::BadCard(m);
    let Some(configs) = crate::yaml::top_level_key(yaml, "configs").map_err(bad)? else {
        return Ok(Vec::new());
    };
    let Json::Array(list) = configs else {
        return Err(bad(format!("expected a list, found {configs}")));
    };
    let str_list = |v: &Json, what: &str| -> Result<Vec<String>, DataFilesError> {
        match v {
            Json::String(s) => Ok(vec![s.clone()]),
            Json::Array(items) => items
                .iter()
                .map(|i| match i {
                    Json::String(s) => Ok(s.clone()),
                    other => Err(bad(format!("{what}: expected a string, found {other}"))),
                })
                .collect(),
            other => Err(bad(format!(
                "{what}: expected a string or a list, found {other}"
            ))),
        }
    };
    let mut out = Vec::new();
    for entry in &list {
        let Json::Object(map) = entry else {
            return Err(bad(format!("each config must be a mapping, found {entry}")));
        };
        let name = match map.get("config_name") {
            Some(Json::String(s)) => s.clone(),
            _ => {
                return Err(bad(format!(
                    "each config must have a `config_name`, found {entry}"
                )))
            }
        };
        let what = format!("config {name:?} data_files");
        // sanitize_patterns: a string or a list of strings is split "train"; a list of
        // {split, path} names its splits.
        let data_files = match map.get("data_files") {
            None | Some(Json::Null) => None,
            Some(Json::Array(items)) if items.iter().any(Json::is_object) => {
                let mut splits: Vec<(String, Vec<String>)> = Vec::new();
                for item in items {
                    let (Some(Json::String(split)), Some(path)) =
                        (item.get("split"), item.get("path"))
                    else {
                        return Err(bad(format!(
                            "{what}: each item needs `split` and `path`, found {item}"
                        )));
                    };
                    if splits.iter().any(|(s, _)| s == split) {
                        return Err(bad(format!("{what}: split {split:?} is listed twice")));
                    }
                    splits.push((split.clone(), str_list(path, &what)?));
                }
                Some(splits)
            }
            Some(v) => Some(vec![("train".to_string(), str_list(v, &what)?)]),
        };
        let data_dir = match map.get("data_dir") {
            Some(Json::String(s)) => Some(s.clone()),
            _ => None,
        };
        let default = matches!(map.get("default"), Some(Json::Bool(true)));
        out.push(CardConfig {
            name,
            data_files,
            data_dir,
            default,
        });
    }
    Ok(out)
}

/// The files of (`config`, `split`) among the repo's `files`, as `datasets.load_dataset`
/// picks them. `readme` is the repo's README.md, if it has one.
pub fn resolve_split(
    files: &[String],
    readme: Option<&str>,
    config: Option<&str>,
    split: &str,
) -> Result<SplitFiles, DataFilesError> {
    let configs = match readme {
        Some(r) => card_configs(r)?,
        None => Vec::new(),
    };
    let names = || configs.iter().map(|c| c.name.clone()).collect::<Vec<_>>();
    let chosen = match config {
        _ if configs.is_empty() => {
            // Without `configs:` the one config is "default", as in `datasets`.
            if let Some(c) = config.filter(|c| *c != "default") {
                return Err(DataFilesError::NoConfigs {
                    config: c.to_string(),
                });
            }
            None
        }
        Some(name) => Some(configs.iter().find(|c| c.name == name).ok_or_else(|| {
            DataFilesError::ConfigNotFound {
                config: name.to_string(),
                configs: names(),
            }
        })?),
        None => {
            // get_default_config_name: the only one, the one named "default", or the one
            // marked default (two of these: an error).
            let defaults: Vec<&CardConfig> = configs
                .iter()
                .filter(|c| configs.len() == 1 || c.name == "default" || c.default)
                .collect();
            match defaults.as_slice() {
                [one] => Some(*one),
                [] => return Err(DataFilesError::ConfigMissing { configs: names() }),
                [a, b, ..] => {
                    return Err(DataFilesError::BadCard(format!(
                        "several default configs: {:?} and {:?}",
                        a.name, b.name
                    )))
                }
            }
        }
    };
    let config_name = chosen.map(|c| c.name.clone());
    let dir = chosen.and_then(|c| c.data_dir.clone()).unwrap_or_default();
    let splits = match chosen.and_then(|c| c.data_files.clone()) {
        Some(s) => s,
        None => default_patterns(files, &dir),
    };
    if splits.is_empty() {
        return Err(DataFilesError::NoDataFiles);
    }
    let Some((_, patterns)) = splits.iter().find(|(s, _)| s == split) else {
        return Err(DataFilesError::SplitNotFound {
            config: config_name,
            split: split.to_string(),
            found: splits.into_iter().map(|(s, _)| s).collect(),
        });
    };
    let found = split_files(files, &dir, config_name.clone(), split, patterns)?;
    if found.files.is_empty() {
        return Err(DataFilesError::SplitNotFound {
            config: config_name,
            split: split.to_string(),
            found: splits.into_iter().map(|(s, _)| s).collect(),
        });
    }
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn globs_follow_fsspec() {
        for (pattern, path, want) in [
            ("**", "a.json", true),
            ("**", "a/b/c.json", true),
            ("*", "a/b.json", false),
            ("*", "b.json", true),
            ("data/*", "data/x.parquet", true),
            ("data/*", "data/sub/x.parquet", false),
            ("data/**", "data/sub/x.parquet", true),
            ("**/train/**", "train/a.json", true),
            ("**/train/**", "x/y/train/a.json", true),
            ("**/train/**", "x/trains/a.json", false),
            ("**/train[-._ 0-9]*", "train.jsonl", true),
            ("**/train[-._ 0-9]*", "sub/train-0.jsonl", true),
            ("**/train[-._ 0-9]*", "trainer.jsonl", false),
            ("**/*[-._ 0-9]train[-._ 0-9]*", "my_train.jsonl", true),
            ("**/*[-._ 0-9]train[-._ 0-9]*", "mytrain.jsonl", false),
            ("a**b", "ab", false),
            ("data/train-[0-9][0-9]*.*", "data/train-01.parquet", true),
            ("data/train-[0-9][0-9]*.*", "data/train-0x.parquet", false),
            ("[!a]*.json", "b.json", true),
            ("[!a]*.json", "a.json", false),
            ("f?.json", "f1.json", true),
            ("f?.json", "f/.json", false),
        ] {
            assert_eq!(glob_match(pattern, path), want, "{pattern} ~ {path}");
        }
    }

    #[test]
    fn sharded_split_names() {
        assert_eq!(
            sharded_split("train-00000-of-00003.parquet").as_deref(),
            Some("train")
        );
        assert_eq!(
            sharded_split("my-split-00001-of-00002.jsonl").as_deref(),
            Some("my-split")
        );
        assert_eq!(sharded_split("train.parquet"), None);
    }

    #[test]
    fn configs_from_the_card() {
        let readme = "---\nlicense: mit\nconfigs:\n- config_name: a\n  data_files:\n  - split: \
                      train\n    path: a/train-*\n  - split: test\n    path:\n    - a/t1.jsonl\n    \
                      - \"a/t2.jsonl\"\n  default: true\n- config_name: b\n  data_files: b/*.jsonl\n\
                      - config_name: c\n  data_dir: c\ndataset_info:\n  features: []\n---\n# Card\n";
        let cfgs = card_configs(readme).unwrap();
        assert_eq!(cfgs.len(), 3);
        assert_eq!(cfgs[0].name, "a");
        assert!(cfgs[0].default);
        assert_eq!(
            cfgs[0].data_files,
            Some(vec![
                ("train".into(), strings(&["a/train-*"])),
                ("test".into(), strings(&["a/t1.jsonl", "a/t2.jsonl"])),
            ])
        );
        assert_eq!(
            cfgs[1].data_files,
            Some(vec![("train".into(), strings(&["b/*.jsonl"]))])
        );
        assert_eq!(
            (cfgs[2].data_files.clone(), cfgs[2].data_dir.as_deref()),
            (None, Some("c"))
        );
        assert!(card_configs("# no front matter\n").unwrap().is_empty());
        // No configs: "default" is the one config, any other name is refused.
        let files = strings(&["train.jsonl"]);
        let got = resolve_split(&files, None, Some("default"), "train").unwrap();
        assert_eq!((got.config, got.files), (None, files.clone()));
        assert!(matches!(
            resolve_split(&files, None, Some("x"), "train"),
            Err(DataFilesError::NoConfigs { .. })
        ));
        assert!(matches!(
            card_configs("---\nconfigs: 3\n---\n"),
            Err(DataFilesError::BadCard(_))
        ));
    }

    /// The table `scripts/make_datafiles_cases.py` wrote with the `datasets` library's own
    /// resolver (`load_dataset_builder(dir, name=config).config.data_files`): the same files per
    /// split, a split it lacks is "not found", its errors are errors here.
    #[test]
    fn same_files_as_the_datasets_library() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../tests/fixtures/data/datafiles_cases.json"
        );
        let table: Json = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let mut checked = 0;
        for case in table["cases"].as_array().unwrap() {
            let name = case["name"].as_str().unwrap();
            let files: Vec<String> = case["files"]
                .as_array()
                .unwrap()
                .iter()
                .map(|f| f.as_str().unwrap().to_string())
                .collect();
            let readme = case["readme"].as_str();
            for (k, r) in case["results"].as_array().unwrap().iter().enumerate() {
                let config = r["config_asked"].as_str();
                let what = format!("{name} / config {config:?}");
                if let Some(err) = r["error"].as_str() {
                    let got = resolve_split(&files, readme, config, "train");
                    assert!(got.is_err(), "{what}: datasets raised {err}, got {got:?}");
                    checked += 1;
                    continue;
                }
                let module = r["module"].as_str().unwrap();
                let splits = r["splits"].as_object().unwrap();
                for (split, want) in splits {
                    let want: Vec<String> = want
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|f| f.as_str().unwrap().to_string())
                        .collect();
                    let got = resolve_split(&files, readme, config, split);
                    match module {
                        "json" | "parquet" => {
                            let got = got.unwrap_or_else(|e| panic!("{what} {split}: {e}"));
                            assert_eq!(got.files, want, "{what} {split}");
                            // datasets infers the format from the first config's files only
                            // (k == 0 is the default, k == 1 the first config).
                            if k <= 1 {
                                let format = match module {
                                    "json" => ShardFormat::JsonLines,
                                    _ => ShardFormat::Parquet,
                                };
                                assert_eq!(got.format, format, "{what} {split}");
                            }
                        }
                        _ => assert!(
                            matches!(got, Err(DataFilesError::Unsupported { .. })),
                            "{what} {split}: {module} files must be refused, got {got:?}"
                        ),
                    }
                    checked += 1;
                }
                for absent in ["train", "validation", "test", "nope"] {
                    if !splits.contains_key(absent) {
                        let got = resolve_split(&files, readme, config, absent);
                        match got {
                            Err(DataFilesError::SplitNotFound { found, .. }) => {
                                let listed: Vec<&String> = splits.keys().collect();
                                let mut found_sorted: Vec<&String> = found.iter().collect();
                                found_sorted.sort();
                                let mut listed_sorted = listed.clone();
                                listed_sorted.sort();
                                assert_eq!(found_sorted, listed_sorted, "{what} {absent}");
                            }
                            other => panic!("{what} {absent}: expected not found, got {other:?}"),
                        }
                        checked += 1;
                    }
                }
            }
        }
        assert!(checked > 60, "{checked} checks");
    }
}
