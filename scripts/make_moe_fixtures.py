#!/usr/bin/env python3
"""Mixture-of-experts reference fixtures from HF transformers (dev-only; issue 40).

Run from the repository root, first with transformers 4.57 (it makes the models), then 5.x:

    /work/pyref/bin/python scripts/make_moe_fixtures.py     (scripts/requirements-fixtures.txt)
    /work/pyref5/bin/python scripts/make_moe_fixtures.py    (scripts/requirements-fixtures-v5.txt)

transformers 4.57 writes, for tiny random Qwen3-MoE and Mixtral checkpoints:

    tests/fixtures/models/tiny-qwen3-moe/   Qwen3MoeForCausalLM, per-expert linears: 3 layers,
                                            8 experts, top 3, norm_topk_prob, mlp_only_layers
                                            [1] (layer 1 dense), head_dim 16 != hidden / heads,
                                            output_router_logits with coefficient 0.05; the
                                            "chatml" tokenizer of tiny-qwen3
    tests/fixtures/models/tiny-mixtral/     MixtralForCausalLM (`block_sparse_moe`, experts
                                            w1 / w3 / w2): 2 layers, 4 experts, top 2,
                                            sliding_window 8, output_router_logits with
                                            coefficient 0.05; the "bos" tokenizer of tiny-mistral
    tests/fixtures/models/tiny-qwen2-moe/   Qwen2MoeForCausalLM: 2 layers, 6 experts, top 2, no
                                            renormalization, a shared expert of 40 with its
                                            sigmoid gate, q/k/v bias, tied embeddings,
                                            output_router_logits with coefficient 0.05; the
                                            "chatml" tokenizer of tiny-qwen2
    tests/fixtures/reference/moe-<model>.json          the rows (text and messages rows of
                                            tiny-qwen3 / tiny-mistral's reference), each
                                            row's NLL sum and target count and its aux loss
                                            (the row alone), and a padded batch of every row:
                                            its CE, aux loss and total loss
    tests/fixtures/reference/moe-<model>.safetensors   "row.<k>.logits" (T, V) f32, and
                                            "grad.<key>" of the batch's total loss for every
                                            parameter (full fine-tuning; 4.57's names)

and, with transformers 4.57 and PEFT 0.17:

    tests/fixtures/adapters/tiny-<model>-peft/         LoRA r=4, alpha=8 on the attention's
                                            q, k, v, o and every expert's linears (Qwen3-MoE:
                                            gate_proj / up_proj / down_proj, which also hit
                                            layer 1's dense MLP; Mixtral: w1 / w3 / w2),
                                            A and B set to 0.2 randn, as PeftModel saves it
    tests/fixtures/reference/peft-moe-<model>.json     its text batch (the 4 text rows, one
                                            right-padded batch as `tallow train` makes it):
                                            CE, aux and total loss
    tests/fixtures/reference/peft-moe-<model>-sgd.safetensors  "after.<key>" of one plain SGD
                                            step (lr 0.5) on that total loss, and "grad.<key>"

and, with transformers 5 and PEFT 0.21, LoRA with `target_parameters` on the fused expert
tensors of the fused-layout models (PEFT's `ParamWrapper`; it takes no dropout):

    tests/fixtures/v5/adapters/tiny-<model>-peft-params/   r=4, alpha=8, A and B 0.2 randn:
                                            tiny-qwen3-moe: q/k/v/o + "mlp.experts.gate_up_proj"
                                            and "mlp.experts.down_proj" (nested wrappers: the
                                            gate_up adapter under `experts.base_layer.`);
                                            tiny-qwen2-moe: the seven Llama names (attention and
                                            the shared expert) + "mlp.experts.gate_up_proj";
                                            tiny-mixtral: q/k/v/o + "down_proj" (PEFT's suffix
                                            match)
    tests/fixtures/v5/reference/peft-moe-<model>.json and -sgd.safetensors   one SGD step of
                                            it on the text batch, as the 4.57 ones above

Each reference JSON also holds "generate": 8 greedy tokens (`generate(do_sample=False)`)
after the first messages row's prompt.

The router's coefficient is 0.05 rather than the default 0.001 so that the aux loss moves
the loss and the router's gradient well past the tests' tolerances.

transformers 5 reads the 4.57 checkpoints, computes the same references, and saves each model
with `save_original_format=False`: its own fused layout (`mlp.experts.gate_up_proj` (E, 2I, C),
`mlp.experts.down_proj` (E, C, I), Mixtral's `block_sparse_moe` renamed `mlp`) and its config
layout (`rope_parameters`):

    tests/fixtures/v5/models/tiny-{qwen3-moe,mixtral}/
    tests/fixtures/v5/reference/moe-<model>.json       as above, from transformers 5

Everything runs in f32 on the CPU, eager attention, one thread, fixed seeds.

Check mode: the eval loss (mean NLL over the text rows' targets, each row alone) of a PEFT
adapter, e.g. one `tallow train` wrote, on the fixture model, to compare with `tallow eval
--model tests/fixtures/models/<model> --adapter DIR --data tests/fixtures/data/text.jsonl
--max-seq-len 32 --dtype f32`. transformers 4.57 loads it with PEFT's `PeftModel`; transformers
5 with `load_adapter` on the fused-layout model of tests/fixtures/v5/models/:

    /work/pyref/bin/python scripts/make_moe_fixtures.py --check-adapter DIR --model tiny-mixtral
"""

