# Sourced by the GPU session scripts: stage the SGLang 0.5.17 runtime (part b; part a was untarred
# into $HOME/sgl-site by the previous call; the parts are tarballs under the git-ignored .devb/, see
# docs/results/kernels.md "Running the benchmarks") and make sglang_oscar an SGLang plugin without pip
# (a dist-info with its entry point next to the runtime, as `pip install` would leave).
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SITE=$HOME/sgl-site
if [ -d .devb/b ] && ls .devb/b/*.tgz >/dev/null 2>&1 && [ ! -d "$SITE/flashinfer" ]; then
  tar xzf .devb/b/*.tgz -C "$SITE"
fi
for m in sglang flashinfer; do
  [ -d "$SITE/$m" ] || { echo "runtime not staged: $SITE/$m missing (run call 1 with .devb/a first)"; return 3 2>/dev/null || exit 3; }
done
DI=$SITE/sglang_oscar-0.1.0.dist-info
mkdir -p "$DI"
printf 'Metadata-Version: 2.1\nName: sglang-oscar\nVersion: 0.1.0\n' > "$DI/METADATA"
printf '[sglang.srt.plugins]\nsglang_oscar = sglang_oscar.srt.plugin:register\n' > "$DI/entry_points.txt"
export PYTHONPATH=$SITE:$PWD/python PYTHONUNBUFFERED=1
export SGLANG_PLUGINS=sglang_oscar
# Wheels the runtime bundle lacks (rpds-py: the server's jsonschema -> referencing needs it), carried in the
# git-ignored .whl/ (fetched with pip download --python-version 3.12); installed once per machine.
if ! python3 -c "import rpds" 2>/dev/null; then
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
  fi
  python3 -c "import rpds" 2>/dev/null || echo "warning: rpds (rpds-py) missing: sglang.launch_server will not import; carry .whl/"
fi
# NVLink multicast stays off on the shared multi-GPU hosts
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee -a "$OUT/gpu_state.txt"
# The versions once per machine (importing sglang takes ~15 s; the staged runtime does not change while it is held).
[ -s "$SITE/versions.txt" ] || python3 -c "import torch, triton, sglang, flashinfer; print('torch', torch.__version__, 'triton', triton.__version__, 'sglang', sglang.__version__, 'flashinfer', flashinfer.__version__)" > "$SITE/versions.txt" \
  || { rm -f "$SITE/versions.txt"; echo "the staged runtime does not import (above)"; return 3 2>/dev/null || exit 3; }
tee "$OUT/versions.txt" < "$SITE/versions.txt"
