"""One benchmark report: every figure next to plain Celery measured in the same run.

Runs the existing benchmark scripts as subprocesses (each prints a markdown table, or, for
``beat_catchup.py``, plain lines), parses their output and writes

- ``OUT/report.md``: a summary table (ours, plain Celery, ratio) and every script's own table;
- ``OUT/report.png``: throughput ratios, recovery time ours vs plain, checkpoint p50/p99 and
  beat catch-up vs plain ``send_task`` (matplotlib, Agg backend);
- ``OUT/raw/<name>.txt``: each script's full stdout and stderr.

    python benchmarks/report.py [--quick] [--out benchmarks/out]

``--quick`` uses small sizes (checkpoint latency with 1k and 100k rows, fewer tasks and
samples, a 20 s recovery cap, 1k/100k units stored, 1-16 store processes): a smoke run of a
few minutes. The full run (10 million units stored, 1-64 store processes) takes ~25 minutes.
A benchmark that fails is reported as failed; the others still run.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from bench_common import HERE, ROOT, machine, markdown_table

Row = dict[str, str]

FULL: dict[str, list[str]] = {
    "throughput": [],
    "throughput_body10": ["--body-ms", "10"],
    "checkpoint": ["--rows", "1000,1000000"],
    "recovery": [],
    "beat": ["--slots", "10000"],
    "context": [],
    "checkpoint_breakdown": [],
    "store_size": ["--sizes", "1000,10000000"],
    "store_load": [],
}
QUICK: dict[str, list[str]] = {
    "throughput": ["--tasks", "400", "--reps", "2", "--warmup", "100"],
    "throughput_body10": ["--body-ms", "10", "--tasks", "150", "--reps", "2", "--warmup", "50"],
    "checkpoint": ["--rows", "1000,100000", "--samples", "500", "--warmup", "100",
                   "--first-saves", "100"],
    "recovery": ["--cap", "20"],
    "beat": ["--slots", "10000"],  # ~10 s: the real size even in a smoke run
    "context": ["--samples", "500", "--warmup", "100"],
    "checkpoint_breakdown": ["--samples", "500"],
    "store_size": ["--quick"],
    "store_load": ["--quick"],
}
SCRIPTS = {
    "throughput": "throughput.py",
    "throughput_body10": "throughput.py",
    "checkpoint": "checkpoint_latency.py",
    "recovery": "recovery_time.py",
    "beat": "beat_catchup.py",
    "context": "context_latency.py",
    "checkpoint_breakdown": "checkpoint_breakdown.py",
    "store_size": "store_size.py",
    "store_load": "store_load.py",
}
TITLES = {
    "throughput": "Throughput, trivial tasks",
    "throughput_body10": "Throughput, 10 ms task body",
    "checkpoint": "Checkpoint save latency",
    "recovery": "Time from SIGKILL + restart to the killed task running again",
    "beat": "Beat catch-up",
    "context": "Context get/put latency",
    "checkpoint_breakdown": "Checkpoint save against a raw fenced UPDATE + commit",
    "store_size": "Flat at size: few vs many finished units stored",
    "store_load": "Many workers on one store",
}


@dataclass
class Result:
    name: str
    argv: list[str]
    rc: int = 0
    seconds: float = 0.0
    stdout: str = ""
    stderr: str = ""
    tables: list[list[Row]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.rc == 0

    @property
    def table(self) -> list[Row]:
        return self.tables[-1] if self.tables else []


def parse_tables(text: str) -> list[list[Row]]:
    """Every markdown table in ``text``, as rows keyed by the header cells."""
    tables: list[list[Row]] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        is_table = (lines[i].startswith("|") and i + 1 < len(lines)
                    and re.fullmatch(r"\|(---\|)+", lines[i + 1].strip()))
        if not is_table:
            i += 1
            continue
        header = [c.strip() for c in lines[i].strip().strip("|").split("|")]
        rows: list[Row] = []
        i += 2
        while i < len(lines) and lines[i].startswith("|"):
            cells = [c.strip() for c in lines[i].strip().strip("|").split("|")]
            rows.append(dict(zip(header, cells, strict=False)))
            i += 1
        tables.append(rows)
    return tables


def run(name: str, extra: Sequence[str], raw_dir: Path) -> Result:
    argv = [sys.executable, str(HERE / SCRIPTS[name]), *extra]
    shown = " ".join(["python", f"benchmarks/{SCRIPTS[name]}", *extra])
    print(f"running: {shown}", flush=True)
    began = time.monotonic()
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, check=False)
    result = Result(name, [shown], proc.returncode, time.monotonic() - began,
                    proc.stdout, proc.stderr, parse_tables(proc.stdout))
    (raw_dir / f"{name}.txt").write_text(
        f"$ {shown}\nexit {proc.returncode}, {result.seconds:.0f} s\n\n{proc.stdout}\n"
        f"--- stderr ---\n{proc.stderr}")
    status = "ok" if result.ok else f"FAILED (exit {proc.returncode})"
    print(f"  {status} in {result.seconds:.0f} s", flush=True)
    return result


def num(text: str) -> float | None:
    match = re.search(r"-?\d[\d,]*(?:\.\d+)?", text or "")
    return float(match.group().replace(",", "")) if match else None


def ratio(ours: float | None, plain: float | None, fmt: str = "{:.2f}") -> str:
    return fmt.format(ours / plain) if ours is not None and plain else "-"


# --- figures out of each benchmark's output -------------------------------------------------

def throughput_rows(res: Result, label: str) -> list[list[str]]:
    table = res.table
    plain = next((r for r in table if r.get("mode") == "plain"), None)
    rows = []
    for r in table:
        if r.get("mode") == "plain" or plain is None:
            continue
        rows.append([f"{label} throughput, tasks/s ({r['store']} store)",
                     r["median tasks/s"], plain["median tasks/s"],
                     r["ratio ours/plain (medians)"],
                     "ours/plain, target >= 0.8" if label == "trivial-task"
                     else "ours/plain, target >= 0.95"])
    return rows


def throughput_ratios(res: Result) -> dict[str, float]:
    return {r["store"]: num(r["ratio ours/plain (medians)"]) or 0.0
            for r in res.table if r.get("mode") != "plain"}


def recovery_cases(res: Result) -> dict[str, dict[str, tuple[float | None, Row]]]:
    """broker -> mode -> (seconds or None if not within the cap, row)."""
    out: dict[str, dict[str, tuple[float | None, Row]]] = {}
    for r in res.table:
        text = r["killed task running again after the kill"]
        seconds = None if text.startswith("not within") else num(text)
        out.setdefault(r["broker"], {})[r["mode"]] = (seconds, r)
    return out


def recovery_rows(res: Result, cap: float) -> list[list[str]]:
    rows = []
    for broker, modes in recovery_cases(res).items():
        ours, ours_row = modes.get("resilient", (None, {}))
        plain, plain_row = modes.get("plain", (None, {}))

        def show(seconds: float | None, row: Row) -> str:
            if not row:
                return "-"
            when = f"{seconds:.1f} s" if seconds is not None else f"not within {cap:.0f} s"
            return f"{when} ({row['finished']} finished)"

        rows.append([f"SIGKILL + restart to the task running again, {broker}",
                     show(ours, ours_row), show(plain, plain_row),
                     ratio(ours, plain) if ours is not None and plain is not None else "-",
                     "ours/plain; lower is better"])
    return rows


BEAT_PLAIN = re.compile(r"plain Celery send_task of (\d+) messages: ([\d.]+) s")
BEAT_OURS = re.compile(r"catch-up: (\d+) missed slots .* in ([\d.]+) s")
BEAT_START = re.compile(r"start: (\d+) entries .* in ([\d.]+) s")


def beat_figures(res: Result) -> dict[str, float]:
    figures: dict[str, float] = {}
    for key, pattern in (("plain", BEAT_PLAIN), ("ours", BEAT_OURS), ("start", BEAT_START)):
        match = pattern.search(res.stdout)
        if match:
            figures[f"{key}_n"] = float(match.group(1))
            figures[key] = float(match.group(2))
    return figures


def beat_rows(res: Result) -> list[list[str]]:
    f = beat_figures(res)
    rows = []
    if "ours" in f:
        rows.append([f"beat: catch-up of {f['ours_n']:,.0f} missed slots, s",
                     f"{f['ours']:.2f}", f"{f['plain']:.2f} (send_task only)" if "plain" in f
                     else "-", ratio(f.get("ours"), f.get("plain")),
                     "ours/plain; target <= 1.2"])
    if "start" in f:
        rows.append([f"beat: install + first tick, {f['start_n']:,.0f} entries, s",
                     f"{f['start']:.2f}", "-", "-", "target <= 1 s for 1,000"])
    return rows


def checkpoint_rows(res: Result) -> list[list[str]]:
    return [[f"checkpoint save p50 / p99 ms, {r['store']}, {r['rows already stored']} rows",
             f"{r['save p50 ms']} / {r['save p99 ms']}", "- (plain Celery has none)", "-",
             "target p50 <= 1 ms (PostgreSQL)"] for r in res.table]


def context_rows(res: Result) -> list[list[str]]:
    rows = []
    store_only = next((r for r in res.table if r["cache"].startswith("store only")), None)
    for r in res.table:
        if r is store_only:
            continue
        base = (f"{store_only['hit get p50']} / {store_only['hit get p99']} (store read)"
                if store_only else "-")
        rows.append([f"context get (cache hit) p50 / p99 ms, {r['cache']}",
                     f"{r['hit get p50']} / {r['hit get p99']}", base,
                     ratio(num(r["hit get p50"]), num(store_only["hit get p50"]))
                     if store_only else "-", "p50 vs a bare store read"])
        rows.append([f"context get (miss, recovered) p50 / p99 ms, {r['cache']}",
                     f"{r['miss (recovered) get p50']} / {r['miss (recovered) get p99']}",
                     "-", "-", ""])
        rows.append([f"context put p50 / p99 ms, {r['cache']}",
                     f"{r['put p50']} / {r['put p99']}", "-", "-", ""])
    return rows


def table_with(res: Result, column: str) -> list[Row]:
    """The output's last table that has ``column`` (a script may print several)."""
    return next((t for t in reversed(res.tables) if t and column in t[0]), [])


