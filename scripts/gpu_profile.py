"""Nsight Compute's side of `scripts/gpu-check --profile` (run through `gpu_check.py profile`
and `profile-summary`): a rollout's launches exported from ncu, and the last decode steps'
device time by kernel and by group."""
import argparse
import csv
import json
import os
import subprocess
import sys


# Nsight Compute's time units (`--print-units base` gives nanoseconds; others are scaled).
UNITS_NS = {"nsecond": 1.0, "usecond": 1e3, "msecond": 1e6, "second": 1e9,
            "ns": 1.0, "us": 1e3, "ms": 1e6, "s": 1e9}
# The engine's sampling kernel ends every iteration that samples.
STEP_END = "gumbel_sample"


def kernel_times(path):
    """(kernel name, nanoseconds) of each launch in an `ncu --csv --page raw` export, in
    launch order: the columns found by name, the units row read, rows without an ID skipped."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    header = next((r for r in rows if "Kernel Name" in r), None)
    if header is None:
        raise ValueError(f"{path}: no 'Kernel Name' column (not an ncu raw-page CSV export)")
    name_col = header.index("Kernel Name")
    id_col = header.index("ID") if "ID" in header else 0
    time_col = next((i for i, c in enumerate(header) if c.startswith("gpu__time_duration")), None)
    if time_col is None:
        raise ValueError(f"{path}: no gpu__time_duration column")
    scale, out = 1.0, []
    for line, row in enumerate(rows[rows.index(header) + 1:], rows.index(header) + 2):
        if len(row) <= max(name_col, time_col, id_col):
            continue
        if not row[id_col].strip().isdigit():
            unit = row[time_col].strip()
            if unit not in UNITS_NS:
                raise ValueError(f"{path}:{line}: unknown time unit {unit!r}")
            scale = UNITS_NS[unit]
            continue
        value = row[time_col].replace(",", "").strip()
        try:
            out.append((row[name_col], float(value) * scale))
        except ValueError:
            # A launch without its time would merge two iterations' averages silently.
            raise ValueError(f"{path}:{line}: {row[name_col]!r} has no time ({value!r})")
    return out


def kind_of(name):
    """The group a kernel counts in: cuBLAS's GEMMs (and their split-K reductions), dppo's
    paged and layer kernels, sampling, candle's ops."""
    low = name.lower()
    if any(k in low for k in ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "sm80_",
                              "splitkreduce")):
        return "gemm"
    if low.startswith(("paged_", "write_slots", "write_table", "copy_slots", "qkv_rope")):
        return "paged kernels"
    if low.startswith(("add_rms_norm", "silu_mul")):
        return "layer kernels"
    if low.startswith(STEP_END):
        return "sampling"
    return "other"


def profile_of(launches, steps=3):
    """Per decode step, averaged over the last `steps` complete iterations (each ends with the
    sampling kernel; the last ones of a short rollout are decode steps): the device time and
    launches in all, per group, and per kernel name, largest first."""
    ends = [i for i, (name, _) in enumerate(launches) if name.startswith(STEP_END)]
    if len(ends) < 2:
        raise ValueError(f"{len(launches)} launches, {len(ends)} sampling kernels: no whole "
                         f"iteration between two of them")
    picked = ends[-(steps + 1):]
    n = len(picked) - 1
    names, kinds = {}, {}
    for start, end in zip(picked, picked[1:]):
        for name, ns in launches[start + 1:end + 1]:
            calls, total = names.get(name, (0, 0.0))
            names[name] = (calls + 1, total + ns)
            kinds[kind_of(name)] = kinds.get(kind_of(name), 0.0) + ns
    total = sum(t for _, t in names.values())
    top = sorted(names.items(), key=lambda kv: -kv[1][1])
    return {
        "steps": n,
        "step_device_ms": total / n / 1e6,
        "launches_per_step": sum(c for c, _ in names.values()) / n,
        "groups_ms": {k: v / n / 1e6 for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
        "kernels": [{"name": name[:120], "calls": c / n, "ms": t / n / 1e6,
                     "share": t / total if total else 0.0} for name, (c, t) in top],
    }


def profile(args):
    """Runs `dppo bench rollout ARGS` under Nsight Compute (each kernel's duration, launch
    order), exports the launches, and prints the last decode steps' device time by kernel as
    one JSON object."""
    report = os.path.join(args.outdir, args.name)
    capture = [args.ncu, "--clock-control", "none", "--cache-control", "none", "--metrics",
               "gpu__time_duration.sum", "--launch-skip", str(args.launch_skip),
               "--launch-count", str(args.launch_count), "-f", "-o",
               report, "--", args.dppo, "bench", "rollout", "--json"] + args.rest
    print("capture:", " ".join(capture), file=sys.stderr, flush=True)
    run = subprocess.run(capture, stdout=sys.stderr, stderr=sys.stderr)
    if run.returncode != 0:
        print(f"profile: ncu exited {run.returncode}", file=sys.stderr)
        return run.returncode
    exported = report + ".csv"
    with open(exported, "w") as f:
        run = subprocess.run([args.ncu, "--import", report + ".ncu-rep", "--csv", "--page", "raw",
                              "--print-units", "base", "--print-kernel-base", "function"],
                             stdout=f, stderr=sys.stderr)
    if run.returncode != 0:
        print(f"profile: ncu --import exited {run.returncode}", file=sys.stderr)
        return run.returncode
    return profile_summary(argparse.Namespace(csv=exported))


def profile_summary(args):
    """The JSON of `profile` from an exported CSV; a table of the largest kernels on stderr."""
    result = profile_of(kernel_times(args.csv))
    for k in result["kernels"][:15]:
        print(f"{k['ms']:8.3f} ms {k['calls']:6.1f}x {k['share']:6.1%}  {k['name']}",
              file=sys.stderr)
    print(json.dumps(result))
    return 0
