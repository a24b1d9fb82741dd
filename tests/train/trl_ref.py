"""Per-step TRL 0.29.1 references for kiln's trainers (tests/it/train.rs).

Builds a tiny random Llama (f32) with a byte-level tokenizer, an initial LoRA adapter, small
SFT / DPO datasets, trains each with TRL on the CPU for six steps from those exact starting
weights, and records every logged figure (loss, grad_norm, learning_rate, the task's metrics)
in reference.json. kiln trains from the same files and must reproduce the numbers.

    python3 -m venv venv && venv/bin/pip install -r tests/train/requirements.txt
    venv/bin/python tests/train/trl_ref.py            # rewrites tests/train/{tiny,data,reference.json}

Every run uses `train_sampling_strategy="sequential"` (transformers' option) so both sides see
the examples in file order; kiln's default is shuffled, like TRL's.
"""

import json
import os
import shutil
import sys
import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, TrainerCallback

HERE = os.path.dirname(os.path.abspath(__file__))
TINY = os.path.join(HERE, "tiny")
DATA = os.path.join(HERE, "data")


def byte_symbol(b):
    printable = lambda x: (33 <= x <= 126) or (0xA1 <= x <= 0xAC) or (0xAE <= x <= 0xFF)
    if printable(b):
        return chr(b)
    return chr(256 + sum(1 for x in range(b) if not printable(x)))


SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]

# The demo model's chat template (runtime/src/demo.rs), with TRL's `{% generation %}` marks.
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'assistant' %}<|assistant|>{% generation %}"
    "{{ m.content }}{{ eos_token }}{% endgeneration %}{% else %}<|{{ m.role }}|>{{ m.content }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def write_tokenizer(d):
    """The byte-level tokenizer kiln's demo model ships (runtime/src/demo.rs), written here
    independently: BPE with no merges, byte b = token 4 + b, a <s> before every sequence."""
    vocab = {t: i for i, t in enumerate(SPECIALS)}
    vocab.update({byte_symbol(b): 4 + b for b in range(256)})
    added = [
        {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}
        for i, t in enumerate(SPECIALS)
    ]
    tok = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": "<s>", "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}},
        },
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": False, "vocab": vocab, "merges": []},
    }
    with open(os.path.join(d, "tokenizer.json"), "w") as f:
        json.dump(tok, f, indent=2, ensure_ascii=False)
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>",
                   "model_max_length": 2048, "tokenizer_class": "PreTrainedTokenizerFast",
                   "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE}, f, indent=2)


def random_llama(model_dir, hidden=32, intermediate=64):
    """A seeded random Llama (f32) with the byte tokenizer in `model_dir`; the QLoRA references
    (qlora_ref.py) take a 64-wide one."""
    os.makedirs(model_dir)
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=260,
                      max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
                      bos_token_id=1, eos_token_id=2, pad_token_id=3)
    model = LlamaForCausalLM(cfg).float()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.2)
    model.save_pretrained(model_dir, safe_serialization=True)
    write_tokenizer(model_dir)
    return model_dir


def build_model():
    if os.path.isdir(TINY):
        shutil.rmtree(TINY)
    return random_llama(os.path.join(TINY, "model"))


def build_reward_model(model_dir):
    """The tiny model as a sequence classifier with one label (what TRL's RewardTrainer trains),
    its `score` head seeded here so that kiln starts from the same one, saved as transformers
    saves it (`LlamaForSequenceClassification`, no lm_head)."""
    from transformers import LlamaForSequenceClassification

    out = os.path.join(TINY, "reward-model")
    if os.path.isdir(out):
        shutil.rmtree(out)
    model = LlamaForSequenceClassification.from_pretrained(model_dir, num_labels=1, dtype=torch.float32)
    torch.manual_seed(2)
    with torch.no_grad():
        model.score.weight.normal_(0.0, 0.3)
    model.config.pad_token_id = 3
    model.save_pretrained(out, safe_serialization=True)
    write_tokenizer(out)
    return out


def build_teacher():
    """A wider random Llama with the same tokenizer: GKD's teacher."""
    out = os.path.join(TINY, "teacher")
    if os.path.isdir(out):
        shutil.rmtree(out)
    random_llama(out, hidden=64, intermediate=128)
    return out


def build_reward_adapter(reward_model):
    """An initial LoRA adapter of the reward model (PEFT's SEQ_CLS task: its `score` head
    trained in full, as `modules_to_save`), non-zero A and B."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForSequenceClassification

    torch.manual_seed(3)
    model = LlamaForSequenceClassification.from_pretrained(reward_model, dtype=torch.float32)
    cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"],
                     init_lora_weights=False, task_type="SEQ_CLS")
    peft_model = get_peft_model(model, cfg)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_" in n:
                p.normal_(0.0, 0.3)
    out = os.path.join(TINY, "reward-adapter")
    peft_model.save_pretrained(out)
    return out


def build_adapter(model_dir, out=None):
    """A shared initial LoRA adapter with non-zero A and B (init_lora_weights=False), so the
    first step already moves both."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"],
                     init_lora_weights=False, task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, cfg)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_" in n:
                p.normal_(0.0, 0.3)
    out = out or os.path.join(TINY, "init-adapter")
    peft_model.save_pretrained(out)
    return out


