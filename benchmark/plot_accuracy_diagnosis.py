"""Plot the retrieval diagnosis (docs/results/accuracy_diagnosis.png) from the two JSON files that
benchmark/accuracy_diagnosis.py wrote on the GPU machine.

    python benchmark/plot_accuracy_diagnosis.py [--out docs/results/accuracy_diagnosis.png]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RES = ROOT / "benchmark" / "results"


def kept(cells: dict, length: str, name: str, tasks=("niah_single_1", "niah_multikey_1")) -> float:
    """Samples kept over samples bf16 solved, pooled over the tasks."""
    k = sum(cells[length][t][name]["kept"] for t in tasks if name in cells[length][t])
    n = sum(cells[length][t][name]["n"] for t in tasks if name in cells[length][t])
    return 100.0 * k / n if n else float("nan")


def per_layer(diag: dict, length: str, name: str, key: str, task: str = "niah_single_1") -> np.ndarray:
    return np.array(diag[length][task][name][key])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "accuracy_diagnosis.png")
    args = ap.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    a = json.loads((RES / "accuracy_diagnosis_NVIDIA_H200.json").read_text())
    b = json.loads((RES / "accuracy_context_NVIDIA_H200.json").read_text())
    fig, ax = plt.subplots(2, 2, figsize=(15, 10))

    # (a) what each change keeps of bf16's answers (single + multikey pooled)
    rows = [("balanced K + mean, 2k windows (old default)", a, "int2_best"),
            ("  same, V exact (K quantized only)", a, "int2_best_kq_only"),
            ("  same, K exact (V quantized only)", a, "int2_best_vq_only"),
            ("  same + logit variance correction", a, "int2_best_vc"),
            ("  same, K groups of 32 (2.75 bits)", a, "int2_best_kg32"),
            ("  same, exact K on the 9 worst KV heads", a, "int2_best_exactK_top9"),
            ("Hadamard + clip, 2k windows", a, "int2_hadamard_clip"),
            ("Hadamard + clip, 8k windows", b, "int2_hadamard_clip_8k"),
            ("balanced K + mean, 8k windows (new default)", b, "int2_best_8k"),
            ("INT4 K + INT2 V, 8k windows (3.5 bits)", b, "k4_v2_8k")]
    y = np.arange(len(rows))
    for i, L in enumerate(("4096", "8192")):
        vals = [kept(src["cells"], L, name) if L in src["cells"] else np.nan for _, src, name in rows]
        ax[0, 0].barh(y + 0.4 * i, vals, height=0.4, label=f"{int(L) // 1024}k")
    ax[0, 0].set_yticks(y + 0.2, [r[0] for r in rows])
    ax[0, 0].invert_yaxis()
    ax[0, 0].axvline(90, color="r", ls="--", lw=1, label="target 90%")
    ax[0, 0].set_xlabel("% of bf16's NIAH answers kept (single + multikey, SmolLM2-135M)")
    ax[0, 0].legend(loc="upper right", framealpha=0.9)
    ax[0, 0].set_title("(a) K precision decides retrieval; V does not")

    # (b) logit error of quantized keys per layer
    layers = np.arange(len(per_layer(a["diag"], "8192", "int2_best", "err_sq")))
    for src, name, L, style, lab in ((a, "int2_best", "4096", "C0--", "2k windows, 4k ctx"),
                                     (a, "int2_best", "8192", "C0-", "2k windows, 8k ctx"),
                                     (b, "int2_best_8k", "4096", "C1--", "8k windows, 4k ctx"),
                                     (b, "int2_best_8k", "8192", "C1-", "8k windows, 8k ctx")):
        rms = np.sqrt(per_layer(src["diag"], L, name, "err_sq")).mean(1)
        ax[0, 1].plot(layers, rms, style, label=lab)
    ax[0, 1].set_xlabel("layer")
    ax[0, 1].set_ylabel("RMS logit error on quantized keys (nats)")
    ax[0, 1].set_title("(b) keys fitted on 2k windows drift at 8k (RoPE phases)")
    ax[0, 1].legend()

    # (c) attention mass on the quantized history, method / exact
    for src, name, lab in ((a, "int2_best", "2k windows"), (a, "int2_best_vc", "2k windows + variance correction"),
                           (b, "int2_best_8k", "8k windows")):
        he = per_layer(src["diag"], "8192", name, "hist_e").sum(1)
        hq = per_layer(src["diag"], "8192", name, "hist_q").sum(1)
        ax[1, 0].semilogy(layers, hq / np.maximum(he, 1e-12), "o-", ms=3, label=lab)
    ax[1, 0].axhline(1, color="k", lw=0.8)
    ax[1, 0].set_xlabel("layer")
    ax[1, 0].set_ylabel("attention mass on INT2 history: quantized / exact (8k)")
    ax[1, 0].set_title("(c) noise mass: the history steals the softmax")
    ax[1, 0].legend()

    # (d) attention mass on the needle value's tokens per layer at 8k
    ne = per_layer(b["diag"], "8192", "int2_best_8k", "needle_e").sum(1)
    ax[1, 1].plot(layers, ne, "k-", label="exact")
    ax[1, 1].plot(layers, per_layer(a["diag"], "8192", "int2_best", "needle_q").sum(1), "C0-",
                  label="2k windows")
    ax[1, 1].plot(layers, per_layer(b["diag"], "8192", "int2_best_8k", "needle_q").sum(1), "C1-",
                  label="8k windows")
    ax[1, 1].set_xlabel("layer")
    ax[1, 1].set_ylabel("needle-value mass, summed over the 9 query heads (8k)")
    ax[1, 1].set_title("(d) retrieval heads lose needle mass")
    ax[1, 1].legend()
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=90)
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
