"""The nightly report: what each stage did, the gate's numbers, and a plot across
runs (the reward the agents earned per day, the held-out score of each candidate
against what was serving, and production's reward by served version), as Markdown
beside a PNG a person can glance at.
"""

from __future__ import annotations

import datetime as dt
import shutil
from pathlib import Path

#: Metrics on which the serving model scores a fixed value by definition: the gate's
#: ranking accuracy compares likelihood *changes* against the serving model, whose
#: own change is zero (50 %: no change). Drawn as a labelled reference line, never
#: as a series, which would read as a measurement that happened to stay flat.
BY_DEFINITION = {"ranking_accuracy": 0.5}


def _daily_reward(data: str) -> list[tuple[str, float, int]]:
    """(date, mean reward, rated rows) per transitions partition."""
    import polars as pl

    from nightshift.schemas import layout

    try:
        layout.check_dataset(data, layout.TRANSITIONS, "the nightly report")
        df = (pl.scan_parquet(layout.files(data, layout.TRANSITIONS), hive_partitioning=True)
              .filter(pl.col("reward").is_not_null() & pl.col("reward").is_finite())
              .group_by("date").agg(pl.col("reward").mean().alias("mean"), pl.len().alias("n"))
              .sort("date").collect())
    except layout.LayoutError:  # data this version cannot read: the run says so (exit 2), not a plot of it
        raise
    except Exception:  # noqa: BLE001 - no transitions yet: the plot says so
        return []
    return [(str(r["date"]), float(r["mean"]), int(r["n"])) for r in df.iter_rows(named=True)]


def _versions(data: str, checkpoints: str | None = None):
    """`judge.versions.by_version` (publish order and registry facts when `checkpoints`
    is given), or None when there are no transitions yet."""
    try:
        from nightshift.judge.versions import by_version

        return by_version(data, checkpoints=checkpoints)
    except Exception as e:  # noqa: BLE001 - no transitions yet: the plot and the section say so
        from nightshift.schemas.layout import LayoutError

        if isinstance(e, LayoutError):  # data this version cannot read: the run says so (exit 2)
            raise
        return None


def rolled_back(checkpoints: str | None) -> dict[str, str]:
    """Versions rolled back, and by what: the watch's decisions in `gate-log.jsonl`
    (`kind: watch` with `rolled_back_to`), and any other rollback `published.json`
    records (`rollback_of`, e.g. a manual `nightshift rollback`)."""
    out: dict[str, str] = {}
    if not checkpoints:
        return out
    from nightshift.judge import gatelog
    from nightshift.publish import registry

    for e in registry.read_lenient(checkpoints)[0]:
        if e.get("rollback_of"):
            out[str(e["rollback_of"])] = f"rolled back: to {e.get('version')}"
    for e in gatelog.read(checkpoints)[0]:
        if e.get("kind") == "watch" and e.get("rolled_back_to"):
            p = e.get("p_value")
            what = "canary stopped" if e.get("canary") else "rolled back"
            number = isinstance(p, (int, float)) and not isinstance(p, bool)
            out[str(e.get("candidate"))] = f"{what}: watch" + (f", p {p:.2g}" if number else "")
    return out


def state_notes(checkpoints: str | None) -> list[str]:
    """What the report could not read beside the checkpoints and left out: entries of
    `published.json`, lines of `gate-log.jsonl`."""
    if not checkpoints:
        return []
    from nightshift.judge import gatelog
    from nightshift.publish import registry

    notes = registry.read_lenient(checkpoints)[1]
    bad = gatelog.read(checkpoints)[1]
    if bad:
        notes.append(f"{checkpoints.rstrip('/')}/{gatelog.LOG}: {bad} unreadable line(s) skipped (a torn last line, "
                     "invalid UTF-8, or not a JSON object)")
    return notes


