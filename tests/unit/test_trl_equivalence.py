"""gpo's objectives against TRL 1.16's own GRPO and RLOO code, on seeded random inputs (float64, tol 1e-6).

Each test draws from its own fixed seed (derived from its name), so every run checks the same inputs; the
equalities hold for any draw, and the one inequality below is on inputs built so that it holds by construction.

Nothing of TRL is re-typed here. A bare `GRPOTrainer` (built with `object.__new__`, with only the attributes the
two methods read) runs TRL's real code:
- `_generate_and_score_completions`, for advantages, truncation masking and the token count. Its generator and
  reward functions are replaced by functions that return our tensors.
- `_compute_loss`, for losses, gradients and metrics. Its log-prob function returns our `logp` tensor.
The accelerator is a single-process stand-in. A run with several ranks is simulated as DDP does it: each rank's
loss on its own rows, then their mean.

Deliberate differences, each tested below (see also the gpo/ops.py docstring):
1. DAPO's advantage epsilon is 1e-6 (verl, the paper's code). TRL always uses 1e-4; with std_eps=1e-4 the two agree.
2. Dr.GRPO divides by (step sequences * normaliser). TRL divides by (micro-batch rows * max_completion_length)
   and then by the accumulation steps, so the two agree only when micro-batches have equal row counts.
3. TRL's `dapo` divides by tokens/world_size, and DDP's mean over ranks turns that back into the global token
   count. gpo returns each rank's share directly (the engine multiplies by world_size before backward).
   So TRL's per-rank loss is world_size times gpo's share.
4. grpo `token_mean` uses the step's token count. TRL's `bnpo` uses the micro-batch's, so the two agree only for
   a single micro-batch (or micro-batches with equal token counts).
5. CISPO's cap: TRL's `epsilon_high` is the cap itself (5.0 recommended); gpo's cap is 1 + epsilon_high (4.0).
6. RLOO: TRL's RLOOTrainer averages over every row, and a row without loss tokens (masked) adds -A to the value
   (not to the gradient); gpo's sequence mean adds nothing for it.
GSPO is TRL's `importance_sampling_level="sequence"` with `loss_type="grpo"`; SAPO and CISPO are its loss types.
"""

from __future__ import annotations

import functools
import importlib.util
import types
import zlib
from collections import defaultdict

import pytest
import torch

from gpo.metrics import advantage_metrics
from gpo.types import StepTotals
from kit import build_objective, micro_batch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("trl") is None,
                                reason="TRL (the `dev` extra) is not installed")
TOL = 1e-6
EOS, PAD, TOKEN = 1, 0, 5


@functools.cache
def trl_trainers() -> tuple[type, type]:
    """TRL's GRPOTrainer and RLOOTrainer, imported on first use: TRL imports transformers' trainer stack (seconds),
    which a test worker that runs none of these tests should not pay while collecting."""
    from trl.trainer.grpo_trainer import GRPOTrainer
    from trl.trainer.rloo_trainer import RLOOTrainer

    return GRPOTrainer, RLOOTrainer


