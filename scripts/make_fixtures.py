#!/usr/bin/env python3
"""Generate tallow's committed reference fixtures from HF transformers (dev-only).

Run (from the repository root):

    /work/pyref/bin/python scripts/make_fixtures.py

or, in any virtualenv:

    pip install -r scripts/requirements-fixtures.txt
    python scripts/make_fixtures.py

Pinned reference stack (see scripts/requirements-fixtures.txt):

    torch==2.8.0  transformers==4.57.1  tokenizers==0.22.2  peft==0.17.1
    safetensors==0.8.0  numpy==2.4.6  jinja2==3.1.6

The output is deterministic (fixed seeds, single-threaded CPU torch, deterministic
algorithms). Only the files listed here are deleted and rewritten (the other scripts' fixtures
beside them are kept):

    tests/fixtures/tokenizers/{chatml,bos}/      tiny byte-level BPE tokenizers
    tests/fixtures/models/tiny-llama/             LlamaForCausalLM, "bos" tokenizer, 2 shards
    tests/fixtures/models/tiny-qwen2/             Qwen2ForCausalLM, "chatml" tokenizer
    tests/fixtures/models/tiny-qwen3/             Qwen3ForCausalLM, "chatml" tokenizer,
                                                  chat template in chat_template.jinja
    tests/fixtures/models/tiny-mistral/           MistralForCausalLM, sliding_window 8 (the
                                                  rows, up to 32 tokens, are longer), "bos"
                                                  tokenizer with a Mistral [INST] chat template
    tests/fixtures/tokenizers/gemma/              byte-level BPE with Gemma's specials (<pad>,
                                                  <eos>, <bos>, <start_of_turn>, <end_of_turn>)
    tests/fixtures/models/tiny-gemma2/            Gemma2ForCausalLM: 4 layers (0, 2 slide with
                                                  sliding_window 8; 1, 3 global), head_dim 32 !=
                                                  hidden/heads, query_pre_attn_scalar 64, attn
                                                  softcap 2 with q/k weights scaled x1.5 (scores
                                                  pass the cap), final softcap 4 with a larger
                                                  final norm (logits pass it), random (1 + w)
                                                  norms, tied embeddings; "gemma" tokenizer with
                                                  Gemma 2's chat template (no system role: its
                                                  messages format is refused, the error is kept)
    tests/fixtures/tokenizers/phi3/               byte-level BPE with Phi-3's chat specials
    tests/fixtures/models/tiny-phi3/              Phi3ForCausalLM: fused qkv_proj / gate_up_proj,
                                                  longrope with original_max_position_embeddings
                                                  16 (rows of up to 32 tokens use the long
                                                  factors, shorter ones the short), partial
                                                  rotary 0.5, "phi3" tokenizer and template
    tests/fixtures/models/tiny-gemma3/            Gemma3ForCausalLM: 6 layers, every 3rd global
                                                  (sliding_window_pattern 3: 2 and 5; the others
                                                  slide with sliding_window 8), head_dim 32 !=
                                                  hidden/heads, query_pre_attn_scalar 48, q/k
                                                  norms, local rope base 1000 on the sliding
                                                  layers, base 1e5 with linear scaling x4 on the
                                                  global ones, random (1 + w) norms, tied
                                                  embeddings; "gemma" tokenizer with Gemma 3's
                                                  chat template (system folded into the first
                                                  user turn)
    tests/fixtures/data/{text,prompt_completion,messages}.jsonl
    tests/fixtures/reference/<model>.json         token ids / targets / losses
    tests/fixtures/reference/<model>.safetensors  per-row logits and text-format gradients

Tokenization rules (the Rust pipeline implements the same; max_seq_len = 32):
  * text:              ids = tok(text, add_special_tokens=True) (+ eos unless already last);
                       targets = every position >= 1.
  * prompt_completion: ids = tok(prompt + completion, add_special_tokens=True) (+ eos);
                       p = len(tok(prompt, add_special_tokens=True)); targets = positions >= max(p, 1).
  * messages:          ids = tok(apply_chat_template(msgs, tokenize=False), add_special_tokens=False);
                       for each assistant message i: a = len(tok(render(msgs[:i], add_generation_prompt=True))),
                       b = len(tok(render(msgs[:i+1]))) (both add_special_tokens=False); targets[a:b] = True.
                       No eos appended.
  * truncate ids/targets to max_seq_len; rows with no target left are skipped.

Reference values: each kept row runs alone (batch 1, no padding) through the f32 model
(eager attention). NLL of a row = sum over target positions i of -log_softmax(logits[i-1])[ids[i]],
computed in float64 from the f32 logits; a format's loss = sum(nll) / sum(n_targets).
loss_bf16: same with the model cast to bfloat16 (logits upcast before log_softmax).
Gradients: loss over all kept text rows (token-weighted, rows run separately), backward with
every parameter requiring grad; stored as "grad.<safetensors key>" (tied embeddings: only
grad.model.embed_tokens.weight, which includes the lm_head contribution).
Logits: "<format>.<k>.logits" (T, V) f32 where k indexes formats[<format>]["rows"] (kept rows);
formats[<format>]["source_rows"] gives the line index in the .jsonl of each kept row.
"""

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import torch

import peft
import safetensors
import tokenizers
import transformers
from safetensors.torch import load_file, save_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
from tokenizers import pre_tokenizers, processors, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
)

REPO = Path(__file__).resolve().parent.parent
FIX = REPO / "tests" / "fixtures"
MAX_SEQ_LEN = 32
SEED = 20240607
NUM_MERGES = 64
ADD_EOS = True

VERSIONS = {
    "torch": torch.__version__,
    "transformers": transformers.__version__,
    "tokenizers": tokenizers.__version__,
    "peft": peft.__version__,
    "safetensors": safetensors.__version__,
    "numpy": np.__version__,
}
PINNED = {
    "torch": "2.8.0",
    "transformers": "4.57.1",
    "tokenizers": "0.22.2",
    "peft": "0.17.1",
}

