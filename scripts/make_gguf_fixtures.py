#!/usr/bin/env python3
"""GGUF fixtures: tiny models converted by llama.cpp's own converter, and what transformers'
GGUF loader computes on them (dev-only; issue 39, docs/gguf.md).

Run from the repository root, after scripts/make_fixtures.py has made the tiny models:

    /work/pyref/bin/python scripts/make_gguf_fixtures.py convert [FILE...]  # the .gguf files
    /work/pyref/bin/python scripts/make_gguf_fixtures.py reference    # transformers 4.57's numbers
    /work/pyref5/bin/python scripts/make_gguf_fixtures.py reference   # transformers 5's numbers
    python3 scripts/make_gguf_fixtures.py vocabs    # llama.cpp's vocabulary test files, for
                                                     # tests/tests/gguf_vocabs.rs (not committed)

`convert` downloads llama-cpp-python 0.3.36's source archive from PyPI (pinned by SHA-256; it
vendors llama.cpp with `convert_hf_to_gguf.py`, its `conversion/` package and `gguf-py`, MIT
licence), unpacks those into a scratch dir (nothing of it is committed) and runs the converter
on tests/fixtures/models/ (needs torch, transformers, sentencepiece, numpy: the pinned stack of
scripts/requirements-fixtures.txt plus `sentencepiece`):

    tiny-llama -> tests/fixtures/gguf/tiny-llama-f32.gguf   (f32; Llama 3 rope scaling, so the
                  file carries `rope_freqs.weight`; q / k rows in llama.cpp's rotary order)
    tiny-qwen2 -> tests/fixtures/gguf/tiny-qwen2-q8_0.gguf  (Q8_0 blocks; q/k/v biases, tied)
    tiny-qwen2 -> tests/fixtures/gguf/tiny-qwen2-f16.gguf   (f16)
    tiny-qwen3 -> tests/fixtures/gguf/tiny-qwen3-f32.gguf   (f32; q/k norms, head dim 32 != 64/4...)
    tiny-llama-spm -> tests/fixtures/gguf/tiny-llama-spm-f32.gguf  (a SentencePiece vocabulary,
                  `tokenizer.ggml.model` = "llama", as Llama 2 and Mistral have: tiny-llama's shape
                  without rope scaling, random weights (seed 0), and a 400-piece SentencePiece BPE
                  model with byte fallback trained here on tests/fixtures/data's texts; the model
                  dir is made in the scratch dir and not committed, only its GGUF)
    tiny-mistral -> tests/fixtures/gguf/tiny-mistral-f32.gguf  (architecture `llama`, its sliding
                  window dropped, as the converter writes Mistral)
    tiny-gemma2-spm, tiny-gemma3-spm, tiny-phi3-spm -> tests/fixtures/gguf/tiny-*-spm-f32.gguf,
                  tiny-gemma3-spm-q8_0.gguf, tiny-phi3-spm-q8_0.gguf  (made in the scratch dir by
                  make_gemma_model / make_phi3_model: SentencePiece vocabularies of Gemma's and
                  Phi-3's kinds, Gemma's norms as 1 + w; the files the converter read besides the
                  weights are kept in tests/fixtures/gguf/hf/NAME for the export test)
    tiny-phi3-longrope -> tests/fixtures/gguf/tiny-phi3-longrope-f32.gguf  (tiny-phi3: LongRoPE
                  as the tensors rope_factors_long / _short, partial rotary 0.5)

and llama.cpp's `llama-quantize` (built here from the same archive's sources, with cmake and the
system C++ compiler) for the fixtures in llama.cpp's k-quant blocks, which gguf-py cannot write
(the Llama below, and tiny-gemma3-spm / tiny-phi3-spm in Q4_K_M):

    tiny-llama-256 -> tests/fixtures/gguf/tiny-llama-256-q4_k_m.gguf  (Q4_K_M: Q4_K and Q6_K
                  blocks, as llama-quantize mixes them; tiny-llama's config and tokenizer at k-quant
                  sizes, hidden 256, intermediate 256, head dim 64, no rope scaling (so that
                  transformers reads what the file says), random weights (seed 0); converted to
                  f32 first, then quantized; the model dir is made in the scratch dir and not
                  committed. For `model.quantize = "keep"`: LoRA over the blocks as stored)
    tiny-llama-256 -> tests/fixtures/gguf/tiny-llama-256-q8_0.gguf  (the converter's Q8_0: the
                  source of the Q4_K_M export test below)

and llama-quantize on committed files (REQUANTIZED; `--allow-requantize`: the values dequantized,
then quantized; the Q8_0 file's on an 8-bit grid, which the 4- and 6-bit blocks must search):

    tiny-llama-256-q8_0.gguf -> tests/fixtures/gguf/tiny-llama-256-q4_k_m-from-q8_0.gguf  (what
                  `tallow export --outtype q4_k_m` of tiny-llama-256-q8_0.gguf must write, byte
                  for byte)
    tiny-gemma3-spm-f32.gguf -> tests/fixtures/gguf/tiny-gemma3-spm-{q3_k_s,q3_k_m,q3_k_l,q4_k_s,
                  q5_k_m,q5_k_s,q6_k}.gguf  (the other mixes `tallow export` writes)

and `convert_lora_to_gguf.py` on two PEFT adapter fixtures (llama.cpp's LoRA adapter layout):

    adapters/tiny-llama-peft -> tests/fixtures/gguf/tiny-llama-peft-f32.gguf
    adapters/tiny-qwen2-peft -> tests/fixtures/gguf/tiny-qwen2-peft-f16.gguf
    adapters/tiny-{mistral,gemma2,gemma3,phi3}-peft -> tests/fixtures/gguf/tiny-*-peft-f16.gguf
                  (the adapter layout reads only the base's config.json, so the tiny models'
                  own Gemma settings, which the model export refuses, do not matter here)

The converter names a BPE vocabulary's pre-tokenizer (`tokenizer.ggml.pre`) by hashing the ids
the tokenizer gives a test string, and knows only real models' hashes: for these tiny
vocabularies it is told the name of the split their tokenizer.json uses (llama-bpe for tiny-llama,
qwen2 for tiny-qwen2 and tiny-qwen3), the one thing not left to it.

`reference` loads each file with transformers' GGUF support (`from_pretrained(dir,
gguf_file=...)`, float32) and writes tests/fixtures/gguf/reference-v{4,5}.json:

    {"versions": {...}, "texts": [...],
     "files": {NAME: {"ids": [[...] per text]   (tokenizer(text).input_ids),
                      "tokenizer_json": the tokenizer transformers built from the file, as
                       tokenizers serializes it (its tokenizer.json),
                      "nll_sum": float, "count": int  (summed next-token NLL over every text's
                       ids, each row on its own, count = its targets),
                      "original_nll_sum": float  (the same ids through the safetensors model the
                       file was converted from, tests/fixtures/models/MODEL, float32),
                      "config": {model_type, hidden_size, head_dim, rope},
                      "error": str (instead of nll_sum and config, when transformers cannot
                       load the model from the file)},
                     NAME: {"tokenizer_error": str}  (alone, when transformers cannot tokenize the
                       texts with the tokenizer it builds from the file: 4.57 on the Gemma files,
                       "Encountered an unknown token but `unk_id` is missing")}}

Where transformers' GGUF loader computes something else than the model the file came from, the
numbers say so: tiny-llama's nll_sum differs from its original_nll_sum (the loader drops
`rope_freqs.weight`, so its rope is unscaled), and tiny-qwen3's file does not load (the loader
leaves `attention.key_length` out of the config, so Qwen3Config's default head_dim 128 meets
weights of head dim 32): "error".
"""