@pytest.fixture
def gen(request):
    """A generator seeded from the test's name (parameters included): other inputs per test, the same every run."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.name.encode()))


def bare_trainer(*, group_size=4, scale_rewards="group", loss_type="grpo", beta=0.0, eps_low=0.2, eps_high=0.2,
                 max_completion_length=8, accumulation=1, world_size=1, mask_truncated=False, level="token",
                 sapo_pos=1.0, sapo_neg=1.05, cls=None):
    t = object.__new__(cls or trl_trainers()[0])
    t.accelerator = types.SimpleNamespace(
        device=torch.device("cpu"), process_index=0, num_processes=world_size, is_main_process=True,
        gather=lambda x: x, reduce=lambda x, reduction="sum": x, gather_for_metrics=lambda x: x,
    )
    t.model = types.SimpleNamespace(training=True, is_gradient_checkpointing=False)
    t.args = types.SimpleNamespace(
        steps_per_generation=accumulation, gradient_accumulation_steps=accumulation, per_device_train_batch_size=1,
        gradient_checkpointing_kwargs=None, delta=None, use_bias_correction_kl=False,
        sapo_temperature_pos=sapo_pos, sapo_temperature_neg=sapo_neg,
    )
    t.current_gradient_accumulation_steps = accumulation
    t.environment_factories = t.tools = t.environments = None
    t._tokenizer = types.SimpleNamespace(pad_token_id=PAD)
    t.pad_to_multiple_of = None
    t.mask_truncated_completions, t.eos_token_ids = mask_truncated, [EOS]
    t.num_iterations, t.use_vllm, t.vllm_importance_sampling_correction = 1, False, False
    t.num_generations, t.scale_rewards = group_size, scale_rewards
    t.multi_objective_aggregation = "sum_then_normalize"
    t.reward_weights, t.reward_func_names = torch.ones(1, dtype=torch.float64), ["r"]
    t.loss_type, t.beta, t.epsilon_low, t.epsilon_high = loss_type, beta, eps_low, eps_high
    t.max_completion_length = max_completion_length
    t.importance_sampling_level, t.top_entropy_quantile, t.off_policy_mask_threshold = level, 1.0, None
    t._entropy_bonus_enabled = t.aux_loss_enabled = t.log_multimodal = False
    t._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    t._logs = {"prompt": [], "completion": [], "rewards": defaultdict(list), "advantages": [],
               "extra": defaultdict(list), "images": []}
    t._pending_extra_logs, t._pending_metrics = defaultdict(list), defaultdict(list)
    return t


def trl_score(rewards, completion_ids=None, **settings):
    """TRL's `_generate_and_score_completions` on given rewards [B, G] (and token ids, for truncation)."""
    n = rewards.numel()
    completion_ids = completion_ids or [[TOKEN, EOS]] * n
    t = bare_trainer(group_size=rewards.shape[1], **settings)
    t._generate = lambda prompts: ([[7, 8]] * n, completion_ids, None, ["text"] * n, None, {}, None, [None] * n)
    t._calculate_rewards = lambda inputs, prompts, completions, ids: rewards.reshape(n, 1)
    out = t._generate_and_score_completions([{"prompt": "question"}] * n)
    return out, t._metrics["train"]


def trl_loss(logp, adv, mask, old=None, ref=None, num_items=None, **settings):
    """TRL's `_compute_loss` on one micro-batch; returns (loss, grad w.r.t. logp, metrics)."""
    t = bare_trainer(**settings)
    logp = logp.detach().clone().requires_grad_()
    t._get_per_token_logps_and_entropies = lambda *a, **k: (logp, torch.zeros_like(logp), None)
    inputs = {
        "prompt_ids": torch.ones(len(adv), 1, dtype=torch.long), "prompt_mask": torch.ones(len(adv), 1),
        "completion_ids": torch.zeros_like(mask), "completion_mask": mask, "advantages": adv,
        "num_items_in_batch": torch.as_tensor(mask.sum() if num_items is None else num_items),
    }
    if old is not None:
        inputs["old_per_token_logps"] = old
    if ref is not None:
        inputs["ref_per_token_logps"] = ref
    loss = t._compute_loss(None, inputs)
    loss.backward()
    return loss.detach(), logp.grad, {k: v[0] for k, v in t._metrics["train"].items()}


def gpo_loss(objective, logp, adv, mask, old, ref, totals):
    logp = logp.detach().clone().requires_grad_()
    loss, metrics = objective.loss(logp, micro_batch(adv, mask, old_logprobs=old, ref_logprobs=ref), totals)
    loss.backward()
    return loss.detach(), logp.grad, metrics


def random_rewards(gen, groups=6, group_size=4):
    """[B, G]: binary, continuous, and two zero-variance groups."""
    rewards = torch.rand(groups, group_size, generator=gen, dtype=torch.float64)  # [B, G]
    rewards[: groups // 2] = rewards[: groups // 2].round()
    rewards[0] = 1.0
    rewards[1] = 0.3
    return rewards


def random_rollout(gen, n=8, length=7):
    """logp, old, ref [n, L] (ratios across both clip edges), advantages [n], a padded mask with one empty row."""
    lengths = torch.randint(1, length + 1, (n,), generator=gen)
    lengths[0], lengths[1] = 0, 1  # a fully masked row and a single-token one
    mask = (torch.arange(length) < lengths.unsqueeze(1)).long()  # [n, L]
    old = -2 * torch.rand(n, length, generator=gen, dtype=torch.float64)  # [n, L]
    logp = old + 0.5 * torch.randn(n, length, generator=gen, dtype=torch.float64)  # [n, L]
    ref = old + 0.3 * torch.randn(n, length, generator=gen, dtype=torch.float64)  # [n, L]
    adv = torch.randn(n, generator=gen, dtype=torch.float64)  # [n]
    return logp, old, ref, adv, mask


def assert_close(a, b):
    assert torch.allclose(torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64),
                          atol=TOL, rtol=0), (a, b)