def breakdown_rows(res: Result) -> list[list[str]]:
    table = table_with(res, "p50 ms")
    ours = next(r for r in table if r["PostgreSQL checkpoint save"].startswith("as shipped"))
    raw = next(r for r in table if r["PostgreSQL checkpoint save"].startswith("raw fenced"))
    return [["checkpoint save p50 ms (PostgreSQL)", ours["p50 ms"],
             f"{raw['p50 ms']} (raw fenced UPDATE + commit)",
             ratio(num(ours["p50 ms"]), num(raw["p50 ms"])), "target <= 1.5"]]


def size_rows(res: Result) -> list[list[str]]:
    table = table_with(res, "ratio p50 big/small")
    small, big = [k for k in table[0] if k.endswith(": p50 / p99 ms")][:2]
    return [[f"{r['operation']} p50 / p99 ms, {big.split(':')[0]} units stored",
             r[big], f"{r[small]} (at {small.split(':')[0]} units)", r["ratio p50 big/small"],
             "flat: target <= 1.2"]
            for r in table if r["operation"] in ("take", "checkpoint save", "finish")]


def load_rows(res: Result) -> list[list[str]]:
    table = table_with(res, "units/s")
    one = next((r for r in table if r["procs"] == "1"), None)
    return [[f"store hot path, {r['procs']} concurrent processes: units/s (take p50 / p99 ms)",
             f"{r['units/s']} ({r['take']})",
             f"{one['units/s']} (1 process)" if one else "-", r["per-proc efficiency"],
             "per-process efficiency against 1 process"] for r in table]


