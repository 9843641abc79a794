"""The nightly report: what each stage did, the gate's numbers, and a plot across
runs (the reward the agents earned per day, the held-out score of each candidate
against what was serving), as Markdown beside a PNG a person can glance at.
"""

from __future__ import annotations

import datetime as dt
import json
import shutil
from pathlib import Path


def _daily_reward(data: str) -> list[tuple[str, float, int]]:
    """(date, mean reward, rated rows) per transitions partition."""
    import polars as pl

    try:
        df = (pl.scan_parquet(f"{data.rstrip('/')}/transitions/**/*.parquet", hive_partitioning=True)
              .filter(pl.col("reward").is_not_null() & pl.col("reward").is_finite())
              .group_by("date").agg(pl.col("reward").mean().alias("mean"), pl.len().alias("n"))
              .sort("date").collect())
    except Exception:  # noqa: BLE001 - no transitions yet: the plot says so
        return []
    return [(str(r["date"]), float(r["mean"]), int(r["n"])) for r in df.iter_rows(named=True)]


def plot(history: list[dict], data: str, path: Path) -> Path:
    import logging

    import matplotlib

    matplotlib.use("Agg")
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6.5), constrained_layout=True)
    days = _daily_reward(data)
    if days:
        ax1.plot([d for d, _, _ in days], [m for _, m, _ in days], marker="o", color="tab:green")
        for d, m, n in days:
            ax1.annotate(str(n), (d, m), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=7, color="grey")
        ax1.tick_params(axis="x", rotation=30, labelsize=8)
    else:
        ax1.text(0.5, 0.5, "no rated transitions yet", ha="center", va="center", transform=ax1.transAxes)
    ax1.set_title("mean reward of the agents' calls per day (labels: rated calls)")
    ax1.set_ylabel("reward")
    runs = [h for h in history if h.get("candidate_metric") is not None]
    if runs:
        xs = [h["run_id"][:16] for h in runs]
        ax2.plot(xs, [h["candidate_metric"] for h in runs], marker="o", label="candidate")
        ax2.plot(xs, [h.get("published_metric") for h in runs], marker="s", linestyle="--", label="serving before")
        for x, h in zip(xs, runs):
            ax2.annotate("published" if h.get("published") else "held back", (x, h["candidate_metric"]),
                         textcoords="offset points", xytext=(0, 7), ha="center", fontsize=7,
                         color="tab:blue" if h.get("published") else "tab:red")
        ax2.set_ylabel(runs[-1].get("metric", "metric"))
        ax2.legend(fontsize=8)
        ax2.tick_params(axis="x", rotation=30, labelsize=8)
    else:
        ax2.text(0.5, 0.5, "no gated candidates yet", ha="center", va="center", transform=ax2.transAxes)
    ax2.set_title("held-out score per nightly run (higher is better for adv_weighted_logp)")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def markdown(run: dict, history: list[dict], png_name: str) -> str:
    lines = [f"# Nightshift nightly run {run['run_id']}", "", f"**Outcome:** {run.get('outcome', '?')}", ""]
    for stage, key in (("Build", "build"), ("Production watch", "watch"), ("Train", "train"), ("Gate", "gate_lines"),
                       ("Publish", "publish_lines"), ("Reward by version", "versions")):
        body = run.get(key)
        if body:
            lines += [f"## {stage}", "", "```", *body, "```", ""]
    g = run.get("gate") or {}
    if g.get("candidate_metrics"):
        lines += ["| metric | candidate | serving before |", "|---|---|---|"]
        for k in ("nll", "adv_weighted_logp", "rows", "tokens"):
            c, p = g["candidate_metrics"].get(k), (g.get("published_metrics") or {}).get(k)
            fmt = (lambda v: f"{v:.4f}" if isinstance(v, float) else str(v))
            lines.append(f"| {k} | {fmt(c) if c is not None else '-'} | {fmt(p) if p is not None else '-'} |")
        lines.append("")
    lines += [f"![reward and held-out score across runs]({png_name})", "", "## Recent runs", "",
              "| run | outcome | version | candidate | serving before |", "|---|---|---|---|---|"]
    for h in history[-14:]:
        c, p = h.get("candidate_metric"), h.get("published_metric")
        lines.append(f"| {h['run_id']} | {h.get('outcome', '')} | {h.get('version') or '-'} | "
                     f"{'-' if c is None else f'{c:.4f}'} | {'-' if p is None else f'{p:.4f}'} |")
    lines.append("")
    return "\n".join(lines)


def history_entry(run: dict) -> dict:
    g = run.get("gate") or {}
    metric = g.get("metric")
    return {"run_id": run["run_id"], "outcome": run.get("outcome"), "version": run.get("version"),
            "published": bool(run.get("published")), "metric": metric,
            "candidate_metric": (g.get("candidate_metrics") or {}).get(metric),
            "published_metric": (g.get("published_metrics") or {}).get(metric),
            "finished": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}


def versions_lines(data: str) -> list[str]:
    """The production reward of each version (publish/versions.py), for the report."""
    try:
        from nightshift.publish.versions import by_version, lines

        return lines(by_version(data))
    except Exception:  # noqa: BLE001 - no transitions yet
        return []


def write(run: dict, history: list[dict], data: str, out_dir: str | Path) -> tuple[Path, Path]:
    """`<out_dir>/<run>.md` and `.png`, and `latest.md`/`latest.png` beside them."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = run["run_id"].replace(":", "").replace("+", "")
    png = plot(history, data, out / f"{stem}.png")
    md = out / f"{stem}.md"
    md.write_text(markdown(run, history, png.name))
    shutil.copyfile(png, out / "latest.png")
    (out / "latest.md").write_text(markdown(run, history, "latest.png"))
    return md, png


def read_history(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
