#!/usr/bin/env python3
"""`scripts/gpu-check`'s Python half: the CPU-vs-device greedy agreement, and the summary
(`summary.json` plus the table printed last) of the steps recorded in OUTDIR/steps.tsv.

    gpu_check.py agree DPPO DEVICE OUTDIR --shapes A,B --max-tokens N --budget SECONDS
    gpu_check.py prompt-len FILE     the mean prompt length of a `bench rollout --json` output
    gpu_check.py summary OUTDIR
    gpu_check.py profile NCU DPPO OUTDIR NAME [--launch-skip N] [--launch-count N] -- ARGS...
                                     `dppo bench rollout ARGS` under Nsight Compute: the last
                                     decode steps' device time by kernel, as JSON
    gpu_check.py profile-summary CSV the same from an exported `ncu --csv --page raw`
    gpu_check.py fastest FILE... [--doctor F --default NAME]
                                     `--attention-kernel NAME` of the attention variant of the fastest
                                     of the rollouts whose JSON outputs are FILE..., leaving out
                                     the variants but NAME that doctor's JSON F did not pass

With `--targets`, the summary also sets issue #38's targets against what the steps measured:
dppo's rollout tokens/s over HF `generate`'s on each shape (at least 5x), and the decode step
at batch 256 over its memory floor (at most 2x).
"""
import argparse
import json
import os
import subprocess
import sys
import time

from gpu_profile import profile, profile_summary

PROMPTS = ["What is 2+3?", "Tom has 17 apples and buys 5 more. How many apples does he have now?"]


def greedy(dppo, shape, device, prompt, max_tokens, timeout):
    """`dppo generate` greedy on `random:SHAPE`: (token ids, logprobs)."""
    out = subprocess.run(
        [dppo, "generate", "--model", f"random:{shape}", "--device", device, "--prompt", prompt,
         "--max-tokens", str(max_tokens), "--temperature", "0", "--json"],
        capture_output=True, text=True, timeout=timeout, check=True)
    line = json.loads(out.stdout.strip().splitlines()[-1])
    return line["token_ids"], line["logprobs"]


def agree(args):
    """Greedy tokens and logprobs on the CPU against DEVICE for each shape, within the budget.

    The random models are near-uniform, so a near-tie may flip a greedy pick in bf16: the
    report counts the tokens that agree up to the first divergence, and fails only on a
    logprob of an agreeing token further off than the tolerance, or on a failed run. Shapes
    left when the budget runs out are reported as `timeout`."""
    deadline = time.monotonic() + args.budget
    tol = 1e-4 if args.device == "cpu" else args.tolerance
    shapes, ok = {}, True
    for shape in args.shapes.split(","):
        agreed = total = 0
        worst = 0.0
        try:
            for prompt in PROMPTS:
                # The device first: when it fails, the CPU's run would be time lost.
                dev = greedy(args.dppo, shape, args.device, prompt, args.max_tokens,
                             deadline - time.monotonic())
                cpu = greedy(args.dppo, shape, "cpu", prompt, args.max_tokens,
                             deadline - time.monotonic())
                total += len(cpu[0])
                for a, b, la, lb in zip(cpu[0], dev[0], cpu[1], dev[1]):
                    if a != b:
                        break
                    agreed += 1
                    worst = max(worst, abs(la - lb))
            report = {"status": "ok" if worst <= tol else "failed", "agreed_tokens": agreed,
                      "tokens": total, "max_logprob_diff": worst, "tolerance": tol}
        except subprocess.TimeoutExpired as err:
            # Out of the step's time box: the larger shapes are left out, not failed.
            report = {"status": "timeout", "agreed_tokens": agreed, "tokens": total,
                      "error": str(err)[:200]}
        except (subprocess.CalledProcessError, ValueError, KeyError, IndexError) as err:
            stderr = getattr(err, "stderr", None) or ""
            report = {"status": "failed", "agreed_tokens": agreed, "tokens": total,
                      "error": f"{err} {stderr.strip()[-400:]}".strip()}
        shapes[shape] = report
        ok &= report["status"] != "failed"
        print(f"{shape}: {json.dumps(report)}", file=sys.stderr)
    print(json.dumps({"device": args.device, "shapes": shapes}))
    return 0 if ok else 1


