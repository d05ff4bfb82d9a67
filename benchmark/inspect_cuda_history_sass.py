"""Static resources of the CUDA history kernel (kernels/cuda/int2_history.cu) for sm_90, compiled here with nvcc (no
GPU): per template instance (pipeline stages NSTAGE, query heads per CTA column HC) its registers, stack and spills
(ptxas -v), its SASS size, its hot loop: the shortest loop with >= 16 HMMA + IMMA, i.e. one 16-token tile of a
history warp (8 mma for the K dot, 8 for the V dot), and the code of a 32-token block outside it (its copies).

Why: 2 CTAs of 8 warps per SM need <= 128 registers, and a longer hot loop costs every history token. Both can be
checked on a CPU; test/test_cuda_history_sass.py holds them to BUDGET. A GPU is still needed for time: code outside
the loop once cost every batch-1 call ~1.8 us with an identical loop (benchmark/NOTES.md "q rotated in the decode's
CTAs"; benchmark/run_gpu_ab.sh is the check for that).

    python benchmark/inspect_cuda_history_sass.py [--source FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
from sglang_oscar.kernels.history_cuda import SOURCE  # noqa: E402  (the source the server builds)
# (hot-loop instructions, whole-kernel instructions) per (NSTAGE, HC), nvcc 13.0 (the GPU image's), at 32-token
# stages (OSCAR_TOK 32, after 57af105: the hot loop +1 instruction at NSTAGE 2, measured faster in the same-call A/B,
# results/probe_history_trace_57af105_tok_*; 9f16703's were 253 / 274 and 7704 / 7768 at NSTAGE 2). The window
# folded into the history CTAs (ace6621, 141cb17) grew the kernel ~9-10% (7112 / 7168 before at NSTAGE 2) and moved
# HC 8's hot loop by one scheduled instruction (275); kept on a same-call H200 A/B (results/probe_history_trace_
# 141cb17_foldbal_*: 0.96x at 64k batch 1 alone and chained, within 1% elsewhere, 32k batch 1 unchanged).
# The whole kernel is held too: rotate_q (8ecb8ea) left the hot loop as it was and grew the kernel by 32-43%, and
# that alone cost every batch-1 call ~1.8 us. A change that grows either needs a GPU A/B (run_gpu_ab.sh,
# probe_history_trace.py --sources) before these move; one that shrinks them lowers them.
# The K dot as integer mma (OSCAR_IMMA_K, 289fc8b) cut the hot loop by 6 and the block's copies in 32-bit records
# (f43d1c9) the per-block code 137 -> 90 (HC 4); the int8 q build grew the kernel ~10% (7608 -> 8352 at NSTAGE 2), kept
# on same-call H200 A/Bs (results/probe_history_trace_imma3_*: batch 1 0.99-1.01x alone, 1.02x chained; batch 8 / 32
# 0.93 / 0.95x). The int8 q build then took q from the fp16 build's one read of it instead of a second (8352 -> 8088;
# hot loop and per-block code unchanged; not A/B'd on a GPU).
# Keys (NSTAGE, HC, G64). The groups-of-64 instances (G64, compile-time groups: the default format) cut the hot loop by
# 2 (HC 4) / 8 (HC 8) and a block's other code by 15: the params copies and group selects were issued both ways under
# the runtime flags, which the other instances (G*: a group of 128 on either side) still read.
# Keys (NSTAGE, HC, G64, D). D 64 (SmolLM2, 2026-11-29): ~80 registers (3 CTAs of 8 warps per SM), a tile of 4 IMMA + 4
# HMMA in 198-223 instructions (D 128: 246-270; the score, softmax and V-param code per token is the same), 103-117 more
# per block (one 16-byte copy per token and side, instead of two lanes' halves).
# D 128's blocks unrolled (2026-11-29, tile_unroll: both tiles of a 32-token block in one pass; same-call H200 A/B
# 0.96-0.98x at batch 1, results/probe_history_trace_d128_unroll_*): the hot loop is the block, 548-618 instructions per
# 32 tokens against 2 x 246-270 + 75-100 = 567-640 before (G64 HC 4: 548 vs 567, HC 8: 581 vs 602), the kernel ~2.5%
# longer (8248 vs 8048 at NSTAGE 2 HC 4 G64), 128 registers, no spills. D 128 has no BLOCK_BUDGET rows since.
# Paired tiles at D 128 HC 4 (OSCAR_PAIR, 2026-12-01: the block's two tiles share one softmax): the hot loop 441-477
# instead of 548-572 (the common path without the rare rescale branch 375-384 instead of 418 at G64 NSTAGE 2), the
# kernel 3.8-4.2% longer (the second K dot's select and the halves' merge after the loop), 128 registers through the
# launch bounds.
BUDGET = {(2, 4, False, 128): (477, 8608), (2, 8, False, 128): (612, 8416), (3, 4, False, 128): (471, 8736),
          (3, 8, False, 128): (618, 8528), (4, 4, False, 128): (465, 8840), (4, 8, False, 128): (614, 8624),
          (2, 4, True, 128): (450, 8592), (2, 8, True, 128): (581, 8352), (3, 4, True, 128): (445, 8672),
          (3, 8, True, 128): (588, 8472), (4, 4, True, 128): (439, 8752), (4, 8, True, 128): (584, 8552),
          (2, 4, False, 64): (200, 2792), (2, 8, False, 64): (223, 2840), (2, 4, True, 64): (198, 2768),
          (2, 8, True, 64): (213, 2824), (3, 4, False, 64): (199, 2840), (3, 8, False, 64): (226, 2896),
          (3, 4, True, 64): (198, 2824), (3, 8, True, 64): (213, 2880), (4, 4, False, 64): (199, 2888),
          (4, 8, False, 64): (222, 2936), (4, 4, True, 64): (198, 2864), (4, 8, True, 64): (213, 2912)}
# instructions of a 32-token block outside the hot loop (block_loop extra; D 64's 32-token instances, whose tiles
# are not unrolled; D 128's were 75-100 before its blocks were)
BLOCK_BUDGET = {(2, 4, False, 64): 117, (2, 8, False, 64): 109, (2, 4, True, 64): 106, (2, 8, True, 64): 103,
                (3, 4, False, 64): 112, (3, 8, False, 64): 106, (3, 4, True, 64): 109, (3, 8, True, 64): 106,
                (4, 4, False, 64): 108, (4, 8, False, 64): 100, (4, 4, True, 64): 105, (4, 8, True, 64): 102}
# The 64-token D-64 instances (int2_history.cu WIDE, 4-head columns, 2-3 stages; 2026-11-29): keys (NSTAGE, HC, G64, D) as above;
# their hot loop is the whole 64-token block (four tiles unrolled: 16 IMMA + 16 HMMA, the rare rescale four times, the
# copies once): (its length, whole kernel). Per 32 tokens 446-452 against 2 x 198 + 106 = 502 / 2 x 200 + 117 = 517 in
# the 32-token instances' listings (the rescale included); 73-80 registers.
WIDE_BUDGET = {(2, 4, False, 64): (904, 3424), (2, 4, True, 64): (892, 3384), (3, 4, False, 64): (915, 3528),
               (3, 4, True, 64): (917, 3480)}
WIDE_TILES = 4  # tiles of 16 tokens per 64-token block
D128_BLOCK_TILES = 2  # a D-128 32-token block's tiles, unrolled: its hot loop is the block
BUDGET_NVCC = "13.0"
TOTAL_SLACK = 1.05  # whole-kernel growth allowed without an A/B
MAX_REGISTERS = 128  # 2 CTAs of 256 threads per SM (64K registers)
MAX_REGISTERS_D64 = 80  # D 64: 3 CTAs of 256 threads per SM (history_cuda's split count assumes it for either width)


def block_tiles(key) -> int:
    """16-token tiles in one pass of an instance's hot loop (int2_history.cu tile_unroll): the 64-token D-64 block's 4
    (wide), a D-128 32-token block's 2 (unrolled since 2026-11-29), else 1 (D 64's 32-token instances)."""
    return WIDE_TILES if key[4] else D128_BLOCK_TILES if key[3] == 128 else 1


def budget(key) -> tuple:
    """(hot-loop, whole-kernel) instruction budget of an instance key (nstage, hc, g64, d, wide)."""
    return (WIDE_BUDGET if key[4] else BUDGET)[key[:4]]


def tools():
    """(nvcc, cuobjdump) paths, or None where either is missing (nvcc: where the server's build looks,
    cuda_build.nvcc; cuobjdump: PATH, next to nvcc, or Triton's bundled copy)."""
    from sglang_oscar.kernels import cuda_build

    try:
        nvcc = cuda_build.nvcc()
    except cuda_build.CudaUnavailable:
        nvcc = None
    cands = [shutil.which("cuobjdump")]
    if nvcc:
        cands.append(os.path.join(os.path.dirname(nvcc), "cuobjdump"))
    try:
        import triton

        cands.append(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump"))
    except ImportError:
        pass
    cuobjdump = next((p for p in cands if p and os.path.exists(p)), None)
    return (nvcc, cuobjdump) if nvcc and cuobjdump else None


def nvcc_version(nvcc: str) -> str:
    """'13.0' from nvcc --version ('... release 13.0, V13.0.88')."""
    m = re.search(r"release (\d+\.\d+)", subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout)
    return m.group(1) if m else ""


def _instance(name: str):
    """(nstage, hc, g64, d, wide) of a kernel instance's mangled name (g64: the instance of two groups per row known at
    compile time, int2_history.cu TWO_G: groups of 64 at D 128, of 32 at D 64; d: head_dim; wide: 64-token stages)."""
    m = re.search(r"int2_history_kernelILi(\d+)ELi(\d+)ELb([01])ELi(\d+)ELb([01])E", name)
    return (int(m.group(1)), int(m.group(2)), bool(int(m.group(3))), int(m.group(4)), bool(int(m.group(5)))) \
        if m else None


def tile_mma(d: int) -> int:
    """mma instructions of one 16-token tile: 8 K + 8 V at D 128, 4 + 4 at D 64."""
    return d // 8


def compile_resources(source: str, nvcc: str, cubin: str) -> dict:
    """ptxas -v per instance: {(nstage, hc): {registers, stack, spill_stores, spill_loads}}."""
    res = subprocess.run([nvcc, "-O3", "-cubin", "-arch=sm_90", "-Xptxas", "-v", "-o", cubin, source],
                         capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(f"nvcc failed:\n{res.stderr[-2000:]}")
    out, cur = {}, None
    for line in res.stderr.splitlines():
        m = re.search(r"(?:Compiling entry function|Function properties for) '?(\S+?)'?(?: for|$)", line)
        if m:
            cur = _instance(m.group(1))
            continue
        if cur is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            out.setdefault(cur, {}).update(stack=int(m.group(1)), spill_stores=int(m.group(2)),
                                           spill_loads=int(m.group(3)))
        m = re.search(r"Used (\d+) registers", line)
        if m:
            out.setdefault(cur, {})["registers"] = int(m.group(1))
    return out


def sass_functions(cubin: str, cuobjdump: str) -> dict:
    """{(nstage, hc): [(address, instruction text)]} from cuobjdump -sass."""
    text = subprocess.run([cuobjdump, "-sass", cubin], capture_output=True, text=True, check=True).stdout
    out = {}
    for chunk in re.split(r"\n\s+Function : ", text)[1:]:
        key = _instance(chunk.split("\n", 1)[0])
        if key is None:
            continue
        ins = []
        for line in chunk.split("\n"):
            m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s*(.*?);", line)
            if m:
                ins.append((int(m.group(1), 16), m.group(2).strip()))
        out[key] = ins
    return out


def _backward_branches(ins: list):
    """(target, address) of every branch back to an earlier address: the loops of the listing."""
    for addr, text in ins:
        m = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            yield int(m.group(1), 16), addr


def hot_loop(ins: list, min_mma: int = 16) -> dict:
    """The shortest loop (a backward branch and its target) holding >= min_mma HMMA + IMMA (a tile's, tile_mma):
    {start, end, length, hmma}."""
    best = None
    for target, addr in _backward_branches(ins):
        body = [t for a, t in ins if target <= a <= addr]
        hmma = sum(1 for t in body if re.search(r"\b[HI]MMA\b", t))
        if hmma >= min_mma and (best is None or len(body) < best["length"]):
            best = dict(start=target, end=addr, length=len(body), hmma=hmma)
    if best is None:
        raise ValueError(f"no loop with >= {min_mma} HMMA + IMMA found")
    return best


def block_loop(ins: list, hot: dict) -> dict:
    """The shortest loop strictly around the hot loop: a history warp's 32-token block (its copies' addresses and
    issue, the next slots' loads, the stage wait, and the hot loop twice by trip count). {start, end, length, extra}:
    extra = its instructions outside the hot loop, the per-block cost that every history token shares."""
    best = None
    for target, addr in _backward_branches(ins):
        if not (target <= hot["start"] and hot["end"] <= addr) or (target, addr) == (hot["start"], hot["end"]):
            continue
        length = sum(1 for a, _ in ins if target <= a <= addr)
        if best is None or length < best["length"]:
            best = dict(start=target, end=addr, length=length, extra=length - hot["length"])
    if best is None:
        raise ValueError("no loop around the hot loop found")
    return best


def inspect(source: str = SOURCE) -> dict:
    found = tools()
    if found is None:
        raise RuntimeError("needs nvcc and cuobjdump")
    nvcc, cuobjdump = found
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "int2_history.cubin")
        res = compile_resources(source, nvcc, cubin)
        funcs = sass_functions(cubin, cuobjdump)
    out = {}
    for key in sorted(funcs):
        if block_tiles(key) > 1:  # a block's tiles unrolled: the hot loop is the block (no loop inside it)
            hot = hot_loop(funcs[key], block_tiles(key) * tile_mma(key[3]))
            out[key] = dict(res.get(key, {}), instructions=len(funcs[key]), hot_loop=hot, block_loop=None)
        else:
            hot = hot_loop(funcs[key], tile_mma(key[3]))
            out[key] = dict(res.get(key, {}), instructions=len(funcs[key]), hot_loop=hot,
                            block_loop=block_loop(funcs[key], hot))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", default=SOURCE)
    ap.add_argument("--json", default="", help="also write the rows here")
    args = ap.parse_args(argv)
    rows = inspect(args.source)
    for (nstage, hc, g64, d, wide), r in rows.items():
        loop_b, total_b = (WIDE_BUDGET if wide else BUDGET).get((nstage, hc, g64, d), (None, None))
        tiles = block_tiles((nstage, hc, g64, d, wide))
        block = (f"the hot loop is the {16 * tiles}-token block ({tiles} tiles)" if tiles > 1 else
                 f"per block {r['block_loop']['extra']} more (budget {BLOCK_BUDGET.get((nstage, hc, g64, d))})")
        print(f"D {d}{' wide' if wide else ''} NSTAGE {nstage} HC {hc} {'G2' if g64 else 'G*'}: "
              f"{r.get('registers')} registers, stack {r.get('stack')}, spills {r.get('spill_stores')}/"
              f"{r.get('spill_loads')}, {r['instructions']} instructions (budget {total_b}), "
              f"hot loop {r['hot_loop']['length']} ({r['hot_loop']['hmma']} HMMA / IMMA; budget {loop_b}), {block}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({f"{k[0]}x{k[1]}{'_g64' if k[2] else ''}{'_d64' if k[3] == 64 else ''}{'_wide' if k[4] else ''}":
                       v for k, v in rows.items()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
