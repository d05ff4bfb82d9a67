"""Fit a RotationBundle from CalibrationStats.

Methods (U = eigenvectors, columns sorted by descending eigenvalue, eigh in float64):
  identity   T = I                       (no rotation; the INT2 baseline)
  hadamard   T = H                       (QuaRot-style, data-free)
  pca        K: U of C_K (centered if center_k), V: U of C_V, then the composition
  oscar      K: U of C_Q (what logits are sensitive to), V: U of C_S (cheap or exact)
  balanced   K: the non-orthogonal transform that balances logit sensitivity against key energy
             (below), V: as oscar. Queries use T^{-T}, so logits are unchanged; T is not orthogonal.

Why "balanced". Quantizing k' = k·M adds noise e' of about equal size in every coordinate (after
the Hadamard), and the logit error (q·M^{-T})·e'ᵀ has variance tr(M^{-1} C_Q M^{-T})·σ²(e'), where
σ²(e') grows with the energy of k', tr(Mᵀ C_K M)/D. An orthogonal M (all rotations) leaves the product tr(C_Q)·tr(C_K)/D fixed; the
best invertible M makes both matrices diagonal and equal: with A = C_Q^{1/2} and
A·C_K·A = U_B Λ_B U_Bᵀ, M = A·U_B·Λ_B^{-1/4} gives the product (Σ λ_B^{1/2})²/D <= tr(C_Q)tr(C_K)/D
(Cauchy–Schwarz), a strict gain whenever query and key spectra are not aligned. The decode
kernel multiplies q by T^{-T} anyway, so this costs nothing at serving time.
Compositions of a fitted U:
  u          T = U
  u_h        T = U·H                     (default)
  u_p_hg     T = U·P·blockdiag(H_G)      (spectral placement, then a Hadamard inside each group)
"""

from __future__ import annotations

import warnings
from typing import Optional, Sequence

import torch
from tqdm.auto import tqdm

from ..config import SERVED_RECENT, SERVED_SINK, check_group_fits, clip_ratio_misfit, max_k4_heads
from ..quant.hadamard import block_hadamard_matrix, hadamard_matrix
from ..quant.placement import permutation_matrix, spectral_placement
from .bundle import RotationBundle, orthogonality_error
from .capture import CalibrationStats
from .clip_calibration import DEFAULT_RHO_GRID, calibrate_layer_clip, key_damage

METHODS = ("identity", "hadamard", "pca", "oscar", "balanced")
COMPOSITIONS = ("u", "u_h", "u_p_hg")