# --------------------------------------------------------------------------------------
# Tokenizers
# --------------------------------------------------------------------------------------

# Small built-in English training corpus. Role names and "\n\n" are frequent (as in real
# chat-tuned vocabularies) so they merge into few tokens and the chat fixtures stay short.
CORPUS = [
    "The quick brown fox jumps over the lazy dog. The dog sleeps in the sun.",
    "Once upon a time there was a small robot that loved to read books about the sea.",
    "The robot read the books in the morning and in the evening, and then it went to sleep.",
    "What is the capital of France? The capital of France is Paris.",
    "Good morning! How are you today? I am fine, thank you, and you?",
    "This is a test of the tokenizer. It is only a test, and it is a small one.",
    "The assistant answers the question of the user. The user asks the assistant.",
    "In the beginning the world was quiet, and the stars were bright over the mountains.",
    "system\n\nuser\n\nassistant\n\nuser\n\nassistant\n\n",
    "system\nuser\nassistant\nuser\nassistant\n",
    "Be brief.\n\nHi\n\nHello.\n\nThe fox and the dog.\n\nThe capital is Paris.",
]


def train_bpe(specials, regex):
    """Byte-level BPE: 256 byte tokens + NUM_MERGES merges, then `specials` appended."""
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=256 + NUM_MERGES,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    assert tok.get_vocab_size() == 256 + NUM_MERGES, tok.get_vocab_size()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    return tok


# Qwen2's pre-tokenizer regex (single digits) and Llama 3's (digit groups of up to 3).
QWEN_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

CHATML_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "    {%- set loop_messages = messages[1:] %}\n"
    "{%- else %}\n"
    "    {%- set loop_messages = messages %}\n"
    "{%- endif %}\n"
    "{%- for message in loop_messages %}\n"
    "    {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

LLAMA3_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- for message in messages %}\n"
    "    {%- if message['role'] not in ['system', 'user', 'assistant'] %}\n"
    "        {{- raise_exception('Unknown role: ' + message['role']) }}\n"
    "    {%- endif %}\n"
    "    {%- if message['role'].startswith('sys') and not loop.first %}\n"
    "        {{- raise_exception('The system message must come first') }}\n"
    "    {%- endif %}\n"
    "    {%- set content = message['content'] | trim %}\n"
    "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + content + '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n"
)

# Mistral-7B-Instruct's template (v0.1's role check and layout, v0.3's optional system message
# and trimmed replies), with the system message put before the FIRST user message (v0.3 puts it
# before the last one, so a conversation's rendered prefix would not be a prefix of the whole).
MISTRAL_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {%- set system_message = messages[0]['content'] %}\n"
    "    {%- set loop_messages = messages[1:] %}\n"
    "{%- else %}\n"
    "    {%- set loop_messages = messages %}\n"
    "{%- endif %}\n"
    "{{- bos_token }}\n"
    "{%- for message in loop_messages %}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}\n"
    "        {{- raise_exception('After the optional system message, conversation roles must alternate user/assistant/user/assistant/...') }}\n"
    "    {%- endif %}\n"
    "    {%- if message['role'] == 'user' %}\n"
    "        {%- if loop.first and system_message is defined %}\n"
    "            {{- '[INST] ' + system_message + '\\n\\n' + message['content'] + '[/INST]' }}\n"
    "        {%- else %}\n"
    "            {{- '[INST] ' + message['content'] + '[/INST]' }}\n"
    "        {%- endif %}\n"
    "    {%- elif message['role'] == 'assistant' %}\n"
    "        {{- ' ' + message['content'] | trim + eos_token }}\n"
    "    {%- else %}\n"
    "        {{- raise_exception('Only user and assistant roles are supported, with the exception of an initial optional system message!') }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
)

# google/gemma-2-2b-it's chat template, word for word: no system role, `model` for the
# assistant, trimmed contents.
GEMMA2_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)


# google/gemma-3-1b-it's chat template (its tokenizer_config.json), word for word: a system
# message becomes a prefix of the first user turn, `model` for the assistant, trimmed contents.
GEMMA3_TEMPLATE = (
    "{{ bos_token }}\n{%- if messages[0]['role'] == 'system' -%}\n    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}\n    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n{%- else -%}\n    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n{%- endif -%}\n{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n    {%- if (message['role'] == 'assistant') -%}\n        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n        {%- set role = message['role'] -%}\n    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n        {%- endfor -%}\n    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n    {%- endif -%}\n    {{ '<end_of_turn>\n' }}\n"
    "{%- endfor -%}\n{%- if add_generation_prompt -%}\n    {{'<start_of_turn>model\n'}}\n{%- endif -%}\n"
)

# Phi-3-mini-instruct's chat template (no system-message special casing beyond its own tag, no
# BOS: the "phi3" tokenizer adds none).
PHI3_TEMPLATE = (
    "{%- for message in messages %}\n"
    "    {%- if message['role'] not in ['system', 'user', 'assistant'] %}\n"
    "        {{- raise_exception('Unknown role: ' + message['role']) }}\n"
    "    {%- endif %}\n"
    "    {{- '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|assistant|>\\n' }}\n"
    "{%- endif %}\n"
)


def added_tokens_decoder(tok, specials):
    return {
        str(tok.token_to_id(s)): {
            "content": s,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for s in specials
    }


def build_chatml(out_dir: Path):
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = train_bpe(specials, QWEN_REGEX)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    cfg = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added_tokens_decoder(tok, specials),
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "chat_template": CHATML_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 32768,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }
    write_json(out_dir / "tokenizer_config.json", cfg)