import hashlib
import json
import os
import runpy
import sys
import tarfile
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FIX = REPO / "tests" / "fixtures"
OUT = FIX / "gguf"
SDIST = (
    "https://files.pythonhosted.org/packages/ec/e9/"
    "e7de2b0463ea3ffbf0ede6cb21b58c1258a8f6521aae45ca773a59fe7cf3/llama_cpp_python-0.3.36.tar.gz"
)
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
LLAMA_CPP = "llama_cpp_python-0.3.36/vendor/llama.cpp"
SCRATCH = Path(os.environ.get("GGUF_SCRATCH", "/tmp/tallow-gguf-scratch"))

# (fixture model, output type, tokenizer.ggml.pre, file name)
FILES = [
    ("tiny-llama", "f32", "llama-bpe", "tiny-llama-f32.gguf"),
    ("tiny-llama-spm", "f32", None, "tiny-llama-spm-f32.gguf"),
    ("tiny-qwen2", "q8_0", "qwen2", "tiny-qwen2-q8_0.gguf"),
    ("tiny-qwen2", "f16", "qwen2", "tiny-qwen2-f16.gguf"),
    ("tiny-qwen3", "f32", "qwen2", "tiny-qwen3-f32.gguf"),
    ("tiny-llama-256", "Q4_K_M", "llama-bpe", "tiny-llama-256-q4_k_m.gguf"),
    ("tiny-llama-256", "q8_0", "llama-bpe", "tiny-llama-256-q8_0.gguf"),
    ("tiny-mistral", "f32", "llama-bpe", "tiny-mistral-f32.gguf"),
    ("tiny-gemma2-spm", "f32", None, "tiny-gemma2-spm-f32.gguf"),
    ("tiny-gemma3-spm", "f32", None, "tiny-gemma3-spm-f32.gguf"),
    ("tiny-phi3-spm", "f32", None, "tiny-phi3-spm-f32.gguf"),
    ("tiny-phi3-longrope", "f32", "qwen2", "tiny-phi3-longrope-f32.gguf"),
    ("tiny-gemma3-spm", "q8_0", None, "tiny-gemma3-spm-q8_0.gguf"),
    ("tiny-phi3-spm", "q8_0", None, "tiny-phi3-spm-q8_0.gguf"),
    ("tiny-gemma3-spm", "Q4_K_M", None, "tiny-gemma3-spm-q4_k_m.gguf"),
    ("tiny-phi3-spm", "Q4_K_M", None, "tiny-phi3-spm-q4_k_m.gguf"),
]

