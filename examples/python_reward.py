#!/usr/bin/env python3
"""Run a reward function written for verl or TRL as dppo's reward process, unchanged.

    reward.command = ["python3", "examples/python_reward.py", "--verl", "my_score.py:compute_score"]
    reward.command = ["python3", "examples/python_reward.py", "--trl", "my_rewards.py:accuracy",
                      "--label-key", "solution"]

--verl FILE:FUNC calls verl's custom reward signature once per completion:
    FUNC(data_source, solution_str, ground_truth, extra_info) -> float or {"score": float, ...}
(a dict's other numeric entries are logged as reward/<name>/mean, as verl logs them).

--trl FILE:FUNC calls TRL's reward function signature once per group:
    FUNC(prompts=[...], completions=[...], <label-key>=[...], data_source=[...],
         extra_info=[...]) -> [float, ...]
(None, which TRL allows for "not applicable", scores 0).

dppo writes one request per line on stdin and reads one answer per line on stdout (the JSON
of OpenRLHF's remote reward protocol; see examples/reward_server.py). Standard library only.
"""

import argparse
import importlib.util
import json
import math
import sys


def load(spec):
    """The function FUNC of FILE, from 'FILE:FUNC'."""
    path, _, name = spec.rpartition(":")
    if not path or not name:
        sys.exit(f"python_reward.py: expected FILE:FUNC, got {spec!r}")
    module_spec = importlib.util.spec_from_file_location("user_reward", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return getattr(module, name)


def verl_answer(func, body):
    """Scores each completion with verl's compute_score signature."""
    rewards, logs = [], {}
    items = zip(body["data_sources"], body["completions"], body["labels"], body["extra_info"])
    for k, (source, completion, label, extra) in enumerate(items):
        result = func(source, completion, label, extra)
        if isinstance(result, dict):
            rewards.append(float(result["score"]))
            for name, value in result.items():
                if name != "score" and isinstance(value, (int, float)):
                    logs.setdefault(name, [0.0] * len(body["completions"]))[k] = float(value)
        else:
            rewards.append(float(result))
    return {"rewards": rewards, "extra_logs": logs}


def trl_answer(func, body, label_key):
    """Scores the request's completions with one call of TRL's reward function signature."""
    values = func(
        prompts=body["prompts"],
        completions=body["completions"],
        data_source=body["data_sources"],
        extra_info=body["extra_info"],
        **{label_key: body["labels"]},
    )
    return {"rewards": [0.0 if v is None else float(v) for v in values]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    kind = parser.add_mutually_exclusive_group(required=True)
    kind.add_argument("--verl", metavar="FILE:FUNC")
    kind.add_argument("--trl", metavar="FILE:FUNC")
    parser.add_argument("--label-key", default="ground_truth",
                        help="the keyword the TRL function reads the labels from")
    args = parser.parse_args()
    func = load(args.verl or args.trl)
    for line in sys.stdin:
        if not line.strip():
            continue
        body = json.loads(line)
        if args.verl:
            answer = verl_answer(func, body)
        else:
            answer = trl_answer(func, body, args.label_key)
        # JSON has no NaN: a non-finite reward is sent as null, which dppo names as an error.
        answer["rewards"] = [r if math.isfinite(r) else None for r in answer["rewards"]]
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
