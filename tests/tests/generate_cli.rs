//! `tallow generate` and `tallow chat` end to end: greedy ids against transformers' `generate`
//! (tests/fixtures/reference/generate.json, made by scripts/make_generate_fixtures.py) with and
//! without the KV cache, stop tokens, seeded sampling, the JSON shape, chat through a pipe, and
//! bad input. Issue 8.

use std::io::Write;
use std::process::{Command, Stdio};

use tallow_tests::*;

fn reference() -> serde_json::Value {
    let p = fixtures().join("reference").join("generate.json");
    serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap()
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap_or_else(|| panic!("not an id list: {v}"))
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// `tallow generate ... --json`, required to succeed; its JSON object.
fn generate_json(args: &[&str]) -> serde_json::Value {
    let mut all = vec!["generate", "--dtype", "f32", "--device", "cpu", "--json"];
    all.extend_from_slice(args);
    let r = tallow(&all);
    assert_eq!(r.code, 0, "tallow {all:?} failed: {}", r.stderr);
    serde_json::from_str(r.stdout.trim()).unwrap_or_else(|e| panic!("bad JSON {e}: {}", r.stdout))
}

/// The command-line arguments of one reference case.
/// The model comes from the fixture root `root` (one per config layout, see `layouts`).
fn case_args_at(root: &std::path::Path, case: &serde_json::Value, max_new: u64) -> Vec<String> {
    let model = root.join("models").join(case["model"].as_str().unwrap());
    let mut a = vec![
        "--model".to_string(),
        model.to_str().unwrap().to_string(),
        "--prompt".into(),
        case["prompt"].as_str().unwrap().into(),
        "--temperature".into(),
        "0".into(),
        "--max-new-tokens".into(),
        max_new.to_string(),
        "--repetition-penalty".into(),
        case["repetition_penalty"].as_f64().unwrap().to_string(),
    ];
    if let Some(adapter) = case["adapter"].as_str() {
        a.push("--adapter".into());
        let dir = fixtures().join("adapters").join(adapter);
        a.push(dir.to_str().unwrap().into());
    }
    if case["chat"].as_bool().unwrap() {
        a.push("--chat".into());
    }
    a
}

/// Greedy ids equal transformers' for Llama, Qwen2, Qwen3 and Mistral (whose sliding window the
/// prompt and output pass), plain and chat prompts, with a PEFT adapter and with a repetition
/// penalty, through the KV cache and through full recompute; in both config layouts
/// (transformers 4.57's and 5's, each with its own reference).
#[test]
fn greedy_ids_match_transformers_with_and_without_the_cache() {
    for (layout, root) in layouts() {
        greedy_ids_match(layout, &root);
    }
}

fn greedy_ids_match(layout: &str, root: &std::path::Path) {
    let r = json_at(root, "generate.json");
    let max_new = r["max_new_tokens"].as_u64().unwrap();
    let cases = r["cases"].as_array().unwrap();
    let families: std::collections::HashSet<&str> =
        cases.iter().map(|c| c["model"].as_str().unwrap()).collect();
    assert_eq!(
        families,
        MODELS.into_iter().collect(),
        "{layout}: every family has reference cases"
    );
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let want_prompt = ids(&case["prompt_ids"]);
        let want = ids(&case["generated_ids"]);
        for no_cache in [false, true] {
            let mut a = case_args_at(root, case, max_new);
            if no_cache {
                a.push("--no-cache".into());
            }
            let a: Vec<&str> = a.iter().map(String::as_str).collect();
            let out = generate_json(&a);
            assert_eq!(
                ids(&out["prompt_ids"]),
                want_prompt,
                "{layout} {name}: prompt ids"
            );
            assert_eq!(
                ids(&out["generated_ids"]),
                want,
                "{layout} {name} (no_cache {no_cache}): generated ids"
            );
        }
    }
}