# (fixture, file, mix): llama-quantize's Q3_K_S / _M / _L, Q4_K_M / _S, Q5_K_M / _S and Q6_K of the
# fixture's values
# (`--allow-requantize`: its Q8_0 blocks dequantized, then quantized), what `tallow export
# --outtype q4_k_m` (`q5_k_m`, `q6_k`) of the fixture must write byte for byte (tests/tests/gguf.rs).
REQUANTIZED = [("tiny-llama-256-q8_0.gguf", "tiny-llama-256-q4_k_m-from-q8_0.gguf", "Q4_K_M"),
               ("tiny-gemma3-spm-f32.gguf", "tiny-gemma3-spm-q5_k_m.gguf", "Q5_K_M"),
               ("tiny-gemma3-spm-f32.gguf", "tiny-gemma3-spm-q6_k.gguf", "Q6_K"),
               ("tiny-gemma3-spm-f32.gguf", "tiny-gemma3-spm-q4_k_s.gguf", "Q4_K_S"),
               ("tiny-gemma3-spm-f32.gguf", "tiny-gemma3-spm-q5_k_s.gguf", "Q5_K_S"),
               ("tiny-gemma3-spm-f32.gguf", "tiny-gemma3-spm-q3_k_s.gguf", "Q3_K_S"),
               ("tiny-gemma3-spm-f32.gguf", "tiny-gemma3-spm-q3_k_m.gguf", "Q3_K_M"),
               ("tiny-gemma3-spm-f32.gguf", "tiny-gemma3-spm-q3_k_l.gguf", "Q3_K_L")]

# The fixture models made in the scratch dir (not committed), by their maker.
SCRATCH_MODELS = {"tiny-llama-spm": lambda: make_spm_model(), "tiny-llama-256": lambda: make_k_quant_model(),
                  "tiny-gemma2-spm": lambda: make_gemma_model(2), "tiny-gemma3-spm": lambda: make_gemma_model(3),
                  "tiny-phi3-spm": lambda: make_phi3_model(), "tiny-phi3-longrope": lambda: make_phi3_longrope()}

# (PEFT adapter fixture, its base model, output type, file name): convert_lora_to_gguf.py's
# adapter files, which `tallow export --adapter-only` must reproduce.
LORA_FILES = [
    ("tiny-llama-peft", "tiny-llama", "f32", "tiny-llama-peft-f32.gguf"),
    ("tiny-qwen2-peft", "tiny-qwen2", "f16", "tiny-qwen2-peft-f16.gguf"),
    ("tiny-mistral-peft", "tiny-mistral", "f16", "tiny-mistral-peft-f16.gguf"),
    ("tiny-gemma2-peft", "tiny-gemma2", "f16", "tiny-gemma2-peft-f16.gguf"),
    ("tiny-gemma3-peft", "tiny-gemma3", "f16", "tiny-gemma3-peft-f16.gguf"),
    ("tiny-phi3-peft", "tiny-phi3", "f16", "tiny-phi3-peft-f16.gguf"),
]

TEXTS = [
    "Hello world, this is a test.",
    "The quick brown fox jumps over the lazy dog. 12345 67",
    "  leading spaces, tabs\tand\nnew lines\n\n and CAPS: I'm, you'll, it's",
    "Unicode: café, naïve, 東京, emoji 🦙 and <|im_end|> as text",
]


