#!/usr/bin/env bash
# One short check on a machine with an NVIDIA GPU (about 10 minutes): environment, the CUDA
# tests, and the training benchmark, ending with one summary. Run from the repo root:
#   bash bench/gpu_check.sh
# It uses .venv when present (build it with `make setup`), else installs requirements.txt
# into a fresh .venv; the machine needs the same Python 3.11 and PyPI (or a wheel mirror).
set -uo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
summary=()

if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu_check: no NVIDIA GPU visible (nvidia-smi failed)"; exit 2
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

if [ ! -x .venv/bin/python ]; then
  python3.11 -m venv .venv && .venv/bin/pip install -q -r requirements.txt && .venv/bin/pip install -q --no-deps -e .
fi
PY=.venv/bin/python
$PY -c "import torch; assert torch.cuda.is_available(), 'torch sees no CUDA'; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())" \
  || { echo "gpu_check: torch cannot use the GPU"; exit 2; }

# The training box's preflight, as a GPU box runs it: CUDA required, the driver against
# torch's CUDA build, the GPU count (BURSTCV_INSTANCE_TYPE names the EC2 type, if any).
if $PY -c "import sys; from burstcv.training.preflight import run_checks; f = run_checks(True, sys.argv[1] or None); print(f.summary()); sys.exit(not f.ok)" "${BURSTCV_INSTANCE_TYPE:-}"; then
  summary+=("preflight: PASS")
else
  summary+=("preflight: FAIL")
fi

if timeout 240 $PY -m pytest -q -m cuda tests/training -p no:cacheprovider; then
  summary+=("cuda tests: PASS")
else
  summary+=("cuda tests: FAIL")
fi

# ResNet-50 at 224 px on photos: the burstcv data path against ImageFolder + DataLoader, both
# bf16 + channels_last, on the 4 vCPUs of a g4dn/g5/g6.xlarge.
if timeout 330 $PY bench/train.py --model resnet50 --image-size 224 --images 6000 --epochs 2 \
    --batch 256 --vcpus 4 --json /tmp/gpu_bench.json; then
  summary+=("bench/train.py: $($PY -c "import json; r=json.load(open('/tmp/gpu_bench.json')); b, o = r['baseline'], r['burstcv']; print(f\"{r['speedup']:.2f}x ImageFolder+DataLoader ({o['images_per_s']:.0f} vs {b['images_per_s']:.0f} img/s; GPU util {o['gpu_util']} vs {b['gpu_util']} %), published-RN50 fraction {r.get('published_fraction')}\")")")
else
  summary+=("bench/train.py: FAIL")
fi

echo "=== gpu_check summary ($(( $(date +%s) - start )) s) ==="
printf '%s\n' "${summary[@]}"
[[ "${summary[*]}" != *FAIL* ]]
