#!/usr/bin/env python3
"""The workload of `configs/smollm2-gsm8k.toml` through TRL's `GRPOTrainer`, for a
same-machine step-time ratio against

    dppo run --config configs/smollm2-gsm8k.toml --set algorithm=grpo --set steps=8 \
        --set data.num_eval=10 --out runs/smol-grpo

SmolLM2-135M-Instruct as an HF directory (`dppo convert --model <gguf> --out <dir>`), f32,
CPU, 4 prompts x 8 generations a step from data/gsm8k/train.jsonl in chat form, at most 64
new tokens, temperature 1, beta 0, token-level clipped loss with eps 0.2/0.28, lr 1e-6,
grad clip 1, HF `generate`, 2 threads, and dppo's reward (`flexible` extraction, truncated
completions count only an answer complete before the cut), ported below:

    python3 benches/trl_grpo.py --model runs/smollm2-hf --steps 8

Prints one JSON object with every step's seconds and their mean over the steps after the
first. Needs `pip install trl==1.16.0 torch transformers datasets accelerate` (PyPI); not part
of CI.
"""
import argparse
import json
import re
import time

import torch
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def gold(answer):
    """GSM8K's reference answer: the number after `####`."""
    return float(answer.split("####")[-1].strip().replace(",", ""))


PHRASES = ("the final answer is", "final answer:", "the answer is")


def whole_line(rest, truncated):
    """`rest` up to its first line break; all of it only when the completion was not cut."""
    end = rest.find("\n")
    if end >= 0:
        return rest[:end]
    return None if truncated else rest


def first_number(text):
    match = NUMBER.search(text)
    return float(match.group().replace(",", "")) if match else None


def flexible(text, truncated):
    """dppo's `reward.extract = "flexible"` (rewards/src/extract.rs): the last closed
    `\\boxed{}`, else the line after the last `####`, else the line after the last "the
    answer is"-type phrase, else the last number; a truncated completion only counts an
    answer complete before the cut (a closed box, a line ended by a line break), never the
    last number."""
    start = text.rfind("\\boxed{")
    if start >= 0:
        depth, i = 0, start + len("\\boxed")
        for j in range(i, len(text)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                return first_number(text[i + 1:j])
    if "####" in text:
        line = whole_line(text[text.rfind("####") + 4:], truncated)
        if line is not None and line.strip():
            return first_number(line)
    lower = text.lower()
    ends = [lower.rfind(p) + len(p) for p in PHRASES if p in lower]
    if ends:
        line = whole_line(text[max(ends):], truncated)
        if line is not None and line.strip(" :*$"):
            return first_number(line.split(". ")[0])
    if truncated:
        return None
    numbers = NUMBER.findall(text)
    return float(numbers[-1].replace(",", "")) if numbers else None


def make_reward(eos_token_id, max_tokens):
    """1 when the completion's final answer under `flexible` equals the reference, as dppo
    scores it; a completion is truncated when it used every token without an EOS."""

    def correct(completions, answer, completion_ids, **_):
        scores = []
        for completion, ids, ref in zip(completions, completion_ids, answer):
            text = completion[0]["content"] if isinstance(completion, list) else completion
            truncated = len(ids) >= max_tokens and eos_token_id not in ids
            value = flexible(text, truncated)
            scores.append(1.0 if value is not None and abs(value - gold(ref)) < 1e-6 else 0.0)
        return scores

    correct.__name__ = "correct"
    return correct


class StepTimer(TrainerCallback):
    """Wall-clock seconds of every optimizer step, and the part of each spent in `model`'s
    `generate` (which it wraps)."""

    def __init__(self, model):
        self.start, self.seconds, self.gen_seconds, self.gen = None, [], [], 0.0
        generate = model.generate

        def timed_generate(*args, **kwargs):
            t = time.perf_counter()
            out = generate(*args, **kwargs)
            self.gen += time.perf_counter() - t
            return out

        model.generate = timed_generate

    def on_step_begin(self, args, state, control, **kwargs):
        self.start, self.gen = time.perf_counter(), 0.0

    def on_step_end(self, args, state, control, **kwargs):
        self.seconds.append(time.perf_counter() - self.start)
        self.gen_seconds.append(self.gen)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True, help="HF directory from `dppo convert`")
    parser.add_argument("--data", default="data/gsm8k/train.jsonl")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="runs/trl-grpo")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    data = load_dataset("json", data_files=args.data, split="train")
    data = data.map(lambda row: {"prompt": [{"role": "user", "content": row["question"]}]})
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    config = GRPOConfig(
        output_dir=args.out,
        use_cpu=True,
        bf16=False,
        max_steps=args.steps,
        per_device_train_batch_size=32,
        gradient_accumulation_steps=1,
        # TRL turns activation checkpointing on by default; a 135M model needs no memory
        # saving, so the peer runs its faster setting.
        gradient_checkpointing=False,
        num_generations=8,
        max_completion_length=64,
        temperature=1.0,
        top_p=1.0,
        beta=0.0,
        epsilon=0.2,
        epsilon_high=0.28,
        loss_type="dapo",
        learning_rate=1e-6,
        max_grad_norm=1.0,
        weight_decay=0.0,
        warmup_steps=0,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
    )
    timer = StepTimer(model)
    reward = make_reward(tokenizer.eos_token_id, config.max_completion_length)
    trainer = GRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=reward,
                          args=config, train_dataset=data, callbacks=[timer])
    trainer.train()
    later = timer.seconds[1:] or timer.seconds
    print(json.dumps({
        "trainer": "trl.GRPOTrainer",
        "steps": len(timer.seconds),
        "step_seconds": [round(s, 3) for s in timer.seconds],
        "mean_step_seconds_after_first": sum(later) / len(later),
        "threads": args.threads,
    }))


if __name__ == "__main__":
    main()
