#!/usr/bin/env bash
# One device call: stage the SGLang 0.5.17 runtime (part b; part a was untarred by the previous
# call, see /work/shared/device/README.md), make sglang_oscar discoverable as an SGLang plugin
# without pip (a dist-info with its entry point next to the runtime), then run the serving
# benchmark driver given as arguments, e.g.
#   bash benchmark/serving/run_gpu.sh benchmark/serving/one_batch.py --contexts 32768
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SITE=$HOME/sgl-site
if [ -d .devb/b ] && ls .devb/b/*.tgz >/dev/null 2>&1 && [ ! -d "$SITE/flashinfer" ]; then
  tar xzf .devb/b/*.tgz -C "$SITE"
fi
for m in sglang flashinfer; do
  [ -d "$SITE/$m" ] || { echo "runtime not staged: $SITE/$m missing (run call 1 with .devb/a first)"; exit 3; }
done
# importlib.metadata finds entry points in any *.dist-info on sys.path: this is what
# `pip install sglang-oscar` would leave behind, minus the files.
DI=$SITE/sglang_oscar-0.1.0.dist-info
mkdir -p "$DI"
printf 'Metadata-Version: 2.1\nName: sglang-oscar\nVersion: 0.1.0\n' > "$DI/METADATA"
printf '[sglang.srt.plugins]\nsglang_oscar = sglang_oscar.srt.plugin:register\n' > "$DI/entry_points.txt"
export PYTHONPATH=$SITE:$PWD/python PYTHONUNBUFFERED=1
export SGLANG_PLUGINS=sglang_oscar
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/gpu_state.txt"
python3 -c "import torch, triton, sglang, flashinfer; print('torch', torch.__version__, 'triton', triton.__version__, 'sglang', sglang.__version__, 'flashinfer', flashinfer.__version__)" | tee "$OUT/versions.txt"
python3 "$@" --out "$OUT" 2>&1 | tee "$OUT/driver.log"