def last_json(text):
    """The last line of `text` that is a JSON object, else None."""
    for line in reversed(text.strip().splitlines()):
        try:
            data = json.loads(line)
        except ValueError:
            continue
        return data if isinstance(data, dict) else None
    return None


def prompt_len(args):
    """Prints the mean prompt length of a rollout's JSON, rounded half up; fails without one."""
    data = last_json(open(args.file, errors="replace").read()) or {}
    mean = data.get("prompt_tokens_mean")
    if not mean:
        print(f"{args.file}: no prompt_tokens_mean", file=sys.stderr)
        return 1
    print(int(mean + 0.5))  # half up, not Python's half to even
    return 0


def key_numbers(name, text, outdir):
    """The numbers worth a glance from a step's stdout (its last JSON object, else its last
    line) or, for `dppo run`, from the run directory's summary.json."""
    run_summary = os.path.join(outdir, name, "summary.json")
    if name.startswith("run") and os.path.exists(run_summary):
        numbers = json.load(open(run_summary))
        numbers.update(mismatch(os.path.join(outdir, name, "metrics.jsonl")))
        return numbers
    data = last_json(text)
    if data is None:
        last = text.strip().splitlines()[-1:]
        return {"last_line": last[0][:200]} if last else {}
    if name.startswith("doctor"):
        return {"verdict": data.get("verdict")}
    if name == "agree":
        return {"shapes": data.get("shapes", {})}
    if name.startswith("profile"):
        return dict(data, kernels=data.get("kernels", [])[:20])
    if name.startswith("attention"):
        return {"attention_rows": data.get("rows", [])}
    if name.startswith("sample"):
        return {"sample_rows": data.get("results", [])}
    keys = ["tokens_per_s", "fraction_of_compute_limit", "train_tokens_per_s", "step_s",
            "rollout_s", "prompts", "samples", "new_tokens", "compute_dtype", "gpu", "steps",
            "seconds", "decode_step", "memory_floor", "prompt_tokens_mean", "prompt_len",
            "complete", "attention_kernel", "lazy_noise", "cuda_graphs", "split_draws"]
    return {k: data[k] for k in keys if data.get(k) is not None}


def mismatch(path):
    """The learner-engine mismatch over a run's trained steps: the largest logprob
    difference and the mean k3 KL."""
    if not os.path.exists(path):
        return {}
    steps = [json.loads(line) for line in open(path)]
    steps = [s for s in steps if "mismatch/k3_kl" in s]
    if not steps:
        return {}
    return {"mismatch_max": max(s["mismatch/logprob_abs_diff_max"] for s in steps),
            "mismatch_k3": sum(s["mismatch/k3_kl"] for s in steps) / len(steps)}