/// A stop id from generation_config.json (here a list, as chat models write it) ends generation
/// where transformers does (`stop_at_eos` of the reference: transformers' own generate with that
/// eos_token_id): right after its first occurrence, kept as the last id and left out of the
/// text.
#[test]
fn generation_stops_at_eos_from_generation_config() {
    let r = reference();
    let stop_case = &r["stop_at_eos"];
    let case = &r["cases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == stop_case["case"])
        .unwrap()
        .clone();
    let full = ids(&case["generated_ids"]);
    let want = ids(&stop_case["generated_ids"]);
    let stop = ids(&stop_case["eos_token_id"])[0];
    let k = want.len() - 1;
    assert!(
        want.len() < full.len() && want[..] == full[..=k] && want[k] == stop,
        "transformers stopped after the first {stop}: {want:?} vs {full:?}"
    );
    let dir = scratch("gen-eos");
    copy_model("tiny-llama", &dir);
    std::fs::write(
        dir.join("generation_config.json"),
        format!("{{\"eos_token_id\": [999999, {stop}]}}"),
    )
    .unwrap();
    for cache in [true, false] {
        let mut a = vec![
            "--model",
            dir.to_str().unwrap(),
            "--prompt",
            case["prompt"].as_str().unwrap(),
            "--max-new-tokens",
            "24",
        ];
        if !cache {
            a.push("--no-cache");
        }
        let out = generate_json(&a);
        assert_eq!(ids(&out["generated_ids"]), want, "cache {cache}");
        assert_eq!(out["stopped"], true);
        let tok = tallow_text::TextTokenizer::from_model_dir(&model_dir("tiny-llama")).unwrap();
        assert_eq!(
            out["text"].as_str().unwrap(),
            tok.decode(&full[..k]).unwrap()
        );
    }
}

/// Sampling: the same seed gives the same ids, another seed other ids (flat-ish logits of a
/// random model at temperature 2 over 24 tokens: a collision is vanishingly unlikely).
#[test]
fn sampling_is_reproducible_under_a_seed() {
    let dir = model_dir("tiny-qwen2");
    let run = |seed: &str, cache: bool| {
        let mut a = vec![
            "--model",
            dir.to_str().unwrap(),
            "--prompt",
            "Once upon a time",
            "--temperature",
            "2",
            "--top-k",
            "0",
            "--max-new-tokens",
            "24",
            "--seed",
            seed,
        ];
        if !cache {
            a.push("--no-cache");
        }
        ids(&generate_json(&a)["generated_ids"])
    };
    let a = run("7", true);
    assert_eq!(a.len(), 24);
    assert_eq!(a, run("7", true), "same seed, same ids");
    assert_eq!(a, run("7", false), "the cache does not change sampled ids");
    assert_ne!(a, run("8", true), "another seed, other ids");
}

/// `--json` prints one object with the prompt ids, the generated ids and their text; without it
/// the text streams to stdout and the timings go to stderr.
#[test]
fn json_shape_and_streamed_text() {
    let dir = model_dir("tiny-qwen3");
    let base = [
        "--model",
        dir.to_str().unwrap(),
        "--prompt",
        "hello world",
        "--max-new-tokens",
        "12",
    ];
    let out = generate_json(&base);
    let obj = out.as_object().unwrap();
    for key in ["prompt_ids", "generated_ids", "text"] {
        assert!(obj.contains_key(key), "missing {key}: {out}");
    }
    let gen = ids(&out["generated_ids"]);
    assert_eq!(gen.len(), 12);
    let tok = tallow_text::TextTokenizer::from_model_dir(&dir).unwrap();
    assert_eq!(
        ids(&out["prompt_ids"]),
        tok.encode("hello world", true).unwrap()
    );
    let text = out["text"].as_str().unwrap();
    assert_eq!(
        text,
        tok.decode(&gen).unwrap(),
        "text is the generated part only"
    );

    let mut a = vec!["generate", "--dtype", "f32", "--device", "cpu"];
    a.extend_from_slice(&base);
    let r = tallow(&a);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(r.stdout, format!("{text}\n"), "streamed text");
    assert!(
        r.stderr.contains("prefill") && r.stderr.contains("decode 11 tokens"),
        "timings on stderr: {}",
        r.stderr
    );
    assert!(r.stderr.contains("tokens/s"), "{}", r.stderr);

    // --prompt-file: the same prompt from a file (its trailing newline dropped).
    let f = scratch("gen-prompt").join("p.txt");
    std::fs::write(&f, "hello world\n").unwrap();
    let from_file = generate_json(&[
        "--model",
        dir.to_str().unwrap(),
        "--prompt-file",
        f.to_str().unwrap(),
        "--max-new-tokens",
        "12",
    ]);
    assert_eq!(from_file["generated_ids"], out["generated_ids"]);
}

/// Runs `tallow chat ARGS` with `input` on stdin.
fn chat(args: &[&str], input: &str) -> Run {
    let mut child = Command::new(tallow_bin())
        .arg("chat")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    Run {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// Two turns through a pipe: the first reply is `generate --chat`'s, the second turn's prompt
/// holds the whole history, `/reset` forgets it, `/exit` ends before the last line.
#[test]
fn chat_keeps_history_through_a_pipe() {
    let dir = model_dir("tiny-qwen2");
    let common = ["--model", dir.to_str().unwrap(), "--max-new-tokens", "8"];
    let mut chat_args = common.to_vec();
    chat_args.extend_from_slice(&["--dtype", "f32", "--device", "cpu"]);
    let r = chat(
        &chat_args,
        "Tell me a story.\nAnd then?\n/reset\nTell me a story.\n/exit\nnever read\n",
    );
    assert_eq!(r.code, 0, "{}", r.stderr);
    let replies: Vec<&str> = r.stdout.lines().collect();
    assert_eq!(replies.len(), 3, "three replies: {:?}", r.stdout);
    assert_eq!(
        replies[0], replies[2],
        "after /reset the history is the first turn's"
    );
    let prompts: Vec<usize> = r
        .stderr
        .lines()
        .filter_map(|l| l.strip_prefix("prompt "))
        .map(|l| l.split(' ').next().unwrap().parse().unwrap())
        .collect();
    assert_eq!(prompts.len(), 3, "{}", r.stderr);
    // Turn 2 = turn 1's prompt + its reply + the closing and the new user turn.
    assert!(prompts[1] > prompts[0] + 8, "history kept: {prompts:?}");
    assert_eq!(prompts[2], prompts[0], "history cleared: {prompts:?}");

    let mut a = vec!["--prompt", "Tell me a story.", "--chat"];
    a.extend_from_slice(&common);
    let one = generate_json(&a);
    assert_eq!(replies[0], one["text"].as_str().unwrap());
}

/// Bad input: a clear message and a non-zero exit.
#[test]
fn bad_input_is_refused_with_a_message() {
    let llama = model_dir("tiny-llama");
    let llama = llama.to_str().unwrap();
    // No prompt, and both prompt sources: usage errors (clap, exit 2).
    let r = tallow(["generate", "--model", llama]);
    assert_ne!(r.code, 0);
    assert!(r.stderr.contains("--prompt"), "{}", r.stderr);
    let r = tallow([
        "generate",
        "--model",
        llama,
        "--prompt",
        "x",
        "--prompt-file",
        "p.txt",
    ]);
    assert_ne!(r.code, 0);
    assert!(r.stderr.contains("--prompt-file"), "{}", r.stderr);
    // An adapter made for another model.
    let other = fixtures().join("adapters").join("tiny-qwen3-peft");
    let r = tallow([
        "generate",
        "--model",
        llama,
        "--adapter",
        other.to_str().unwrap(),
        "--prompt",
        "x",
    ]);
    assert_eq!(r.code, 1, "{}", r.stderr);
    assert!(
        r.stderr.contains("tiny-qwen3-peft") && r.stderr.contains("different model"),
        "{}",
        r.stderr
    );
    // Out-of-range sampling values name the flag.
    let r = tallow([
        "generate", "--model", llama, "--prompt", "x", "--top-p", "0",
    ]);
    assert_eq!(r.code, 1);
    assert!(r.stderr.contains("--top-p"), "{}", r.stderr);
    // --chat on a model without a chat template.
    let dir = scratch("gen-no-template");
    copy_model("tiny-qwen3", &dir);
    std::fs::remove_file(dir.join("chat_template.jinja")).unwrap();
    let r = tallow([
        "generate",
        "--model",
        dir.to_str().unwrap(),
        "--prompt",
        "x",
        "--chat",
    ]);
    assert_eq!(r.code, 1);
    assert!(
        r.stderr.contains("--chat") && r.stderr.contains("no chat template"),
        "{}",
        r.stderr
    );
    let r = tallow(["generate", "--model", "no/such/dir", "--prompt", "x"]);
    assert_eq!(r.code, 1);
    assert!(r.stderr.contains("--model no/such/dir"), "{}", r.stderr);
}