def build_bos(out_dir: Path):
    specials = [
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eot_id|>",
    ]
    tok = train_bpe(specials, LLAMA3_REGEX)
    bos_id = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single="<|begin_of_text|> $A:0",
                pair="<|begin_of_text|>:0 $A:0 <|begin_of_text|>:1 $B:1",
                special_tokens=[("<|begin_of_text|>", bos_id)],
            ),
        ]
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    cfg = {
        "added_tokens_decoder": added_tokens_decoder(tok, specials),
        "bos_token": "<|begin_of_text|>",
        "chat_template": LLAMA3_TEMPLATE,
        "clean_up_tokenization_spaces": True,
        # Old-style AddedToken dict form (as in Llama-2 / Mistral configs) to exercise both forms.
        "eos_token": {
            "__type": "AddedToken",
            "content": "<|end_of_text|>",
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
        },
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": 131072,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    write_json(out_dir / "tokenizer_config.json", cfg)


def build_gemma(out_dir: Path):
    """Gemma's special tokens (its tokenizer adds <bos>), Gemma 2's chat template."""
    specials = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"]
    tok = train_bpe(specials, LLAMA3_REGEX)
    bos_id = tok.token_to_id("<bos>")
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single="<bos> $A:0",
                pair="<bos>:0 $A:0 <bos>:1 $B:1",
                special_tokens=[("<bos>", bos_id)],
            ),
        ]
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    cfg = {
        "add_bos_token": True,
        "add_eos_token": False,
        "added_tokens_decoder": added_tokens_decoder(tok, specials),
        "additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"],
        "bos_token": "<bos>",
        "chat_template": GEMMA2_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<eos>",
        "model_max_length": 1000000000000000019884624838656,
        "pad_token": "<pad>",
        "padding_side": "left",
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }
    write_json(out_dir / "tokenizer_config.json", cfg)


def build_phi3(out_dir: Path):
    # Phi-3's specials: <|endoftext|> (pad, never in the data), <|end|> ends every turn (eos)
    specials = ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
    tok = train_bpe(specials, QWEN_REGEX)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    cfg = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added_tokens_decoder(tok, specials),
        "bos_token": None,
        "chat_template": PHI3_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|end|>",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }
    write_json(out_dir / "tokenizer_config.json", cfg)


def expect_template_errors(t, cases):
    """Each (messages, text) case makes the chat template raise an error containing text."""
    for bad, msg in cases:
        try:
            t.apply_chat_template(bad, tokenize=False)
        except Exception as e:  # jinja2 TemplateError
            assert msg in str(e), e
        else:
            raise AssertionError(f"template should have raised: {bad}")


def check_tokenizer(tok_dir: Path, kind: str):
    t = AutoTokenizer.from_pretrained(str(tok_dir))
    assert type(t).__name__ == "PreTrainedTokenizerFast", type(t)
    assert len(t) <= 330, len(t)
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    if kind == "chatml":
        assert t.bos_token is None and t.bos_token_id is None
        assert t.eos_token == "<|im_end|>" and t.pad_token == "<|endoftext|>"
        ids = t("hello world").input_ids
        assert ids == t("hello world", add_special_tokens=False).input_ids
        s = t.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        assert s == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n<|im_start|>assistant\n", s
        s = t.apply_chat_template([{"role": "system", "content": "S"}] + msgs, tokenize=False)
        assert s.startswith("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\n"), s
    elif kind == "gemma":
        assert t.bos_token == "<bos>" and t.eos_token == "<eos>" and t.pad_token == "<pad>"
        ids = t("hello world").input_ids
        assert ids[0] == t.bos_token_id and ids[1:] == t("hello world", add_special_tokens=False).input_ids
        s = t.apply_chat_template(
            msgs + [{"role": "user", "content": " Bye "}], tokenize=False, add_generation_prompt=True
        )
        want = (
            "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nHello<end_of_turn>\n"
            "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"
        )
        assert s == want, s
        expect_template_errors(t, [
            ([{"role": "system", "content": "x"}] + msgs, "System role not supported"),
            ([{"role": "assistant", "content": "x"}], "must alternate"),
            (msgs + [{"role": "assistant", "content": "x"}], "must alternate"),
        ])
    elif kind == "gemma3":  # the "gemma" tokenizer with GEMMA3_TEMPLATE
        assert t.bos_token == "<bos>" and t.eos_token == "<eos>" and t.pad_token == "<pad>"
        s = t.apply_chat_template(
            [{"role": "system", "content": "Be brief."}] + msgs + [{"role": "user", "content": " Bye "}],
            tokenize=False,
            add_generation_prompt=True,
        )
        want = (
            "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello<end_of_turn>\n"
            "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"
        )
        assert s == want, s
        expect_template_errors(t, [
            ([{"role": "assistant", "content": "x"}], "must alternate"),
            (msgs + [{"role": "assistant", "content": "x"}], "must alternate"),
        ])
    elif kind == "phi3":
        assert t.bos_token is None and t.eos_token == "<|end|>" and t.pad_token == "<|endoftext|>"
        s = t.apply_chat_template(
            [{"role": "system", "content": "S"}] + msgs, tokenize=False, add_generation_prompt=True
        )
        want = "<|system|>\nS<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\nHello<|end|>\n<|assistant|>\n"
        assert s == want, s
        expect_template_errors(t, [([{"role": "tool", "content": "x"}], "Unknown role")])
    elif kind == "mistral":  # the "bos" tokenizer with MISTRAL_TEMPLATE
        assert t.bos_token == "<|begin_of_text|>" and t.eos_token == "<|end_of_text|>"
        ids = t("hello world").input_ids
        assert ids[0] == t.bos_token_id and ids[1:] == t("hello world", add_special_tokens=False).input_ids
        s = t.apply_chat_template(
            [{"role": "system", "content": "Be brief."}] + msgs + [{"role": "user", "content": "Bye"}],
            tokenize=False,
            add_generation_prompt=True,
        )
        want = "<|begin_of_text|>[INST] Be brief.\n\nHi[/INST] Hello<|end_of_text|>[INST] Bye[/INST]"
        assert s == want, s
        expect_template_errors(t, [
            ([{"role": "assistant", "content": "x"}], "must alternate"),
            (msgs + [{"role": "assistant", "content": "x"}], "must alternate"),
            ([{"role": "tool", "content": "x"}, {"role": "user", "content": "x"}], "must alternate"),
            (msgs + [{"role": "system", "content": "x"}], "must alternate"),
        ])
    else:
        assert t.bos_token == "<|begin_of_text|>" and t.eos_token == "<|end_of_text|>"
        ids = t("hello world").input_ids
        assert ids[0] == t.bos_token_id and ids[1:] == t("hello world", add_special_tokens=False).input_ids
        s = t.apply_chat_template(
            [{"role": "system", "content": "  Be brief. "}] + msgs, tokenize=False, add_generation_prompt=True
        )
        want = (
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\nHello<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n"
        )
        assert s == want, s
        expect_template_errors(t, [
            ([{"role": "tool", "content": "x"}], "Unknown role"),
            (msgs + [{"role": "system", "content": "x"}], "must come first"),
        ])
    # special tokens are single ids and decode back; round trip of non-ASCII text
    text = "Grüße, naïve café — 東京!"
    assert t.decode(t(text, add_special_tokens=False).input_ids) == text
    return t


