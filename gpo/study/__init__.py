"""`gpo study` runs a grid of combinations and compares them; `gpo report` rebuilds that comparison from MLflow.

    gpo study algo=grpo,dapo pruner=none,topk pruner.rate=0.5,0.75,0.875 task=arith train.steps=30
    gpo study pruner=topk pruner.rate=0,0.5,0.75,0.875 study.seeds=3 eval.tasks=[arith]   # replicates, P grid
    gpo study experiment=NAME            # the experiment YAML carries `grid:` (and `baseline:`, `study:`)
    gpo study study.resume=runs/study-...   # continue: finished runs kept, failed/killed ones run again
    gpo report RUN_ID... --tracking-uri sqlite:///runs/study-.../mlflow.db

Everything lives in one study directory, `<output_dir>/study-<timestamp>/`: one SQLite MLflow store
(`mlflow.db`, artifacts in `mlartifacts/`) with a parent run and one child run per combination and seed, each
run's own directory and log, and the outputs `study.md`, `study.csv`, `groups.csv` (replicates), `rates.md`,
`rates.csv`, `rates.png` (a pruning-rate grid), `reward_vs_time.png`, `accuracy_vs_speedup.png` (also artifacts
of the parent run). The tables are always built from what MLflow holds, so `gpo report` on the same runs
reproduces them exactly.

Modules: grid (what runs), runner and child (running them), store (MLflow), stats (confidence intervals),
tables, plots, report (writing the outputs), ray_launcher (study.launcher=ray).
"""

from gpo.study.grid import Plan, PlannedRun, plan, split_values
from gpo.study.report import report, write_outputs
from gpo.study.runner import study_from_args
from gpo.study.tables import table
from gpo.tracking_store import (
    TAG_BASELINE,
    TAG_COMBINATION,
    TAG_ERROR,
    TAG_GROUP,
    TAG_INDEX,
    TAG_PARENT,
    TAG_ROLE,
    RunRecord,
)

__all__ = ["Plan", "PlannedRun", "RunRecord", "TAG_BASELINE", "TAG_COMBINATION", "TAG_ERROR", "TAG_GROUP",
           "TAG_INDEX", "TAG_PARENT", "TAG_ROLE", "plan", "report", "split_values", "study_from_args", "table",
           "write_outputs"]