# --- report ---------------------------------------------------------------------------------

def summary(results: dict[str, Result], cap: float) -> str:
    builders = {
        "throughput": lambda r: throughput_rows(r, "trivial-task"),
        "throughput_body10": lambda r: throughput_rows(r, "10 ms-task"),
        "checkpoint": checkpoint_rows,
        "recovery": lambda r: recovery_rows(r, cap),
        "beat": beat_rows,
        "context": context_rows,
        "checkpoint_breakdown": breakdown_rows,
        "store_size": size_rows,
        "store_load": load_rows,
    }
    rows: list[list[str]] = []
    for name, build in builders.items():
        res = results.get(name)
        if res is None:
            continue
        if not res.ok:
            rows.append([TITLES[name], f"**failed** (exit {res.rc}, see raw/{name}.txt)",
                         "", "", ""])
            continue
        try:
            rows.extend(build(res))
        except (KeyError, TypeError, ValueError, IndexError, StopIteration) as exc:
            rows.append([TITLES[name], f"could not parse output ({exc!r})", "", "", ""])
    return markdown_table(["figure", "celery-resilient",
                           "baseline, same run (plain Celery unless named)", "ratio", "note"],
                          rows)


def context_line(res: Result) -> str:
    for line in res.stdout.splitlines():
        if line.startswith(("versions:", "load average", "SQLAlchemy", "broker ")):
            return line
    return ""


