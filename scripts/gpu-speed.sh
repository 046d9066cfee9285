#!/usr/bin/env bash
# The speed part of `rapid bench` on one CUDA GPU, in bf16, in under 8 minutes: lc against RAPID
# (self-speculation on the embedded model) at 2K-8K tokens and RoPE-scaled 16K-64K, plus one QA
# pass at 8K for quality. Exactness on the device is checked first (scripts/gpu_exact.py); the
# speed part runs either way and the script exits 1 if that check failed.
# Usage: scripts/gpu-speed.sh [OUT_DIR]
#
# Needs a Python with CUDA torch where this checkout is installed (`pip install -e .`, or the
# checkout on PYTHONPATH with transformers, faiss-cpu and sentence-transformers present) and the
# converted embedded model (run `python -m rapid_integrations.models.loading` once, or copy
# ~/.cache/rapid-integrations/SmolLM2-135M-Instruct and point RAPID_MODEL_DIR at it).
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
out="${1:-${OUT:-bench-gpu}}"
python3 -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device')"
exact=0
python3 scripts/gpu_exact.py cuda || exact=$?
timeout 470 python3 -m rapid_integrations.cli bench \
    --device cuda --dtype bfloat16 \
    --lengths 8192 --tasks 1 --methods lc,rapid,hf,hf-pld --etas 5 \
    --speed-lengths 2048,4096,8192 --rope-lengths 16384,32768,65536 --speed-tokens 256 \
    --no-tiny-speed --out "$out"
echo "results: $out/results.md"
exit "$exact"
