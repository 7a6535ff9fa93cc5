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


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