def write_markdown(path: Path, results: dict[str, Result], quick: bool, cap: float,
                   started: datetime, png_name: str) -> None:
    parts = [
        "# celery-resilient benchmark report",
        "",
        f"{started:%Y-%m-%d %H:%M} UTC, {'**quick** (small sizes, smoke run)' if quick else 'full'}"
        f" run; machine: {machine()}.",
        "Every figure with a plain-Celery baseline was measured in the same run as it.",
        "",
        f"![benchmark plots]({png_name})",
        "",
        "## Summary",
        "",
        summary(results, cap),
        "",
        "## Each benchmark",
    ]
    for name, res in results.items():
        parts += ["", f"### {TITLES[name]}", "", f"`{res.argv[0]}`: exit {res.rc}, "
                  f"{res.seconds:.0f} s (full output: `raw/{name}.txt`)", ""]
        notes = [context_line(res)] if context_line(res) else []
        if name == "beat":
            notes = [line for line in res.stdout.splitlines()
                     if line.startswith(("baseline:", "catch-up", "start:"))]
        parts += [f"{n}  " for n in notes]
        if res.tables:
            parts += ["", markdown_table(list(res.table[0].keys()),
                                         [list(r.values()) for r in res.table])]
        if not res.ok:
            tail = "\n".join(res.stderr.strip().splitlines()[-15:])
            parts += ["", "**Failed.** Last lines of stderr:", "", "```", tail, "```"]
    path.write_text("\n".join(parts) + "\n")


# --- plot -----------------------------------------------------------------------------------

def plot(path: Path, results: dict[str, Result], cap: float, quick: bool) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    plot_throughput(axes[0][0], results)
    plot_recovery(axes[0][1], results, cap)
    plot_checkpoint(axes[1][0], results)
    plot_beat(axes[1][1], results)
    fig.suptitle("celery-resilient vs plain Celery, same run"
                 + (" (quick run: small sizes)" if quick else ""), fontsize=13)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def no_data(ax, title: str) -> None:  # type: ignore[no-untyped-def]
    ax.set_title(title)
    ax.text(0.5, 0.5, "no data (benchmark failed)", ha="center", va="center",
            transform=ax.transAxes)
    ax.set_xticks([])
    ax.set_yticks([])


def plot_throughput(ax, results: dict[str, Result]) -> None:  # type: ignore[no-untyped-def]
    title = "Throughput, ours / plain acks_late (higher is better)"
    series = {label: throughput_ratios(results[name])
              for name, label in (("throughput", "trivial task"),
                                  ("throughput_body10", "10 ms task body"))
              if name in results and results[name].ok}
    if not series:
        no_data(ax, title)
        return
    stores = sorted({s for ratios in series.values() for s in ratios})
    width = 0.8 / len(stores)
    for j, store in enumerate(stores):
        xs = [i + (j - (len(stores) - 1) / 2) * width for i in range(len(series))]
        ys = [ratios.get(store, 0.0) for ratios in series.values()]
        bars = ax.bar(xs, ys, width, label=f"{store} store")
        ax.bar_label(bars, fmt="%.2f", fontsize=9)
    ax.axhline(1.0, color="grey", linewidth=1, label="plain Celery = 1.0")
    ax.axhline(0.9, color="red", linestyle="--", linewidth=1, label="target 0.9")
    ax.set_xticks(range(len(series)), list(series))
    ax.set_ylim(0, 1.25)
    ax.set_ylabel("ratio of median tasks/s")
    ax.set_title(title)
    ax.legend(fontsize=8, loc="upper left", ncols=2)


def plot_recovery(ax, results: dict[str, Result], cap: float) -> None:  # type: ignore[no-untyped-def]
    title = "SIGKILL + restart until the task runs again (lower is better)"
    res = results.get("recovery")
    if res is None or not res.ok or not res.table:
        no_data(ax, title)
        return
    cases = recovery_cases(res)
    brokers = list(cases)
    colors = {"plain": "tab:grey", "resilient": "tab:green"}
    labels = {"plain": "plain Celery", "resilient": "ResumableTask"}
    for j, mode in enumerate(("plain", "resilient")):
        for i, broker in enumerate(brokers):
            seconds, row = cases[broker].get(mode, (None, {}))
            if not row:
                continue
            x = i + (j - 0.5) * 0.38
            label = labels[mode] if i == 0 else None
            if seconds is None:
                ax.bar(x, cap, 0.38, color="white", edgecolor=colors[mode], hatch="//",
                       label=None)
                ax.text(x, cap * 0.5, f"not within\n{cap:.0f} s cap\n({row['finished']} done)",
                        ha="center", va="center", fontsize=8,
                        bbox={"facecolor": "white", "edgecolor": "none", "pad": 1})
                if label:
                    ax.bar(x, 0, 0.38, color=colors[mode], label=label)
            else:
                bars = ax.bar(x, seconds, 0.38, color=colors[mode], label=label)
                ax.bar_label(bars, fmt="%.1f s", fontsize=9)
    ax.axhline(cap, color="red", linestyle=":", linewidth=1, label=f"cap {cap:.0f} s")
    if any(seconds is None for modes in cases.values() for seconds, _ in modes.values()):
        ax.bar(0, 0, 0, color="white", edgecolor="black", hatch="//",
               label="not within the cap (drawn at the cap)")
    ax.set_xticks(range(len(brokers)), [{"sqlalchemy": "kombu SQL (SQLite)"}.get(b, b)
                                        for b in brokers])
    ax.set_ylim(0, cap * 1.12)
    ax.set_ylabel("seconds after the SIGKILL")
    ax.set_title(title)
    ax.legend(fontsize=8, loc="upper center")


