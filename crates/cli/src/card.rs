//! The model card (`README.md`) an upload adds when the dir has none: YAML front matter the hub
//! reads, then what was trained, on what, and how it ended.
//!
//! The front matter follows PEFT's `create_or_update_model_card` (peft 0.17) for an adapter:
//! `base_model`, `library_name: peft`, `pipeline_tag: text-generation` and the tags
//! `base_model:adapter:<base>`, `lora`, `transformers` (plus `tallow`), which is what makes the hub
//! list the repo as an adapter of its base. A merged or fully fine-tuned model gets
//! `library_name: transformers`. `base_model` must be a hub id, so it is written only when the
//! base is one (an id, or a snapshot in the HF cache); a local base dir is named in the text.
//! Hub datasets (`hf://datasets/OWNER/NAME/...`) go under `datasets:`.
//!
//! The run is read from the dir's parent when it is a tallow run (`config.toml`,
//! `metrics.jsonl` next to `adapter/` or `model/`).

use std::path::Path;

use tallow_hub::{HubId, RepoKind};
use tallow_trainer::TrainConfig;

/// The hub id of a base model spec: an `OWNER/NAME[@REV]` that is not a local path, or a path
/// inside the HF cache (`.../models--OWNER--NAME/snapshots/<commit>`).
pub fn hub_base(spec: &str) -> Option<String> {
    for part in Path::new(spec).components() {
        let part = part.as_os_str().to_string_lossy();
        if let Some(rest) = part.strip_prefix("models--") {
            if let Some((owner, name)) = rest.split_once("--") {
                return Some(format!("{owner}/{name}"));
            }
        }
    }
    if Path::new(spec).exists() {
        return None;
    }
    HubId::parse(spec, RepoKind::Model).map(|id| id.repo_id)
}

/// The final numbers of a run's `metrics.jsonl`.
#[derive(Debug, Default, PartialEq)]
struct Metrics {
    /// (step, loss) of the last logged step.
    last_train: Option<(u64, f64)>,
    /// (step, eval loss), first and last.
    first_eval: Option<(u64, f64)>,
    last_eval: Option<(u64, f64)>,
}

fn read_metrics(path: &Path) -> Metrics {
    let mut m = Metrics::default();
    let Ok(text) = std::fs::read_to_string(path) else {
        return m;
    };
    for line in text.lines() {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        let step = v["step"].as_u64().unwrap_or(0);
        if let Some(l) = v["loss"].as_f64() {
            m.last_train = Some((step, l));
        }
        if let Some(l) = v["eval_loss"].as_f64() {
            m.first_eval.get_or_insert((step, l));
            m.last_eval = Some((step, l));
        }
    }
    m
}

