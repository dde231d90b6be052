"""engine.generator=ray (gpo/async_ray.py): the generator running ahead as a Ray actor on a local Ray cluster, its
weights broadcast over a gloo group of two, samples what a spawned generator process samples; an actor that dies
is replaced and the run goes on."""

from __future__ import annotations

import copy
import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from gpo.logprobs import TokenLogprobs, batch_logprobs
from kit import MULTI_RANK, final_params, finish, plugins_importable, recorded, records, start, toy_engine

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="pip install 'gpo[ray]'")]
plugins_importable()  # before the Ray cluster starts: its workers get this process's sys.path


@pytest.fixture(scope="module")
def local_ray():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": ":".join(p for p in sys.path if p)}})
    yield ray
    ray.shutdown()


def test_a_ray_actor_generator_samples_and_trains_what_a_generator_process_does(local_ray, tiny_model_path,
                                                                                tmp_path):
    runs = {}
    for where in ("process", "ray"):
        eng = toy_engine(tiny_model_path, tmp_path, "train.max_staleness=1", "train.steps=3",
                         f"engine.generator={where}", f"run_name={where}")
        seen = recorded(eng)
        metrics = [eng.step() for _ in range(3)]
        runs[where] = (seen, metrics, {k: v.detach().clone() for k, v in eng.policy.state_dict().items()})
        eng.close()
    (p_rows, _, p_weights), (r_rows, r_metrics, r_weights) = runs["process"], runs["ray"]
    # The same completions, sampled by the same versions: the generator's log-probs of them are the broadcast
    # weights' (stale weights in the actor would change them, though maybe not the sampled tokens).
    for a, b in zip(p_rows, r_rows, strict=True):
        assert b.versions.tolist() == a.versions.tolist() and torch.equal(b.completion_ids, a.completion_ids)
        torch.testing.assert_close(b.generator_logprobs, a.generator_logprobs, atol=1e-6, rtol=0)
    assert [m["async/staleness_mean"] for m in r_metrics] == [0.0, 1.0, 1.0]
    initial = load_file(str(Path(tiny_model_path) / "model.safetensors"))
    for name, value in p_weights.items():
        torch.testing.assert_close(r_weights[name], value, atol=1e-6, rtol=0, msg=name)
    assert max(float((r_weights[n] - v).abs().max()) for n, v in initial.items()) > 1e-4


def test_an_actor_that_dies_is_replaced_and_the_run_goes_on(local_ray, tiny_model_path, tmp_path):
    """The replacement starts from the last published weights, not the trainer's newer ones: every row's generator
    log-probs are those of the version it names."""
    eng = toy_engine(tiny_model_path, tmp_path, "train.max_staleness=1", "train.steps=4", "engine.generator=ray")
    seen = recorded(eng)
    delivered = eng.rollouts.next

    def next_step(step, timer):  # the actor dies in step 2, before the trainer publishes version 3 to it
        produced = delivered(step, timer)
        if step == 2:
            local_ray.kill(eng.rollouts.link.actor)
        return produced

    eng.rollouts.next = next_step
    versions = [copy.deepcopy(eng.policy)]
    metrics = []
    for _ in range(4):
        metrics.append(eng.step())
        versions.append(copy.deepcopy(eng.policy))
    eng.close()
    assert metrics[1]["async/generator_restarts"] == 0 and metrics[-1]["async/generator_restarts"] == 1
    assert all(m["async/staleness_max"] <= 1 and m["train/rows"] == 8 for m in metrics)
    for rows in seen:
        for v in set(rows.versions.tolist()):
            mine = rows.select(rows.versions == v)
            mask = mine.completion_mask.bool()
            pi = batch_logprobs(TokenLogprobs(versions[v]), mine, 8, 1.0)  # [N, L]
            torch.testing.assert_close(mine.generator_logprobs[mask], pi[mask], atol=2e-5, rtol=0)


def test_two_ranks_each_with_an_actor_train_what_one_process_with_its_generator_trains(tiny_model_path, tmp_path):
    """engine.num_processes=2 with engine.generator=ray: rank 0 starts a local Ray cluster and rank 1 joins it; each
    rank's actor samples that rank's share of every step, the actors gather the rows among themselves, and the run
    ends with the weights of one process with a spawned generator."""
    base = [f"model={tiny_model_path}", f"output_dir={tmp_path}", "tracker=none", *MULTI_RANK, "train.steps=3",
            "train.max_staleness=1"]
    one = finish(start([*base, "run_name=one"], tmp_path / "one.jsonl"))
    two = finish(start([*base, "run_name=two", "engine=ddp", "engine.num_processes=2", "engine.generator=ray"],
                       tmp_path / "two.jsonl"))
    assert "launching 2 processes" in two and "Started a local Ray instance" in two, (one[-2000:], two[-4000:])
    p1, p2 = final_params(tmp_path / "one"), final_params(tmp_path / "two")
    for name in p1:
        torch.testing.assert_close(p2[name], p1[name], atol=1e-5, rtol=0, msg=name)
    initial = load_file(str(Path(tiny_model_path) / "model.safetensors"))
    assert max(float((p1[n] - initial[n]).abs().max()) for n in p1) > 1e-4
    single = [r["metrics"] for r in records(tmp_path / "one.jsonl", "step")]
    for rank in (0, 1):
        mine = [r["metrics"] for r in records(tmp_path / "two.jsonl", "step") if r["rank"] == rank]
        assert [m["train/rows"] for m in mine] == [m["train/rows"] for m in single]
        assert [m["loss/total"] for m in mine] == pytest.approx([m["loss/total"] for m in single], abs=1e-5)
