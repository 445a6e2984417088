#!/usr/bin/env python3
"""Audits dppo's verifier against Hugging Face's math-verify (not run in CI).

Re-scores every sample of a `dppo eval --samples` file (or of `dppo score --out`, for
another extraction mode) with math-verify and lists each sample where math-verify and the
reward saved by dppo disagree:

    pip install math-verify==0.9.0
    dppo eval --model M.gguf --data data/eval/math500.jsonl --question-field problem \
        --limit 40 --max-tokens 400 --samples math500.jsonl
    python3 benches/audit_math_verify.py --samples math500.jsonl \
        --data data/eval/math500.jsonl

`--data` names the JSONL the samples came from, so that math-verify reads each raw gold
answer (line `prompt_id + 1`) rather than dppo's normal form of it. Prints one JSON line
per disagreement, then one summary line. math-verify reads the whole completion, cut off
by the token limit or not: a disagreement on a truncated sample is dppo's truncation rule.
"""
import argparse
import json

from math_verify import parse, verify


def raw_golds(path, field):
    """Raw gold answers of a data file, by line index (dppo's `prompt_id`)."""
    with open(path) as f:
        return [str(json.loads(line)[field]) for line in f if line.strip()]


def gold_text(raw):
    """The final answer of a gold string (GSM8K's `#### n`), in math mode for parsing."""
    answer = raw.rsplit("####", 1)[-1].strip().replace(",", "") if "####" in raw else raw
    return answer if "$" in answer else f"${answer}$"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", required=True, help="a dppo eval --samples file")
    parser.add_argument("--data", help="the JSONL the samples came from (raw gold answers)")
    parser.add_argument("--answer-field", default="answer")
    args = parser.parse_args()
    golds = raw_golds(args.data, args.answer_field) if args.data else None
    total = agree = ours = theirs = 0
    with open(args.samples) as f:
        for line_no, line in enumerate(f, 1):
            row = json.loads(line)
            raw = golds[row["prompt_id"]] if golds else row["answer"]
            gold = parse(gold_text(raw))
            for index, sample in enumerate(row["samples"]):
                dppo_correct = sample["reward"] >= 1.0
                mv_correct = bool(verify(gold, parse(sample["text"])))
                total += 1
                ours += dppo_correct
                theirs += mv_correct
                if dppo_correct == mv_correct:
                    agree += 1
                    continue
                print(json.dumps({
                    "line": line_no,
                    "sample": index,
                    "gold": raw,
                    "dppo": dppo_correct,
                    "math_verify": mv_correct,
                    "extracted_by": sample.get("extracted_by"),
                    "truncated": sample.get("truncated"),
                    "text_tail": sample["text"][-300:],
                }))
    print(json.dumps({
        "samples": total,
        "agreement": agree / max(total, 1),
        "disagreements": total - agree,
        "dppo_accuracy": ours / max(total, 1),
        "math_verify_accuracy": theirs / max(total, 1),
    }))


if __name__ == "__main__":
    main()