def sorted_eigh(c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenvalues (descending) and eigenvectors (columns) of a symmetric matrix, float64."""
    c = c.double()
    evals, evecs = torch.linalg.eigh((c + c.transpose(-1, -2)) / 2)
    return evals.flip(-1), evecs.flip(-1)


def compose(u: torch.Tensor, eigenvalues: torch.Tensor, composition: str, group: int) -> torch.Tensor:
    """T from the eigenbasis U [D, D] (columns descending) for one side.

    u_p_hg: the placement P spreads the spectrum evenly over groups and H_G only mixes inside a group. (P after a
    full H, the seed's U·H·P, is inert: every coordinate of x·U·H has variance tr(C)/D; docs/design.md.)
    """
    d = u.shape[-1]
    if composition == "u":
        return u
    if composition == "u_h":
        return u @ hadamard_matrix(d)
    if composition == "u_p_hg":
        return u @ permutation_matrix(spectral_placement(eigenvalues)) @ block_hadamard_matrix(d, group)
    raise ValueError(f"composition must be one of {COMPOSITIONS}, got {composition!r}")


def balanced_basis(c_q: torch.Tensor, c_k: torch.Tensor, floor: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, weights) with M = C_Q^{1/2}·U_B·Λ_B^{-1/4}; weights = Λ_B^{1/2} (descending) for placement.

    Eigenvalues of C_Q below floor·max are raised to it so M stays well conditioned (directions
    no query ever reads would otherwise get an unbounded key scale).
    """
    lq, uq = sorted_eigh(c_q)
    lq = lq.clamp_min(float(lq.max()) * floor)
    a = uq @ torch.diag(lq.sqrt()) @ uq.T
    lb, ub = sorted_eigh(a @ c_k.double() @ a)
    lb = lb.clamp_min(float(lb.max()) * floor)
    return a @ ub @ torch.diag(lb ** -0.25), lb.sqrt()


def _side_covariances(stats: CalibrationStats, layer: int, method: str, side: str, *, per_head: bool,
                      center_k: bool, cs: str) -> torch.Tensor:
    """[Hk, D, D] covariance whose eigenbasis is the transform of one side (Hk = 1 per layer)."""
    if method == "pca" and side == "k":
        if center_k:
            return stats.c_k(layer, centered=True) if per_head else stats.c_k_layer_centered(layer)
        c = stats.c_k(layer)
    elif method == "pca":
        c = stats.c_v(layer)
    elif side == "k":
        c = stats.c_q(layer)
    else:
        c = stats.c_s(layer, cs)
    return c if per_head else stats.layer_mean(c)


def fit_bundle(
    stats: CalibrationStats,
    method: str,
    *,
    composition: str = "u_h",
    per_head: bool = False,
    center_k: bool = False,
    cs: str = "exact",
    k_group: int,
    v_group: int,
    bits: int = 2,
    clip="auto",
    model_id: str = "",
    calibration: Optional[dict] = None,
    rho_grid: Sequence[float] = DEFAULT_RHO_GRID,
    progress: bool = False,
    k4_heads=0,
) -> RotationBundle:
    """Fit transforms (and clip ratios) for every layer; see the module docstring for methods (V: the V side of
    `method`; balanced uses oscar's V).

    clip: "auto" (per-layer calibration on the held-out windows of `stats`), (rho_k, rho_v) for
    every layer, or None (= 1.0).
    k4_heads: how many (layer, KV head) pairs get INT4 keys (choose_k4_heads, on the held-out windows): a count, or
    "served" for config.max_k4_heads(L, H), the served format's share (2.5 bits per element at groups of 64); 0 = INT2
    keys only.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    v_method = "oscar" if method == "balanced" else method
    if composition not in COMPOSITIONS:
        raise ValueError(f"composition must be one of {COMPOSITIONS}, got {composition!r}")
    if cs not in ("exact", "cheap"):
        raise ValueError(f"cs must be 'exact' or 'cheap', got {cs!r}")
    L, H, D = stats.num_layers, stats.kv_heads, stats.head_dim
    for name, g in (("k_group", k_group), ("v_group", v_group)):
        check_group_fits(D, g, name)
    hk = H if per_head else 1
    kt = torch.empty(L, hk, D, D, dtype=torch.float64)
    vt = torch.empty_like(kt)
    keig = vkeig = None
    data_free = {"identity": torch.eye(D, dtype=torch.float64), "hadamard": hadamard_matrix(D)}
    composition_used = "none" if method in data_free and v_method in data_free else composition
    keig = None if method in data_free else torch.empty(L, hk, D, dtype=torch.float64)
    vkeig = None if v_method in data_free else torch.empty(L, hk, D, dtype=torch.float64)
    if method in data_free:
        kt[:] = data_free[method]
    if v_method in data_free:
        vt[:] = data_free[v_method]
    if keig is not None or vkeig is not None:
        for layer in range(L):
            for side, out, eig, g, meth in (("k", kt, keig, k_group, method), ("v", vt, vkeig, v_group, v_method)):
                if meth in data_free:
                    continue
                if meth == "balanced":
                    cq = _side_covariances(stats, layer, "oscar", "k", per_head=per_head, center_k=center_k, cs=cs)
                    ck = _side_covariances(stats, layer, "pca", "k", per_head=per_head, center_k=center_k, cs=cs)
                    for h in range(hk):
                        m, w = balanced_basis(cq[h], ck[h])
                        eig[layer, h] = w
                        out[layer, h] = compose(m, w, composition, g)
                    continue
                covs = _side_covariances(stats, layer, meth, side, per_head=per_head, center_k=center_k, cs=cs)
                for h in range(hk):
                    lam, u = sorted_eigh(covs[h])
                    eig[layer, h] = lam
                    out[layer, h] = compose(u, lam, composition, g)
    k_mean = None
    if center_k:
        mu = torch.stack([stats.mu_k(layer) for layer in range(L)])  # [L, H, D]
        k_mean = mu.float()  # per KV head even for a per-layer transform: means differ by head
    ones = torch.ones(L)
    bundle = RotationBundle(
        k_transform=kt.float(),
        v_transform=vt.float(),
        k_clip=ones.clone(),
        v_clip=ones.clone(),
        k_group=k_group,
        v_group=v_group,
        bits=bits,
        kv_heads=H,
        k_mean=k_mean,
        k_eigenvalues=None if keig is None else keig.float(),
        v_eigenvalues=None if vkeig is None else vkeig.float(),
        model_id=model_id,
        method=method,
        composition=composition_used,
        per_head=per_head,
        center_k=center_k,
        orthogonal=method != "balanced",
        calibration=dict(calibration) if calibration is not None else {
            "source": "unknown", "tokens": stats.tokens, "windows": stats.windows, "seq_len": stats.seq_len},
    )
    if v_method == "oscar":
        bundle.calibration["cs"] = cs
    if v_method != method:
        bundle.calibration["v_method"] = v_method  # which V target was used
    _apply_clip(bundle, stats, clip, rho_grid, progress)
    if k4_heads == "served":
        k4_heads = max_k4_heads(L, H)
    if k4_heads and bits != 2:
        raise ValueError(f"k4_heads gives INT4 keys to heads of an INT2 cache; this bundle has bits {bits}")
    if k4_heads:
        choose_k4_heads(bundle, stats, k4_heads, progress=progress)
    return bundle.validate("fitted bundle")


def choose_k4_heads(bundle: RotationBundle, stats: CalibrationStats, n: int, *, progress: bool = False,
                    sink: int = SERVED_SINK, recent: int = SERVED_RECENT) -> list:
    """Store the keys of the n (layer, KV head) pairs whose INT2 keys disturb attention most
    (clip_calibration.key_damage on the held-out windows, with the layer's calibrated clip; the served sink and
    recent window exact) in INT4 (bundle.k_bits 4: no clip, uniform levels). Returns the pairs, most damaged first;
    the scores go to bundle.calibration["key_damage"] ([L][Hkv])."""
    L, H = bundle.num_layers, bundle.kv_heads
    if not 0 <= n <= L * H:
        raise ValueError(f"{n} INT4-key heads of {L} layers x {H} KV heads")
    longest = max((k.shape[1] for ks in stats.heldout_k for k in ks), default=0)
    if longest <= sink + recent:
        raise ValueError(f"choosing INT4-key heads needs held-out windows longer than sink + recent window "
                         f"({sink} + {recent}: no key is quantized before that); the longest has {longest} tokens")
    damage = []
    for layer in tqdm(range(L), desc="key damage", disable=not progress, unit="layer"):
        kq, _ = bundle.layer_quantizers(layer)
        damage.append(key_damage(stats.heldout_q[layer], stats.heldout_k[layer], kq, scaling=stats.scaling[layer],
                                 sink=sink, recent=recent))
    flat = torch.stack(damage).flatten()
    top = [(int(i) // H, int(i) % H) for i in torch.argsort(flat, descending=True, stable=True)[:n]]
    bundle.k_bits = torch.full((L, H), 2, dtype=torch.int32)
    for layer, head in top:
        bundle.k_bits[layer, head] = 4
    bundle.calibration["key_damage"] = [[round(float(x), 5) for x in d] for d in damage]
    bundle.calibration["k4_heads"] = [list(p) for p in top]
    return top


def _apply_clip(bundle: RotationBundle, stats: CalibrationStats, clip, rho_grid, progress) -> None:
    L = bundle.num_layers
    if clip is None:
        return
    if clip != "auto":
        try:
            rk, rv = (float(x) for x in clip)
        except (TypeError, ValueError):
            raise ValueError(f"clip must be 'auto', None or a pair (rho_k, rho_v), got {clip!r}") from None
        for side, r in (("K", rk), ("V", rv)):
            msg = clip_ratio_misfit(r, f"{side} clip ratio {r}")
            if msg is not None:
                raise ValueError(msg)
        bundle.k_clip[:] = rk
        bundle.v_clip[:] = rv
        return
    if not stats.heldout_q or not any(stats.heldout_q):
        raise ValueError("clip='auto' needs held-out windows in the statistics (capture_statistics(..., heldout=...)); "
                         "pass heldout windows or a fixed clip=(rho_k, rho_v)")
    for layer in tqdm(range(L), desc="clip", disable=not progress, unit="layer"):
        kq, vq = bundle.layer_quantizers(layer)
        choice = calibrate_layer_clip(stats.heldout_q[layer], stats.heldout_k[layer], stats.heldout_v[layer], kq, vq,
                                      scaling=stats.scaling[layer], rho_grid=rho_grid, seed=layer)
        bundle.k_clip[layer] = choice.rho_k
        bundle.v_clip[layer] = choice.rho_v
    # A choice on the smallest ρ of the grid means the optimum may lie below it: say so, because
    # silently clamped clip ratios look like a calibrated result.
    floor = min(rho_grid)
    for side, t in (("K", bundle.k_clip), ("V", bundle.v_clip)):
        at_floor = [i for i in range(L) if float(t[i]) <= floor + 1e-9]
        if at_floor:
            warnings.warn(f"{side} clip ratio hit the smallest grid value {floor} in {len(at_floor)}/{L} layers "
                          f"({at_floor[:8]}{'...' if len(at_floor) > 8 else ''}); extend rho_grid below {floor}",
                          stacklevel=3)


def bundle_orthogonality(bundle: RotationBundle) -> list[float]:
    """Per-layer max|T·Tᵀ − I| over both sides (for the CLI summary)."""
    return [max(orthogonality_error(bundle.k_transform[i]), orthogonality_error(bundle.v_transform[i]))
            for i in range(bundle.num_layers)]
