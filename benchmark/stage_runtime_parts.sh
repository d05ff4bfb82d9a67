# Sourced by the kernel GPU scripts that stage SGLang in two calls (run_gpu_write_decode.sh, run_gpu_table.sh): $OUT,
# the OSCAR_COMMIT warning, the runtime parts this call carries (.devb/a, .devb/b) untarred into $SITE
# ($HOME/sgl-site, which the next call on the warm machine still has), and PYTHONPATH / PATH for the kernels.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
[ -n "${OSCAR_COMMIT:-}" ] || echo "warning: OSCAR_COMMIT unset: results name the device copy's git HEAD" >&2
SITE=$HOME/sgl-site; mkdir -p "$SITE"
for part in a b; do
  if ls .devb/$part/*.tgz >/dev/null 2>&1; then tar xzf .devb/$part/*.tgz -C "$SITE" && echo "staged part $part"; fi
done
export PYTHONPATH=$SITE:$PWD/python PYTHONUNBUFFERED=1 PATH=$PATH:/usr/local/cuda/bin