def llama_cpp() -> Path:
    """The scratch copy of llama.cpp's converter (downloaded and checked once)."""
    root = SCRATCH / LLAMA_CPP
    if (root / "convert_lora_to_gguf.py").exists():
        return root
    SCRATCH.mkdir(parents=True, exist_ok=True)
    archive = SCRATCH / "llama_cpp_python-0.3.36.tar.gz"
    if not archive.exists():
        urllib.request.urlretrieve(SDIST, archive)
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        sys.exit(f"{archive}: SHA-256 {digest}, expected {SDIST_SHA256}")
    wanted = [f"{LLAMA_CPP}/{p}" for p in ("convert_hf_to_gguf.py", "convert_lora_to_gguf.py", "conversion",
                                           "gguf-py", "LICENSE", "models")]
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if any(m.name == w or m.name.startswith(w + "/") for w in wanted)]
        tar.extractall(SCRATCH, members=members, filter="data")
    return root


def make_spm_model() -> Path:
    """tiny-llama-spm (see the module doc), in the scratch dir."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaTokenizer

    out = SCRATCH / "tiny-llama-spm"
    tok = LlamaTokenizer(vocab_file=str(train_spm("spm", dummy_prefix=True, normalization="nmt_nfkc")),
                         legacy=False)
    base = json.loads((FIX / "models" / "tiny-llama" / "config.json").read_text())
    base.update(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                rope_scaling=None)
    for k in ("architectures", "transformers_version", "dtype", "model_type"):
        base.pop(k, None)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**base))
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


def train_spm(prefix: str, dummy_prefix: bool, user_defined=(), normalization="identity") -> Path:
    """A 400-piece SentencePiece BPE model with byte fallback, trained on tests/fixtures/data's
    texts: `prefix`.model in the scratch dir. tiny-llama-spm's keeps SentencePiece's default NFKC
    table (240 KB of the file); the later ones go without it."""
    import sentencepiece as spm

    corpus = SCRATCH / "spm-corpus.txt"
    lines = []
    for f in sorted((FIX / "data").glob("*.jsonl")):
        for line in f.read_text(encoding="utf-8").splitlines():
            lines += [v for v in json.loads(line).values() if isinstance(v, str)]
    corpus.write_text("\n".join(lines + TEXTS) + "\n", encoding="utf-8")
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(SCRATCH / prefix), vocab_size=400, model_type="bpe",
        byte_fallback=True, hard_vocab_limit=False, character_coverage=1.0, seed_sentencepiece_size=1000,
        num_threads=1, add_dummy_prefix=dummy_prefix, split_digits=True, remove_extra_whitespaces=dummy_prefix,
        user_defined_symbols=list(user_defined), normalization_rule_name=normalization)
    return SCRATCH / f"{prefix}.model"


def make_gemma_model(version: int) -> Path:
    """tiny-gemma{2,3}-spm: Gemma's shape where llama.cpp and transformers' GGUF loader agree on
    what a file means (head dim 256 = query_pre_attn_scalar, Gemma 2's soft-capping 50 / 30,
    Gemma 3's sliding pattern 6 and local rope base 10000; a sliding window of 4 tokens, so the
    texts cross it), random weights (seed 0), and a SentencePiece vocabulary as Gemma's: no dummy
    prefix, whitespace kept, runs of spaces as pieces, the turn markers as special tokens; in the
    scratch dir, not committed (only its GGUF)."""
    import torch
    from transformers import GemmaTokenizer

    out = SCRATCH / f"tiny-gemma{version}-spm"
    model = train_spm(f"spm-gemma{version}", dummy_prefix=False,
                      user_defined=["<start_of_turn>", "<end_of_turn>", "\n\n", "  ", "   "])
    tok = GemmaTokenizer(vocab_file=str(model), bos_token="<s>", eos_token="</s>", pad_token="<unk>",
                         additional_special_tokens=["<start_of_turn>", "<end_of_turn>"])
    shape = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, sliding_window=4,
                 max_position_embeddings=256, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                 pad_token_id=tok.pad_token_id, tie_word_embeddings=True)
    torch.manual_seed(0)
    if version == 2:
        from transformers import Gemma2Config, Gemma2ForCausalLM

        m = Gemma2ForCausalLM(Gemma2Config(num_hidden_layers=2, attn_logit_softcapping=50.0,
                                           final_logit_softcapping=30.0, rope_theta=10000.0, **shape))
    else:
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        m = Gemma3ForCausalLM(Gemma3TextConfig(num_hidden_layers=6, rope_theta=1000000.0,
                                               rope_local_base_freq=10000.0, **shape))
    # Gemma's norms are (1 + w) with w initialized at 0: random ones, so that the +1 llama.cpp's
    # converter adds (and the -1 a reader takes off) shows
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0.0, 0.5)
    m.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


def make_phi3_model() -> Path:
    """tiny-phi3-spm: Phi-3-mini-4k's shape (SentencePiece vocabulary with a dummy prefix, full
    rotary, no rope scaling, its sliding window of 2047, which neither llama.cpp nor transformers'
    GGUF loader applies and the texts never reach), grouped-query heads, random weights (seed 0);
    in the scratch dir, not committed (only its GGUF)."""
    import torch
    from transformers import LlamaTokenizer, Phi3Config, Phi3ForCausalLM

    out = SCRATCH / "tiny-phi3-spm"
    tok = LlamaTokenizer(vocab_file=str(train_spm("spm-phi3", dummy_prefix=True)), legacy=False)
    torch.manual_seed(0)
    config = Phi3Config(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                        original_max_position_embeddings=4096, sliding_window=2047, rope_scaling=None,
                        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id,
                        tie_word_embeddings=False)
    Phi3ForCausalLM(config).save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


def make_phi3_longrope() -> Path:
    """tiny-phi3-longrope: tests/fixtures/models/tiny-phi3 (LongRoPE, partial rotary 0.5, a
    byte-level BPE vocabulary) with `tokenizer_class` GPT2Tokenizer, the one thing llama.cpp's
    Phi-3 converter needs to take a byte-level vocabulary (as Phi-4-mini's); in the scratch dir."""
    import shutil

    out = SCRATCH / "tiny-phi3-longrope"
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(FIX / "models" / "tiny-phi3", out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "GPT2Tokenizer"
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return out


def make_k_quant_model() -> Path:
    """tiny-llama-256 (see the module doc), in the scratch dir."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = SCRATCH / "tiny-llama-256"
    src = FIX / "models" / "tiny-llama"
    base = json.loads((src / "config.json").read_text())
    base.update(hidden_size=256, intermediate_size=256, head_dim=64, num_attention_heads=4, num_key_value_heads=2,
                rope_scaling=None)
    for k in ("architectures", "transformers_version", "dtype", "model_type"):
        base.pop(k, None)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**base)).save_pretrained(out, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (src / f).exists():
            shutil.copy(src / f, out / f)
    return out


def llama_quantize() -> Path:
    """llama.cpp's `llama-quantize`, built once in the scratch dir from the pinned archive."""
    import subprocess

    llama_cpp()
    root = SCRATCH / "build" / LLAMA_CPP
    exe = root / "build" / "bin" / "llama-quantize"
    if exe.exists():
        return exe
    with tarfile.open(SCRATCH / "llama_cpp_python-0.3.36.tar.gz") as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(LLAMA_CPP + "/")]
        tar.extractall(SCRATCH / "build", members=members, filter="data")
    cmake = str(Path(sys.executable).parent / "cmake")
    flags = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
             "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DGGML_OPENMP=OFF"]
    subprocess.run([cmake, "-B", "build", *flags], cwd=root, check=True)
    subprocess.run([cmake, "--build", "build", "--target", "llama-quantize", "-j"], cwd=root, check=True)
    return exe


