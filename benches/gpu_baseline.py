#!/usr/bin/env python3
"""The `dppo bench rollout` and `dppo bench train` workloads through transformers/PyTorch on
the same device, for `scripts/gpu-check`'s baseline: a random-init model of a shape's
`config.json` (`model/shapes/*.json`, `AutoModelForCausalLM.from_config`), then

- rollout: HF `generate` with its static cache (`cache_implementation="static"`), P prompts x G
  samples x T new tokens, temperature 1, EOS ignored (`min_new_tokens` = T); the prompts are
  `--prompt-len` fixed token ids, as there is no real tokenizer for a random shape;
- train: `benches/learner_pytorch.py`'s step and optimizer (micro-batches of
  `--micro-batch-tokens` as dppo's packed buffers, logits at completion positions only, no KV
  cache, fused AdamW; clipped token-level PG loss, grad clip) on its batch, under bf16
  autocast on a GPU (f32 on the CPU).

    python3 benches/gpu_baseline.py --shape model/shapes/qwen2.5-0.5b.json --device cuda

Prints one JSON object: `tokens_per_s`, `train_tokens_per_s` and their seconds.
"""
import argparse
import json
import os
import time

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

from learner_pytorch import batch, optimizer, step


def sync(device):
    """Waits for the device's queued work, so a clock read measures it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rollout(model, args, device):
    """HF `generate` on P*G sequences of T new tokens; returns seconds of the timed run."""
    vocab = model.config.vocab_size
    prompts = torch.tensor([[(i * 13 + t * 7) % vocab for t in range(args.prompt_len)]
                            for i in range(args.prompts)], device=device)
    kwargs = dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                  num_return_sequences=args.samples, max_new_tokens=args.new_tokens,
                  min_new_tokens=args.new_tokens, cache_implementation="static",
                  pad_token_id=0, attention_mask=torch.ones_like(prompts))
    with torch.no_grad():
        for _ in range(args.warmup_runs):
            model.generate(prompts, **kwargs)
        sync(device)
        start = time.perf_counter()
        out = model.generate(prompts, **kwargs)
        sync(device)
    took = time.perf_counter() - start
    assert out.shape == (args.prompts * args.samples, args.prompt_len + args.new_tokens), out.shape
    return took


def train(model, args, device):
    """One warm-up and `--steps` timed learner steps; returns seconds per step."""
    model.train()
    ids, adv, old = (t.to(device) for t in batch(model.config.vocab_size, args.seqs,
                                                  args.train_prompt_len, args.completion_len))
    opt, _ = optimizer(model)
    micro = max(1, args.micro_batch_tokens // (args.train_prompt_len + args.completion_len))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.autocast(device.type, dtype=dtype, enabled=device.type == "cuda"):
        step(model, opt, ids, adv, old, args.train_prompt_len, micro)  # warm-up
        sync(device)
        start = time.perf_counter()
        for _ in range(args.steps):
            step(model, opt, ids, adv, old, args.train_prompt_len, micro)
        sync(device)
    return (time.perf_counter() - start) / args.steps


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", required=True, help="a config.json (model/shapes/*.json)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--prompt-len", type=int, default=48)
    parser.add_argument("--warmup-runs", type=int, default=0)
    parser.add_argument("--seqs", type=int, default=32)
    parser.add_argument("--micro-batch-tokens", type=int, default=1024,
                        help="tokens per training micro-batch (dppo's pack.tokens)")
    parser.add_argument("--train-prompt-len", type=int, default=64)
    parser.add_argument("--completion-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--skip-rollout", action="store_true")
    parser.add_argument("--skip-train", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    device = torch.device(args.device)
    config = AutoConfig.from_pretrained(args.shape)
    report = {"shape": args.shape, "device": str(device), "torch": torch.__version__,
              "transformers": transformers.__version__}
    if device.type == "cuda":
        report["gpu"] = torch.cuda.get_device_name(device)
    if not args.skip_rollout:
        # Inference in bf16 on a GPU, as dppo's engine there; f32 on the CPU.
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).to(device).eval()
        took = rollout(model, args, device)
        tokens = args.prompts * args.samples * args.new_tokens
        report.update(rollout_s=took, tokens_per_s=tokens / took, prompts=args.prompts,
                      samples=args.samples, new_tokens=args.new_tokens,
                      prompt_len=args.prompt_len, warmup_runs=args.warmup_runs,
                      cache="static", dtype=str(dtype).removeprefix("torch."))
        del model
    if not args.skip_train:
        # Master weights in f32 with bf16 autocast, as dppo's learner with compute_dtype bf16.
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(device)
        seconds = train(model, args, device)
        tokens = args.seqs * (args.train_prompt_len + args.completion_len)
        report.update(step_s=seconds, train_tokens_per_s=tokens / seconds)
    print(json.dumps(report), flush=True)
    # torch.compile's worker processes can keep the interpreter from exiting for a minute.
    os._exit(0)


if __name__ == "__main__":
    main()