# --- advantages ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "cfg", "scale_rewards"), [
    ("grpo", {}, "group"),
    ("dapo", {"std_eps": 1e-4}, "group"),
    ("dr_grpo", {}, "none"),
])
def test_advantages_match_trl(gen, name, cfg, scale_rewards):
    rewards = random_rewards(gen)
    out, trl_metrics = trl_score(rewards, scale_rewards=scale_rewards)
    ours = build_objective(name, **cfg).advantages(rewards)
    assert_close(ours.flatten(), out["advantages"])
    assert torch.equal(ours[:2], torch.zeros(2, 4, dtype=torch.float64))  # exactly 0 where TRL may leave 1e-13
    metrics = advantage_metrics(rewards, ours)
    assert metrics["zero_std_frac"] == pytest.approx(trl_metrics["frac_reward_zero_std"][0])
    assert metrics["reward/mean"] == pytest.approx(trl_metrics["reward"][0])
    assert metrics["reward/std"] == pytest.approx(trl_metrics["reward_std"][0])


def test_dapo_default_epsilon_is_verls_not_trls(gen):
    rewards = random_rewards(gen)
    out, _ = trl_score(rewards, scale_rewards="group")
    ours = build_objective("dapo").advantages(rewards)  # (r - mean) / (std + 1e-6); TRL: / (std + 1e-4)
    std = rewards.std(dim=1, keepdim=True)  # [B, 1]
    mixed = std.squeeze(1) > 0
    expected = out["advantages"].view_as(rewards) * (std + 1e-4) / (std + 1e-6)
    assert_close(ours[mixed], expected[mixed])
    assert not torch.allclose(ours[mixed], out["advantages"].view_as(rewards)[mixed], atol=1e-9, rtol=0)


def test_truncation_masking_and_token_count_match_trl(gen):
    n, length = 8, 6
    lengths = torch.randint(1, length + 1, (n,), generator=gen).tolist()
    truncated = [bool(torch.rand(1, generator=gen) < 0.5) for _ in range(n)]
    # A truncated completion ends without EOS; the others end with it.
    ids = [[TOKEN] * (k - 1) + [TOKEN if cut else EOS] for k, cut in zip(lengths, truncated, strict=True)]
    out, _ = trl_score(random_rewards(gen, groups=2), completion_ids=ids, mask_truncated=True)
    mask = (torch.arange(out["completion_mask"].shape[1]) < torch.tensor(lengths).unsqueeze(1)).long()  # [n, L]
    dapo = build_objective("dapo", mask_truncated=True)
    ours = dapo.loss_mask(micro_batch(torch.zeros(n), mask, truncated=truncated))
    assert torch.equal(ours, out["completion_mask"])
    assert int(ours.sum()) == int(out["num_items_in_batch"])  # StepTotals.tokens == TRL's num_items_in_batch


# --- losses -------------------------------------------------------------------------------------------------------

# (gpo objective, its settings, TRL loss_type, TRL settings)
PAIRS = [
    ("grpo", {}, "grpo", {"beta": 0.04}),
    ("grpo", {"loss_agg": "token_mean", "beta": 0.1}, "bnpo", {"beta": 0.1}),
    ("dapo", {}, "dapo", {"eps_high": 0.28}),
    ("dapo", {"beta": 0.05}, "dapo", {"eps_high": 0.28, "beta": 0.05}),
    ("dr_grpo", {}, "dr_grpo", {}),
]