import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
if __name__ == "__main__":
    from fixture_env import pin_hash_seed_and_go_offline

    pin_hash_seed_and_go_offline(__file__)

import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
FIX = REPO / "tests" / "fixtures"
V5 = transformers.__version__.startswith("5.")
SEED = 20261128
MODELS = {
    # name: (rows from this reference, tokenizer's model dir, config)
    "tiny-qwen3-moe": (
        "tiny-qwen3",
        "tiny-qwen3",
        dict(
            model_type="qwen3_moe",
            hidden_size=32,
            intermediate_size=48,
            moe_intermediate_size=24,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=3,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
            output_router_logits=True,
            router_aux_loss_coef=0.05,
            rope_theta=1e6,
            max_position_embeddings=256,
            initializer_range=0.1,
            tie_word_embeddings=False,
        ),
    ),
    "tiny-qwen2-moe": (
        "tiny-qwen2",
        "tiny-qwen2",
        dict(
            model_type="qwen2_moe",
            hidden_size=32,
            intermediate_size=48,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=40,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_experts=6,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            qkv_bias=True,
            output_router_logits=True,
            router_aux_loss_coef=0.05,
            rope_theta=1e6,
            max_position_embeddings=256,
            initializer_range=0.1,
            tie_word_embeddings=True,
        ),
    ),
    "tiny-mixtral": (
        "tiny-mistral",
        "tiny-mistral",
        dict(
            model_type="mixtral",
            hidden_size=32,
            intermediate_size=24,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=8,
            output_router_logits=True,
            router_aux_loss_coef=0.05,
            max_position_embeddings=256,
            initializer_range=0.1,
            tie_word_embeddings=False,
        ),
    ),
}


def rows_of(reference):
    ref = json.loads((FIX / "reference" / f"{reference}.json").read_text())
    rows = []
    for fmt in ("text", "messages"):
        rows += ref["formats"][fmt]["rows"]
    return ref, rows


def labels_of(ids, targets):
    return [i if t else -100 for i, t in zip(ids, targets)]


def make_model(name):
    reference, tok_model, cfg = MODELS[name]
    ref, _ = rows_of(reference)
    src = FIX / "models" / tok_model
    out = FIX / "models" / name
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    kind = cfg["model_type"]
    config = transformers.AutoConfig.for_model(
        kind,
        vocab_size=ref["vocab_size"],
        bos_token_id=ref["bos_token_id"],
        eos_token_id=ref["eos_token_id"],
        **{k: v for k, v in cfg.items() if k != "model_type"},
    )
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    gen = torch.Generator().manual_seed(SEED + 1)
    with torch.no_grad():
        # norms that matter: 1 + 0.2 randn, as scripts/make_fixtures.py
        for mname, mod in model.named_modules():
            if "RMSNorm" in type(mod).__name__:
                mod.weight.copy_(1.0 + 0.2 * torch.randn(mod.weight.shape, generator=gen))
        # and biases (Qwen2-MoE's q/k/v): 0.1 randn
        for pname, p in model.named_parameters():
            if pname.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(str(out), safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (src / f).exists():
            shutil.copy(src / f, out / f)


def references(name, model_dir):
    reference, _, cfg = MODELS[name]
    _, rows = rows_of(reference)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), attn_implementation="eager", dtype=torch.float32)
    model.eval()
    tensors = {}
    out_rows = []
    for k, r in enumerate(rows):
        ids = torch.tensor([r["ids"]])
        labels = torch.tensor([labels_of(r["ids"], r["targets"])])
        with torch.no_grad():
            o = model(input_ids=ids, labels=labels, output_router_logits=True)
        logits = o.logits[0].float()
        lp = torch.log_softmax(logits.double(), -1)
        nll = 0.0
        n = 0
        for i in range(1, len(r["ids"])):
            if r["targets"][i]:
                nll -= lp[i - 1, r["ids"][i]].item()
                n += 1
        out_rows.append(dict(ids=r["ids"], targets=r["targets"], nll_sum=nll, n_targets=n, aux=o.aux_loss.item()))
        tensors[f"row.{k}.logits"] = logits.contiguous()

    # One right-padded batch of every row: CE over its targets + coef * aux over its real tokens.
    pad = model.config.eos_token_id if isinstance(model.config.eos_token_id, int) else 0
    ids, mask, labels = padded(rows, pad)
    model.train()  # dropout is 0; Mixtral's jitter is 0
    for p in model.parameters():
        p.requires_grad_(True)
    model.zero_grad()
    o = model(input_ids=ids, attention_mask=mask, labels=labels, output_router_logits=True)
    o.loss.backward()
    coef = cfg["router_aux_loss_coef"]
    batch = dict(
        pad=pad,
        ce=o.loss.item() - coef * o.aux_loss.item(),
        aux=o.aux_loss.item(),
        loss=o.loss.item(),
        coef=coef,
    )
    if not V5:
        for pname, p in model.named_parameters():
            tensors[f"grad.{pname}"] = p.grad.detach().float().contiguous()
    model.eval()
    prompt = rows[-1]["ids"][:12]
    with torch.no_grad():
        gen = model.generate(
            torch.tensor([prompt]),
            do_sample=False,
            max_new_tokens=8,
            min_new_tokens=8,
            pad_token_id=pad,
            output_router_logits=False,  # 4.57 fails computing the aux loss of a cached step
        )[0, len(prompt):].tolist()
    return dict(
        versions={"torch": torch.__version__, "transformers": transformers.__version__},
        model=name,
        rows=out_rows,
        batch=batch,
        generate=dict(prompt=prompt, ids=gen),
    ), tensors