def brief(numbers):
    """One short cell for the table."""
    if "shapes" in numbers:
        # "agreeing tokens/tokens (worst logprob difference)" per shape.
        return "; ".join(
            f"{shape} {v['agreed_tokens']}/{v['tokens']}" +
            (f" ({v['max_logprob_diff']:.2g})" if "max_logprob_diff" in v else "") +
            ("" if v["status"] == "ok" else f" {v['status']}")
            for shape, v in numbers["shapes"].items())
    if "attention_rows" in numbers:
        # Fastest first: each variant's time a call and the KV read rate it implies.
        rows = sorted((r for r in numbers["attention_rows"] if "us_per_call" in r),
                      key=lambda r: r["us_per_call"])
        return "; ".join(f"{r['attention_kernel']} {r['us_per_call']:.0f} us "
                         f"({r['kv_gb_per_s']:,.0f} GB/s, "
                         f"{100 * r.get('fraction_of_bandwidth', 0):.0f}%)" for r in rows)[:170]
    if "sample_rows" in numbers:
        # Per spread: the exact noise's time a call, then lazy noise's, then split draws' (with
        # a mark where tokens differ from the exact noise's, which they must not).
        cells = {}
        for r in numbers["sample_rows"]:
            mark = "" if r.get("same_tokens", True) else " DIFFERENT TOKENS"
            kernel = "split" if r.get("split") else r["noise"]
            cells.setdefault(r["std"], []).append(f"{kernel} {r['us_per_call']:.0f} us{mark}")
        return "; ".join(f"std {std:g}: " + ", ".join(v) for std, v in cells.items())[:170]
    if "step_device_ms" in numbers:
        groups = ", ".join(f"{k} {v:.2f}" for k, v in numbers["groups_ms"].items())
        return (f"device {numbers['step_device_ms']:.2f} ms a decode step, "
                f"{numbers['launches_per_step']:.0f} launches: {groups}")[:170]
    for key in ["verdict", "last_line"]:
        if key in numbers:
            return str(numbers[key])[:70]
    if "wall_s" in numbers:
        cell = (f"{numbers.get('steps')} steps in {numbers['wall_s']:.1f} s, held-out "
                f"{numbers.get('eval_before')} -> {numbers.get('eval_after')}")
        if "mismatch_max" in numbers:
            cell += f", mismatch max {numbers['mismatch_max']:.1e}"
        return cell
    parts = []
    for key, unit in [("tokens_per_s", "tok/s"), ("train_tokens_per_s", "train tok/s")]:
        if key in numbers:
            parts.append(f"{numbers[key]:,.0f} {unit}")
    step = numbers.get("decode_step") or {}
    if step.get("count"):
        # The whole step: with device sampling the wait for the device is in sample_ms.
        total = sum(step.get(k, 0) for k in
                    ["schedule_ms", "forward_ms", "fetch_ms", "sample_ms", "emit_ms"])
        parts.append(f"decode step {total:.1f} ms, {step['attention_ops']:.0f} attn ops, "
                     f"{step['h2d_kib']:.0f} KiB up")
        if step.get("attention_ms"):
            parts.append(f"attention {step['attention_ms']:.1f} ms "
                         f"(waiting {step.get('attention_wait_ms', 0):.1f})")
    floor = numbers.get("memory_floor")
    if floor:
        parts.append(f"{floor['times_floor']:.1f}x its memory floor at batch {floor['batch']:.0f}")
        if floor.get("attention_kv_gb_per_s"):
            parts.append(f"KV read at {floor['attention_kv_gb_per_s']:,.0f} GB/s")
    if not parts:
        parts = [f"{k}: {v}" for k, v in numbers.items()]
    return "; ".join(parts)[:170]


def targets(steps):
    """Issue #38's targets against the `--targets` steps: per shape, dppo's rollout tokens/s
    over HF's on the same work (at least 5x), and the decode step at batch 256 over its memory
    floor (at most 2x); then the same with captured CUDA graphs (`target-graphs-` rows, an
    experiment until the doctor passes it). A target whose steps did not finish is `not
    measured`, but for a dppo rollout its timeout cut, which has missed the target."""
    by_name = {s["name"]: s for s in steps}
    # The shapes of the protocol's own rows (the rows after it name more than a kind).
    kinds = ("target-floor-", "target-rollout-", "target-hf-")
    shapes = sorted({s["name"][len(k):] for s in steps for k in kinds
                     if s["name"].startswith(k)})
    result, lines = {}, []
    if by_name.get("doctor", {}).get("status") != "ok":
        lines.append("targets: doctor did not pass, so the paged kernels are unverified on this "
                     "card and the numbers below are not the protocol's")
    for shape in shapes:
        hf = by_name.get(f"target-hf-{shape}", {})
        row, shape_lines = measured_targets(by_name, "target-", shape, hf)
        graphs, graph_lines = measured_targets(by_name, "target-graphs-", shape, hf)
        if any(by_name.get(f"target-graphs-{k}-{shape}") for k in ("floor", "rollout")):
            row["cuda_graphs"] = graphs
            shape_lines += [line.replace(f"target {shape}:", f"target {shape} (cuda graphs):")
                            for line in graph_lines]
        result[shape] = row
        lines += shape_lines
    return {"shapes": result, "lines": lines}


