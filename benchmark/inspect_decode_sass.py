"""Compile the decode kernel's stage 1 for sm_90 on a machine without a GPU and count what its
history loop costs: registers, shared memory, spills, SASS instructions, barriers, shared-memory
loads/stores, tensor-core MMAs and the layout conversions Triton inserted (TTGIR).

Static numbers, not timings: they explain a measured time (benchmark/NOTES.md), they do not
replace one. Needs triton with its bundled ptxas / cuobjdump (the CI venv has them).

    python benchmark/inspect_decode_sass.py --model qwen3-8b --config 128:2:3
    python benchmark/inspect_decode_sass.py --dump /tmp/sass   # also write ttgir / ptx / sass
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))
from sglang_oscar.kernels import decode  # noqa: E402
from sglang_oscar.kernels.shapes import window_programs  # noqa: E402
from bench_decode import MODELS  # noqa: E402  (the benchmark's layer shapes)


# argument -> Triton signature type of _oscar_decode_stage1's runtime arguments
POINTERS = {
    "Q": "*bf16", "KC": "*u8", "KP32": "*i32", "KP64": "*i64", "VC": "*u8", "VP32": "*i32", "VP64": "*i64",
    "SK": "*bf16", "SV": "*bf16", "RK": "*bf16", "RV": "*bf16", "SINK_TABLE": "*i32",
    "REQ_TO_TOKEN": "*i32", "REQ_IDX": "*i32", "SEQ_LENS": "*i32", "RING_START": "*i32",
    "O_PART": "*fp32", "LSE_PART": "*fp32",
}
SCALARS = {"qk_scale": "fp32", "stride_r2t": "i32"}


def compile_stage1(hq, hkv, d, gk=64, gv=64, block_n=None, num_warps=2, num_stages=3, ns=16, fast_cvt=True,
                   maxnreg=None, subnormal=None, fold=None, page=1):
    fn = decode._oscar_decode_stage1
    group = hq // hkv
    np_ = max(decode.MIN_NP, triton.next_power_of_2(group))
    if block_n is None:
        block_n = decode.default_block_n(np_, d)
    if fold is None:
        fold = decode.default_fold(np_, d, block_n)
    if fold and maxnreg is None:
        maxnreg = decode.FOLD_MAXNREG
    consts = dict(
        HKV=hkv, GQA=group, D=d, GK=gk, GV=gv, SINK=64, WINDOW=256, NS=ns,
        SS=window_programs(64, 256)[0], RS=window_programs(64, 256)[1],
        WINDOW_ONLY=False, PDL_TRIGGER=False,
        BLOCK_M=max(16, triton.next_power_of_2(group)), NP=np_,
        BLOCK_N=block_n, BLOCK_W=16, K_A=1.0, V_A=1.0, K_CODEBOOK=False, V_CODEBOOK=False,
        DT=tl.float16, WDT=tl.bfloat16, FAST_CVT=fast_cvt, NGK=d // gk, NGV=d // gv, CH=min(gk, gv, d // 4),
        SUB=True if subnormal is None else subnormal,  # uniform levels: subnormal codes (oscar_decode's choice)
        FOLD=bool(fold), PAGE=page,  # pool page size (kernels/records.py)
    )
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in POINTERS:
            sig[name] = POINTERS[name]
            attrs[(i,)] = [["tt.divisibility", 16]]  # torch allocations are 16-byte aligned
        elif name in SCALARS:
            sig[name] = SCALARS[name]
            if name == "stride_r2t":
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "constexpr"
    src = ASTSource(fn, sig, constexprs=consts, attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": num_warps, "num_stages": num_stages,
                                     **({"maxnreg": maxnreg} if maxnreg else {})})
    kernel.oscar_settings = {"config": f"{block_n}:{num_warps}:{num_stages}", "subnormal": consts["SUB"],
                             "fold": bool(fold),
                             "maxnreg": maxnreg}  # as compiled (defaults resolved like oscar_decode)
    return kernel


def _cuobjdump(kernel, flag):
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([tool, flag, f.name], capture_output=True, text=True, check=True).stdout


def sass_of(kernel):
    return _cuobjdump(kernel, "-sass")


def resources(kernel):
    """REG / STACK / SHARED from the cubin (CompiledKernel.n_regs needs a GPU driver)."""
    text = _cuobjdump(kernel, "-res-usage")
    get = lambda key: int(re.search(key + r":(\d+)", text).group(1))  # noqa: E731
    return get("REG"), get("STACK")


def instructions(sass):
    """[(address, instruction text)] of a cuobjdump -sass listing (addresses of any width)."""
    ins = []
    for ln in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", ln)
        if m:
            ins.append((int(m.group(1), 16), m.group(2).strip()))
    return ins


def loops(ins):
    """Loop bodies of instructions(sass) (a backward branch to a lower address): [(start, end,
    opcode counts)], largest first. count() takes the INT2 history loop as the first one with HMMA in
    address order (the window loop comes after it)."""
    index = {a: i for i, (a, _) in enumerate(ins)}
    out = []
    for i, (a, text) in enumerate(ins):
        tgt = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", text)
        if tgt and int(tgt.group(1), 16) < a and int(tgt.group(1), 16) in index:
            body = ins[index[int(tgt.group(1), 16)]:i + 1]
            ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0] for _, t in body)
            out.append((body[0][0], a, ops))
    return sorted(out, key=lambda x: -sum(x[2].values()))


def skipped_inside(ins, start, end):
    """Instructions of the loop body [start, end] that a forward conditional branch inside it can
    skip (e.g. the lazy-rescale block): the loop's common path is the body without them."""
    skip = set()
    for a, text in ins:
        tgt = re.search(r"^@!?U?P\w+\s+BRA\b.*?0x([0-9a-f]+)", text)
        if start <= a < end and tgt and a < int(tgt.group(1), 16) <= end:
            skip.update(x for x, _ in ins if a < x < int(tgt.group(1), 16))
    return len(skip)