def keep_hf_files(src: Path):
    """The files of a scratch model with a SentencePiece vocabulary that the export test needs
    (tests/fixtures/gguf/hf/NAME: config.json, tokenizer.model, tokenizer_config.json): what
    llama.cpp's converter read besides the weights, which the test takes from the converter's own
    f32 file instead (`tallow export` of them must write the converter's file)."""
    import shutil

    out = OUT / "hf" / src.name
    out.mkdir(parents=True, exist_ok=True)
    for f in ("config.json", "tokenizer.model", "tokenizer_config.json"):
        shutil.copy(src / f, out / f)


def convert():
    root = llama_cpp()
    sys.path[:0] = [str(root / "gguf-py"), str(root)]
    import conversion.base as base  # llama.cpp's

    OUT.mkdir(parents=True, exist_ok=True)
    original = base.TextModel.get_vocab_base_pre
    only = sys.argv[2:]  # file names to make (all when none)
    for model, outtype, pre, name in FILES:
        if only and name not in only:
            continue
        base.TextModel.get_vocab_base_pre = (lambda self, tokenizer, pre=pre: pre) if pre else original
        src = SCRATCH_MODELS[model]() if model in SCRATCH_MODELS else FIX / "models" / model
        if (src / "tokenizer.model").exists():
            keep_hf_files(src)
        # A k-quant type: converted to f32, then quantized by llama-quantize.
        k_quant = outtype.upper() == outtype
        converted = SCRATCH / f"{model}-f32.gguf" if k_quant else OUT / name
        sys.argv = ["convert_hf_to_gguf.py", str(src), "--outfile", str(converted),
                    "--outtype", "f32" if k_quant else outtype]
        runpy.run_path(str(root / "convert_hf_to_gguf.py"), run_name="__main__")
        if k_quant:
            import subprocess

            subprocess.run([str(llama_quantize()), str(converted), str(OUT / name), outtype], check=True)
        print(f"wrote {OUT / name} ({(OUT / name).stat().st_size} bytes)")
    for source, name, mix in REQUANTIZED:
        if only and name not in only:
            continue
        import subprocess

        subprocess.run([str(llama_quantize()), "--allow-requantize", str(OUT / source), str(OUT / name), mix],
                       check=True)
        print(f"wrote {OUT / name} ({(OUT / name).stat().st_size} bytes)")
    for adapter, model, outtype, name in LORA_FILES:
        if only and name not in only:
            continue
        sys.argv = ["convert_lora_to_gguf.py", str(FIX / "adapters" / adapter), "--base", str(FIX / "models" / model),
                    "--outfile", str(OUT / name), "--outtype", outtype]
        runpy.run_path(str(root / "convert_lora_to_gguf.py"), run_name="__main__")
        print(f"wrote {OUT / name} ({(OUT / name).stat().st_size} bytes)")


