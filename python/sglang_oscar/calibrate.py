"""Offline calibration CLI: capture statistics once, fit rotations and clip ratios, write a bundle.

    python -m sglang_oscar.calibrate --model smollm2 --out bundle.safetensors

Statistics windows and held-out windows (clip calibration) are cut from the same text but are
disjoint: held-out tokens are the last --heldout-tokens of the text, statistics windows are spread
over what precedes them. `calibrate_many` is the Python entry point that fits several variants
from one capture (the capture is the slow part).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Optional

import torch

from .config import SERVED_GROUP, SERVED_RECENT, SERVED_SINK, check_groups, clip_ratio_misfit, default_group
from .models import ModelError, attention_shape, model_attention_shape
from .rotation.bundle import save_bundle
from .rotation.capture import capture_statistics
from .rotation.fit import COMPOSITIONS, METHODS, bundle_orthogonality, fit_bundle


K4_CHOICE_MIN_WINDOW = SERVED_SINK + SERVED_RECENT  # no key is quantized before that (fit.choose_k4_heads)


def check_window_sizes(tokens: int, seq_len: int, heldout_tokens: int) -> None:
    if seq_len <= 0 or tokens <= 0 or heldout_tokens < 0:
        raise ValueError("--tokens and --seq-len must be positive and --heldout-tokens >= 0")


def split_windows(ids: list[int], *, tokens: int, seq_len: int, heldout_tokens: int):
    """(statistics windows, held-out windows): held-out from the end, statistics spread before it."""
    check_window_sizes(tokens, seq_len, heldout_tokens)
    need = tokens + heldout_tokens
    if len(ids) < need:
        raise ValueError(f"calibration text has {len(ids)} tokens but --tokens {tokens} + --heldout-tokens "
                         f"{heldout_tokens} = {need} are needed; lower them or pass a longer --text-file")
    head = ids[: len(ids) - heldout_tokens]
    tail = ids[len(ids) - heldout_tokens:]
    length = min(seq_len, tokens)
    count = max(1, tokens // length)
    stride = len(head) // count
    windows = [head[i * stride: i * stride + length] for i in range(count)]
    heldout = [tail[i: i + seq_len] for i in range(0, len(tail), seq_len)]
    heldout = [w for w in heldout if len(w) > 0]
    return windows, heldout


def served_context(model, requested: Optional[int]) -> Optional[int]:
    """The context calibration covers: `requested` (0: none), else the model's
    max_position_embeddings."""
    if requested is not None:
        if requested < 0:
            raise ValueError(f"--context must be >= 0, got {requested}")
        return requested or None
    return getattr(model.config, "max_position_embeddings", None)


def calibrate_many(model, tokenizer, variants: dict[str, dict], *, tokens: int, seq_len: int, heldout_tokens: int,
                   text: Optional[str] = None, progress: bool = True, source: Optional[str] = None,
                   model_id: str = "", context: Optional[int] = None):
    """Capture once, fit every variant. variants: name -> kwargs of fit_bundle (method required).
    context: spread the windows over RoPE positions [0, context) (rotation.capture_statistics)."""
    from . import data

    if text is None:
        text, source = data.calibration_text(), source or data.CALIBRATION_SOURCE
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    windows, heldout = split_windows(ids, tokens=tokens, seq_len=seq_len, heldout_tokens=heldout_tokens)
    stats = capture_statistics(model, windows, heldout, progress=progress, context=context)
    calibration = dict(source=source or "user text", tokens=stats.tokens, windows=stats.windows, seq_len=stats.seq_len,
                       heldout_tokens=stats.heldout_tokens, context=context)
    bundles = {}
    for name, kwargs in variants.items():
        kw = dict(kwargs)
        if "method" not in kw:
            raise ValueError(f"variant {name!r} has no 'method'")
        method = kw.pop("method")
        kw.setdefault("calibration", dict(calibration))
        kw.setdefault("model_id", model_id)
        d = stats.head_dim
        kw.setdefault("k_group", default_group(d))
        kw.setdefault("v_group", default_group(d))
        bundles[name] = fit_bundle(stats, method, progress=progress, **kw)
    return bundles, stats


def _fail(message: str):
    """Bad input: one line on stderr, exit status 2, no traceback."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def check_output_path(path: str) -> None:
    """The bundle can be written there: not a directory, and its nearest existing parent is a writable directory
    (save_bundle creates the missing ones). Checked before the capture, which takes minutes."""
    out = Path(path)
    if out.is_dir():
        raise ValueError(f"--out {path} is a directory; give a file name, e.g. {out / 'bundle.safetensors'}")
    parent = out.parent.resolve()
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"--out {path}: cannot create it under {parent} (not a writable directory)")


