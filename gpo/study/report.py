"""Writing a study's outputs from MLflow runs, and `gpo report RUN_ID...`, which rebuilds them from the store."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from gpo import tracking_store as store
from gpo.study import plots, tables
from gpo.tracking_store import RunRecord


def write_outputs(records: Sequence[RunRecord], out_dir: Path, title: str, notes: Sequence[str] = ()) -> list[Path]:
    """study.csv, study.md, the plots, and (when there are) groups.csv and the rates table; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = tables.table(records)
    columns = tables.run_columns(records)
    written = [tables.write_csv(out_dir / "study.csv", columns, rows)]
    summary = tables.groups(rows)
    base = next((r["group"] for r in rows if r["baseline"]), "")
    lines = [f"# {title}", "", *[f"- {n}" for n in notes],
             f"- Baseline for speed-ups: `{base}` (each run against the baseline run of its own seed). train_s sums "
             "the per-step times (evaluation and saving excluded); wall_s is the whole run.",
             f"- {tables.REWARD_NOTE}", ""]
    if tables.has_replicates(rows):
        group_columns, group_rows = tables.group_csv_rows(summary)
        written.append(tables.write_csv(out_dir / "groups.csv", group_columns, group_rows))
        shown = [c for c in summary[0] if c not in ("tokens_generated", "tokens_trained", "kept_frac")]
        lines += ["## Combinations over seeds", "", tables.interval_note(rows), "", tables.markdown(summary, shown),
                  ""]
    rates = tables.rate_table(records, rows)
    if rates:
        accuracy_key = next(k for k in rates[0] if k.startswith("accuracy"))
        written.append(tables.write_csv(out_dir / "rates.csv", *tables.group_csv_rows(rates)))
        rate_md = tables.markdown(rates, list(rates[0]))
        (out_dir / "rates.md").write_text(f"# Pruning rates: {title}\n\n{tables.interval_note(rows)}\n\n{rate_md}\n")
        written += [out_dir / "rates.md", plots.rates(rates, accuracy_key, out_dir / plots.RATE_PLOT)]
        lines += ["## By pruning rate", "", rate_md, "", f"![rates]({plots.RATE_PLOT})", ""]
    lines += ["## Runs", "", tables.markdown(rows, [c for c in columns if c != "run_id"]), ""]
    figures = [plots.reward_vs_time(records, out_dir / plots.PLOTS[0]),
               plots.accuracy_vs_speedup(rows, summary, out_dir / plots.PLOTS[1])]
    lines += [f"![{p.stem}]({p.name})" for p in figures]
    curve = plots.curve_metric(records)  # the caption says which measure the curve shows
    lines += ["", f"{figures[0].name} shows `{curve}` against training time: {plots.CURVES[curve][0]}."]
    md = out_dir / "study.md"
    md.write_text("\n".join(lines) + "\n")
    return [*written, md, *figures]


def report(run_ids: list[str], tracking_uri: str | None = None, out_dir: str | Path = "report") -> list[Path]:
    """`gpo report RUN_ID...`: the study's tables and plots from existing runs. A study's parent run id stands for
    all its runs; the baseline is the runs a study tagged, else the first run's group."""
    uri = store.tracking_uri(tracking_uri)
    client = store.client_for(uri)
    ids: list[str] = []
    for run_id in run_ids:
        ids += store.children(client, run_id) or [run_id]
    records = [store.read_run(client, rid) for rid in ids]
    out = Path(out_dir)
    outputs = write_outputs(records, out, title=f"gpo report of {len(records)} runs", notes=[f"Runs in `{uri}`."])
    print((out / "study.md").read_text(), flush=True)
    print(f"gpo: tables and plots in {out} ({', '.join(p.name for p in outputs)})", flush=True)
    return outputs