def reference():
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import gguf

    def nll_of(model, ids):
        nll = 0.0
        with torch.no_grad():
            for row in ids:
                x = torch.tensor([row])
                logits = model(x).logits[0, :-1].double()
                nll += float(torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="sum"))
        return nll

    files = {}
    for model_name, _, _, name in FILES:
        try:
            tok = AutoTokenizer.from_pretrained(OUT, gguf_file=name)
            ids = [tok(t).input_ids for t in TEXTS]
        except Exception as e:  # noqa: BLE001 -- recorded: 4.57 cannot tokenize with a Gemma file's vocabulary
            files[name] = {"tokenizer_error": f"{type(e).__name__}: {str(e).splitlines()[0]}"}
            print(name, files[name])
            continue
        src = SCRATCH / model_name if model_name in SCRATCH_MODELS else FIX / "models" / model_name
        original = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
        entry = {"ids": ids, "count": sum(len(r) - 1 for r in ids),
                 "tokenizer_json": json.loads(tok.backend_tokenizer.to_str()),
                 "original_nll_sum": nll_of(original.eval(), ids)}
        try:
            model = AutoModelForCausalLM.from_pretrained(OUT, gguf_file=name, dtype=torch.float32)
        except Exception as e:  # noqa: BLE001 -- recorded: what transformers does with the file
            entry["error"] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
        else:
            c = model.config
            rope = getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None)
            entry["nll_sum"] = nll_of(model.eval(), ids)
            entry["config"] = {"model_type": c.model_type, "hidden_size": c.hidden_size,
                               "head_dim": getattr(c, "head_dim", None), "rope": rope}
        files[name] = entry
        print(name, {k: v for k, v in entry.items() if k not in ("ids", "tokenizer_json")})
    major = transformers.__version__.split(".")[0]
    versions = {"transformers": transformers.__version__, "torch": torch.__version__,
                "gguf": getattr(gguf, "__version__", "?"), "llama.cpp": "llama-cpp-python 0.3.36's vendor copy"}
    out = OUT / f"reference-v{major}.json"
    out.write_text(json.dumps({"versions": versions, "texts": TEXTS, "files": files}, indent=1) + "\n")
    print(f"wrote {out}")


def vocabs():
    """llama.cpp's tokenizer test files (`models/ggml-vocab-*.gguf`: real vocabularies without
    weights, with `.inp` texts and the `.out` ids llama.cpp gives them), unpacked for the ignored
    test tests/tests/gguf_vocabs.rs: prints the dir to pass as TALLOW_LLAMA_CPP_VOCABS."""
    print(llama_cpp() / "models")


if __name__ == "__main__":
    {"convert": convert, "reference": reference, "vocabs": vocabs}[sys.argv[1] if len(sys.argv) > 1 else ""]()
