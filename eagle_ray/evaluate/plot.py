"""Per-position acceptance plot of an evaluation report: python -m eagle_ray.evaluate.plot REPORT PNG."""

import json
import sys


def main(report_path: str, png_path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    r = json.loads(open(report_path).read())
    fig, ax = plt.subplots(figsize=(6, 4))
    pos = list(range(r["k"]))
    for name, label in (("offline", "offline (simulated)"), ("online", "online EAGLE-3"),
                        ("untrained", "untrained drafter"), ("ngram", "n-gram")):
        if not r.get(name):  # no offline figures for an online-trained drafter
            continue
        ax.plot(pos, r[name]["per_position_acceptance"], marker="o",
                label=f"{label} (AL {r[name]['mean_acceptance_length']:.2f})")
    served = r.get("as_served") or {}
    for name, label in (("online", "as served, greedy drafting"),
                        ("online_probabilistic", "as served, probabilistic drafting")):
        m = (served.get("runs") or {}).get(name)
        if m and "per_position_acceptance" in m:
            ax.plot(pos, m["per_position_acceptance"], marker="s", linestyle="--",
                    label=f"{label} (AL {m['mean_acceptance_length']:.2f})")
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate (pooled over drafts)")
    ax.set_ylim(0, 1.05)
    ax.set_xticks(pos)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)


def curve(curve_path: str, png_path: str) -> None:
    """Mean acceptance length vs training tokens (log2 axis), fitted lines, extrapolation."""
    import math

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    r = json.loads(open(curve_path).read())
    fig, ax = plt.subplots(figsize=(6.5, 4))
    pts = r["points"]
    xs = [p["tokens"] for p in pts]
    last = xs[-1] * max(int(e["data"].rstrip("x")) for e in r["extrapolation"])
    for m, f in r["fits"].items():
        line = ax.plot(xs, [p[m] for p in pts], marker="o", linestyle="none", label=m.replace("_", " "))
        grid = [xs[0] * (last / xs[0]) ** (i / 40) for i in range(41)]
        ax.plot(grid, [min(r["k"] + 1, f["a"] + f["b"] * math.log2(x)) for x in grid],
                color=line[0].get_color(), alpha=0.6,
                label=f"fit: +{f['b']:.2f} per doubling (R^2 {f['r2']:.2f})")
    for key in ("online_as_served_probabilistic", "online_as_served_greedy_drafting"):
        if key in pts[-1]:
            ax.plot([xs[-1]], [pts[-1][key]], marker="*", markersize=12, linestyle="none",
                    label=key.replace("_", " "))
    ax.axvline(xs[-1], color="gray", linestyle=":", alpha=0.6)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("training tokens")
    ax.set_ylabel("mean acceptance length")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)


if __name__ == "__main__":
    if sys.argv[1] == "--curve":
        curve(sys.argv[2], sys.argv[3])
    else:
        main(sys.argv[1], sys.argv[2])