def _plot_versions(ax, stats, rolled: dict[str, str]) -> None:
    """Mean reward per served version (publish order) with its 95 % interval; per agent
    when there are several; hollow and without a bar below the trajectories an interval
    needs; the predecessor over the same hours of the week in grey when traffic has a
    weekly shape; rolled-back versions shaded red."""
    from matplotlib.lines import Line2D

    from nightshift.judge.versions import ALL, MIN_TRAJECTORIES

    rows = [s for s in (stats or []) if s.agent == ALL]
    if not rows:
        ax.text(0.5, 0.5, "no calls by any version yet", ha="center", va="center", transform=ax.transAxes)
        ax.set_title("production reward by served version")
        return
    by = {(s.version, s.agent): s for s in stats}
    agents = sorted({s.agent for s in stats if s.agent != ALL})
    series = [ALL] + (agents if len(agents) > 1 else [])
    matched = any(s.matched is not None and s.matched.mean is not None for s in rows)
    slots = (["matched"] if matched else []) + series
    step = min(0.7 / len(slots), 0.25)
    off = {k: (i - (len(slots) - 1) / 2) * step for i, k in enumerate(slots)}
    colors = {ALL: "black", **{a: f"C{i % 10}" for i, a in enumerate(agents)}}
    handles = []

    def point(x, s, color, marker="o", size=6):
        if s is None or s.mean is None:
            return
        if s.low is None:  # too few rated trajectories: a hollow marker, no bar
            ax.plot([x], [s.mean], marker=marker, markersize=size, markerfacecolor="white", markeredgecolor=color,
                    linestyle="none")
        else:
            ax.errorbar([x], [s.mean], yerr=[[s.mean - s.low], [s.high - s.mean]], fmt=marker, color=color,
                        markersize=size, capsize=3, elinewidth=1.2)

    for i, r in enumerate(rows):
        for a in series:
            point(i + off[a], by.get((r.version, a)), colors[a])
        if matched:
            point(i + off["matched"], r.matched, "grey", marker="D", size=4)
        if r.version in rolled:
            ax.axvspan(i - 0.45, i + 0.45, color="tab:red", alpha=0.10, linewidth=0)
    labels = []
    for r in rows:
        label = f"{r.label}\n{r.rated:,} rated"
        if r.version in rolled:
            label += "\n" + rolled[r.version].split(":")[0]  # rolled back / canary stopped
        elif any(t.startswith(("unknown", "malformed")) for t in r.tags):
            label += "\n(unknown)"
        labels.append(label)
    ax.set_xticks(range(len(rows)), labels, fontsize=8, rotation=30 if len(rows) > 8 else 0)
    for tick, r in zip(ax.get_xticklabels(), rows):
        if r.version in rolled:
            tick.set_color("tab:red")
        elif any(t.startswith(("unknown", "malformed")) for t in r.tags):
            tick.set_color("grey")
    ax.set_xlim(-0.6, len(rows) - 0.4)
    binary = all(s.binary for s in rows if s.mean is not None)
    ax.set_ylabel("success rate" if binary else "mean reward")
    handles += [Line2D([], [], color=colors[a], marker="o", linestyle="none",
                       label="all agents" if a == ALL else a) for a in series]
    if matched:
        handles.append(Line2D([], [], color="grey", marker="D", markersize=4, linestyle="none",
                              label="version before, same hours of the week"))
    if any(s.too_few for s in stats):
        handles.append(Line2D([], [], color="black", marker="o", markerfacecolor="white", linestyle="none",
                              label=f"too few rated (< {MIN_TRAJECTORIES}): no interval"))
    ax.legend(handles=handles, fontsize=7, loc="best")
    ax.grid(axis="y", alpha=0.3)
    ax.set_title("production reward by served version, in publish order (95 % interval)")


def _plot_gate(ax, history: list[dict]) -> None:
    """The candidate's held-out score per run. What served before is a series only
    where it was measured; on a metric whose serving score is fixed by definition
    (`BY_DEFINITION`) it is one labelled horizontal line."""
    runs = [h for h in history if h.get("candidate_metric") is not None]
    metric = (runs[-1].get("metric") or "metric") if runs else "metric"
    if not runs:
        ax.text(0.5, 0.5, "no gated candidates yet", ha="center", va="center", transform=ax.transAxes)
    else:
        xs = [h["run_id"][:16] for h in runs]
        ax.plot(xs, [h["candidate_metric"] for h in runs], marker="o", label="candidate")
        measured = [h for h in runs if h.get("metric") not in BY_DEFINITION and h.get("published_metric") is not None]
        if measured:
            ax.plot([h["run_id"][:16] for h in measured], [h["published_metric"] for h in measured], marker="s",
                    linestyle="--", label="serving before")
        for name in sorted({h.get("metric") for h in runs} & set(BY_DEFINITION)):
            ax.axhline(BY_DEFINITION[name], color="grey", linestyle=":", linewidth=1.2,
                       label=f"serving model: {BY_DEFINITION[name]:.0%} by definition (no change)")
        for x, h in zip(xs, runs):
            ax.annotate("published" if h.get("published") else "held back", (x, h["candidate_metric"]),
                        textcoords="offset points", xytext=(0, 7), ha="center", fontsize=7,
                        color="tab:blue" if h.get("published") else "tab:red")
        ax.set_ylabel(metric)
        ax.legend(fontsize=8)
        ax.tick_params(axis="x", rotation=30, labelsize=8)
    ax.set_title(f"the gate's held-out score per nightly run ({metric}, higher is better)")