def write_data():
    os.makedirs(DATA, exist_ok=True)
    sft = [{"prompt": f"{a}+{b}=", "completion": str(a + b)} for a, b in
           [(1, 2), (3, 4), (5, 2), (7, 1), (2, 2), (6, 3), (4, 4), (9, 0), (8, 1), (0, 5), (3, 3), (1, 1)]]
    with open(os.path.join(DATA, "sft.jsonl"), "w") as f:
        for r in sft:
            f.write(json.dumps(r) + "\n")
    text = [{"text": f"the {w} is {c}"} for w, c in
            [("sky", "blue"), ("grass", "green"), ("sun", "bright"), ("night", "dark"), ("sea", "deep"), ("snow", "white")]]
    with open(os.path.join(DATA, "sft-text.jsonl"), "w") as f:
        for r in text:
            f.write(json.dumps(r) + "\n")
    dpo = [{"prompt": f"Q: {a}+{b}? A: ", "chosen": str(a + b), "rejected": str(a + b + 1 + (a % 3))}
           for a, b in [(1, 2), (3, 4), (5, 2), (7, 1), (2, 2), (6, 3), (4, 4), (9, 0), (8, 1), (0, 5), (3, 3), (1, 1)]]
    with open(os.path.join(DATA, "dpo.jsonl"), "w") as f:
        for r in dpo:
            f.write(json.dumps(r) + "\n")
    # Unpaired: each pair's chosen (desirable) and rejected (undesirable), interleaved unevenly.
    kto = []
    for i, r in enumerate(dpo):
        kto.append({"prompt": r["prompt"], "completion": r["chosen"], "label": True})
        if i % 3 != 0:
            kto.append({"prompt": r["prompt"], "completion": r["rejected"], "label": False})
    with open(os.path.join(DATA, "kto.jsonl"), "w") as f:
        for r in kto:
            f.write(json.dumps(r) + "\n")
    with open(os.path.join(DATA, "sft-chat.jsonl"), "w") as f:
        for r in sft[:8]:
            f.write(json.dumps({"messages": [{"role": "system", "content": "add"},
                                             {"role": "user", "content": r["prompt"]},
                                             {"role": "assistant", "content": r["completion"]}]}) + "\n")
    with open(os.path.join(DATA, "sft-chat-pc.jsonl"), "w") as f:
        for r in sft[:8]:
            f.write(json.dumps({"prompt": [{"role": "user", "content": r["prompt"]}],
                                "completion": [{"role": "assistant", "content": r["completion"]}]}) + "\n")
    with open(os.path.join(DATA, "dpo-chat.jsonl"), "w") as f:
        for r in dpo[:8]:
            f.write(json.dumps({"prompt": [{"role": "user", "content": r["prompt"]}],
                                "chosen": [{"role": "assistant", "content": r["chosen"]}],
                                "rejected": [{"role": "assistant", "content": r["rejected"]}]}) + "\n")
    # The prompt ends with the assistant's own words, so the template continues them (TRL's
    # continue_final_message), and a system turn goes first.
    with open(os.path.join(DATA, "pref-chat-continue.jsonl"), "w") as f:
        for r in dpo[:8]:
            f.write(json.dumps({"prompt": [{"role": "system", "content": "add"},
                                           {"role": "user", "content": r["prompt"]},
                                           {"role": "assistant", "content": "The sum is "}],
                                "chosen": [{"role": "assistant", "content": r["chosen"]}],
                                "rejected": [{"role": "assistant", "content": r["rejected"]}]}) + "\n")
    with open(os.path.join(DATA, "kto-chat.jsonl"), "w") as f:
        for r in kto[:10]:
            f.write(json.dumps({"prompt": [{"role": "user", "content": r["prompt"]}],
                                "completion": [{"role": "assistant", "content": r["completion"]}],
                                "label": r["label"]}) + "\n")
    # Raw text for pretraining: a `content` column, and a plain text file (one example per line).
    lines = ["In the beginning was the word.", "The quick brown fox jumps over the lazy dog.",
             "A stitch in time saves nine.", "All that glitters is not gold.", "",
             "Where there is smoke there is fire, and where there is fire there is heat."]
    with open(os.path.join(DATA, "pretrain.jsonl"), "w") as f:
        for l in lines:
            f.write(json.dumps({"content": l}) + "\n")
    with open(os.path.join(DATA, "pretrain.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    # Reward data with an implicit prompt (part of both sides) and a margin per pair.
    with open(os.path.join(DATA, "reward-margin.jsonl"), "w") as f:
        for i, r in enumerate(dpo):
            f.write(json.dumps({"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"],
                                "margin": 0.25 * (i % 4)}) + "\n")
    for name, rows in [("sft-eval.jsonl", [{"prompt": f"{a}+{b}=", "completion": str(a + b)}
                                             for a, b in [(2, 5), (6, 1), (3, 0), (4, 2)]]),
                       ("dpo-eval.jsonl", [{"prompt": f"Q: {a}+{b}? A: ", "chosen": str(a + b), "rejected": str(a + b + 2)}
                                           for a, b in [(2, 5), (6, 1), (3, 0), (4, 2)]]),
                       ("kto-eval.jsonl", [{"prompt": f"Q: {a}+{b}? A: ", "completion": str(a + b + k), "label": k == 0}
                                           for a, b in [(2, 5), (6, 1), (3, 0)] for k in (0, 1)])]:
        with open(os.path.join(DATA, name), "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    with open(os.path.join(DATA, "grpo-eval.jsonl"), "w") as f:
        for a, b in [(2, 5), (6, 1), (3, 0)]:
            f.write(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n")
    with open(os.path.join(DATA, "grpo.jsonl"), "w") as f:
        for a, b in [(1, 2), (3, 4), (5, 2), (7, 1), (2, 2), (6, 3), (4, 4), (9, 0), (8, 1), (0, 5)]:
            f.write(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n")


def exact_match(prompts, completions, answer, **kwargs):
    """kiln's built-in `exact_match`: 1 when the answer appears in the completion."""
    return [1.0 if str(a).strip() in c else 0.0 for a, c in zip(answer, completions)]


def count_digits(prompts, completions, **kwargs):
    """The `count_digits` reward tests/it/train.rs registers with #[reward]."""
    return [float(sum(ch.isdigit() for ch in c)) for c in completions]


class Record(TrainerCallback):
    def __init__(self):
        self.logs = []
        self.eval_logs = []

    def on_log(self, args, state, control, logs=None, **kw):
        if logs and ("loss" in logs or "objective/kl" in logs):
            self.logs.append({"step": state.global_step, **{k: float(v) for k, v in logs.items()}})
        elif logs and "eval_loss" in logs:
            self.eval_logs.append({"step": state.global_step, **{k: float(v) for k, v in logs.items()}})


def run(task, model_dir, data, adapter=None, **overrides):
    from datasets import load_dataset
    from peft import PeftModel

    # A plain text file is read as datasets' text loader reads it: one example per line.
    ds = load_dataset("text" if data.endswith(".txt") else "json", data_files=data, split="train")
    eval_file = overrides.pop("eval_data", None)
    if eval_file:
        overrides.update(eval_strategy="steps")
    eval_ds = load_dataset("json", data_files=eval_file, split="train") if eval_file else None
    tok = PreTrainedTokenizerFast.from_pretrained(model_dir)
    if task == "reward":
        from transformers import LlamaForSequenceClassification
        model = LlamaForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32)
    else:
        model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter:
        model = PeftModel.from_pretrained(model, adapter, is_trainable=True)
    common = dict(output_dir=tempfile.mkdtemp(), max_steps=6, logging_steps=1, bf16=False, use_cpu=True,
                  gradient_checkpointing=False, report_to=[], save_strategy="no", seed=42,
                  train_sampling_strategy="sequential", per_device_train_batch_size=2)
    common.update(overrides)
    rec = Record()
    if task == "pretrain":
        # kiln's pretrain: TRL's SFTTrainer on raw text, packed by default.
        task = "sft"
        common.setdefault("packing", True)
    if task == "sft":
        from trl import SFTConfig, SFTTrainer
        trainer = SFTTrainer(model=model, args=SFTConfig(**common), train_dataset=ds, eval_dataset=eval_ds, processing_class=tok,
                             callbacks=[rec])
    elif task == "dpo":
        from trl import DPOConfig, DPOTrainer
        trainer = DPOTrainer(model=model, args=DPOConfig(**common), train_dataset=ds, eval_dataset=eval_ds, processing_class=tok,
                             callbacks=[rec])
    elif task == "orpo":
        from trl.experimental.orpo import ORPOConfig, ORPOTrainer
        trainer = ORPOTrainer(model=model, args=ORPOConfig(**common), train_dataset=ds, processing_class=tok,
                              callbacks=[rec])
    elif task == "simpo":
        from trl.experimental.cpo import CPOConfig, CPOTrainer
        common.setdefault("loss_type", "simpo")
        trainer = CPOTrainer(model=model, args=CPOConfig(**common), train_dataset=ds, processing_class=tok,
                             callbacks=[rec])
    elif task == "grpo":
        from trl import GRPOConfig, GRPOTrainer
        funcs = {"exact_match": exact_match, "count_digits": count_digits}
        names = common.pop("reward_funcs")
        trainer = GRPOTrainer(model=model, args=GRPOConfig(**common), train_dataset=ds, eval_dataset=eval_ds,
                              processing_class=tok,
                              # A name not among the functions is a reward model's folder.
                              reward_funcs=[funcs.get(n) or os.path.join(HERE, n) for n in names],
                              callbacks=[rec])
        generated, eval_generated = [], []
        original = trainer._generate_single_turn

        def record(prompt_ids, images, multimodal_fields):
            out = original(prompt_ids, images, multimodal_fields)
            completions = [list(map(int, c)) for c in out[0]]
            if trainer.model.training:
                generated.append(completions)
            else:
                # Evaluation batches come in torch's shuffled order: kept with their prompts.
                eval_generated.append({"prompts": [list(map(int, p)) for p in prompt_ids],
                                       "completions": completions})
            return out

        trainer._generate_single_turn = record
        trainer.train()
        return ((rec.logs, rec.eval_logs) if eval_file else rec.logs), {"train": generated, "eval": eval_generated}
    elif task == "rloo":
        from trl import RLOOConfig, RLOOTrainer
        funcs = {"exact_match": exact_match, "count_digits": count_digits}
        names = common.pop("reward_funcs")
        trainer = RLOOTrainer(model=model, args=RLOOConfig(**common), train_dataset=ds, eval_dataset=eval_ds,
                              processing_class=tok,
                              reward_funcs=[funcs.get(n) or os.path.join(HERE, n) for n in names],
                              callbacks=[rec])
        generated = []
        original = trainer._generate_single_turn

        def record(prompt_ids, images, multimodal_fields):
            out = original(prompt_ids, images, multimodal_fields)
            generated.append([list(map(int, c)) for c in out])
            return out

        trainer._generate_single_turn = record
        trainer.train()
        return rec.logs, {"train": generated, "eval": []}
    elif task == "online_dpo":
        from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer
        funcs = {"exact_match": exact_match, "count_digits": count_digits}
        names = common.pop("reward_funcs")
        trainer = OnlineDPOTrainer(model=model, args=OnlineDPOConfig(**common), train_dataset=ds,
                                   processing_class=tok,
                                   reward_funcs=[funcs.get(n) or os.path.join(HERE, n) for n in names],
                                   callbacks=[rec])
        generated = []
        original = trainer._generate

        def record(model_, prompts, images=None):
            out = original(model_, prompts, images)
            ids, mask = out[2], out[3]
            rows = [[int(t) for t, m in zip(r, k) if m] for r, k in zip(ids.tolist(), mask.tolist())]
            b = len(rows) // 2
            # Per prompt its two samples (TRL's rows: every first sample, then every second).
            generated.append([rows[i + j * b] for i in range(b) for j in range(2)])
            return out

        trainer._generate = record
        trainer.train()
        return rec.logs, {"train": generated, "eval": []}
    elif task == "bco":
        from trl.experimental.bco import BCOConfig, BCOTrainer
        trainer = BCOTrainer(model=model, args=BCOConfig(**common), train_dataset=ds, eval_dataset=eval_ds,
                             processing_class=tok, callbacks=[rec])
    elif task == "distill":
        from trl.experimental.gkd import GKDConfig, GKDTrainer
        teacher = LlamaForCausalLM.from_pretrained(os.path.join(HERE, common.pop("teacher_model_name_or_path")),
                                                   dtype=torch.float32)
        trainer = GKDTrainer(model=model, teacher_model=teacher, args=GKDConfig(**common), train_dataset=ds,
                             eval_dataset=eval_ds, processing_class=tok, callbacks=[rec])
    elif task == "reward":
        from trl import RewardConfig, RewardTrainer
        trainer = RewardTrainer(model=model, args=RewardConfig(**common), train_dataset=ds, eval_dataset=eval_ds,
                                processing_class=tok, callbacks=[rec])
    elif task == "kto":
        from trl.experimental.kto import KTOConfig, KTOTrainer
        trainer = KTOTrainer(model=model, args=KTOConfig(**common), train_dataset=ds, eval_dataset=eval_ds, processing_class=tok,
                             callbacks=[rec])
    else:
        raise SystemExit(f"unknown task {task}")
    trainer.train()
    return (rec.logs, rec.eval_logs) if eval_file else rec.logs, None


def run_ppo(model_dir, data, adapter=None, **overrides):
    """TRL's PPOTrainer (trl.experimental.ppo) as its example script builds it: the policy and
    its frozen copy (under LoRA the base without the adapter), the reward model and a value
    model both from the reward model's folder, prompts tokenized as `tokenizer(prompt)` and
    left-padded. Records every update's figures, its prompts (dataset indices) and TRL's
    sampled responses, and the minibatch permutations numpy drew, for kiln to replay."""
    import numpy as np
    from datasets import load_dataset
    from peft import PeftModel
    from transformers import LlamaForSequenceClassification
    import trl.experimental.ppo.ppo_trainer as ppo_mod
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    ds = load_dataset("json", data_files=data, split="train")
    tok = PreTrainedTokenizerFast.from_pretrained(model_dir, padding_side="left")

    def ids(p):
        # Text: `tokenizer(prompt)`; a conversation: the template with the generation prompt,
        # as TRL's PPO example tokenizes its chat datasets.
        if isinstance(p, str):
            return tok(p)["input_ids"]
        r = tok.apply_chat_template(p, add_generation_prompt=True)
        return list(r["input_ids"] if hasattr(r, "keys") else r)

    prompts = [ids(p) for p in ds["prompt"]]
    train = ds.map(lambda e: {"input_ids": ids(e["prompt"])}, remove_columns=ds.column_names)
    policy = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter:
        policy = PeftModel.from_pretrained(policy, adapter, is_trainable=True)
    rm_dir = os.path.join(HERE, overrides.pop("reward_model_path"))
    reward = LlamaForSequenceClassification.from_pretrained(rm_dir, num_labels=1, dtype=torch.float32)
    value = LlamaForSequenceClassification.from_pretrained(rm_dir, num_labels=1, dtype=torch.float32)
    common = dict(output_dir=tempfile.mkdtemp(), logging_steps=1, bf16=False, use_cpu=True,
                  gradient_checkpointing=False, report_to=[], save_strategy="no", seed=42,
                  per_device_train_batch_size=2, num_sample_generations=0)
    common.update(overrides)
    rec = Record()
    trainer = PPOTrainer(args=PPOConfig(**common), processing_class=tok, model=policy,
                         ref_model=None if adapter else LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                         reward_model=reward, train_dataset=train, value_model=value, callbacks=[rec])
    updates = []
    original = ppo_mod.batch_generation

    def record(model, queries, *args):
        qr, logits = original(model, queries, *args)
        ctx = queries.shape[1]
        rows = [[int(t) for t in q if t != tok.pad_token_id] for q in queries.tolist()]
        updates.append({"prompts": [prompts.index(r) for r in rows],
                        "responses": qr[:, ctx:].tolist(), "permutations": []})
        return qr, logits

    ppo_mod.batch_generation = record
    np.random.seed(0)
    draw = np.random.permutation

    def permutation(n):
        p = draw(n)
        updates[-1]["permutations"].append([int(i) for i in p])
        return p

    ppo_mod.np.random.permutation = permutation
    try:
        trainer.train()
    finally:
        ppo_mod.batch_generation = original
        ppo_mod.np.random.permutation = draw
    return rec.logs, {"train": updates, "eval": []}


# PPO's stop token in "ppo-stop-k3": a byte the tiny model samples often, so that responses end
# at it (its EOS is one of 260 tokens and seldom drawn).
STOP = 4 + ord("E")


def write_ppo_data():
    """Prompts of different lengths (TRL left-pads them to the batch's longest)."""
    os.makedirs(DATA, exist_ok=True)
    prompts = ["1+2=", "Say hello", "3", "What is 7 times 6?", "abc", "Count: 1 2 3", "x=", "The end is near"]
    with open(os.path.join(DATA, "ppo.jsonl"), "w") as f:
        for p in prompts:
            f.write(json.dumps({"prompt": p}) + "\n")
    # The same prompts as conversations (some with a system turn).
    with open(os.path.join(DATA, "ppo-chat.jsonl"), "w") as f:
        for i, p in enumerate(prompts):
            turns = ([{"role": "system", "content": "be brief"}] if i % 2 else []) + [{"role": "user", "content": p}]
            f.write(json.dumps({"prompt": turns}) + "\n")


def dropout_adapter(adapter):
    """The shared adapter with lora_dropout 0.1: TRL's disable_dropout (on for DPO) must turn
    it off, so the run is deterministic and kiln's default must do the same."""
    out = os.path.join(TINY, "init-adapter-dropout")
    shutil.copytree(adapter, out, dirs_exist_ok=True)
    cfg_path = os.path.join(out, "adapter_config.json")
    cfg = json.load(open(cfg_path))
    cfg["lora_dropout"] = 0.1
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)
    return out


def main():
    only = sys.argv[1:]
    if only and os.path.isdir(os.path.join(TINY, "model")):
        # Some runs again: the same tiny model, adapter and data as the whole file's.
        model_dir, adapter = os.path.join(TINY, "model"), os.path.join(TINY, "init-adapter")
    else:
        model_dir = build_model()
        adapter = build_adapter(model_dir)
        write_data()
        build_reward_adapter(build_reward_model(model_dir))
        build_teacher()
    dropout = dropout_adapter(adapter)
    reward_model = os.path.join(TINY, "reward-model")
    if not os.path.isdir(reward_model):
        build_reward_model(model_dir)
    if not os.path.isdir(os.path.join(TINY, "teacher")):
        build_teacher()
    reward_adapter = os.path.join(TINY, "reward-adapter")
    if not os.path.isdir(reward_adapter):
        build_reward_adapter(reward_model)
    d = lambda n: os.path.join(DATA, n)
    if not os.path.exists(d("reward-margin.jsonl")) or not os.path.exists(d("pretrain.txt")):
        write_data()
    if not os.path.exists(d("ppo-chat.jsonl")):
        write_ppo_data()
    runs = {
        # PPO (TRL's experimental PPOTrainer) on its own samples: the reward model's folder as
        # reward and value model; a stop token with k3 KL, whitened rewards and the missing-EOS
        # penalty; minibatches under accumulation across an epoch's end (accelerate's
        # optimizer steps); LoRA on the policy (the value model in full).
        "ppo-rm": ("ppo", d("ppo.jsonl"), None, dict(
            learning_rate=1e-3, response_length=6, total_episodes=16, gradient_accumulation_steps=2,
            num_ppo_epochs=2, reward_model_path="tiny/reward-model")),
        "ppo-stop-k3": ("ppo", d("ppo.jsonl"), None, dict(
            learning_rate=1e-3, response_length=6, total_episodes=16, per_device_train_batch_size=4,
            gradient_accumulation_steps=2, stop_token_id=STOP, kl_estimator="k3", whiten_rewards=True,
            missing_eos_penalty=1.0, temperature=1.0, kl_coef=0.1, reward_model_path="tiny/reward-model")),
        "ppo-minibatches": ("ppo", d("ppo.jsonl"), None, dict(
            learning_rate=3e-3, response_length=5, total_episodes=24, gradient_accumulation_steps=2,
            num_mini_batches=2, num_ppo_epochs=2, cliprange=0.1, cliprange_value=0.05, vf_coef=0.5,
            gamma=0.9, lam=0.8, lr_scheduler_type="cosine", reward_model_path="tiny/reward-model")),
        "ppo-chat": ("ppo", d("ppo-chat.jsonl"), None, dict(
            learning_rate=1e-3, response_length=5, total_episodes=8, per_device_train_batch_size=4,
            num_ppo_epochs=2, reward_model_path="tiny/reward-model")),
        "ppo-lora": ("ppo", d("ppo.jsonl"), adapter, dict(
            learning_rate=1e-2, response_length=5, total_episodes=8, reward_model_path="tiny/reward-model")),
        "sft-full": ("sft", d("sft.jsonl"), None, dict(learning_rate=1e-3, gradient_accumulation_steps=2)),
        "sft-text": ("sft", d("sft-text.jsonl"), None, dict(learning_rate=1e-3, lr_scheduler_type="cosine",
                                                              warmup_steps=2, weight_decay=0.1)),
        "sft-lora": ("sft", d("sft.jsonl"), adapter, dict(learning_rate=1e-2)),
        # Mixed precision (TRL's bf16=True: torch's CPU autocast to bf16).
        "sft-bf16": ("sft", d("sft.jsonl"), None, dict(learning_rate=1e-3, gradient_accumulation_steps=2,
                                                        bf16=True)),
        "dpo-bf16": ("dpo", d("dpo.jsonl"), None, dict(learning_rate=1e-3, bf16=True)),
        "dpo-full": ("dpo", d("dpo.jsonl"), None, dict(learning_rate=1e-3)),
        "dpo-lora": ("dpo", d("dpo.jsonl"), adapter, dict(learning_rate=1e-2)),
        "dpo-ipo": ("dpo", d("dpo.jsonl"), None, dict(learning_rate=1e-3, loss_type=["ipo"], beta=0.5)),
        "dpo-hinge-precompute": ("dpo", d("dpo.jsonl"), None, dict(learning_rate=1e-3, loss_type=["hinge"],
                                                                   precompute_ref_log_probs=True)),
        # TRL 0.29.1's other DPO loss types, its f-divergences, LD-DPO, WPO and loss mixtures.
        "dpo-robust": ("dpo", d("dpo.jsonl"), None, dict(learning_rate=1e-3, loss_type=["robust"],
                                                         label_smoothing=0.1)),
        "dpo-exo-pair": ("dpo", d("dpo.jsonl"), None, dict(learning_rate=1e-3, loss_type=["exo_pair"],
                                                           label_smoothing=1e-3)),
        "dpo-nca-pair": ("dpo", d("dpo.jsonl"), None, dict(learning_rate=1e-3, loss_type=["nca_pair"])),
        "dpo-bco-pair": ("dpo", d("dpo.jsonl"), None, dict(learning_rate=1e-3, loss_type=["bco_pair"])),
        "dpo-sppo-hard": ("dpo", d("dpo.jsonl"), None, dict(learning_rate=1e-3, loss_type=["sppo_hard"], beta=0.5)),
        "dpo-aot": ("dpo", d("dpo.jsonl"), None, dict(learning_rate=1e-3, loss_type=["aot"], label_smoothing=0.1,
                                                      per_device_train_batch_size=4)),
        "dpo-aot-unpaired": ("dpo", d("dpo.jsonl"), None, dict(learning_rate=1e-3, loss_type=["aot_unpaired"],
                                                               per_device_train_batch_size=4)),
        "dpo-apo-zero": ("dpo", d("dpo.jsonl"), None, dict(learning_rate=1e-3, loss_type=["apo_zero"])),
        "dpo-apo-down": ("dpo", d("dpo.jsonl"), None, dict(learning_rate=1e-3, loss_type=["apo_down"])),
        "dpo-discopop": ("dpo", d("dpo.jsonl"), None, dict(learning_rate=1e-3, loss_type=["discopop"],
                                                           discopop_tau=0.1)),
        "dpo-sft": ("dpo", d("dpo.jsonl"), None, dict(learning_rate=1e-3, loss_type=["sft"])),
        "dpo-mix-weights": ("dpo", d("dpo.jsonl"), adapter, dict(learning_rate=1e-2, loss_type=["sigmoid", "sft"],
                                                                 loss_weights=[0.8, 0.2])),
        "dpo-forward-kl": ("dpo", d("dpo.jsonl"), None, dict(learning_rate=1e-3, f_divergence_type="forward_kl")),
        "dpo-js": ("dpo", d("dpo.jsonl"), None, dict(learning_rate=1e-3, f_divergence_type="js_divergence",
                                                     loss_type=["hinge"])),
        "dpo-alpha-div": ("dpo", d("dpo.jsonl"), None, dict(learning_rate=1e-3, f_divergence_type="alpha_divergence",
                                                            f_alpha_divergence_coef=0.3)),
        "dpo-ld-alpha": ("dpo", d("dpo.jsonl"), None, dict(learning_rate=1e-3, ld_alpha=0.5)),
        "dpo-wpo": ("dpo", d("dpo.jsonl"), None, dict(learning_rate=1e-3, use_weighting=True,
                                                      loss_type=["sigmoid", "ipo"], loss_weights=[1.0, 0.1])),
        "dpo-lora-dropout": ("dpo", d("dpo.jsonl"), dropout, dict(learning_rate=1e-2)),
        "sft-dft": ("sft", d("sft.jsonl"), None, dict(learning_rate=1e-3, loss_type="dft",
                                                       gradient_accumulation_steps=2)),
        "orpo-full": ("orpo", d("dpo.jsonl"), None, dict(learning_rate=1e-3)),
        "orpo-lora": ("orpo", d("dpo.jsonl"), adapter, dict(learning_rate=1e-2, gradient_accumulation_steps=2)),
        "simpo-full": ("simpo", d("dpo.jsonl"), None, dict(learning_rate=1e-3, beta=2.0, simpo_gamma=1.0)),
        "simpo-lora": ("simpo", d("dpo.jsonl"), adapter, dict(learning_rate=1e-2)),
        "cpo-sigmoid": ("simpo", d("dpo.jsonl"), None, dict(learning_rate=1e-3, loss_type="sigmoid",
                                                            label_smoothing=0.1, cpo_alpha=0.5)),
        "simpo-short": ("simpo", d("dpo.jsonl"), None, dict(learning_rate=1e-3, max_length=12, cpo_alpha=0.0)),
        "kto-full": ("kto", d("kto.jsonl"), None, dict(learning_rate=1e-3, per_device_train_batch_size=3)),
        "kto-lora": ("kto", d("kto.jsonl"), adapter, dict(learning_rate=1e-2, desirable_weight=1.5,
                                                          undesirable_weight=0.7)),
        "kto-apo-precompute": ("kto", d("kto.jsonl"), None, dict(learning_rate=1e-3, loss_type="apo_zero_unpaired",
                                                                 precompute_ref_log_probs=True,
                                                                 gradient_accumulation_steps=2)),
        "sft-messages": ("sft", d("sft-chat.jsonl"), None, dict(learning_rate=1e-3, assistant_only_loss=True)),
        "sft-chat-pc": ("sft", d("sft-chat-pc.jsonl"), adapter, dict(learning_rate=1e-2)),
        "dpo-chat": ("dpo", d("dpo-chat.jsonl"), None, dict(learning_rate=1e-3)),
        "orpo-chat": ("orpo", d("dpo-chat.jsonl"), adapter, dict(learning_rate=1e-2)),
        "simpo-chat-continue": ("simpo", d("pref-chat-continue.jsonl"), None, dict(learning_rate=1e-3)),
        "kto-chat": ("kto", d("kto-chat.jsonl"), None, dict(learning_rate=1e-3)),
        "kto-paired": ("kto", d("dpo.jsonl"), None, dict(learning_rate=1e-3, per_device_train_batch_size=4)),
        "sft-eval": ("sft", d("sft.jsonl"), None, dict(learning_rate=1e-3, eval_data=d("sft-eval.jsonl"),
                                                        eval_steps=3, per_device_eval_batch_size=3)),
        "dpo-eval": ("dpo", d("dpo.jsonl"), adapter, dict(learning_rate=1e-2, eval_data=d("dpo-eval.jsonl"),
                                                          eval_steps=2, per_device_eval_batch_size=3)),
        "kto-eval": ("kto", d("kto.jsonl"), None, dict(learning_rate=1e-3, eval_data=d("kto-eval.jsonl"),
                                                       eval_steps=3)),
        "grpo-dapo": ("grpo", d("grpo.jsonl"), None, dict(
            learning_rate=1e-3, num_generations=4, per_device_train_batch_size=8, max_completion_length=8,
            temperature=0.7, shuffle_dataset=False, reward_funcs=["exact_match", "count_digits"],
            reward_weights=[1.0, 0.5], max_steps=4)),
        "grpo-beta": ("grpo", d("grpo.jsonl"), None, dict(
            learning_rate=1e-3, num_generations=4, per_device_train_batch_size=4, max_completion_length=6,
            shuffle_dataset=False, reward_funcs=["count_digits"], loss_type="grpo", beta=0.04, max_steps=4)),
        "grpo-lora": ("grpo", d("grpo.jsonl"), adapter, dict(
            learning_rate=1e-2, num_generations=4, per_device_train_batch_size=8, max_completion_length=8,
            shuffle_dataset=False, reward_funcs=["count_digits"], loss_type="bnpo", scale_rewards="batch",
            max_steps=4)),
        "grpo-iterations": ("grpo", d("grpo.jsonl"), None, dict(
            learning_rate=3e-2, num_generations=4, per_device_train_batch_size=4, max_completion_length=8,
            shuffle_dataset=False, reward_funcs=["count_digits"], num_iterations=2, epsilon=0.1,
            epsilon_high=0.15, max_steps=6)),
        "grpo-eval": ("grpo", d("grpo.jsonl"), None, dict(
            learning_rate=1e-3, num_generations=4, per_device_train_batch_size=4, max_completion_length=6,
            shuffle_dataset=False, reward_funcs=["count_digits", "exact_match"], max_steps=4,
            eval_data=d("grpo-eval.jsonl"), eval_steps=2, per_device_eval_batch_size=4)),
        "grpo-reward-model": ("grpo", d("grpo.jsonl"), None, dict(
            learning_rate=1e-3, num_generations=4, per_device_train_batch_size=4, max_completion_length=6,
            shuffle_dataset=False, reward_funcs=["tiny/reward-model", "count_digits"], max_steps=4)),
        "grpo-dr": ("grpo", d("grpo.jsonl"), None, dict(
            learning_rate=1e-3, num_generations=4, per_device_train_batch_size=4, max_completion_length=8,
            shuffle_dataset=False, reward_funcs=["count_digits"], loss_type="dr_grpo", scale_rewards="none",
            max_steps=4)),
        # Packing (SFTConfig.packing): best-fit bins whose sequences attend only to themselves,
        # positions reset (TRL's padding-free collator); the overflow re-queued, with
        # completion-only labels; kiln's pretrain task (SFT on raw text, packed) cutting one
        # stream (wrapped), from another column and from a plain text file; evaluation unpacked.
        "sft-pack-bfd": ("sft", d("sft-text.jsonl"), None, dict(learning_rate=1e-3, packing=True, max_length=40)),
        "sft-pack-requeue": ("sft", d("sft.jsonl"), None, dict(
            learning_rate=1e-3, packing=True, packing_strategy="bfd-requeue", max_length=6,
            gradient_accumulation_steps=2)),
        "pretrain-wrapped": ("pretrain", d("pretrain.jsonl"), None, dict(
            learning_rate=1e-3, packing_strategy="wrapped", max_length=16, dataset_text_field="content")),
        "pretrain-txt": ("pretrain", d("pretrain.txt"), adapter, dict(learning_rate=1e-2, max_length=32)),
        "sft-pack-eval": ("sft", d("sft.jsonl"), None, dict(
            learning_rate=1e-3, packing=True, max_length=16, eval_data=d("sft-eval.jsonl"), eval_steps=3,
            per_device_eval_batch_size=3, eval_packing=False)),
        # Online DPO (TRL's OnlineDPOTrainer) on its own samples: a reward model ranking the
        # pairs; a function with IPO, the missing-EOS penalty and accumulation (each
        # micro-batch's loss back-propagated whole); LoRA.
        "online-dpo-rm": ("online_dpo", d("grpo.jsonl"), None, dict(
            learning_rate=1e-3, max_new_tokens=6, reward_funcs=["tiny/reward-model"], max_steps=4)),
        "online-dpo-ipo": ("online_dpo", d("grpo.jsonl"), None, dict(
            learning_rate=1e-3, max_new_tokens=6, reward_funcs=["count_digits"], loss_type="ipo", beta=[0.3],
            missing_eos_penalty=1.0, gradient_accumulation_steps=2, max_steps=3)),
        "online-dpo-lora": ("online_dpo", d("grpo.jsonl"), adapter, dict(
            learning_rate=1e-2, max_new_tokens=5, reward_funcs=["tiny/reward-model"], max_steps=4)),
        # BCO (TRL's BCOTrainer): the running reward shift; LoRA; paired data unpaired, with an
        # evaluation that reads the training's shift; precomputed reference log-probs under
        # accumulation.
        "bco-full": ("bco", d("kto.jsonl"), None, dict(learning_rate=1e-3)),
        "bco-lora": ("bco", d("kto.jsonl"), adapter, dict(learning_rate=1e-2, beta=0.2)),
        "bco-paired-eval": ("bco", d("dpo.jsonl"), None, dict(
            learning_rate=1e-3, eval_data=d("kto-eval.jsonl"), eval_steps=3)),
        "bco-precompute": ("bco", d("kto.jsonl"), None, dict(
            learning_rate=1e-3, precompute_ref_log_probs=True, gradient_accumulation_steps=2)),
        # GKD (TRL's GKDTrainer) from a wider teacher, offline (lmbda 0: on-policy samples come
        # from each side's own random stream): the JSD, forward KL under accumulation, reverse
        # KL under LoRA, evaluation.
        "distill-jsd": ("distill", d("sft-chat.jsonl"), None, dict(
            learning_rate=1e-3, lmbda=0.0, teacher_model_name_or_path="tiny/teacher")),
        "distill-kl": ("distill", d("sft-chat.jsonl"), None, dict(
            learning_rate=1e-3, lmbda=0.0, beta=0.0, gradient_accumulation_steps=2,
            teacher_model_name_or_path="tiny/teacher")),
        "distill-lora": ("distill", d("sft-chat.jsonl"), adapter, dict(
            learning_rate=1e-2, lmbda=0.0, beta=1.0, teacher_model_name_or_path="tiny/teacher")),
        "distill-eval": ("distill", d("sft-chat.jsonl"), None, dict(
            learning_rate=1e-3, lmbda=0.0, beta=0.3, teacher_model_name_or_path="tiny/teacher",
            eval_data=d("sft-chat.jsonl"), eval_steps=3, per_device_eval_batch_size=3)),
        # RLOO (TRL's RLOOTrainer): its default β 0.05 (the KL in the rewards) with a reward model
        # and a function, weighted; normalised, clipped advantages over two iterations; LoRA; a
        # reward model alone.
        "rloo-kl": ("rloo", d("grpo.jsonl"), None, dict(
            learning_rate=1e-3, num_generations=4, per_device_train_batch_size=8, max_completion_length=8,
            temperature=0.7, shuffle_dataset=False, reward_funcs=["tiny/reward-model", "count_digits"],
            reward_weights=[1.0, 0.5], max_steps=4)),
        "rloo-normalize-clip": ("rloo", d("grpo.jsonl"), None, dict(
            learning_rate=3e-2, num_generations=4, per_device_train_batch_size=4, max_completion_length=8,
            shuffle_dataset=False, reward_funcs=["count_digits"], beta=0.0, normalize_advantages=True,
            reward_clip_range=[0.0, 1.5], num_iterations=2, epsilon=0.1, epsilon_high=0.15, max_steps=6)),
        "rloo-lora": ("rloo", d("grpo.jsonl"), adapter, dict(
            learning_rate=1e-2, num_generations=2, per_device_train_batch_size=4, max_completion_length=6,
            shuffle_dataset=False, reward_funcs=["count_digits"], max_steps=4)),
        "rloo-reward-model": ("rloo", d("grpo.jsonl"), None, dict(
            learning_rate=1e-3, num_generations=4, per_device_train_batch_size=4, max_completion_length=6,
            shuffle_dataset=False, reward_funcs=["tiny/reward-model"], beta=0.0, max_steps=4)),
        # Reward models (TRL's RewardTrainer) from tiny/reward-model, a sequence classifier.
        "reward-full": ("reward", d("dpo.jsonl"), None, dict(learning_rate=1e-3)),
        "reward-margin-center": ("reward", d("reward-margin.jsonl"), None, dict(
            learning_rate=1e-3, center_rewards_coefficient=0.01, gradient_accumulation_steps=2)),
        "reward-chat": ("reward", d("dpo-chat.jsonl"), None, dict(learning_rate=1e-3)),
        "reward-lora": ("reward", d("dpo.jsonl"), reward_adapter, dict(learning_rate=1e-2)),
        "reward-short": ("reward", d("dpo.jsonl"), None, dict(learning_rate=1e-3, max_length=14)),
        "reward-eval": ("reward", d("dpo.jsonl"), None, dict(learning_rate=1e-3, eval_data=d("dpo-eval.jsonl"),
                                                             eval_steps=3, per_device_eval_batch_size=3)),
    }
    out = {}
    if only and os.path.exists(os.path.join(HERE, "reference.json")):
        out = json.load(open(os.path.join(HERE, "reference.json")))
    for name, (task, data, ad, over) in runs.items():
        if only and name not in only:
            continue
        mdir = reward_model if task == "reward" else model_dir
        if task == "ppo":
            logs, generated = run_ppo(mdir, data, ad, **dict(over))
        else:
            logs, generated = run(task, mdir, data, ad, **dict(over))
        eval_logs = None
        if isinstance(logs, tuple):
            logs, eval_logs = logs
        out[name] = {"task": task, "data": os.path.relpath(data, HERE), "adapter": ad is not None,
                     "model_dir": os.path.relpath(mdir, HERE),
                     "adapter_dir": os.path.relpath(ad, HERE) if ad else None,
                     "settings": {k: os.path.relpath(v, HERE) if k == "eval_data" else v for k, v in over.items()},
                     "logs": logs}
        if eval_logs is not None:
            out[name]["eval_logs"] = eval_logs
        if generated is not None:
            out[name]["completions"] = generated["train"]
            if generated["eval"]:
                out[name]["eval_completions"] = generated["eval"]
        print(name, [round(l.get("loss", l.get("objective/scores", 0.0)), 6) for l in out[name]["logs"]], flush=True)
    import peft, transformers, trl
    out["_versions"] = {"torch": torch.__version__, "transformers": transformers.__version__,
                        "trl": trl.__version__, "peft": peft.__version__}
    with open(os.path.join(HERE, "reference.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