def plot_checkpoint(ax, results: dict[str, Result]) -> None:  # type: ignore[no-untyped-def]
    title = "Checkpoint save latency by rows already stored"
    res = results.get("checkpoint")
    if res is None or not res.ok or not res.table:
        no_data(ax, title)
        return
    labels = [f"{r['store'].replace(' file', '')}\n{r['rows already stored']} rows"
              for r in res.table]
    xs = range(len(labels))
    p50 = [num(r["save p50 ms"]) or 0.0 for r in res.table]
    p99 = [num(r["save p99 ms"]) or 0.0 for r in res.table]
    b1 = ax.bar([x - 0.2 for x in xs], p50, 0.4, label="p50", color="tab:blue")
    b2 = ax.bar([x + 0.2 for x in xs], p99, 0.4, label="p99", color="tab:orange")
    ax.bar_label(b1, fmt="%.2f", fontsize=8)
    ax.bar_label(b2, fmt="%.2f", fontsize=8)
    ax.axhline(1.0, color="red", linestyle="--", linewidth=1, label="target p50 1 ms")
    ax.set_xticks(list(xs), labels, fontsize=9)
    ax.set_ylim(0, max([*p99, 1.0]) * 1.2)
    ax.set_ylabel("ms per save (no plain-Celery equivalent)")
    ax.set_title(title)
    ax.legend(fontsize=8, loc="upper left")


def plot_beat(ax, results: dict[str, Result]) -> None:  # type: ignore[no-untyped-def]
    res = results.get("beat")
    f = beat_figures(res) if res is not None and res.ok else {}
    title = "Beat catch-up (lower is better)"
    if "ours" not in f or "plain" not in f:
        no_data(ax, title)
        return
    title = f"Beat catch-up of {f['ours_n']:,.0f} missed slots (lower is better)"
    bars = ax.bar(["plain Celery\nsend_task only", "ResumableTask beat:\nclaim + publish + record"],
                  [f["plain"], f["ours"]], 0.5, color=["tab:grey", "tab:green"])
    ax.bar_label(bars, fmt="%.2f s", fontsize=9)
    ax.axhline(1.2 * f["plain"], color="red", linestyle="--", linewidth=1,
               label="target: 1.2 x plain")
    ax.legend(fontsize=8, loc="upper left")
    ax.set_ylim(0, max(f["plain"] * 1.2, f["ours"]) * 1.2)
    ax.set_ylabel("seconds")
    ax.set_title(title)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="small sizes (1k and 100k checkpoint rows): a few minutes")
    parser.add_argument("--out", type=Path, default=HERE / "out", help="output directory")
    parser.add_argument("--only", default=",".join(SCRIPTS),
                        help="comma-separated subset of: " + ", ".join(SCRIPTS))
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL
    cap = float(plan["recovery"][plan["recovery"].index("--cap") + 1]) \
        if "--cap" in plan["recovery"] else 90.0
    out: Path = args.out
    raw_dir = out / "raw"
    raw_dir.mkdir(parents=True, exist_ok=True)
    started = datetime.now(timezone.utc)
    results: dict[str, Result] = {}
    for name in (n.strip() for n in args.only.split(",") if n.strip()):
        results[name] = run(name, plan[name], raw_dir)
    png = out / "report.png"
    plot(png, results, cap, args.quick)
    md = out / "report.md"
    write_markdown(md, results, args.quick, cap, started, png.name)
    print()
    print(summary(results, cap))
    print(f"\nwrote {md} and {png}")
    return 0 if all(r.ok for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