# --------------------------------------------------------------------------------------
# Datasets
# --------------------------------------------------------------------------------------

TEXT_ROWS = [
    {"text": "The fox and the dog."},
    {"text": "Grüße aus Köln!"},
    {
        "text": "Once upon a time there was a small robot that loved to read books about the sea "
        "and the stars over the quiet mountains."
    },
    {"text": "Line one.\nLine\ttwo."},
]

PC_ROWS = [
    {"prompt": "What is the capital of France?\n", "completion": "Paris."},
    {"prompt": "French for coffee?\n", "completion": "Café."},
    {
        "prompt": "Read the story and answer. Once upon a time there was a small robot that loved "
        "to read books about the sea. Question:",
        "completion": " The sea.",
    },
]

MSG_ROWS = [
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"},
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "Hi!"},
            {"role": "assistant", "content": "Ça va?"},
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "The fox?"},
            {"role": "assistant", "content": "  Quick and brown. "},
        ]
    },
]

DATASETS = {"text": TEXT_ROWS, "prompt_completion": PC_ROWS, "messages": MSG_ROWS}


def write_jsonl(path: Path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def write_json(path: Path, obj):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, ensure_ascii=False, indent=2)
        f.write("\n")


# --------------------------------------------------------------------------------------
# Tokenization rules (mirror of the Rust pipeline)
# --------------------------------------------------------------------------------------

NOTES = []  # prefix-consistency observations, printed at the end


def _with_eos(tok, ids):
    if ADD_EOS and (not ids or ids[-1] != tok.eos_token_id):
        ids = ids + [tok.eos_token_id]
    return ids


def encode_text(tok, row):
    ids = _with_eos(tok, tok(row["text"], add_special_tokens=True).input_ids)
    return ids, [i >= 1 for i in range(len(ids))]


def encode_prompt_completion(tok, row):
    ids = _with_eos(tok, tok(row["prompt"] + row["completion"], add_special_tokens=True).input_ids)
    p_ids = tok(row["prompt"], add_special_tokens=True).input_ids
    if ids[: len(p_ids)] != p_ids:
        NOTES.append(f"prompt tokens are not a prefix of prompt+completion tokens: {row}")
    p = len(p_ids)
    return ids, [i >= p and i >= 1 for i in range(len(ids))]


def encode_messages(tok, row):
    msgs = row["messages"]
    full = tok.apply_chat_template(msgs, tokenize=False)
    ids = tok(full, add_special_tokens=False).input_ids
    targets = [False] * len(ids)
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        pre = tok(
            tok.apply_chat_template(msgs[:i], tokenize=False, add_generation_prompt=True),
            add_special_tokens=False,
        ).input_ids
        upto = tok(tok.apply_chat_template(msgs[: i + 1], tokenize=False), add_special_tokens=False).input_ids
        if ids[: len(pre)] != pre or ids[: len(upto)] != upto:
            NOTES.append(f"chat prefix tokens are not a prefix of the full tokens: {msgs[: i + 1]}")
        for k in range(len(pre), len(upto)):
            targets[k] = True
    if targets:
        targets[0] = False
    return ids, targets, full


class TemplateRefused(Exception):
    """The chat template raised on a row (Gemma 2 has no system role): transformers refuses the
    whole messages file, and so does tallow."""


def build_rows(tok, fmt):
    if fmt == "messages":
        for row in DATASETS[fmt]:
            try:
                tok.apply_chat_template(row["messages"], tokenize=False)
            except Exception as e:  # jinja2 TemplateError from raise_exception
                raise TemplateRefused(str(e)) from e
    rows, source_rows, rendered, skipped = [], [], [], 0
    for idx, row in enumerate(DATASETS[fmt]):
        if fmt == "text":
            ids, tg = encode_text(tok, row)
        elif fmt == "prompt_completion":
            ids, tg = encode_prompt_completion(tok, row)
        else:
            ids, tg, full = encode_messages(tok, row)
            rendered.append(full)
        ids, tg = ids[:MAX_SEQ_LEN], tg[:MAX_SEQ_LEN]
        if not any(tg):
            skipped += 1
            continue
        rows.append({"ids": ids, "targets": tg})
        source_rows.append(idx)
    return rows, source_rows, rendered, skipped


# --------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------


def randomize(model, gen):
    """Make norms and biases matter: RMSNorm weights 1 + 0.2*randn, biases 0.1*randn."""
    with torch.no_grad():
        for name, mod in model.named_modules():
            if "RMSNorm" in type(mod).__name__:
                w = mod.weight
                w.copy_(1.0 + 0.2 * torch.randn(w.shape, generator=gen, dtype=torch.float32))
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen, dtype=torch.float32))