def count(kernel, sass):
    ttgir = kernel.asm["ttgir"]
    ins = instructions(sass)
    op = lambda pat: sum(1 for _, text in ins if re.search(pat, text))  # noqa: E731
    regs, stack = resources(kernel)
    # loops with tensor-core MMAs in address order: the INT2 history loop (full blocks) comes first, then
    # its masked tail loop when peeled (PEEL_TAIL), then the window loop
    hot = sorted((lp for lp in loops(ins) if any(name.startswith("HMMA") for name in lp[2])), key=lambda lp: lp[0])
    return {
        "registers": regs,
        "stack_bytes": stack,
        "shared_bytes": kernel.metadata.shared,
        "sass_instructions": len(ins),
        "bar_sync": op(r"\bBAR\.SYNC|\bBAR\b"),
        "lds": op(r"\bLDS"),
        "sts": op(r"\bSTS"),
        "ldsm": op(r"\bLDSM"),
        "ldg": op(r"\bLDG"),
        "ldgsts": op(r"\bLDGSTS"),
        "hmma": op(r"\bHMMA"),
        "prmt": op(r"\bPRMT"),
        "mufu_ex2": op(r"MUFU\.EX2"),
        "ttgir_convert_layout": ttgir.count("ttg.convert_layout"),
        "ttgir_local_alloc": ttgir.count("ttg.local_alloc"),
        # the INT2 history loop, per iteration and warp (benchmark/NOTES.md v4)
        "int2_loop": {"sass_range": f"{hot[0][0]:#x}-{hot[0][1]:#x}", "instructions": sum(hot[0][2].values()),
                      "common_path": sum(hot[0][2].values()) - skipped_inside(ins, hot[0][0], hot[0][1]),
                      "spill_ops": sum(n for name, n in hot[0][2].items() if name.startswith(("LDL", "STL"))),
                      "top_opcodes": dict(hot[0][2].most_common(16))} if hot else None,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-8b", choices=sorted(MODELS))
    ap.add_argument("--config", default="auto:2:3", help="BLOCK_N:num_warps:num_stages (auto: decode.default_block_n)")
    ap.add_argument("--slow-cvt", action="store_true", help="codes -> fp16 by plain arithmetic (no inline PTX)")
    ap.add_argument("--maxnreg", type=int, help="register cap per thread (ptxas -maxrregcount)")
    ap.add_argument("--subnormal", type=int, choices=(0, 1), help="code format (default: 1, uniform levels)")
    ap.add_argument("--fold", type=int, choices=(0, 1), help="folded [BLOCK_N/2, 2·NP] tiles (default: decode.default_fold)")
    ap.add_argument("--dump", help="folder for the ttgir / ptx / sass text")
    args = ap.parse_args()
    hq, hkv, d = MODELS[args.model]
    bn, nw, st = args.config.split(":")
    bn, nw, st = None if bn == "auto" else int(bn), int(nw), int(st)
    k = compile_stage1(hq, hkv, d, block_n=bn, num_warps=nw, num_stages=st, fast_cvt=not args.slow_cvt,
                       maxnreg=args.maxnreg, subnormal=None if args.subnormal is None else bool(args.subnormal),
                       fold=None if args.fold is None else bool(args.fold))
    sass = sass_of(k)
    res = {"model": args.model, "fast_cvt": not args.slow_cvt, **k.oscar_settings,
           **count(k, sass)}
    print(json.dumps(res, indent=1))
    if args.dump:
        os.makedirs(args.dump, exist_ok=True)
        for ext in ("ttgir", "ptx"):
            with open(os.path.join(args.dump, f"stage1.{ext}"), "w") as f:
                f.write(k.asm[ext])
        with open(os.path.join(args.dump, "stage1.sass"), "w") as f:
            f.write(sass)


if __name__ == "__main__":
    main()