@pytest.mark.parametrize(("name", "cfg", "loss_type", "trl_cfg"), PAIRS)
def test_one_micro_batch_loss_gradient_and_metrics_match_trl(gen, name, cfg, loss_type, trl_cfg):
    logp, old, ref, adv, mask = random_rollout(gen)
    objective = build_objective(name, max_completion_length=mask.shape[1], **cfg)
    totals = StepTotals(sequences=len(adv), tokens=int(mask.sum()))
    loss, grad, metrics = gpo_loss(objective, logp, adv, mask, old, ref, totals)
    trl, trl_grad, trl_metrics = trl_loss(logp, adv, mask, old, ref, loss_type=loss_type,
                                          max_completion_length=mask.shape[1], **trl_cfg)
    assert_close(loss, trl)
    assert_close(grad, trl_grad)
    assert grad.abs().sum() > 0
    # clip fractions and KL are token means over the micro-batch in TRL; here shares of the step: equal for one
    assert_close(metrics["clip/low_frac"], trl_metrics["clip_ratio/low_mean"])
    assert_close(metrics["clip/high_frac"], trl_metrics["clip_ratio/high_mean"])
    if objective.policy_loss.beta > 0:
        assert_close(metrics["kl/mean"], trl_metrics["kl"])


def test_mu_one_matches_trl_without_old_logprobs(gen):
    logp, _, ref, adv, mask = random_rollout(gen)
    totals = StepTotals(sequences=len(adv), tokens=int(mask.sum()))
    loss, grad, _ = gpo_loss(build_objective("grpo"), logp, adv, mask, None, ref, totals)
    trl, trl_grad, _ = trl_loss(logp, adv, mask, None, ref, loss_type="grpo", beta=0.04)
    assert_close(loss, trl)
    assert_close(grad, trl_grad)


def split_rows(*tensors, parts):
    return list(zip(*(t.chunk(parts) if t is not None else [None] * parts for t in tensors), strict=True))


@pytest.mark.parametrize(("name", "cfg", "loss_type", "trl_cfg"), [PAIRS[0], PAIRS[2], PAIRS[4]])
def test_equal_micro_batches_with_accumulation_match_trl(gen, name, cfg, loss_type, trl_cfg):
    """grpo, dapo and dr_grpo over 3 accumulation steps of equal row counts (token counts differ)."""
    logp, old, ref, adv, mask = random_rollout(gen, n=9)
    objective = build_objective(name, max_completion_length=mask.shape[1], **cfg)
    totals = StepTotals(sequences=9, tokens=int(mask.sum()))
    ours = trl = 0.0
    for lp, o, r, a, m in split_rows(logp, old, ref, adv, mask, parts=3):
        ours += gpo_loss(objective, lp, a, m, o, r, totals)[0]
        trl += trl_loss(lp, a, m, o, r, num_items=totals.tokens, loss_type=loss_type, accumulation=3,
                        max_completion_length=mask.shape[1], **trl_cfg)[0]
    assert_close(ours, trl)


def test_dapo_across_ranks_trl_normaliser_is_tokens_over_world_size(gen):
    """Difference 3: per rank, TRL's loss is world_size x gpo's share; DDP's mean of TRL's = the sum of gpo's."""
    logp, old, ref, adv, mask = random_rollout(gen, n=8)
    objective = build_objective("dapo", max_completion_length=mask.shape[1])
    totals = StepTotals(sequences=8, tokens=int(mask.sum()))  # all-reduced over both ranks
    ours, trl = [], []
    for lp, o, r, a, m in split_rows(logp, old, ref, adv, mask, parts=2):
        ours.append(gpo_loss(objective, lp, a, m, o, r, totals)[0])
        trl.append(trl_loss(lp, a, m, o, r, num_items=totals.tokens, loss_type="dapo", eps_high=0.28,
                            world_size=2)[0])
    for mine, theirs in zip(ours, trl, strict=True):
        assert_close(2 * mine, theirs)
    assert_close(sum(ours), sum(trl) / 2)
    whole = gpo_loss(objective, logp, adv, mask, old, ref, totals)[0]
    assert_close(sum(ours), whole)  # = the global token mean of the step