def make_config(name, tok):
    v = len(tok)
    common = dict(
        vocab_size=v,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.1,
        hidden_act="silu",
        attention_dropout=0.0,
        dtype="float32",
    )
    if name == "tiny-llama":
        return LlamaConfig(
            intermediate_size=128,
            tie_word_embeddings=False,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                # 64 rather than 32: with head_dim 16 and theta 5e5 the per-pair wavelengths are
                # 6.3, 32.3, 167, ...; with 64 the low/high thresholds are 64/16, so all three
                # llama3 branches (kept, smoothed, divided by factor) are exercised.
                "original_max_position_embeddings": 64,
            },
            rms_norm_eps=1e-5,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            attention_bias=False,
            mlp_bias=False,
            **common,
        )
    # what tiny-qwen2 and tiny-qwen3 share
    qwen = dict(
        tie_word_embeddings=True,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        use_sliding_window=False,
        max_window_layers=2,
        # as in Qwen2.5-*-Instruct: config bos = <|endoftext|>, although the tokenizer adds no BOS
        bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tok.eos_token_id,
        **common,
    )
    if name == "tiny-qwen2":
        return Qwen2Config(intermediate_size=160, **qwen)
    if name == "tiny-qwen3":
        return Qwen3Config(intermediate_size=128, head_dim=32, attention_bias=False, **qwen)
    if name == "tiny-gemma2":
        return Gemma2Config(
            vocab_size=v,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,  # layer_types: sliding, full, sliding, full
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,  # != hidden_size / heads (16), as Gemma's 256
            query_pre_attn_scalar=64,  # scale 1/8, not head_dim ** -0.5
            max_position_embeddings=256,
            initializer_range=0.1,
            # as Google's config.json: both keys, transformers reads hidden_activation only
            hidden_act="gelu_pytorch_tanh",
            hidden_activation="gelu_pytorch_tanh",
            attention_dropout=0.0,
            dtype="float32",
            tie_word_embeddings=True,
            rope_theta=10000.0,
            rms_norm_eps=1e-6,
            sliding_window=8,  # shorter than the fixture rows
            attn_logit_softcapping=2.0,  # low: the scaled q/k (randomize_gemma2) pass it
            final_logit_softcapping=4.0,  # low: the larger final norm passes it
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
    if name == "tiny-gemma3":
        return Gemma3TextConfig(
            vocab_size=v,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=6,
            # layer i global when (i + 1) % 3 == 0: layers 2 and 5 global, the others slide
            sliding_window_pattern=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,  # != hidden_size / heads (16), as Gemma's 256
            query_pre_attn_scalar=48,  # scale 48 ** -0.5, not head_dim ** -0.5
            max_position_embeddings=256,
            initializer_range=0.1,
            hidden_activation="gelu_pytorch_tanh",
            attention_dropout=0.0,
            dtype="float32",
            tie_word_embeddings=True,
            # global layers: base 1e5 with linear scaling (as the 4B's factor 8); sliding
            # layers: their own base, unscaled
            rope_theta=100000.0,
            rope_scaling={"rope_type": "linear", "factor": 4.0},
            rope_local_base_freq=1000.0,
            rms_norm_eps=1e-6,
            sliding_window=8,  # shorter than the fixture rows
            attn_logit_softcapping=None,
            final_logit_softcapping=None,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
    if name == "tiny-mistral":
        return MistralConfig(
            intermediate_size=128,
            tie_word_embeddings=False,
            rope_theta=10000.0,
            rms_norm_eps=1e-5,
            # shorter than the fixture rows (up to MAX_SEQ_LEN = 32 tokens), so the window matters
            sliding_window=8,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            **common,
        )
    if name == "tiny-phi3":
        hd = common["hidden_size"] // common["num_attention_heads"]  # 16; 8 rotary dims
        rng = np.random.default_rng(SEED)
        return Phi3Config(
            intermediate_size=96,
            tie_word_embeddings=False,
            rope_theta=10000.0,
            rms_norm_eps=1e-5,
            # partial rotary: 8 of each head's 16 dims rotate
            partial_rotary_factor=0.5,
            # rows longer than 16 tokens use the long factors, shorter ones the short: both
            # tables and the attention factor sqrt(1 + ln(256 / 16) / ln(16)) = sqrt(2) are
            # exercised
            original_max_position_embeddings=16,
            rope_scaling={
                "type": "longrope",
                "short_factor": [round(float(x), 3) for x in 1.0 + 0.5 * rng.random(hd // 4)],
                "long_factor": [round(float(x), 3) for x in 2.0 + 6.0 * rng.random(hd // 4)],
            },
            sliding_window=None,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            bos_token_id=None,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            **common,
        )
    raise ValueError(name)


def randomize_gemma2(model, gen):
    """Make tiny-gemma2's soft-caps bite: q/k weights x1.5 (attention scores well past the cap
    of 2), the final norm's (1 + w) around 4 (logits past the cap of 4). Returns the fractions of
    scores and logits beyond their caps on a text row (checked > 10%)."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(1.5)
            layer.self_attn.k_proj.weight.mul_(1.5)
        w = model.model.norm.weight
        w.copy_(3.0 + 0.5 * torch.randn(w.shape, generator=gen, dtype=torch.float32))


def gemma2_cap_fractions(model, ids):
    """Fractions of pre-cap attention scores (every layer, causal entries) and logits beyond the
    caps for one row."""
    cfg = model.config
    seen = {"scores": [], "logits": None}
    hooks = []
    for layer in model.model.layers:
        def hook(mod, args, kwargs, out, attn=layer.self_attn):
            h = kwargs["hidden_states"]
            cos, sin = kwargs["position_embeddings"]
            from transformers.models.gemma2.modeling_gemma2 import apply_rotary_pos_emb, repeat_kv
            shape = (*h.shape[:-1], -1, attn.head_dim)
            q = attn.q_proj(h).view(shape).transpose(1, 2)
            k = attn.k_proj(h).view(shape).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            k = repeat_kv(k, attn.num_key_value_groups)
            s = (q @ k.transpose(2, 3)) * attn.scaling
            t = s.shape[-1]
            causal = torch.tril(torch.ones(t, t, dtype=torch.bool))
            seen["scores"].append(s[..., causal].abs().flatten())
        hooks.append(layer.self_attn.register_forward_hook(hook, with_kwargs=True))
    with torch.no_grad():
        hidden = model.model(input_ids=torch.tensor([ids])).last_hidden_state
        raw = model.lm_head(hidden)
    for h in hooks:
        h.remove()
    scores = torch.cat(seen["scores"])
    return {
        "scores_over_cap": float((scores > cfg.attn_logit_softcapping).float().mean()),
        "logits_over_cap": float((raw.abs() > cfg.final_logit_softcapping).float().mean()),
    }


def check_llama3_rope_bands(cfg):
    rs = cfg.rope_scaling
    hd = cfg.hidden_size // cfg.num_attention_heads
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, hd, 2) / hd))
    wl = 2 * np.pi / inv
    lo = rs["original_max_position_embeddings"] / rs["low_freq_factor"]
    hi = rs["original_max_position_embeddings"] / rs["high_freq_factor"]
    bands = {"kept": int((wl < hi).sum()), "scaled": int((wl > lo).sum())}
    bands["smoothed"] = len(wl) - bands["kept"] - bands["scaled"]
    assert all(n > 0 for n in bands.values()), bands
    return bands


def shard_keys(model_dir: Path):
    keys = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        for k in load_file(str(f)).keys():
            keys[k] = f.name
    return keys


def build_model(name, tok_kind, tok_dir: Path):
    out = FIX / "models" / name
    out.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    cfg = make_config(name, tok)
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    gen = torch.Generator().manual_seed(SEED + 1)
    randomize(model, gen)
    if name == "tiny-gemma2":
        randomize_gemma2(model, gen)
    if name in ("tiny-gemma2", "tiny-gemma3"):
        # as google/gemma-2-2b-it's and gemma-3-1b-it's generation_config.json: <eos> and
        # <end_of_turn> stop
        model.generation_config.eos_token_id = [tok.eos_token_id, tok.convert_tokens_to_ids("<end_of_turn>")]
    model.eval()
    extra = {}
    if name == "tiny-llama":
        extra["rope_bands"] = check_llama3_rope_bands(cfg)
        total = sum(p.numel() * p.element_size() for p in model.parameters())
        # ~60% of the weights per shard -> exactly two shards (largest tensor << 40%).
        model.save_pretrained(str(out), safe_serialization=True, max_shard_size=int(total * 0.6))
        files = sorted(p.name for p in out.glob("*.safetensors"))
        assert len(files) == 2, files
        assert (out / "model.safetensors.index.json").exists()
    else:
        model.save_pretrained(str(out), safe_serialization=True)
        assert (out / "model.safetensors").exists()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok_dir / f, out / f)
    if name == "tiny-qwen3":
        # Newer transformers saves the template as chat_template.jinja; mimic that layout.
        tc = json.loads((out / "tokenizer_config.json").read_text(encoding="utf-8"))
        template = tc.pop("chat_template")
        write_json(out / "tokenizer_config.json", tc)
        (out / "chat_template.jinja").write_text(template, encoding="utf-8")
        t2 = AutoTokenizer.from_pretrained(str(out))
        assert t2.chat_template == template, "chat_template.jinja not picked up"
    if name == "tiny-phi3":
        # fused projections, as Phi3ForCausalLM names them
        keys = set(model.state_dict())
        assert "model.layers.0.self_attn.qkv_proj.weight" in keys, keys
        assert "model.layers.0.mlp.gate_up_proj.weight" in keys, keys
    if name == "tiny-mistral":
        # the "bos" tokenizer with Mistral's chat template, in tokenizer_config.json (as Mistral's)
        tc = json.loads((out / "tokenizer_config.json").read_text(encoding="utf-8"))
        tc["chat_template"] = MISTRAL_TEMPLATE
        write_json(out / "tokenizer_config.json", tc)
    if name == "tiny-gemma3":
        # the "gemma" tokenizer with Gemma 3's chat template
        tc = json.loads((out / "tokenizer_config.json").read_text(encoding="utf-8"))
        tc["chat_template"] = GEMMA3_TEMPLATE
        write_json(out / "tokenizer_config.json", tc)
        keys = set(model.state_dict())
        assert "model.layers.0.self_attn.q_norm.weight" in keys, keys
    # config.json is transformers' own; sanity-check a few fields
    c = json.loads((out / "config.json").read_text())
    assert c["vocab_size"] == len(tok)
    if name in ("tiny-gemma2", "tiny-gemma3"):
        # left out: Gemma2Config's / Gemma3TextConfig's default (True) equals
        # PretrainedConfig's, so save_pretrained drops it (tallow must default to tied)
        assert "tie_word_embeddings" not in c, c
    else:
        assert c["tie_word_embeddings"] == (name not in ("tiny-llama", "tiny-mistral", "tiny-phi3"))
    if name == "tiny-mistral":
        assert c["sliding_window"] == 8 and c["sliding_window"] < MAX_SEQ_LEN, c
    if name == "tiny-gemma2":
        assert c["sliding_window"] == 8 and c["sliding_window"] < MAX_SEQ_LEN, c
        assert c["layer_types"] == ["sliding_attention", "full_attention"] * 2, c
        assert c["head_dim"] * c["num_attention_heads"] != c["hidden_size"], c
        ids = tok(" ".join(r["text"] for r in TEXT_ROWS)).input_ids[:MAX_SEQ_LEN]
        extra["caps"] = gemma2_cap_fractions(model, ids)
        assert all(f > 0.1 for f in extra["caps"].values()), extra
    if name == "tiny-gemma3":
        assert c["architectures"] == ["Gemma3ForCausalLM"] and c["model_type"] == "gemma3_text", c
        assert c["sliding_window"] == 8 and c["sliding_window"] < MAX_SEQ_LEN, c
        assert c["sliding_window_pattern"] == 3, c
        want = ["sliding_attention", "sliding_attention", "full_attention"] * 2
        assert c["layer_types"] == want, c
        assert c["rope_local_base_freq"] == 1000.0 and c["rope_theta"] == 100000.0, c
        assert c["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}, c
        assert c["head_dim"] * c["num_attention_heads"] != c["hidden_size"], c
    # the saved weights reload to the same values
    ref = {k: v.detach().clone() for k, v in model.state_dict().items()}
    m2 = load_model(out)
    for k, v in m2.state_dict().items():
        assert torch.equal(v, ref[k]), k
    return out, extra


def load_model(model_dir: Path, dtype=torch.float32):
    m = AutoModelForCausalLM.from_pretrained(str(model_dir), attn_implementation="eager", dtype=dtype)
    m.eval()
    return m


def row_nll(model, ids, targets):
    """Returns (nll float64 tensor (with grad if enabled), logits f32 (T, V))."""
    x = torch.tensor([ids], dtype=torch.long)
    logits = model(input_ids=x, use_cache=False).logits[0].float()
    lp = torch.log_softmax(logits.double(), dim=-1)
    pos = [i for i, t in enumerate(targets) if t and i >= 1]
    idx_prev = torch.tensor([i - 1 for i in pos], dtype=torch.long)
    idx_tok = torch.tensor([ids[i] for i in pos], dtype=torch.long)
    nll = -lp[idx_prev, idx_tok].sum()
    return nll, logits


def make_reference(name, model_dir: Path):
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    m32 = load_model(model_dir)
    mbf = load_model(model_dir).to(torch.bfloat16)
    ref = {
        "versions": VERSIONS,
        "model": name,
        "max_seq_len": MAX_SEQ_LEN,
        "add_eos": ADD_EOS,
        "vocab_size": len(tok),
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "formats": {},
        "rendered": {},
    }
    tensors = {}
    for fmt in DATASETS:
        try:
            rows, source_rows, rendered, skipped = build_rows(tok, fmt)
        except TemplateRefused as e:
            ref["template_errors"] = {fmt: str(e)}
            continue
        nlls, ns, nlls_bf = [], [], []
        with torch.no_grad():
            for k, r in enumerate(rows):
                nll, logits = row_nll(m32, r["ids"], r["targets"])
                tensors[f"{fmt}.{k}.logits"] = logits.contiguous()
                nlls.append(nll.item())
                ns.append(sum(r["targets"]))
                nll_bf, _ = row_nll(mbf, r["ids"], r["targets"])
                nlls_bf.append(nll_bf.item())
        ref["formats"][fmt] = {
            "rows": rows,
            "source_rows": source_rows,
            "nll_sum": nlls,
            "n_targets": ns,
            "skipped": skipped,
            "loss": sum(nlls) / sum(ns),
            "loss_bf16": sum(nlls_bf) / sum(ns),
        }
        if fmt == "messages":
            ref["rendered"]["messages"] = rendered

    # Gradients of the token-weighted text loss w.r.t. every parameter.
    for p in m32.parameters():
        p.requires_grad_(True)
        p.grad = None
    text_rows = ref["formats"]["text"]["rows"]
    total_nll = sum(row_nll(m32, r["ids"], r["targets"])[0] for r in text_rows)
    n_tot = sum(sum(r["targets"]) for r in text_rows)
    loss = total_nll / n_tot
    loss.backward()
    ref["grad_loss"] = loss.item()
    keys = shard_keys(model_dir)
    grad_names = []
    for pname, p in m32.named_parameters():  # tied lm_head is deduplicated here
        assert p.grad is not None, pname
        tensors[f"grad.{pname}"] = p.grad.detach().float().contiguous()
        grad_names.append(pname)
    assert set(grad_names) == set(keys), (set(grad_names) ^ set(keys))

    out_dir = FIX / "reference"
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / f"{name}.json", ref)
    save_file(tensors, str(out_dir / f"{name}.safetensors"), metadata={"format": "pt"})
    return ref


# --------------------------------------------------------------------------------------


README = """# tallow test fixtures (generated; do not edit by hand)

Regenerate with `/work/pyref/bin/python scripts/make_fixtures.py`
(or any venv with `pip install -r scripts/requirements-fixtures.txt`).
See the docstring of scripts/make_fixtures.py for layout, tokenization rules and the
definition of every reference value.

Models: `tiny-llama`, `tiny-qwen2`, `tiny-qwen3`, `tiny-mistral` (MistralForCausalLM with
`sliding_window` 8, shorter than the 32-token rows, and the "bos" tokenizer with a Mistral
`[INST]` chat template), `tiny-gemma2` (Gemma2ForCausalLM: 4 layers, the even ones sliding
with window 8, head_dim 32 != hidden/heads, query_pre_attn_scalar 64, soft-caps low enough to
be hit (attention 2 with q/k scaled up, logits 4), random (1 + w) norms, the "gemma" tokenizer
with Gemma 2's chat template, which has no system role: `reference/tiny-gemma2.json` has no
`messages` format, and `template_errors.messages` keeps transformers' error), `tiny-phi3`
(Phi3ForCausalLM: fused `qkv_proj` / `gate_up_proj`, `longrope` with
`original_max_position_embeddings` 16 so rows over 16 tokens use the long factors,
`partial_rotary_factor` 0.5, the "phi3" tokenizer with Phi-3's `<|user|>` chat template;
tiny-gemma2 and tiny-phi3 were each made as the fifth model of the lists, on parallel branches:
regenerating both in today's order may give tiny-phi3 other random weights) and `tiny-gemma3`
(Gemma3ForCausalLM: 6 layers, `sliding_window_pattern` 3 so layers 2 and 5 are global and the
others slide with window 8, q/k norms, local rope base 1000 on the sliding layers and base 1e5
with linear scaling 4 on the global ones, query_pre_attn_scalar 48, head_dim 32, random (1 + w)
norms, the "gemma" tokenizer with Gemma 3's chat template, which folds a system message into
the first user turn). New models go at the end of each script's model list, so the seeds of
the others do not move.

`models/tiny-gemma3-mm/` (and `v5/models/tiny-gemma3-mm/`) is an image-text
Gemma3ForConditionalGeneration whose language model is tiny-gemma3 (a tiny SigLIP vision tower
beside it), `adapters/tiny-gemma3-mm-peft/` a PEFT adapter on its language model, and
`reference/tiny-gemma3-mm.json` what transformers and PEFT compute on it
(`scripts/make_gemma3_mm_fixtures.py`, after the models above).

`reference/generate.json` (transformers' greedy `generate` ids for `tallow generate`) is made by
`/work/pyref/bin/python scripts/make_generate_fixtures.py`, after the models above.

`v5/` holds the same models saved by transformers 5.x (its `config.json` layout:
`rope_parameters`, `dtype`) and what transformers 5 + PEFT 0.21 compute on them
(`scripts/make_v5_fixtures.py`, venv from `scripts/requirements-fixtures-v5.txt`).
`reference/config-keys.json` is every key of each family's config class under both
transformers versions (`scripts/make_config_key_fixtures.py`, run in each venv);
`reference/saved-models.json` the losses both versions compute on models tallow merged or
fully fine-tuned (`scripts/make_saved_model_fixtures.py`).

## tensorboard/

`events.out.tfevents.0.fixture.tallow` is written by tallow's TensorBoard writer (fixed steps,
values and wall times; `TALLOW_REGEN_TB=1 cargo test -p tallow-trainer --lib tensorboard`);
`tensorboard.json` is what TensorBoard 2.20's `EventAccumulator` read from it
(`scripts/read_tensorboard_fixture.py`). The unit test asserts the writer still writes those
bytes and that the reader saw every scalar, step and wall time it was given.
"""


def main():
    for k, v in PINNED.items():
        if not VERSIONS[k].startswith(v):
            print(f"WARNING: {k} {VERSIONS[k]} != pinned {v}; fixtures may differ", file=sys.stderr)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    transformers.logging.set_verbosity_error()

    # Only what this script writes: the other scripts' fixtures (NF4, PEFT, generate, v5,
    # config keys, saved models, parquet) under the same folders are kept.
    models = ("tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mistral", "tiny-gemma2", "tiny-phi3", "tiny-gemma3")
    toks = ["tokenizers/chatml", "tokenizers/bos", "tokenizers/gemma", "tokenizers/phi3"]
    for sub in toks + [f"models/{m}" for m in models]:
        shutil.rmtree(FIX / sub, ignore_errors=True)
    for f in [f"data/{fmt}.jsonl" for fmt in DATASETS] + [
        f"reference/{m}.{ext}" for m in models for ext in ("json", "safetensors")
    ]:
        (FIX / f).unlink(missing_ok=True)
    FIX.mkdir(parents=True, exist_ok=True)
    (FIX / "README.md").write_text(README, encoding="utf-8")

    tok_dirs = {k: FIX / "tokenizers" / k for k in ("chatml", "bos", "gemma", "phi3")}
    build_chatml(tok_dirs["chatml"])
    build_bos(tok_dirs["bos"])
    build_gemma(tok_dirs["gemma"])
    build_phi3(tok_dirs["phi3"])
    for kind, d in tok_dirs.items():
        check_tokenizer(d, kind)

    for fmt, rows in DATASETS.items():
        write_jsonl(FIX / "data" / f"{fmt}.jsonl", rows)

    # (name, tokenizer, kind of check_tokenizer on the model dir)
    models_spec = [
        ("tiny-llama", "bos", "bos"),
        ("tiny-qwen2", "chatml", "chatml"),
        ("tiny-qwen3", "chatml", "chatml"),
        ("tiny-mistral", "bos", "mistral"),
        ("tiny-gemma2", "gemma", "gemma"),
        ("tiny-phi3", "phi3", "phi3"),
        ("tiny-gemma3", "gemma", "gemma3"),
    ]
    summary = []
    for name, kind, check in models_spec:
        mdir, extra = build_model(name, kind, tok_dirs[kind])
        check_tokenizer(mdir, check)
        ref = make_reference(name, mdir)
        summary.append((name, ref, extra))

    # ---- verify everything loads back -------------------------------------------------
    for name, ref, extra in summary:
        j = json.loads((FIX / "reference" / f"{name}.json").read_text(encoding="utf-8"))
        t = load_file(str(FIX / "reference" / f"{name}.safetensors"))
        for fmt, f in j["formats"].items():
            for k, r in enumerate(f["rows"]):
                lg = t[f"{fmt}.{k}.logits"]
                assert lg.shape == (len(r["ids"]), j["vocab_size"]) and lg.dtype == torch.float32
                assert len(r["ids"]) == len(r["targets"]) <= MAX_SEQ_LEN and not r["targets"][0]
        assert "grad_loss" in j

    # ---- summary ----------------------------------------------------------------------
    print("versions:", VERSIONS)
    for name, ref, extra in summary:
        print(f"\n{name}: vocab={ref['vocab_size']} bos={ref['bos_token_id']} eos={ref['eos_token_id']} {extra}")
        for fmt, f in ref["formats"].items():
            lens = [len(r["ids"]) for r in f["rows"]]
            print(
                f"  {fmt:18s} rows={len(f['rows'])} skipped={f['skipped']} lens={lens} "
                f"n_targets={f['n_targets']} loss={f['loss']:.6f} loss_bf16={f['loss_bf16']:.6f}"
            )
        print(f"  grad_loss={ref['grad_loss']:.6f}")
        if "--verbose" in sys.argv:
            t = AutoTokenizer.from_pretrained(str(FIX / "models" / name))
            for fmt, f in ref["formats"].items():
                for r in f["rows"]:
                    toks = t.convert_ids_to_tokens(r["ids"])
                    print("   ", fmt, " ".join(("*" if g else "") + x for x, g in zip(toks, r["targets"])))
    total = 0
    print()
    for p in sorted(FIX.rglob("*")):
        if p.is_file():
            sz = p.stat().st_size
            total += sz
            h = hashlib.sha256(p.read_bytes()).hexdigest()[:12]
            print(f"{sz:>9d}  {h}  {p.relative_to(REPO)}")
    print(f"{total:>9d}  total bytes")
    for n in NOTES:
        print("NOTE:", n)


if __name__ == "__main__":
    main()