/// The card for uploading `dir` to `repo_id`.
pub fn model_card(dir: &Path, repo_id: &str) -> String {
    let adapter: Option<serde_json::Value> = std::fs::read(dir.join("adapter_config.json"))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok());
    // A tallow run: `<output_dir>/{adapter,model}` next to config.toml and metrics.jsonl.
    let run = dir.parent().filter(|p| p.join("config.toml").is_file());
    let config_text = run.and_then(|r| std::fs::read_to_string(r.join("config.toml")).ok());
    let config = config_text
        .as_deref()
        .and_then(|t| TrainConfig::from_toml_str(t, "config.toml", &[]).ok());
    let metrics = run
        .map(|r| read_metrics(&r.join("metrics.jsonl")))
        .unwrap_or_default();

    let base_spec = adapter
        .as_ref()
        .and_then(|a| a["base_model_name_or_path"].as_str().map(str::to_string))
        .or_else(|| config.as_ref().map(|c| c.model.path.display().to_string()));
    let base_id = base_spec.as_deref().and_then(hub_base);
    let data: Vec<String> = config
        .as_ref()
        .map(|c| {
            std::iter::once(&c.data.train)
                .chain(c.data.eval.as_ref())
                .map(|p| p.display().to_string())
                .collect()
        })
        .unwrap_or_default();
    let mut datasets: Vec<String> = data
        .iter()
        .filter_map(|d| tallow_hub::parse_hf_path(d).ok().map(|(id, _)| id.repo_id))
        .collect();
    datasets.dedup();

    // Front matter.
    let mut y = String::from("---\n");
    if let Some(b) = &base_id {
        y += &format!("base_model: {b}\n");
    }
    if !datasets.is_empty() {
        y += "datasets:\n";
        for d in &datasets {
            y += &format!("- {d}\n");
        }
    }
    y += &format!(
        "library_name: {}\n",
        if adapter.is_some() {
            "peft"
        } else {
            "transformers"
        }
    );
    y += "pipeline_tag: text-generation\ntags:\n";
    let mut tags = vec!["tallow".to_string(), "transformers".to_string()];
    // The adapter's kind, as its adapter_config.json flags it (PEFT's `use_dora`).
    let kind = adapter
        .as_ref()
        .map(|a| tallow_model::AdapterKind::from_use_dora(a["use_dora"].as_bool() == Some(true)));
    if let Some(kind) = kind {
        tags.push("lora".into());
        if kind != tallow_model::AdapterKind::Lora {
            tags.push(kind.name().into());
        }
        if let Some(b) = &base_id {
            tags.push(format!("base_model:adapter:{b}"));
        }
    }
    tags.sort();
    for t in &tags {
        y += &format!("- {t}\n");
    }
    y += "---\n\n";

    // Text.
    let name = repo_id.rsplit('/').next().unwrap_or(repo_id);
    let base_words = match (&base_id, &base_spec) {
        (Some(b), _) => format!("[{b}](https://huggingface.co/{b})"),
        (None, Some(s)) => format!("a local model (`{s}`)"),
        (None, None) => "an unknown base model".into(),
    };
    y += &format!("# {name}\n\n");
    match &adapter {
        Some(a) => {
            // the modules, then PEFT's target_parameters (a mixture of experts' fused tensors)
            let names = |key: &str| -> Vec<&str> {
                let mut t: Vec<&str> = a[key]
                    .as_array()
                    .map(|t| t.iter().filter_map(|x| x.as_str()).collect())
                    .unwrap_or_default();
                t.sort();
                t
            };
            let mut targets = names("target_modules");
            targets.extend(names("target_parameters"));
            let targets = targets.join(", ");
            y += &format!(
                "A {} adapter (rank {}, alpha {}, on {targets}) for {base_words}, trained with \
                 tallow. It is a PEFT adapter: transformers + PEFT load it as it is.\n\n",
                kind.map_or("LoRA", |k| k.spec().label()),
                a["r"],
                a["lora_alpha"],
            );
            y += &format!(
                "```python\nfrom peft import AutoPeftModelForCausalLM\n\nmodel = \
                 AutoPeftModelForCausalLM.from_pretrained(\"{repo_id}\")\n```\n\n"
            );
        }
        None => {
            y += &format!("A fine-tune of {base_words}, trained with tallow.\n\n");
            y += &format!(
                "```python\nfrom transformers import AutoModelForCausalLM\n\nmodel = \
                 AutoModelForCausalLM.from_pretrained(\"{repo_id}\")\n```\n\n"
            );
        }
    }
    if !data.is_empty() {
        y += "## Training data\n\n";
        let roles = ["train", "eval"];
        for (role, d) in roles.iter().zip(&data) {
            y += &format!("- {role}: `{d}`\n");
        }
        y += "\n";
    }
    if metrics != Metrics::default() {
        y += "## Results\n\n| | step | loss |\n|---|---|---|\n";
        if let Some((s, l)) = metrics.last_train {
            y += &format!("| last train loss | {s} | {l:.4} |\n");
        }
        if let Some((s, l)) = metrics.first_eval {
            y += &format!("| eval loss, start | {s} | {l:.4} |\n");
        }
        if let Some((s, l)) = metrics.last_eval.filter(|e| Some(*e) != metrics.first_eval) {
            y += &format!("| eval loss, end | {s} | {l:.4} |\n");
        }
        y += "\n";
    }
    if let Some(t) = &config_text {
        y += &format!(
            "## Training config\n\nThe run's resolved config (`tallow train --config config.toml`):\n\n```toml\n{}\n```\n\n",
            t.trim_end()
        );
    }
    y += &format!(
        "### Framework versions\n\n- tallow {}\n",
        env!("CARGO_PKG_VERSION")
    );
    y
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base_ids() {
        assert_eq!(
            hub_base("Qwen/Qwen2.5-0.5B").as_deref(),
            Some("Qwen/Qwen2.5-0.5B")
        );
        assert_eq!(
            hub_base("Qwen/Qwen2.5-0.5B@v1").as_deref(),
            Some("Qwen/Qwen2.5-0.5B")
        );
        assert_eq!(
            hub_base(
                "/home/u/.cache/huggingface/hub/models--meta-llama--Llama-3.2-1B/snapshots/abc"
            )
            .as_deref(),
            Some("meta-llama/Llama-3.2-1B")
        );
        assert_eq!(hub_base("./models/x"), None);
        // An existing relative dir is local even when it looks like OWNER/NAME.
        assert_eq!(hub_base(std::env::temp_dir().to_str().unwrap()), None);
    }
}