def measured_targets(by_name, prefix, shape, hf):
    """One shape's targets from the rows named PREFIX + `rollout-` / `floor-` + SHAPE and HF's
    row `hf`: the numbers and the summary's lines."""
    dppo = by_name.get(f"{prefix}rollout-{shape}", {})
    floor = by_name.get(f"{prefix}floor-{shape}", {})
    row, lines = {}, []
    kernel = dppo.get("numbers", {}).get("attention_kernel")
    if kernel:
        row["attention_kernel"] = kernel
    lazy = dppo.get("numbers", {}).get("lazy_noise")
    if lazy:
        row["lazy_noise"] = True
    ours = dppo.get("numbers", {}).get("tokens_per_s") if dppo.get("status") == "ok" else None
    theirs = hf.get("numbers", {}).get("tokens_per_s") if hf.get("status") == "ok" else None
    if ours and theirs:
        row["speedup_over_hf"] = ours / theirs
        row["speedup_met"] = ours / theirs >= 5
        on = f" (attention kernel {kernel}{', lazy noise' if lazy else ''})" if kernel else ""
        lines.append(f"target {shape}: dppo{on} {ours:,.0f} tok/s, HF generate {theirs:,.0f} "
                     f"tok/s: {ours / theirs:.2f}x (at least 5x: "
                     f"{'met' if row['speedup_met'] else 'MISSED'})")
    elif dppo.get("status") == "timeout":
        # The protocol: a dppo rollout its timeout cut has missed the target.
        row["speedup_met"] = False
        lines.append(f"target {shape}: dppo's rollout did not finish ({dppo.get('note')}): "
                     f"at least 5x over HF MISSED")
    else:
        lines.append(f"target {shape}: speed over HF not measured (dppo "
                     f"{dppo.get('status', 'absent')}, HF {hf.get('status', 'absent')})")
    measured = floor.get("status") == "ok" and floor["numbers"].get("memory_floor")
    if measured:
        times, batch = measured["times_floor"], measured["batch"]
        row.update(times_floor=times, floor_batch=batch, floor_met=times <= 2)
        lines.append(f"target {shape}: decode step {times:.2f}x its memory floor at batch "
                     f"{batch:.0f} (at most 2x: {'met' if times <= 2 else 'MISSED'})")
    else:
        lines.append(f"target {shape}: memory floor not measured "
                     f"({floor.get('status', 'absent')})")
    return row, lines


def summary(args):
    """Writes OUTDIR/summary.json from steps.tsv and the steps' outputs; prints the table."""
    steps = []
    with open(os.path.join(args.outdir, "steps.tsv")) as f:
        for row in f:
            name, status, seconds, note = (row.rstrip("\n").split("\t") + [""] * 4)[:4]
            path = os.path.join(args.outdir, f"{name}.out")
            text = open(path, errors="replace").read() if os.path.exists(path) else ""
            steps.append({"name": name, "status": status, "seconds": float(seconds or 0),
                          "note": note, "numbers": key_numbers(name, text, args.outdir),
                          "log": f"{name}.log"})
    meta_path = os.path.join(args.outdir, "meta.json")
    meta = json.load(open(meta_path)) if os.path.exists(meta_path) else {}
    report = dict(meta, steps=steps, passed=all(s["status"] in ("ok", "skipped", "no_time")
                                                for s in steps))
    if meta.get("mode") == "targets":
        report["targets"] = targets(steps)
    with open(os.path.join(args.outdir, "summary.json"), "w") as f:
        json.dump(report, f, indent=2)
    width = max([len(s["name"]) for s in steps] + [4])
    print(f"{'step':<{width}}  {'status':<8} {'secs':>6}  result")
    for s in steps:
        numbers = s["numbers"]
        # A failed step's note (exit code, last log line) unless its output says more.
        useful = numbers and (s["status"] == "ok" or "last_line" not in numbers)
        cell = brief(numbers) if useful else s["note"]
        print(f"{s['name']:<{width}}  {s['status']:<8} {s['seconds']:>6.1f}  {cell}")
    for line in report.get("targets", {}).get("lines", []):
        print(line)
    unrun = sum(s["status"] == "no_time" for s in steps)
    verdict = "all steps run passed" if report["passed"] else "some steps FAILED"
    if unrun:
        verdict += f"; {unrun} not run, the budget spent"
    print(f"gpu-check: {verdict}; summary.json and the steps' logs (steps.tar.gz on a GPU) "
          f"in {args.outdir}")
    return 0 if report["passed"] else 1