@pytest.mark.parametrize(("name", "cfg", "loss_type", "ours_by_hand", "trl_by_hand"), [
    # 1 token at A = +1 and 42 tokens at A = -1, ratio 1, so the token losses are -1 and +1 (S1 = -1, S2 = 42).
    # gpo: (S1 + S2) / 43 tokens. TRL bnpo: each micro-batch over its own tokens, halved for accumulation:
    # -1/(2*1) + 42/(2*42) = 0.
    ("grpo", {"loss_agg": "token_mean", "beta": 0.0}, "bnpo", 41 / 43, 0.0),
    # gpo: (S1 + S2) / (8 sequences * 7). TRL dr_grpo: each over (its rows * 7), halved: -1/28 + 42/84 = 13/28.
    ("dr_grpo", {}, "dr_grpo", 41 / 56, 13 / 28),
])
def test_unequal_micro_batches_bnpo_and_dr_grpo_are_local_in_trl(gen, name, cfg, loss_type, ours_by_hand,
                                                                  trl_by_hand):
    """Differences 2 and 4: TRL's bnpo / dr_grpo normalise by the micro-batch; gpo by the whole step.

    The inputs make the gap large by design, for any draw: logp = old = ref (ratio 1, no clipping, no KL), so each
    token's loss is -A; the 2-row micro-batch holds one token at A = +1, the 6-row one 42 tokens at A = -1.
    """
    length = 7
    logp = -2 * torch.rand(8, length, generator=gen, dtype=torch.float64)  # [8, L], values cancel in the ratio
    old, ref = logp.clone(), logp.clone()
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0], dtype=torch.float64)  # [8]
    mask = torch.ones(8, length, dtype=torch.long)  # [8, L]
    mask[0], mask[1, 1:] = 0, 0  # row 0 empty, row 1 a single token: 1 token against 42
    totals = StepTotals(sequences=8, tokens=int(mask.sum()))
    assert totals.tokens == 43
    rows = (slice(0, 2), slice(2, 8))  # 2 rows and 6 rows
    objective = build_objective(name, max_completion_length=length, **cfg)
    ours = sum(gpo_loss(objective, logp[r], adv[r], mask[r], old[r], ref[r], totals)[0] for r in rows)
    trl = sum(trl_loss(logp[r], adv[r], mask[r], old[r], ref[r], loss_type=loss_type, accumulation=2,
                       max_completion_length=length)[0] for r in rows)
    whole_trl = trl_loss(logp, adv, mask, old, ref, loss_type=loss_type, max_completion_length=length)[0]
    assert_close(ours, ours_by_hand)
    assert_close(whole_trl, ours_by_hand)  # gpo is invariant to the split: it equals TRL on one whole batch
    assert_close(trl, trl_by_hand)  # TRL's split-dependent normaliser gives another value
    assert abs(ours_by_hand - trl_by_hand) > 0.25


# --- GSPO, CISPO, SAPO: TRL's `importance_sampling_level="sequence"`, `loss_type="cispo"` and `"sapo"` -----------

# (gpo objective, its settings, TRL loss_type, TRL settings, scale of logp - old). TRL's CISPO cap is epsilon_high
# itself; gpo's is 1 + epsilon_high, so gpo's default 4.0 is TRL's recommended 5.0.
FAMILY_PAIRS = [
    ("gspo", {}, "grpo", {"level": "sequence", "eps_low": 3e-4, "eps_high": 4e-4}, 5e-4),
    ("gspo", {"epsilon_low": 0.2, "epsilon_high": 0.28, "beta": 0.04}, "grpo",
     {"level": "sequence", "eps_high": 0.28, "beta": 0.04}, 0.5),
    ("cispo", {}, "cispo", {"eps_high": 5.0}, 1.5),
    ("cispo", {"epsilon_high": 0.28, "beta": 0.05}, "cispo", {"eps_high": 1.28, "beta": 0.05}, 0.5),
    ("sapo", {}, "sapo", {}, 0.5),
    ("sapo", {"tau_pos": 0.5, "tau_neg": 2.0, "beta": 0.04}, "sapo", {"sapo_pos": 0.5, "sapo_neg": 2.0, "beta": 0.04},
     0.5),
]
FAMILY_IDS = [f"{p[0]}-{i}" for i, p in enumerate(FAMILY_PAIRS)]


def family_rollout(gen, scale, n=8):
    """random_rollout with logp - old scaled: GSPO's clip range is 3e-4 wide, so its ratios must straddle it."""
    logp, old, ref, adv, mask = random_rollout(gen, n=n)
    return old + scale * (logp - old) / 0.5, old, ref, adv, mask


