"""optim.schedule's learning-rate curves (gpo.engine.lr_factor): hand-derived values, and the same numbers as
transformers' get_scheduler, which gpo used before and which TRL's GRPOTrainer still uses."""

from __future__ import annotations

import pytest
import torch

from gpo.engine import _scheduler, lr_factor


@pytest.mark.parametrize(("schedule", "expected"), [
    # warm-up of 2 steps, 6 in all: 0, 1/2, then the schedule over the 4 steps left
    ("constant", [0.0, 0.5, 1.0, 1.0, 1.0, 1.0, 1.0]),
    ("linear", [0.0, 0.5, 1.0, 0.75, 0.5, 0.25, 0.0]),
    ("cosine", [0.0, 0.5, 1.0, (1 + 2 ** -0.5) / 2, 0.5, (1 - 2 ** -0.5) / 2, 0.0]),
])
def test_each_schedule_warms_up_then_follows_its_curve(schedule, expected):
    assert [lr_factor(schedule, step, warmup=2, total=6) for step in range(7)] == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
@pytest.mark.parametrize(("warmup_ratio", "total"), [(0.0, 1), (0.0, 7), (0.1, 10), (0.5, 5), (0.03, 40)])
def test_the_rates_are_transformers_get_scheduler_rates_bit_for_bit(schedule, warmup_ratio, total):
    from transformers import get_scheduler

    def rates(make) -> list[float]:
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=3e-4)
        scheduler = make(optimizer)
        out = []
        for _ in range(total + 1):
            out.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
        return out

    name = {"constant": "constant_with_warmup"}.get(schedule, schedule)
    warmup = -(-warmup_ratio * total // 1)  # ceil, as the engine counts warm-up steps
    theirs = rates(lambda opt: get_scheduler(name, opt, num_warmup_steps=int(warmup), num_training_steps=total))
    assert rates(lambda opt: _scheduler(opt, schedule, warmup_ratio, total)) == theirs
