"""The `gpo` command: run, config, list, eval, study, report.

Exit codes: 0 success, 2 user error (a one-paragraph message, no traceback), 1 internal error (traceback).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import traceback
from collections.abc import Callable, Sequence

from gpo.errors import UserError, print_user_error
from gpo.run_config import KINDS

# Config groups that are not component kinds: picked by name like a component, but plain sections.
PLAIN_GROUPS = ("model", "engine", "experiment")

EXAMPLES = """\
examples:
  gpo run                                          # the embedded default: CPPO on arith with SmolLM2-135M
  gpo run algo=dapo pruner=topk allocator=dynamic task=math
  gpo run algo=grpo pruner=none allocator=static optim.lr=1e-6 train.group_size=16
  gpo run experiment=cppo_gsm8k --dry-run          # print the resolved config, build nothing
  gpo run --config my_run.yaml train.steps=100
  gpo list pruner                                  # components with their fields and defaults
  gpo eval model=runs/NAME/final task=gsm8k split=test limit=20
"""

RUN_HELP = f"""\
arguments are `group=name` picks (groups: {', '.join(KINDS + PLAIN_GROUPS)})
and dotted `key=value` overrides; later layers win:
  configs/base.yaml < group picks < experiment=NAME < --config FILE < key=value overrides
A `model=` value that is not a shipped model config is taken as a path, a .gguf file or a Hub name.
`gpo list KIND` shows a kind's components and their fields (kinds: {', '.join(KINDS)}).
"""


STUDY_HELP = """\
arguments are those of `gpo run`; a comma list (`pruner=none,topk`, `pruner.rate=0.5,0.75`) is a grid axis,
and every combination runs. How the grid runs is set with `study.KEY=VALUE` (or a `study:` section of an
experiment or --config file):
  study.seeds=N             replicates: each combination with seed, seed+1, ... (or give `seed=1,2,3` as an axis)
  study.parallel=N          runs at once on this machine (on GPUs each gets engine.num_processes devices)
  study.resume=DIR          continue the study in DIR: finished runs are kept, failed/killed/missing ones run again
  study.launcher=local|ray  ray: each run a Ray task (pip install gpo[ray]); with study.cpus_per_run=C and
                            study.ray_address=ADDRESS (default: start a local Ray)
  study.keep_checkpoints=true  keep each finished run's training checkpoints (deleted by default)

examples:
  gpo study algo=grpo,dapo pruner=none,topk pruner.rate=0.5,0.75 task=arith train.steps=30
  gpo study experiment=NAME                                 # the experiment YAML carries `grid:`
  gpo study pruner=none,topk study.seeds=3                  # 3 seeds per combination, confidence intervals
  gpo study algo=grpo,dapo study.parallel=2                 # two runs at a time
  gpo study study.resume=runs/study-20261205-101500         # rerun only what did not finish
  gpo study algo=grpo,dapo study.launcher=ray study.cpus_per_run=2