@pytest.mark.parametrize(("name", "cfg", "loss_type", "trl_cfg", "scale"), FAMILY_PAIRS, ids=FAMILY_IDS)
def test_family_one_micro_batch_loss_and_gradient_match_trl(gen, name, cfg, loss_type, trl_cfg, scale):
    logp, old, ref, adv, mask = family_rollout(gen, scale)
    objective = build_objective(name, **cfg)
    totals = StepTotals(sequences=len(adv), tokens=int(mask.sum()))
    loss, grad, metrics = gpo_loss(objective, logp, adv, mask, old, ref, totals)
    trl, trl_grad, trl_metrics = trl_loss(logp, adv, mask, old, ref, loss_type=loss_type, **trl_cfg)
    assert_close(loss, trl)
    assert_close(grad, trl_grad)
    assert (grad.abs().sum(dim=1) > 0).sum() >= 3  # several rows carry a gradient (not all clipped away)
    if objective.policy_loss.beta > 0:
        assert_close(metrics["kl/mean"], trl_metrics["kl"])
    if loss_type == "cispo":  # TRL counts capped tokens with A > 0; here every capped token is flagged
        capped = (torch.exp(logp - old) > objective.weight_max) & mask.bool()
        positive = capped & (adv > 0).unsqueeze(1)
        assert_close(positive.sum() / mask.sum(), trl_metrics["cispo_clip_ratio"])
        assert_close(metrics["clip/high_frac"], capped.sum() / mask.sum())


def test_gspo_clips_some_sequences_and_not_others(gen):
    """The 3e-4-wide case above is not vacuous: some sequence ratios are inside the range, some outside."""
    logp, old, _, _, mask = family_rollout(gen, FAMILY_PAIRS[0][4], n=64)
    m = mask.bool()
    s = torch.exp(torch.where(m, logp - old, 0.0).sum(1) / m.sum(1).clamp(min=1))[m.any(1)]
    inside = ((s > 1 - 3e-4) & (s < 1 + 4e-4)).sum()
    assert 0 < inside < len(s)


@pytest.mark.parametrize(("name", "cfg", "loss_type", "trl_cfg", "scale"), FAMILY_PAIRS, ids=FAMILY_IDS)
def test_family_equal_micro_batches_with_accumulation_match_trl(gen, name, cfg, loss_type, trl_cfg, scale):
    logp, old, ref, adv, mask = family_rollout(gen, scale, n=9)
    objective = build_objective(name, **cfg)
    totals = StepTotals(sequences=9, tokens=int(mask.sum()))
    ours, trl, grads, trl_grads = 0.0, 0.0, [], []
    for lp, o, r, a, m in split_rows(logp, old, ref, adv, mask, parts=3):
        loss, grad, _ = gpo_loss(objective, lp, a, m, o, r, totals)
        theirs, their_grad, _ = trl_loss(lp, a, m, o, r, num_items=totals.tokens, loss_type=loss_type,
                                         accumulation=3, **trl_cfg)
        ours, trl = ours + loss, trl + theirs
        grads.append(grad)
        trl_grads.append(their_grad)
    assert_close(ours, trl)
    assert_close(torch.cat(grads), torch.cat(trl_grads))


@pytest.mark.parametrize(("name", "cfg", "loss_type", "trl_cfg", "scale"), FAMILY_PAIRS, ids=FAMILY_IDS)
def test_family_across_two_ranks_match_trl(gen, name, cfg, loss_type, trl_cfg, scale):
    """Each rank's TRL loss (and gradient) is 2x gpo's share: TRL's normaliser is per rank (its sequences, or
    tokens / world_size), gpo's is the step's, and the engine multiplies by world_size before DDP's mean."""
    logp, old, ref, adv, mask = family_rollout(gen, scale, n=8)
    objective = build_objective(name, **cfg)
    totals = StepTotals(sequences=8, tokens=int(mask.sum()))  # all-reduced over both ranks
    shares = []
    for lp, o, r, a, m in split_rows(logp, old, ref, adv, mask, parts=2):
        loss, grad, _ = gpo_loss(objective, lp, a, m, o, r, totals)
        theirs, their_grad, _ = trl_loss(lp, a, m, o, r, num_items=totals.tokens, loss_type=loss_type,
                                         world_size=2, **trl_cfg)
        assert_close(2 * loss, theirs)
        assert_close(2 * grad, their_grad)
        shares.append(loss)
    assert_close(sum(shares), gpo_loss(objective, logp, adv, mask, old, ref, totals)[0])


# --- RLOO: TRL's RLOOTrainer --------------------------------------------------------------------------------------