def _plot_prompts(ax, table) -> None:
    """Mean reward per prompt version of each agent, with its 95 % interval; hollow
    below the trajectories an interval needs; the version each agent sends now in
    green, the others (older ones, and candidates the route put in) in blue."""
    xs, labels = [], []
    for agent in table:
        for v in agent.versions:
            if v.mean is None:
                continue
            x = len(xs)
            colour = "tab:green" if v.current else "tab:blue"
            if v.low is not None:
                ax.errorbar([x], [v.mean], yerr=[[v.mean - v.low], [v.high - v.mean]], fmt="o", color=colour, capsize=4)
            else:
                ax.plot([x], [v.mean], "o", mfc="none", color=colour)
            ax.annotate(str(v.rated), (x, v.mean), textcoords="offset points", xytext=(8, -3), fontsize=7, color="grey")
            xs.append(x)
            labels.append(f"{agent.agent}\n{v.id[:8]}")
    if not xs:
        ax.text(0.5, 0.5, "no rated prompt versions yet", ha="center", va="center", transform=ax.transAxes)
    ax.set_xticks(xs, labels, fontsize=7)
    ax.set_ylabel("reward")
    ax.set_title("reward by prompt version (green: the prompt each agent sends now; labels: rated trajectories)")


def plot(history: list[dict], data: str, path: Path, *, checkpoints: str | None = None, versions=None,
         prompts=None) -> Path:
    """The PNG: reward per day, held-out score per run, reward by version, and reward
    by prompt version when `prompts` (`prompts.versions.by_agent(...)`) is given.
    `versions`: `by_version(...)` already computed (else read here, with
    `checkpoints`' registry when given); `checkpoints` also says which versions
    were rolled back."""
    import logging

    import matplotlib

    matplotlib.use("Agg")
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    import matplotlib.pyplot as plt

    rows = 4 if prompts is not None else 3
    fig, axes = plt.subplots(rows, 1, figsize=(9, 10 + 3 * (rows - 3)), constrained_layout=True,
                             gridspec_kw={"height_ratios": [1, 1, 1.2, 1][:rows]})
    ax1, ax2, ax3 = axes[:3]
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
    _plot_gate(ax2, history)
    _plot_versions(ax3, versions if versions is not None else _versions(data, checkpoints), rolled_back(checkpoints))
    if prompts is not None:
        _plot_prompts(axes[3], prompts)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def markdown(run: dict, history: list[dict], png_name: str) -> str:
    lines = [f"# Nightshift nightly run {run['run_id']}", "", f"**Outcome:** {run.get('outcome', '?')}", ""]
    for stage, key in (("Build", "build"), ("Production watch", "watch"),
                       ("Prompt canaries: the watch", "prompt_watch"), ("Prompt optimization", "prompts"),
                       ("Train", "train"), ("Gate", "gate_lines"),
                       ("Publish", "publish_lines"), ("Reward by version", "versions"),
                       ("Reward by prompt version", "prompt_versions")):
        body = run.get(key)
        if body:
            lines += [f"## {stage}", "", "```", *body, "```", ""]
    g = run.get("gate") or {}
    if g.get("candidate_metrics"):
        lines += ["| metric | candidate | serving before |", "|---|---|---|"]
        cm, pm = g["candidate_metrics"], g.get("published_metrics") or {}
        for k in [k for k in cm if _number(cm[k]) or _number(pm.get(k))]:  # whatever the gate measured, in its order
            lines.append(f"| {k} | {_cell(cm.get(k))} | {_serving_cell(k, pm.get(k))} |")
        lines.append("")
    if g.get("command"):
        from nightshift.judge.gate import command_how, command_verdict

        c = g["command"]
        lines += ["## Your evaluation command", "", f"**{command_verdict(c)}** ({command_how(c)}): "
                  f"{c.get('said') or c.get('summary') or ''}", ""]
    if run.get("notes"):
        lines += ["## Notes", "", *(f"- {n}" for n in run["notes"]), ""]
    lines += [f"![reward per day, held-out score across runs, reward by version]({png_name})", "", "## Recent runs", "",
              "| run | outcome | version | candidate | serving before |", "|---|---|---|---|---|"]
    for h in history[-14:]:
        c, p = h.get("candidate_metric"), h.get("published_metric")
        lines.append(f"| {h['run_id']} | {h.get('outcome', '')} | {h.get('version') or '-'} | "
                     f"{_cell(c)} | {_serving_cell(h.get('metric'), p)} |")
    lines.append("")
    return "\n".join(lines)


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _cell(v) -> str:
    return "-" if v is None else f"{v:.4f}" if isinstance(v, float) else str(v)


