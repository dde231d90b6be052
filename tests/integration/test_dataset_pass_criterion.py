"""`task=dataset` with no grader, a user's reward as the pass criterion, and `algo=dapo`: DAPO's dynamic sampling
filters on that criterion (not on an `accuracy` component the task does not have), and the run trains."""

from __future__ import annotations

import json
import sys

import pytest

from gpo.config import compose
from kit import recorded

# Questions whose answer is "all" pass on every completion (a flat group: DAPO drops it); the others pass on every
# other completion of a generation call, so each of their groups of 4 (contiguous in the call) scores [0, 1, 0, 1].
REWARDS = '''
def alternating(completions, answer, **kwargs):
    return [1.0 if a == "all" else float(i % 2) for i, a in enumerate(answer)]
'''


def test_dapo_filters_on_the_users_pass_criterion_and_trains(tiny_model_path, tmp_path, monkeypatch):
    from gpo.engine import Engine

    rows = [{"question": f"Question {i}?", "answer": "all" if i % 2 else "some"} for i in range(8)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    module = f"criterion_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{module}.py").write_text(REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    engine = Engine(compose([
        f"model={tiny_model_path}", f"output_dir={tmp_path / 'runs'}", "tracker=none", "task=dataset",
        f"task.path={tmp_path / 'train.jsonl'}", "task.grader=none", "task.validation_size=0",
        f"task.rewards=[{module}:alternating]", "task.pass_criterion=alternating", "algo=dapo", "pruner=none",
        "allocator=dynamic", "allocator.max_rounds=8", "train.questions_per_step=2", "train.group_size=4",
        "train.max_completion_length=8", "train.micro_batch_size=8", "eval.before_and_after=false",
    ]))
    trained, dropped = recorded(engine), []
    try:
        for _ in range(2):
            metrics = engine.step()
            rows_trained = trained[-1]
            assert len(rows_trained) > 0 and "train/skipped" not in metrics and metrics["train/rows"] > 0
            # every trained group is one of the mixed ones: [0, 1, 0, 1], never a flat "all" group
            scores = rows_trained.reward_components["alternating"].view(-1, 4)
            assert scores.tolist() == [[0.0, 1.0, 0.0, 1.0]] * scores.shape[0]
            # Of the whole groups scored, the flat ones (mean 1) were dropped and the mixed ones (mean 0.5) kept:
            # with a share f kept, the step's mean criterion is (1 - f) * 1 + f * 0.5, so f = 2 * (1 - mean).
            mean = metrics["reward/alternating_mean"]
            assert metrics["filter/kept_groups_frac"] == pytest.approx(2 * (1 - mean), abs=1e-6)
            assert metrics["reward/success_rate"] == pytest.approx(mean, abs=1e-6)  # 0/1 scores: passing = value
            dropped.append(metrics["filter/kept_groups_frac"] < 1)
        assert any(dropped)  # half the questions are "all": the steps drew one and dropped its group
    finally:
        engine.close()
        sys.modules.pop(module, None)