def bare_rloo(group_size=4, eps_low=0.2, eps_high=0.2):
    t = bare_trainer(group_size=group_size, eps_low=eps_low, eps_high=eps_high, cls=trl_trainers()[1])
    t.num_generations_eval, t.normalize_advantages, t.reward_clip_range = group_size, False, None
    return t


def test_rloo_advantages_match_trl(gen):
    rewards = random_rewards(gen)
    n = rewards.numel()
    t = bare_rloo(group_size=rewards.shape[1])
    t._generate = lambda prompts: ([[7, 8]] * n, [[TOKEN, EOS]] * n, ["text"] * n)
    t._calculate_rewards = lambda inputs, prompts, completions, ids: rewards.reshape(n, 1)
    t._get_per_token_logps_and_entropies = lambda model, ids, *a, **k: (torch.zeros(ids.shape[0], 2), None, None)
    out = t._generate_and_score_completions([{"prompt": "question"}] * n)
    ours = build_objective("rloo").advantages(rewards)  # [B, G]
    assert_close(ours.flatten(), out["advantages"])
    assert torch.equal(ours[:2], torch.zeros(2, 4, dtype=torch.float64))


def trl_rloo_loss(logp, adv, mask, old, **settings):
    """TRL's RLOOTrainer._compute_loss on one micro-batch (it returns the micro-batch's mean over sequences; the HF
    Trainer then divides by the accumulation steps, done here by the caller)."""
    t = bare_rloo(**settings)
    logp = logp.detach().clone().requires_grad_()
    t._get_per_token_logps_and_entropies = lambda *a, **k: (logp, torch.zeros_like(logp), None)
    inputs = {
        "prompt_ids": torch.ones(len(adv), 1, dtype=torch.long), "prompt_mask": torch.ones(len(adv), 1),
        "completion_ids": torch.zeros_like(mask), "completion_mask": mask, "advantages": adv,
        "old_logps": (old * mask).sum(1),
    }
    loss = t._compute_loss(None, inputs)
    loss.backward()
    return loss.detach(), logp.grad


@pytest.mark.parametrize("parts", [1, 2])
def test_rloo_loss_and_gradient_match_trl(gen, parts):
    """One micro-batch, and two of equal rows (micro-batches or ranks: TRL's mean over each, averaged by the HF
    Trainer's accumulation or by DDP, equals gpo's sum of shares over the step's sequences).

    TRL's mean counts a row without loss tokens (-A, with no gradient); gpo adds nothing for it. Such a row arises
    only from masking (mask_truncated); its advantage is set to 0 here so the values compare.
    """
    logp, old, _, adv, mask = random_rollout(gen)
    logp = old + 0.02 * (logp - old)  # sequence ratios multiply 1-7 token ratios: keep most inside the clip
    logp[2:4, 0] += torch.tensor([0.5, -0.5], dtype=logp.dtype)  # and push two rows out of it, one on each side
    adv[mask.sum(1) == 0] = 0.0
    objective = build_objective("rloo")
    totals = StepTotals(sequences=len(adv), tokens=int(mask.sum()))
    ours, trl, grads, trl_grads = 0.0, 0.0, [], []
    for lp, o, a, m in split_rows(logp, old, adv, mask, parts=parts):
        loss, grad, _ = gpo_loss(objective, lp, a, m, o, None, totals)
        theirs, their_grad = trl_rloo_loss(lp, a, m, o)
        ours, trl = ours + loss, trl + theirs / parts
        grads.append(grad)
        trl_grads.append(their_grad / parts)
    assert_close(ours, trl)
    assert_close(torch.cat(grads), torch.cat(trl_grads))
    ratio = torch.exp((logp - old).mul(mask).sum(1))
    assert ((ratio - 1).abs() < 0.2).any() and ((ratio - 1).abs() > 0.2).any()  # both sides of the clip


def test_rloo_on_policy_gradient_is_the_papers_token_sum(gen):
    """mu = 1: gpo's RLOO gradient is -A_i / n on every token of row i (REINFORCE on the whole sequence)."""
    logp, _, _, adv, mask = random_rollout(gen)
    totals = StepTotals(sequences=len(adv), tokens=int(mask.sum()))
    _, grad, _ = gpo_loss(build_objective("rloo"), logp, adv, mask, None, None, totals)
    assert_close(grad, -adv.unsqueeze(1) * mask / len(adv))