def padded(rows, pad):
    t = max(len(r["ids"]) for r in rows)
    ids = [r["ids"] + [pad] * (t - len(r["ids"])) for r in rows]
    mask = [[1] * len(r["ids"]) + [0] * (t - len(r["ids"])) for r in rows]
    labels = [labels_of(r["ids"], r["targets"]) + [-100] * (t - len(r["ids"])) for r in rows]
    return torch.tensor(ids), torch.tensor(mask), torch.tensor(labels)


def randomize_save_and_step(model, out, name, seed, ref, cfg):
    """Sets every LoRA tensor of the PeftModel `model` to 0.2 randn (seeded), saves it in `out`
    (`base_model_name_or_path` = `name`), then takes one plain SGD step (lr 0.5) on the text
    batch: ({"grad.<key>", "after.<key>"} tensors, the step's losses)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pn, p in model.named_parameters():
            if "lora_" in pn:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    if out.exists():
        shutil.rmtree(out)
    model.save_pretrained(str(out))
    (out / "README.md").unlink(missing_ok=True)
    cfg_path = out / "adapter_config.json"
    ac = json.loads(cfg_path.read_text())
    ac["base_model_name_or_path"] = name
    cfg_path.write_text(json.dumps(ac, indent=2, sort_keys=True) + "\n")
    ids, mask, labels = padded(ref["formats"]["text"]["rows"], ref["eos_token_id"])
    model.train()
    trainable = {pn: p for pn, p in model.named_parameters() if p.requires_grad}
    lr = 0.5
    opt = torch.optim.SGD(list(trainable.values()), lr=lr)
    opt.zero_grad()
    o = model(input_ids=ids, attention_mask=mask, labels=labels, output_router_logits=True)
    o.loss.backward()
    tensors = {}
    for pn, p in trainable.items():
        tensors[f"grad.{pn.replace('.default', '')}"] = p.grad.detach().float().clone().contiguous()
    opt.step()
    for pn, p in trainable.items():
        tensors[f"after.{pn.replace('.default', '')}"] = p.detach().float().clone().contiguous()
    coef = cfg["router_aux_loss_coef"]
    return tensors, dict(lr=lr, loss=o.loss.item(), aux=o.aux_loss.item(), ce=o.loss.item() - coef * o.aux_loss.item())


def peft_fixtures(name):
    """A LoRA adapter on attention and experts, and one SGD step of it on the text batch."""
    from peft import LoraConfig, get_peft_model

    reference, _, cfg = MODELS[name]
    ref, _ = rows_of(reference)
    experts = ["w1", "w3", "w2"] if cfg["model_type"] == "mixtral" else ["gate_proj", "up_proj", "down_proj"]
    model = AutoModelForCausalLM.from_pretrained(str(FIX / "models" / name), attn_implementation="eager", dtype=torch.float32)
    lcfg = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"] + experts,
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(model, lcfg)
    out = FIX / "adapters" / f"{name}-peft"
    tensors, sgd = randomize_save_and_step(model, out, name, SEED + 2, ref, cfg)
    (FIX / "reference" / f"peft-moe-{name}.json").write_text(
        json.dumps(dict(versions={"torch": torch.__version__, "transformers": transformers.__version__}, sgd=sgd), indent=1) + "\n"
    )
    save_file(tensors, str(FIX / "reference" / f"peft-moe-{name}-sgd.safetensors"))
    print(name, "peft", sgd)


# target_modules, target_parameters of each model's transformers 5 fixture
PARAMS = {
    "tiny-qwen3-moe": (["q_proj", "k_proj", "v_proj", "o_proj"], ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
    "tiny-qwen2-moe": (
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        ["mlp.experts.gate_up_proj"],
    ),
    "tiny-mixtral": (["q_proj", "k_proj", "v_proj", "o_proj"], ["down_proj"]),
}


def peft_params_fixtures(name):
    """transformers 5 + PEFT: LoRA on the fused expert tensors, and one SGD step of it."""
    from peft import LoraConfig, get_peft_model

    reference, _, cfg = MODELS[name]
    ref, _ = rows_of(reference)
    modules, params = PARAMS[name]
    model = AutoModelForCausalLM.from_pretrained(
        str(FIX / "v5" / "models" / name), attn_implementation="eager", dtype=torch.float32
    )
    lcfg = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=modules,
        target_parameters=params,
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(model, lcfg)
    out = FIX / "v5" / "adapters" / f"{name}-peft-params"
    tensors, sgd = randomize_save_and_step(model, out, name, SEED + 3, ref, cfg)
    import peft

    versions = {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__}
    (FIX / "v5" / "reference" / f"peft-moe-{name}.json").write_text(json.dumps(dict(versions=versions, sgd=sgd), indent=1) + "\n")
    save_file(tensors, str(FIX / "v5" / "reference" / f"peft-moe-{name}-sgd.safetensors"))
    print(name, "peft target_parameters", sgd)


def check_adapter(adapter, name):
    reference, _, _ = MODELS[name]
    _, rows = rows_of(reference)
    rows = rows[:4]  # the text rows
    if V5:
        model = AutoModelForCausalLM.from_pretrained(
            str(FIX / "v5" / "models" / name), attn_implementation="eager", dtype=torch.float32
        )
        # PEFT's ParamWrapper (the fused experts' LoRA in 5.x) refuses lora_dropout != 0,
        # which changes nothing in eval: a copy with 0
        import tempfile

        tmp = Path(tempfile.mkdtemp())
        for f in Path(adapter).iterdir():
            shutil.copy(f, tmp / f.name)
        cfg = json.loads((tmp / "adapter_config.json").read_text())
        cfg["lora_dropout"] = 0.0
        (tmp / "adapter_config.json").write_text(json.dumps(cfg))
        model.load_adapter(str(tmp))
    else:
        from peft import PeftModel

        base = AutoModelForCausalLM.from_pretrained(
            str(FIX / "models" / name), attn_implementation="eager", dtype=torch.float32
        )
        model = PeftModel.from_pretrained(base, adapter)
    model.eval()
    nll, n = 0.0, 0
    for r in rows:
        with torch.no_grad():
            lp = torch.log_softmax(model(input_ids=torch.tensor([r["ids"]])).logits[0].double(), -1)
        for i in range(1, len(r["ids"])):
            if r["targets"][i]:
                nll -= lp[i - 1, r["ids"][i]].item()
                n += 1
    print(f"{name} {adapter} transformers {transformers.__version__}: eval loss {nll / n:.9f}")


def main():
    if "--check-adapter" in sys.argv:
        args = sys.argv[1:]
        check_adapter(args[args.index("--check-adapter") + 1], args[args.index("--model") + 1])
        return
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    if "--only-params" in sys.argv:  # transformers 5: the target_parameters fixtures alone
        for name in MODELS:
            peft_params_fixtures(name)
        return
    for name in MODELS:
        if V5:
            ref, tensors = references(name, FIX / "models" / name)
            out = FIX / "v5" / "models" / name
            if out.exists():
                shutil.rmtree(out)
            model = AutoModelForCausalLM.from_pretrained(str(FIX / "models" / name), dtype=torch.float32)
            model.save_pretrained(str(out), save_original_format=False)
            for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
                if (FIX / "models" / name / f).exists():
                    shutil.copy(FIX / "models" / name / f, out / f)
            # the fused layout, read back by transformers 5, gives the same references
            ref2, _ = references(name, out)
            assert abs(ref2["batch"]["loss"] - ref["batch"]["loss"]) < 1e-6, (ref2["batch"], ref["batch"])
            (FIX / "v5" / "reference" / f"moe-{name}.json").write_text(json.dumps(ref, indent=1) + "\n")
            peft_params_fixtures(name)
        else:
            make_model(name)
            ref, tensors = references(name, FIX / "models" / name)
            (FIX / "reference" / f"moe-{name}.json").write_text(json.dumps(ref, indent=1) + "\n")
            save_file(tensors, str(FIX / "reference" / f"moe-{name}.safetensors"))
            peft_fixtures(name)
        print(name, ref["batch"])


if __name__ == "__main__":
    main()