def _groups(args, head_dim: int) -> dict:
    """The K and V groups of the bundle (default: the server's, config.default_group), checked against head_dim."""
    groups = dict(k_group=args.group_k or default_group(head_dim), v_group=args.group_v or default_group(head_dim))
    check_groups(head_dim, {"--group-k": groups["k_group"], "--group-v": groups["v_group"]})
    return groups


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sglang_oscar.calibrate", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="smollm2, a .gguf file or a transformers model directory")
    p.add_argument("--out", required=True, help="output .safetensors bundle")
    p.add_argument("--method", default="oscar", choices=METHODS)
    p.add_argument("--composition", default="u_h", choices=COMPOSITIONS)
    p.add_argument("--cs", default="exact", choices=("exact", "cheap"), help="V target of oscar")
    p.add_argument("--per-head", action="store_true", help="one transform per KV head")
    p.add_argument("--center-k", action="store_true", help="subtract the key mean before rotating")
    served = f"default {SERVED_GROUP}, the served format (config.default_group)"
    p.add_argument("--group-k", type=int, default=None, help=f"K quantization group ({served})")
    p.add_argument("--group-v", type=int, default=None, help=f"V quantization group ({served})")
    p.add_argument("--bits", type=int, default=2, choices=(2, 4))
    p.add_argument("--tokens", type=int, default=16384, help="statistics tokens")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--context", type=int, default=None,
                   help="longest context the cache will serve: the windows are spread over RoPE positions "
                        "[0, context) (default: the model's max_position_embeddings; 0: the windows' own positions). "
                        "Windows as long as the served context (--seq-len) fit better still")
    p.add_argument("--heldout-tokens", type=int, default=4096, help="held-out tokens for clip calibration")
    p.add_argument("--clip", default=None, choices=("auto",), help="per-layer clip calibration (default)")
    p.add_argument("--clip-k", type=float, default=None, help="fixed K clip ratio for every layer")
    p.add_argument("--clip-v", type=float, default=None, help="fixed V clip ratio for every layer")
    p.add_argument("--rho-grid", type=float, nargs="+", default=None,
                   help="clip ratios tried by --clip auto (default: 1.0 down to 0.85)")
    p.add_argument("--k4-heads", type=int, default=None,
                   help="(layer, KV head) pairs whose keys are stored in INT4, chosen by how much INT2 keys disturb "
                        "their attention on the held-out windows (default: a quarter of them with --bits 2 and --clip "
                        "auto, the served 2.5-bit format; 0: INT2 keys everywhere)")
    p.add_argument("--text-file", default=None, help="calibration text (default: stdlib docstrings)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    # every input is checked here, before the model load and the capture (minutes): a typo fails in seconds
    if (args.clip_k is None) != (args.clip_v is None):
        _fail("give both --clip-k and --clip-v (or neither, for --clip auto)")
    if args.clip == "auto" and args.clip_k is not None:
        _fail("--clip auto and --clip-k/--clip-v are exclusive")
    clip = "auto" if args.clip_k is None else (args.clip_k, args.clip_v)
    ratios = [("--clip-k", args.clip_k), ("--clip-v", args.clip_v)] + [("--rho-grid", r) for r in args.rho_grid or ()]
    for option, ratio in ratios:
        msg = None if ratio is None else clip_ratio_misfit(ratio, f"{option} {ratio}")
        if msg is not None:
            _fail(msg)
    if args.context is not None and args.context < 0:
        _fail(f"--context must be >= 0 (0: no RoPE offsets), got {args.context}")
    if args.k4_heads is not None and args.k4_heads < 0:
        _fail(f"--k4-heads must be >= 0, got {args.k4_heads}")
    if args.k4_heads and (args.bits != 2 or clip != "auto"):
        _fail("--k4-heads needs --bits 2 and --clip auto (the heads are chosen on the held-out windows)")
    k4 = args.k4_heads if args.k4_heads is not None else "served" if args.bits == 2 and clip == "auto" else 0
    if k4 and min(args.seq_len, args.heldout_tokens) <= K4_CHOICE_MIN_WINDOW:
        _fail(f"INT4-key heads are chosen on held-out windows longer than the BF16 sink + recent window "
              f"({K4_CHOICE_MIN_WINDOW} tokens); --seq-len {args.seq_len} and --heldout-tokens {args.heldout_tokens} "
              "are too short: raise them, or pass --k4-heads 0 for INT2 keys everywhere")
    text, source = None, None
    if args.text_file:
        try:
            with open(args.text_file, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            _fail(f"cannot read --text-file: {e}")
        source = f"file:{args.text_file}"
    try:
        check_window_sizes(args.tokens, args.seq_len, args.heldout_tokens)
        check_output_path(args.out)
        _groups(args, model_attention_shape(args.model)["head_dim"])  # from the config: no weights read
    except (ModelError, ValueError) as e:
        _fail(str(e))
    torch.set_grad_enabled(False)
    t0 = time.time()
    from .models import load_model

    model, tok, model_id = load_model(args.model, device=args.device)
    try:
        groups = _groups(args, attention_shape(model)["head_dim"])
    except ValueError as e:
        _fail(str(e))
    variant = dict(method=args.method, composition=args.composition, per_head=args.per_head, center_k=args.center_k,
                   cs=args.cs, bits=args.bits, clip=clip, k4_heads=k4, **groups)
    if args.rho_grid:
        variant["rho_grid"] = tuple(args.rho_grid)
    context = served_context(model, args.context)
    try:
        bundles, _ = calibrate_many(model, tok, {"cli": variant}, tokens=args.tokens, seq_len=args.seq_len,
                                    heldout_tokens=args.heldout_tokens if clip == "auto" else 0, text=text,
                                    progress=not args.quiet, source=source, model_id=model_id, context=context)
    except ValueError as e:
        _fail(str(e))
    bundle = bundles["cli"]
    path = save_bundle(bundle, args.out)
    ortho = bundle_orthogonality(bundle)
    print(f"{'layer':>5} {'rho_K':>6} {'rho_V':>6} {'ortho_err':>9}  INT4-key heads")
    for i in range(bundle.num_layers):
        print(f"{i:>5} {float(bundle.k_clip[i]):6.3f} {float(bundle.v_clip[i]):6.3f} {ortho[i]:9.2e}  "
              f"{','.join(map(str, bundle.k4_heads(i))) or '-'}")
    print(f"method={bundle.method} composition={bundle.composition} per_head={bundle.per_head} "
          f"tokens={bundle.calibration.get('tokens')} time={time.time() - t0:.1f}s")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