def _serving_cell(metric: str | None, v) -> str:
    """What served before, said as a definition where it is one (not a measurement)."""
    if metric in BY_DEFINITION:
        return f"{BY_DEFINITION[metric]:.0%} by definition"
    return _cell(v)


def history_entry(run: dict) -> dict:
    g = run.get("gate") or {}
    metric = g.get("metric")
    return {"run_id": run["run_id"], "outcome": run.get("outcome"), "version": run.get("version"),
            "published": bool(run.get("published")), "metric": metric,
            "candidate_metric": (g.get("candidate_metrics") or {}).get(metric),
            "published_metric": (g.get("published_metrics") or {}).get(metric),
            "finished": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}


def versions_lines(data: str, checkpoints: str | None = None) -> list[str]:
    """The production reward of each version (judge/versions.py), for the report;
    with `checkpoints`, in publish order, with unknown and deleted versions said."""
    from nightshift.judge.versions import lines

    stats = _versions(data, checkpoints)
    return lines(stats) if stats else []


def write(run: dict, history: list[dict], data: str, out_dir: str | Path, *,
          checkpoints: str | None = None) -> tuple[Path, Path]:
    """`<out_dir>/<run>.md` and `.png`, and `latest.md`/`latest.png` beside them.
    `checkpoints`: the folder of `published.json` and `gate-log.jsonl`, for the
    versions' publish order, serving times and rollbacks (without it, version order
    and no rollback marks). The "Reward by version" section is read afresh here;
    `run["versions"]` is its fallback."""
    from nightshift.judge.versions import lines

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = run["run_id"].replace(":", "").replace("+", "")
    stats = _versions(data, checkpoints)
    if stats:
        run = {**run, "versions": lines(stats)}
    run = {**run, "notes": state_notes(checkpoints)}
    png = plot(history, data, out / f"{stem}.png", checkpoints=checkpoints, versions=stats,
               prompts=_prompt_table(data) if run.get("prompt_versions") else None)
    md = out / f"{stem}.md"
    md.write_text(markdown(run, history, png.name))
    shutil.copyfile(png, out / "latest.png")
    (out / "latest.md").write_text(markdown(run, history, "latest.png"))
    return md, png


def _prompt_table(data: str):
    """Every agent's prompt versions (`nightshift prompts`), for the plot; None when
    they cannot be read (the report's text already says why)."""
    from nightshift.prompts.versions import by_agent

    try:
        return by_agent(data, names=False)
    except Exception:  # noqa: BLE001 - a report only reads: no panel rather than no report
        return None


def read_history(path: Path) -> list[dict]:
    """The runs so far (`runs.jsonl`, appended once per run): a line that cannot be
    read (a torn last line, a hand edit) is skipped, not the report."""
    from nightshift.judge.gatelog import read_lines

    def usable(h: dict) -> bool:
        return isinstance(h.get("run_id"), str) and all(
            h.get(k) is None or isinstance(h[k], (int, float)) and not isinstance(h[k], bool)
            for k in ("candidate_metric", "published_metric"))

    return [h for h in read_lines(path)[0] if usable(h)]
