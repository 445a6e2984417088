#!/usr/bin/env python3
"""GRPO on `configs/smollm2-arithmetic.toml`'s task through TRL's `GRPOTrainer`, like for
like with dppo (issue #39): both sides train every step on the same prompts in the same
order. dppo runs first and dumps each step's rollout (`rollout.dump_dir`); this script reads
the prompts from the dump, in draw order, as already chat-templated text (the same tokens),
and trains on them with dppo's settings: 32 prompts x 8 generations a step, at most 32 new
tokens, temperature 1, top-p 1, beta 0, token-level clipped loss with eps 0.2/0.28, Dr.
GRPO's aggregation (`loss_type="dr_grpo"`, dppo's `seq-mean-token-sum-norm`), group-scaled
advantages, lr 5e-6 constant, grad clip 1, f32, 2 threads, HF `generate` (no vLLM), and
dppo's reward (`flexible` extraction, ported in trl_grpo.py) against each prompt's sum.

    dppo run --config configs/smollm2-arithmetic.toml --set algorithm=grpo --set steps=4 \\
        --set eval.every=0 --set rollout.dump_dir=runs/trl/dump --out runs/trl/dppo
    python3 benches/trl_arithmetic.py --model /tmp/smollm2-hf --dump runs/trl/dump --out runs/trl/trl
    dppo eval --model runs/trl/trl --data builtin:arithmetic --extract flexible --limit 200 --max-tokens 32
    dppo eval --model runs/trl/dppo/checkpoints/step-000004/model --data builtin:arithmetic \\
        --extract flexible --limit 200 --max-tokens 32

TRL's best settings here: no activation checkpointing (a 135M model needs no memory
saving), logits at completion positions only (TRL's own), micro-batches of 32 sequences
with 8 accumulation steps (one generation of 256 completions per optimizer step). Prints
one JSON object: the settings, and every step's seconds with its generation part. Needs
`pip install trl==1.16.0 torch transformers datasets accelerate`; not part of CI.
"""
import argparse
import glob
import json
import os
import re

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

from trl_grpo import StepTimer, flexible

SUM = re.compile(r"What is (\d+)([+-])(\d+)\?")


def prompts_in_draw_order(dump):
    """(templated prompt, its sum) of every group of every dumped step, in order."""
    rows = []
    for path in sorted(glob.glob(os.path.join(dump, "step-*.jsonl"))):
        seen = None
        for line in open(path):
            row = json.loads(line)
            if row["prompt_id"] == seen:
                continue
            seen = row["prompt_id"]
            a, op, b = SUM.search(row["prompt"]).groups()
            value = int(a) + int(b) if op == "+" else int(a) - int(b)
            rows.append({"prompt": row["prompt"], "answer": str(value)})
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True, help="HF directory from `dppo convert`")
    parser.add_argument("--dump", required=True, help="dppo's rollout.dump_dir of the same run")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="runs/trl/trl")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    rows = prompts_in_draw_order(args.dump)
    steps = len(rows) // 32
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    config = GRPOConfig(
        output_dir=args.out,
        use_cpu=True,
        bf16=False,
        max_steps=steps,
        per_device_train_batch_size=32,
        gradient_accumulation_steps=8,
        shuffle_dataset=False,
        gradient_checkpointing=False,
        num_generations=8,
        max_completion_length=32,
        temperature=1.0,
        top_p=1.0,
        beta=0.0,
        epsilon=0.2,
        epsilon_high=0.28,
        loss_type="dr_grpo",
        scale_rewards="group",
        learning_rate=5e-6,
        max_grad_norm=1.0,
        weight_decay=0.0,
        warmup_steps=0,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
    )
    eos = tokenizer.eos_token_id

    def correct(completions, answer, completion_ids, **_):
        scores = []
        for text, ids, ref in zip(completions, completion_ids, answer):
            truncated = len(ids) >= config.max_completion_length and eos not in ids
            value = flexible(text, truncated)
            scores.append(1.0 if value is not None and abs(value - float(ref)) < 1e-6 else 0.0)
        return scores

    timer = StepTimer(model)
    trainer = GRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=correct,
                          args=config, train_dataset=Dataset.from_list(rows), callbacks=[timer])
    trainer.train()
    trainer.save_model(args.out)
    tokenizer.save_pretrained(args.out)
    print(json.dumps({
        "trainer": "trl.GRPOTrainer",
        "trl": __import__("trl").__version__,
        "torch": torch.__version__,
        "settings": {k: getattr(config, k) for k in [
            "per_device_train_batch_size", "gradient_accumulation_steps", "num_generations",
            "max_completion_length", "loss_type", "scale_rewards", "learning_rate",
            "epsilon", "epsilon_high", "beta", "gradient_checkpointing", "shuffle_dataset"]},
        "threads": args.threads,
        "steps": len(timer.seconds),
        "step_seconds": [round(s, 2) for s in timer.seconds],
        "gen_seconds": [round(s, 2) for s in timer.gen_seconds],
    }))


if __name__ == "__main__":
    main()