def doctor_checks(path):
    """Every check of `dppo doctor --json`'s output at PATH (none where it did not finish)."""
    try:
        report = last_json(open(path, errors="replace").read()) or {}
    except OSError:
        report = {}
    return [check for section in report.get("sections", []) for check in section.get("checks", [])]


# The doctor's check of the scalar attention kernel, the default where tensor cores do not
# serve; the other variants' checks name them.
KERNELS_CHECK = "paged attention kernels"
SCALAR_KERNEL = "s1_v8"


def fastest(args):
    """Prints `--attention-kernel NAME` of the fastest attention kernel in FILES, nothing where
    none of them finished. FILES are all `bench rollout --json` outputs (the variant of the
    highest tokens/s) or all `bench attention --json` ones (the variant of the fewest
    microseconds a call). With --doctor (`dppo doctor --json`'s output), only the --default
    variant and those whose kernel check passed there are candidates: a wrong kernel may well
    be fast, and one the doctor did not reach (cut short, or stopped by an earlier error) is
    unchecked."""
    passed = None
    if args.doctor:
        passed = {args.default}
        for check in doctor_checks(args.doctor):
            name = check.get("name", "")
            if check.get("status") != "ok":
                continue
            if ", variant " in name:
                passed.add(name.rsplit(", variant ", 1)[1])
            elif name == KERNELS_CHECK:
                passed.add(SCALAR_KERNEL)
    # (speed, variant, kind): tokens/s of a rollout, calls a second of a kernel alone.
    candidates = []
    for path in args.files:
        try:
            data = last_json(open(path, errors="replace").read()) or {}
        except OSError:
            continue
        if "rows" in data:
            candidates += [(1e6 / r["us_per_call"], r["attention_kernel"], "attention")
                           for r in data["rows"] if r.get("us_per_call")]
        elif data.get("tokens_per_s"):
            candidates.append((data["tokens_per_s"], data.get("attention_kernel"), "rollout"))
    if len({kind for _, _, kind in candidates}) > 1:
        print("fastest: rollouts and kernel timings are not comparable", file=sys.stderr)
        return 1
    candidates = [c for c in candidates if c[1] and (passed is None or c[1] in passed)]
    if candidates:
        print(f"--attention-kernel {max(candidates)[1]}")
    return 0


def main():
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    a = sub.add_parser("agree")
    a.add_argument("dppo")
    a.add_argument("device")
    a.add_argument("--shapes", required=True)
    a.add_argument("--max-tokens", type=int, default=16)
    a.add_argument("--budget", type=float, default=40)
    a.add_argument("--tolerance", type=float, default=0.1)
    p = sub.add_parser("prompt-len")
    p.add_argument("file")
    s = sub.add_parser("summary")
    s.add_argument("outdir")
    r = sub.add_parser("profile")
    r.add_argument("ncu")
    r.add_argument("dppo")
    r.add_argument("outdir")
    r.add_argument("name")
    r.add_argument("--launch-skip", type=int, default=0)
    r.add_argument("--launch-count", type=int, default=8000)
    c = sub.add_parser("profile-summary")
    c.add_argument("csv")
    f = sub.add_parser("fastest")
    f.add_argument("files", nargs="+")
    f.add_argument("--doctor")
    f.add_argument("--default", help="the attention's default variant, a candidate whatever "
                   "the doctor says (it runs where no other is chosen)")
    # `profile`'s rollout arguments follow `--`, kept from argparse whole.
    argv, rest = sys.argv[1:], []
    if "--" in argv:
        cut = argv.index("--")
        argv, rest = argv[:cut], argv[cut + 1:]
    args = parser.parse_args(argv)
    args.rest = rest
    commands = {"agree": agree, "prompt-len": prompt_len, "summary": summary,
                "profile": profile, "profile-summary": profile_summary, "fastest": fastest}
    sys.exit(commands[args.command](args))


if __name__ == "__main__":
    main()