"""


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args, extra = parser.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    # argparse stops collecting `group=name|key=value` words at the first flag; the ones after it (`gpo run a=1
    # --dry-run b=2`) are the same overrides, in the order typed.
    if extra and isinstance(getattr(args, "args", None), list) and not any(e.startswith("-") for e in extra):
        args.args += extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if not getattr(args, "handler", None):
        parser.print_help()
        return 2
    try:
        return int(args.handler(args) or 0)
    except UserError as exc:
        print_user_error(exc)
        return 2
    except BrokenPipeError:
        # The reader went away (`gpo list | head`): not a failure of gpo. Point stdout at /dev/null so the
        # interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        print("gpo: interrupted", file=sys.stderr)
        return 130
    except Exception:
        traceback.print_exc()
        print("gpo: internal error (a bug in gpo, please report it with the traceback above)", file=sys.stderr)
        return 1


def _parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog="gpo", description="GRPO-family RL training with CPPO completion pruning.",
        epilog=EXAMPLES + f"\ncomponent kinds (gpo list KIND): {', '.join(KINDS)}\n",
        formatter_class=fmt,
    )
    sub = parser.add_subparsers(metavar="COMMAND")

    def command(name: str, handler: Callable, help: str, epilog: str = "") -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help, epilog=epilog or EXAMPLES, formatter_class=fmt)
        p.set_defaults(handler=handler)
        return p

    def overrides(p: argparse.ArgumentParser) -> None:
        p.add_argument("args", nargs="*", metavar="group=name|key=value")
        p.add_argument("--config", action="append", default=[], metavar="FILE", help="YAML layered over the picks")

    run = command("run", _run, "train a policy", RUN_HELP + "\n" + EXAMPLES)
    overrides(run)
    run.add_argument("--dry-run", action="store_true", help="print the resolved config and build nothing")

    cfg = command("config", _config, "print the resolved config as YAML", RUN_HELP)
    overrides(cfg)

    lst = command("list", _list, "list registered components, their summaries and config defaults")
    lst.add_argument("kind", nargs="?", help=" | ".join(KINDS))
    lst.add_argument("args", nargs="*", metavar="plugins=[...]", help=argparse.SUPPRESS)

    ev = command("eval", _eval, "evaluate a model on a task (greedy, every example scored)",
                 "examples:\n  gpo eval model=runs/NAME/final task=gsm8k split=test limit=20\n"
                 "  gpo eval model=smollm2 task=arith limit=100 backend=hf\n")
    overrides(ev)

    study = command("study", _study, "run a grid of combinations and compare them", STUDY_HELP)
    overrides(study)
    study.add_argument("--baseline", metavar="'K=V ...'",
                       help="the run speed-ups are measured against, by its settings (default: the first run)")

    rep = command("report", _report, "rebuild a study table and plots from existing MLflow runs")
    rep.add_argument("run_ids", nargs="+", metavar="RUN_ID")
    rep.add_argument("--tracking-uri", default=None)
    rep.add_argument("--out", default="report")
    return parser


def _compose(args: argparse.Namespace):
    from gpo.config import compose

    return compose(args.args, args.config)


def _run(args: argparse.Namespace) -> int:
    from gpo import preflight
    from gpo.config import to_yaml

    cfg = _compose(args)
    preflight.check(cfg)  # before the dry run's print and before anything loads
    if args.dry_run:
        print(to_yaml(cfg), end="")
        return 0
    from gpo import launch

    return launch.run(cfg, [*args.args, *(f for c in args.config for f in ("--config", c))])


def _config(args: argparse.Namespace) -> int:
    from gpo import preflight
    from gpo.config import to_yaml

    cfg = _compose(args)
    preflight.check(cfg)
    print(to_yaml(cfg), end="")
    return 0


def _list(args: argparse.Namespace) -> int:
    from omegaconf import OmegaConf

    from gpo import registry
    from gpo.config import split_args

    kind, rest = args.kind, list(args.args)
    if kind and "=" in kind:  # `gpo list plugins=[m]`: argparse took the override for the optional KIND
        kind, rest = None, [kind, *rest]
    _, overrides = split_args(rest)
    plugins = OmegaConf.from_dotlist([o for o in overrides if o.startswith("plugins=")]).get("plugins") or []
    registry.load_builtins()
    registry.load_plugins([str(m) for m in plugins] if not isinstance(plugins, str) else [plugins])
    kinds = [kind] if kind else list(registry.KINDS)
    for kind in kinds:
        if kind not in registry.KINDS:
            raise UserError(f"unknown kind `{kind}`; kinds are {', '.join(registry.KINDS)}.")
        print(f"{kind}:")
        for entry in registry.entries(kind):
            print(f"  {entry.name:<12} {entry.summary}")
            for f in dataclasses.fields(entry.config):
                print(f"      {f.name} = {entry.defaults()[f.name]!r}")
    return 0


def _eval(args: argparse.Namespace) -> int:
    from gpo.evaluate import evaluate_from_args

    return evaluate_from_args(args.args, args.config)


def _study(args: argparse.Namespace) -> int:
    from gpo.study import study_from_args

    return study_from_args(args.args, args.config, baseline=args.baseline)


def _report(args: argparse.Namespace) -> int:
    from gpo.study import report

    report(args.run_ids, tracking_uri=args.tracking_uri, out_dir=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
