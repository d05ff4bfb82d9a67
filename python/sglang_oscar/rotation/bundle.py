"""RotationBundle: every per-layer parameter of the OSCAR cache for one model, and its file format.

File: safetensors, tensors
  k_transform f32 [L, Hk, D, D]   Hk = 1 (one transform per layer) or kv_heads (per KV head)
  v_transform f32 [L, Hv, D, D]
  k_mean      f32 [L, Hm, D]      optional (center_k): keys are stored as (k − μ)·T; Hm = 1 or kv_heads
                                  (a per-layer transform may still subtract a per-head mean)
  k_clip, v_clip f32 [L]
  k_eigenvalues, v_eigenvalues f32 [L, Hk, D]  optional, descending (diagnostics only)
  k_level_a, v_level_a f32 [L]   only in version-1 files (INT2 codebook parameters): loaded when all are 1
and __metadata__ {"sglang_oscar": json} (format, version, model identity and shape, how it was
fitted, calibration source). Every load is validated so a bundle for another model, a corrupted
file or a non-orthogonal "rotation" fails loudly instead of silently degrading accuracy.
Convention everywhere: rows are right-multiplied, x' = x·T.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
from pathlib import Path
from typing import Optional

import torch

from ..config import clip_ratio_misfit, group_misfit
from ..quant.hadamard import hadamard_matrix
from ..quant.kv import SideQuantizer

FORMAT = "sglang-oscar-rotation"
VERSION = 2  # the version written; version 1 (with the level tensors) is still read
READ_VERSIONS = (1, 2)
META_KEY = "sglang_oscar"
ORTHO_TOL = 1e-3
RECOMPUTE = "recompute it with python -m sglang_oscar.calibrate --model <model> --out <file>"


class BundleError(ValueError):
    """A rotation bundle that cannot be used; the message says which file and what to do."""


def _tool_version() -> str:
    from .. import __version__

    return __version__


def orthogonality_error(t: torch.Tensor) -> float:
    """max |T·Tᵀ − I| over all stacked matrices (float64)."""
    t = t.double()
    eye = torch.eye(t.shape[-1], dtype=torch.float64)
    return float((t @ t.transpose(-1, -2) - eye).abs().max()) if t.numel() else 0.0


@dataclasses.dataclass
class RotationBundle:
    k_transform: torch.Tensor  # [L, Hk, D, D]
    v_transform: torch.Tensor  # [L, Hv, D, D]
    k_clip: torch.Tensor  # [L]
    v_clip: torch.Tensor  # [L]
    k_group: int
    v_group: int
    bits: int = 2
    kv_heads: int = 1  # 0 = unknown (seed files; only per-layer transforms then)
    k_mean: Optional[torch.Tensor] = None  # [L, 1 or kv_heads, D]
    k_eigenvalues: Optional[torch.Tensor] = None
    v_eigenvalues: Optional[torch.Tensor] = None
    k_bits: Optional[torch.Tensor] = None  # [L, kv_heads] key code width per (layer, KV head): 2 or 4; None: all 2
    model_id: str = ""
    method: str = "identity"
    composition: str = "none"
    per_head: bool = False
    center_k: bool = False
    orthogonal: bool = True
    calibration: dict = dataclasses.field(default_factory=dict)
    tool_version: str = dataclasses.field(default_factory=_tool_version)
    created: str = dataclasses.field(
        default_factory=lambda: datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    )

    @property
    def num_layers(self) -> int:
        return self.k_transform.shape[0]

    @property
    def head_dim(self) -> int:
        return self.k_transform.shape[-1]

    def k4_heads(self, layer: int) -> tuple:
        """KV heads of `layer` whose keys are INT4 in an INT2 cache (the calibration's choice, fit.choose_k4_heads)."""
        if self.k_bits is None:
            return ()
        return tuple(int(h) for h in (self.k_bits[layer] == 4).nonzero().flatten().tolist())

    @property
    def k4_count(self) -> int:
        """(layer, KV head) pairs with INT4 keys."""
        return 0 if self.k_bits is None else int((self.k_bits == 4).sum())

    def metadata(self) -> dict:
        return dict(
            format=FORMAT,
            version=VERSION,
            model_id=self.model_id,
            num_layers=self.num_layers,
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            k_group=self.k_group,
            v_group=self.v_group,
            bits=self.bits,
            method=self.method,
            composition=self.composition,
            per_head=self.per_head,
            center_k=self.center_k,
            orthogonal=self.orthogonal,
            calibration=self.calibration,
            tool_version=self.tool_version,
            created=self.created,
        )

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {
            "k_transform": self.k_transform,
            "v_transform": self.v_transform,
            "k_clip": self.k_clip,
            "v_clip": self.v_clip,
        }
        for name in ("k_mean", "k_eigenvalues", "v_eigenvalues", "k_bits"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return {k: v.detach().float().contiguous().cpu() for k, v in out.items()}

    def validate(self, where: str = "rotation bundle") -> "RotationBundle":
        validate_bundle(self, where)
        return self

    def layer_quantizers(self, layer: int, bits: Optional[int] = None) -> tuple[SideQuantizer, SideQuantizer]:
        """(K, V) SideQuantizers of one layer. Per-layer transforms come out [D, D], per-head [H, D, D]."""
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range: the bundle has {self.num_layers} layers")
        bits = self.bits if bits is None else bits
        kt, vt = self.k_transform[layer].float(), self.v_transform[layer].float()
        mean = None if self.k_mean is None else self.k_mean[layer].float()
        if kt.shape[0] == 1:
            kt = kt[0]
        if mean is not None and mean.shape[0] == 1:
            mean = mean[0]
        if vt.shape[0] == 1:
            vt = vt[0]
        kq = SideQuantizer(kt, mean, bits, self.k_group, float(self.k_clip[layer]),
                           self.k4_heads(layer) if bits == 2 else ())
        vq = SideQuantizer(vt, None, bits, self.v_group, float(self.v_clip[layer]))
        return kq, vq

    def shard(self, kv_start: int, kv_end: int) -> "RotationBundle":
        """The bundle a tensor-parallel rank holding KV heads [kv_start, kv_end) needs."""
        per_layer = self.k_transform.shape[1] == 1 and self.v_transform.shape[1] == 1
        if self.kv_heads == 0 and per_layer:  # head count unknown (seed files): any range is fine
            if not 0 <= kv_start < kv_end:
                raise ValueError(f"bad KV head range [{kv_start}, {kv_end})")
            return dataclasses.replace(self)
        if not 0 <= kv_start < kv_end <= self.kv_heads:
            raise ValueError(f"KV head range [{kv_start}, {kv_end}) not inside [0, {self.kv_heads})")

        def cut(t):
            if t is None or t.shape[1] == 1 or self.kv_heads == 0:
                return t  # one transform per layer: every rank uses the same one
            return t[:, kv_start:kv_end].clone()

        k_bits = None if self.k_bits is None else self.k_bits[:, kv_start:kv_end].clone()
        return dataclasses.replace(
            self,
            kv_heads=kv_end - kv_start,
            k_transform=cut(self.k_transform),
            v_transform=cut(self.v_transform),
            k_mean=cut(self.k_mean),
            k_eigenvalues=cut(self.k_eigenvalues),
            v_eigenvalues=cut(self.v_eigenvalues),
            k_bits=k_bits,
        )


def _fail(where: str, msg: str) -> None:
    raise BundleError(f"{where}: {msg}")


def validate_bundle(b: RotationBundle, where: str = "rotation bundle") -> None:
    L = b.k_transform.shape[0] if b.k_transform.dim() == 4 else -1
    if b.k_transform.dim() != 4 or b.v_transform.dim() != 4:
        _fail(where, f"k_transform/v_transform must be [L, H, D, D], got {tuple(b.k_transform.shape)} "
              f"and {tuple(b.v_transform.shape)}; {RECOMPUTE}")
    d = b.k_transform.shape[-1]
    for name in ("k_transform", "v_transform"):
        t = getattr(b, name)
        if t.shape[0] != L or t.shape[2] != d or t.shape[3] != d or t.shape[1] not in (1, b.kv_heads):
            _fail(where, f"{name} has shape {tuple(t.shape)}, expected [{L}, 1 or {b.kv_heads}, {d}, {d}]; {RECOMPUTE}")
        if not torch.isfinite(t).all():
            _fail(where, f"{name} contains NaN or Inf; {RECOMPUTE}")
    hk = b.k_transform.shape[1]
    for side, g in (("k_group", b.k_group), ("v_group", b.v_group)):
        misfit = group_misfit(d, g, side)
        if misfit is not None:
            _fail(where, misfit)
    if b.bits not in (2, 4):
        _fail(where, f"bits must be 2 or 4, got {b.bits}")
    for name in ("k_clip", "v_clip"):
        t = getattr(b, name)
        if tuple(t.shape) != (L,):
            _fail(where, f"{name} has shape {tuple(t.shape)}, expected [{L}]")
        for i, rho in enumerate(t.double().tolist()):
            misfit = clip_ratio_misfit(rho, f"{name}[{i}] = {rho}")
            if misfit is not None:
                _fail(where, misfit)
    if b.k_bits is not None:
        if tuple(b.k_bits.shape) != (L, b.kv_heads) or not b.kv_heads:
            _fail(where, f"k_bits has shape {tuple(b.k_bits.shape)}, expected [{L}, {b.kv_heads}] (layers x KV heads)")
        kb = b.k_bits.double()
        bad = ~((kb == 2) | (kb == 4))
        if bad.any():
            i = bad.nonzero()[0].tolist()
            _fail(where, f"k_bits[{i[0]}, {i[1]}] = {float(kb[i[0], i[1]])}: key code widths are 2 or 4")
        if b.bits != 2:
            _fail(where, f"k_bits chooses INT4-key heads of an INT2 cache, but bits is {b.bits}")
    if b.k_mean is not None and (b.k_mean.dim() != 3 or b.k_mean.shape[0] != L or b.k_mean.shape[2] != d
                                 or b.k_mean.shape[1] not in {1, hk, b.kv_heads}):
        _fail(where, f"k_mean has shape {tuple(b.k_mean.shape)}, expected [{L}, 1 or {max(hk, b.kv_heads)}, {d}]")
    for name, h in (("k_eigenvalues", hk), ("v_eigenvalues", b.v_transform.shape[1])):
        t = getattr(b, name)
        if t is not None and tuple(t.shape) != (L, h, d):
            _fail(where, f"{name} has shape {tuple(t.shape)}, expected [{L}, {h}, {d}]")
    if b.orthogonal:
        for name in ("k_transform", "v_transform"):
            err = orthogonality_error(getattr(b, name))
            if err > ORTHO_TOL:
                _fail(where, f"{name} is marked orthogonal but max|T·Tᵀ − I| = {err:.3g} > {ORTHO_TOL}; "
                      f"the file is corrupted or was written by a buggy tool; {RECOMPUTE}")
    else:
        for name in ("k_transform", "v_transform"):
            t = getattr(b, name).double()
            cond = torch.linalg.cond(t)
            if not bool(torch.isfinite(cond).all()) or float(cond.max()) > 1e6:
                _fail(where, f"{name} is singular or ill-conditioned (condition number {float(cond.max()):.3g} > 1e6); "
                      f"{RECOMPUTE}")


def check_expectations(b: RotationBundle, where: str, *, expect_layers=None, expect_kv_heads=None,
                       expect_head_dim=None) -> None:
    for what, want, have in (("layers", expect_layers, b.num_layers), ("KV heads", expect_kv_heads, b.kv_heads),
                             ("head_dim", expect_head_dim, b.head_dim)):
        if what == "KV heads" and have == 0:
            continue  # 0 = unknown (seed files); their per-layer transforms fit any head count
        if want is not None and int(want) != have:
            _fail(where, f"bundle fitted for {have} {what} but the model has {want}: {RECOMPUTE}")


def save_bundle(bundle: RotationBundle, path) -> Path:
    from safetensors.torch import save_file

    path = Path(path)
    bundle.validate(str(path))
    if path.parent and not path.parent.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file(bundle.tensors(), str(tmp), metadata={META_KEY: json.dumps(bundle.metadata(), sort_keys=True)})
    os.replace(tmp, path)  # never leave a half-written bundle under the real name
    return path


_REQUIRED_META = ("format", "version", "num_layers", "kv_heads", "head_dim", "k_group", "v_group", "bits")
_REQUIRED_TENSORS = ("k_transform", "v_transform", "k_clip", "v_clip")
# INT2 codebook parameters a (levels 0, a, 3−a, 3) that version-1 files carry: a = 1 is the uniform levels,
# the only ones the kernels read
_LEGACY_LEVEL_TENSORS = ("k_level_a", "v_level_a")


def load_bundle(path, *, expect_layers=None, expect_kv_heads=None, expect_head_dim=None) -> RotationBundle:
    from safetensors import safe_open

    where = str(path)
    if not Path(path).is_file():
        _fail(where, f"rotation bundle not found; {RECOMPUTE}")
    try:
        with safe_open(where, framework="pt") as f:
            raw_meta = (f.metadata() or {}).get(META_KEY)
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except BundleError:
        raise
    except Exception as e:  # safetensors raises its own error types for truncated/garbage files
        _fail(where, f"not a readable safetensors file ({e}); {RECOMPUTE}")
    if raw_meta is None:
        _fail(where, f"no '{META_KEY}' metadata: this is not an sglang-oscar rotation bundle; {RECOMPUTE}")
    try:
        meta = json.loads(raw_meta)
        if not isinstance(meta, dict):
            raise ValueError("metadata is not a JSON object")
    except ValueError as e:
        _fail(where, f"corrupted '{META_KEY}' metadata ({e}); {RECOMPUTE}")
    if meta.get("format") != FORMAT:
        _fail(where, f"format is {meta.get('format')!r}, expected {FORMAT!r}; {RECOMPUTE}")
    if meta.get("version") not in READ_VERSIONS:
        _fail(where, f"format version {meta.get('version')!r} is not supported (this tool reads versions "
              f"{', '.join(map(str, READ_VERSIONS))}); {RECOMPUTE}")
    missing = [k for k in _REQUIRED_META if k not in meta] + [k for k in _REQUIRED_TENSORS if k not in tensors]
    if missing:
        _fail(where, f"missing entries {missing}; {RECOMPUTE}")
    for name in _LEGACY_LEVEL_TENSORS:
        bad = (tensors[name].double() != 1.0).flatten().nonzero() if name in tensors else ()
        if len(bad):
            i = int(bad[0])
            _fail(where, f"{name}[{i}] = {float(tensors[name].flatten()[i]):g}: INT2 codebook levels are not "
                  "supported; refit with python -m sglang_oscar.calibrate")
    b = RotationBundle(
        k_transform=tensors["k_transform"],
        v_transform=tensors["v_transform"],
        k_clip=tensors["k_clip"],
        v_clip=tensors["v_clip"],
        k_group=int(meta["k_group"]),
        v_group=int(meta["v_group"]),
        bits=int(meta["bits"]),
        kv_heads=int(meta["kv_heads"]),
        k_mean=tensors.get("k_mean"),
        k_eigenvalues=tensors.get("k_eigenvalues"),
        v_eigenvalues=tensors.get("v_eigenvalues"),
        k_bits=None if "k_bits" not in tensors else tensors["k_bits"].round().to(torch.int32),
        model_id=str(meta.get("model_id", "")),
        method=str(meta.get("method", "")),
        composition=str(meta.get("composition", "")),
        per_head=bool(meta.get("per_head", False)),
        center_k=bool(meta.get("center_k", False)),
        orthogonal=bool(meta.get("orthogonal", True)),
        calibration=dict(meta.get("calibration") or {}),
        tool_version=str(meta.get("tool_version", "")),
        created=str(meta.get("created", "")),
    )
    if b.k_transform.dim() == 4 and (b.k_transform.shape[0] != int(meta["num_layers"])
                                     or b.k_transform.shape[-1] != int(meta["head_dim"])):
        _fail(where, f"k_transform has shape {tuple(b.k_transform.shape)} but the metadata says "
              f"{meta['num_layers']} layers of head_dim {meta['head_dim']}; {RECOMPUTE}")
    validate_bundle(b, where)
    check_expectations(b, where, expect_layers=expect_layers, expect_kv_heads=expect_kv_heads,
                       expect_head_dim=expect_head_dim)
    return b


def data_free_bundle(method: str, num_layers: int, kv_heads: int, head_dim: int, k_group: int, v_group: int,
                     clip=None, bits: int = 2, k4_heads=()) -> RotationBundle:
    """identity (T = I) or hadamard (T = H, QuaRot-style) for every layer; clip = None or (ρ_K, ρ_V).
    k4_heads: (layer, KV head) pairs whose keys are INT4 — without data nothing says which need it, so the builtin
    sources leave it empty; tests and the dummy-weight benchmarks of the served format name them."""
    if method == "identity":
        m = torch.eye(head_dim, dtype=torch.float32)
    elif method == "hadamard":
        m = hadamard_matrix(head_dim).float()
    else:
        raise ValueError(f"data-free method must be 'identity' or 'hadamard', got {method!r}; "
                         "fitted methods need python -m sglang_oscar.calibrate")
    rk, rv = (1.0, 1.0) if clip is None else clip
    t = m.expand(num_layers, 1, head_dim, head_dim).clone()
    ones = torch.ones(num_layers)
    b = RotationBundle(t, t.clone(), ones * rk, ones * rv, k_group, v_group, bits, kv_heads, method=method,
                       composition="none", calibration={"source": "none", "tokens": 0})
    if k4_heads:
        b.k_bits = torch.full((num_layers, kv_heads), 2, dtype=torch.int32)
        for layer, head in k4_heads:
            b.k_bits[layer, head] = 4
    return b.validate(f"{method} bundle")


def _read_seed_side(path, side: str) -> tuple[torch.Tensor, Optional[torch.Tensor], str]:
    """(rotations [L, 1, D, D], eigenvalues [L, 1, D] descending or None, objective) of one seed file."""
    where = str(path)
    if not Path(path).is_file():
        _fail(where, f"seed {side} rotation file not found")
    try:
        obj = torch.load(where, map_location="cpu", weights_only=True)  # never unpickle arbitrary code
    except Exception as e:
        _fail(where, f"cannot read as a weights-only torch file ({e})")
    if not isinstance(obj, dict) or "layers" not in obj:
        _fail(where, "not a seed rotation file: expected a dict with a 'layers' entry")
    if obj.get("format_version") != 1:
        _fail(where, f"seed format_version {obj.get('format_version')!r} is not supported (expected 1)")
    if obj.get("source_grouping", "layer") != "layer":
        _fail(where, f"source_grouping {obj.get('source_grouping')!r} is not supported (expected 'layer')")
    layers = obj["layers"]
    if not isinstance(layers, dict) or not layers:
        _fail(where, "'layers' must be a non-empty dict")
    by_id = {}
    for key, entry in layers.items():
        try:
            lid = int(key)
        except (TypeError, ValueError):
            _fail(where, f"layer key {key!r} is not an integer")
        if not isinstance(entry, dict) or "rotation" not in entry:
            _fail(where, f"layer {lid} has no 'rotation'")
        if "layer_id" in entry and int(entry["layer_id"]) != lid:
            _fail(where, f"layer key {key!r} holds layer_id {entry['layer_id']}")
        if lid in by_id:
            _fail(where, f"layer {lid} appears twice (int and str keys)")
        by_id[lid] = entry
    ids = sorted(by_id)
    if ids != list(range(len(ids))):
        _fail(where, f"layer ids must be contiguous from 0, got {ids[:5]}...{ids[-3:]}")
    rots, eigs = [], []
    d = None
    for lid in ids:
        r = by_id[lid]["rotation"]
        if not isinstance(r, torch.Tensor) or r.dim() != 2 or r.shape[0] != r.shape[1]:
            _fail(where, f"layer {lid} rotation must be a square D×D tensor, got "
                  f"{tuple(r.shape) if isinstance(r, torch.Tensor) else type(r).__name__}")
        if d is None:
            d = r.shape[0]
        elif r.shape[0] != d:
            _fail(where, f"layer {lid} rotation is {tuple(r.shape)} but layer 0 is {d}×{d}")
        err = orthogonality_error(r)
        if err > ORTHO_TOL:
            _fail(where, f"layer {lid} rotation is not orthogonal: max|R·Rᵀ − I| = {err:.3g} > {ORTHO_TOL}")
        rots.append(r.float())
        e = by_id[lid].get("eigenvalues")
        eigs.append(None if e is None else e.float().reshape(-1))
    rot = torch.stack(rots).unsqueeze(1)
    eig = None
    if all(e is not None and e.numel() == d for e in eigs):
        eig = torch.stack(eigs).flip(-1).unsqueeze(1)  # seed stores ascending; bundles descending
    return rot, eig, str(obj.get("objective", ""))


def load_seed_pt(k_path, v_path, *, k_group: int, v_group: int, clip_k: float = 1.0, clip_v: float = 1.0,
                 model_id: str = "") -> RotationBundle:
    """Convert the seed's two .pt files (K and V, one rotation per layer, x_rot = x·R) into a bundle."""
    kr, ke, kobj = _read_seed_side(k_path, "K")
    vr, ve, vobj = _read_seed_side(v_path, "V")
    if kr.shape != vr.shape:
        _fail(f"{k_path} / {v_path}", f"K has {kr.shape[0]} layers of {kr.shape[-1]}×{kr.shape[-1]} but V has "
              f"{vr.shape[0]} of {vr.shape[-1]}×{vr.shape[-1]}; were the files from different models?")
    L = kr.shape[0]
    ones = torch.ones(L)
    b = RotationBundle(kr, vr, ones * clip_k, ones * clip_v, k_group, v_group, 2, 0,
                       k_eigenvalues=ke, v_eigenvalues=ve, model_id=model_id, method=f"seed:{kobj}|{vobj}",
                       composition="seed", calibration={"source": f"seed files {Path(k_path).name}, "
                                                        f"{Path(v_path).name}"})
    return b.validate(f"{k_path} / {v_path}")
