"""The training engine: one algorithm-blind step, the run loop, evaluation, checkpoints and tracking.

`Engine.step` reads top to bottom (docs/architecture.md, "The step"): the rollout source delivers the step's kept
rows (plan, rounds, rewards, score, prune and refill: in this process, or in a generator process running ahead with
train.max_staleness >= 1), then the engine runs the phases after them: shard, log-probs, update, metrics. It only
calls the component interfaces of gpo/types.py; it never names an algorithm, pruner, allocator or task.
"""

from __future__ import annotations

import math
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import torch

from gpo import checkpoint, preflight
from gpo.build import build_parts
from gpo.config import to_yaml
from gpo.distributed import all_reduce_sum, from_rank_zero, peer_failures_explained, shard, world
from gpo.errors import UserError
from gpo.logprobs import TokenLogprobs, batch_logprobs, computing_in, micro_batches
from gpo.metrics import MetricSums, PhaseTimer, entropy_share, mismatch_metrics, staleness_metrics
from gpo.models import export_model
from gpo.parallel import accumulating, build_accelerator, full_state_dict, gathered, prepare_policy, prepare_reference
from gpo.rollout import Lockstep, Rollout, RolloutSource
from gpo.run_config import RunConfig, as_dict
from gpo.sampler import QuestionStream
from gpo.step_math import corrected, step_totals, with_loss_mask, within_staleness
from gpo.tracking import flatten
from gpo.types import Backend, RolloutBatch, StepTotals


class Engine:
    def __init__(self, cfg: RunConfig) -> None:
        from accelerate.utils import set_seed

        self.cfg = cfg
        self.train_cfg, self.optim_cfg, self.eval_cfg, self.ckpt_cfg = cfg.train, cfg.optim, cfg.eval, cfg.checkpoint
        train_cfg = self.train_cfg
        self.accelerator = build_accelerator(cfg.engine, train_cfg, self.optim_cfg)
        self.rank, self.world_size = world()
        set_seed(cfg.seed)
        self.run_name = from_rank_zero(cfg.run_name or "-".join(  # a default name holds the time: rank 0's for all
            [cfg.algo.name, cfg.pruner.name, cfg.allocator.name, cfg.task.name,
             datetime.now().strftime("%Y%m%d-%H%M%S")]
        ))
        self.run_dir = Path(cfg.output_dir) / self.run_name

        self.parts = parts = build_parts(cfg, run_dir=self.run_dir, rank=self.rank)
        # the selector, pruner, allocator and backend live in the rollout alone (`self.rollout`), so a swap is seen
        self.objective, self.task, self.tracker, self.tokenizer, self.policy = (parts.objective, parts.task,
                                                                                parts.tracker, parts.tokenizer,
                                                                                parts.policy)
        self.correction = parts.correction
        engine = cfg.engine
        # docs/precision.md: the training passes under mixed_precision, the no-grad passes under logprob_precision
        self.logprob_precision = (engine.mixed_precision if engine.logprob_precision == "train"
                                  else engine.logprob_precision)
        self.ref = None if parts.reference is None else prepare_reference(
            self.accelerator,
            TokenLogprobs(parts.reference, train_cfg.logprob_chunk_size, train_cfg.share_prompt,
                          self.logprob_precision))

        opt = self.optim_cfg
        optimizer = torch.optim.AdamW(
            [p for p in self.policy.parameters() if p.requires_grad],
            lr=opt.lr, betas=(opt.betas[0], opt.betas[1]), eps=opt.eps, weight_decay=opt.weight_decay, fused=opt.fused,
        )
        self.module, self.optimizer = prepare_policy(
            self.accelerator,
            TokenLogprobs(self.policy, train_cfg.logprob_chunk_size, train_cfg.share_prompt, engine.mixed_precision),
            optimizer,
        )
        self.scheduler = _scheduler(self.optimizer, opt.schedule, opt.warmup_ratio,
                                    total=train_cfg.steps * train_cfg.mu)
        self.accelerator.register_for_checkpointing(self.scheduler)

        self.questions = QuestionStream(self.task.load("train"), cfg.seed)
        self.rollout = Rollout.from_parts(parts, cfg, self.questions, accelerator=self.accelerator, rank=self.rank,
                                          world_size=self.world_size)
        self.rollouts: RolloutSource = Lockstep(self.rollout)
        if train_cfg.max_staleness:
            from gpo.async_rollout import AsyncRollouts

            self.rollouts = AsyncRollouts(cfg, self.rollout, self.policy)
        self.step_index = 0
        self.best_score: float | None = None

    @property
    def backend(self) -> Backend:
        """The generator, for evaluation as for rollouts: the rollout's, one object."""
        return self.rollout.backend

    # ---------------------------------------------------------------------------------------------------------
    def step(self) -> dict[str, float]:
        """One training step (docs/architecture.md, "The step"): rewards, the group filter, advantages and pruning
        all happen before any log-prob pass, so the old-policy, reference and training passes see only kept rows."""
        train_cfg, timer = self.train_cfg, PhaseTimer()
        # The rollout source runs the phases up to the kept rows (plan, rounds, rewards, score, prune, refill: see
        # gpo.rollout), in this process or in a generator running ahead; every row within the staleness bound trains.
        produced = self.rollouts.next(self.step_index, timer)
        rows, staleness = within_staleness(produced.rows, self.step_index, train_cfg.max_staleness)
        # shard: every rank trains its share of the kept rows, which carry the objective's loss mask, computed once
        kept = shard(with_loss_mask(self.objective, rows), self.rank, self.world_size)
        # log-probs: old and reference, only when needed, only on kept rows; the correction where pi_old is known
        with timer("logprobs"):
            kept, mismatch = self._fill_logprobs(kept)
        # update: mu optimizer passes over the kept rows, then the generator gets the new weights (time/weight_sync)
        with timer("update"):
            update_metrics = self._update(kept, mismatch)
        self.rollouts.publish(self.policy, self.step_index + 1, "train/skipped" not in update_metrics, timer)
        # metrics: the rollout's, staleness, the update's and the correction's, and seconds per phase
        self.step_index += 1
        return {
            **produced.metrics,
            **staleness_metrics(staleness, train_cfg.max_staleness),
            **update_metrics,
            **timer.metrics(),
        }

    def _fill_logprobs(self, kept: RolloutBatch) -> tuple[RolloutBatch, MetricSums]:
        """Old and reference log-probs where needed, then the generator/trainer correction wherever pi_old is known
        now: on this rank's whole shard, before the step's tokens are counted, so dropped tokens leave the loss's
        denominators. A correction that may drop tokens gets its pi_old pass even with mu == 1; one that only
        weighs tokens waits, with mu == 1, for the training pass's own log-probs (`_update`)."""
        train_cfg = self.train_cfg
        generated = kept.generator_logprobs is not None
        if train_cfg.mu > 1 or (generated and self.correction.masks):  # else mu == 1: pi_old is detached in the loss
            with computing_in(self.accelerator.unwrap_model(self.module), self.logprob_precision):
                kept.old_logprobs = batch_logprobs(self.module, kept.to(self.accelerator.device),
                                                   train_cfg.micro_batch_size, train_cfg.temperature)
        if self.ref is not None:
            kept.ref_logprobs = batch_logprobs(self.ref, kept.to(self.accelerator.device), train_cfg.micro_batch_size,
                                               train_cfg.temperature)
        mismatch = MetricSums()
        if generated and kept.old_logprobs is not None:
            kept, counts = corrected(self.correction, self.objective, kept, kept.old_logprobs)
            mismatch.add(counts)
        return kept, mismatch

    def _update(self, kept: RolloutBatch, mismatch: MetricSums) -> dict[str, float]:
        train_cfg, device = self.train_cfg, self.accelerator.device
        mine = step_totals(self.objective, kept)
        totals = StepTotals(sequences=int(all_reduce_sum(mine.sequences)), tokens=int(all_reduce_sum(mine.tokens)))
        if totals.tokens == 0:  # everything was filtered, pruned or dropped: nothing to learn from this step
            return {"train/skipped": 1.0, "tokens/trained": 0.0, **mismatch_metrics(mismatch.result(passes=1))}
        sums = MetricSums()
        grad_norms = []
        for _ in range(train_cfg.mu):
            micro = list(micro_batches(kept, train_cfg.micro_batch_size))
            for i, mb in enumerate(micro):
                with accumulating(self.accelerator, self.module, last=i == len(micro) - 1):
                    mb = mb.to(device)
                    logp, entropy = self.module(mb.prompt_ids, mb.prompt_mask, mb.completion_ids, mb.attended,
                                                train_cfg.temperature, with_entropy=True)
                    if mb.generator_logprobs is not None and mb.is_weights is None:  # mu == 1: this pass is pi_old
                        mb, counts = corrected(self.correction, self.objective, mb, logp, may_mask=False)
                        mismatch.add(counts)
                    loss, metrics = self.objective.loss(logp, mb, totals)
                    # Each rank's loss is its share of the global step loss; DDP averages gradients over ranks.
                    self.accelerator.backward(loss * self.world_size)
                sums.add({"loss/total": loss.detach(), **metrics,
                          "policy/entropy": entropy_share(entropy.view(logp.shape), mb, self.objective, totals)})
            grad_norms.append(float(self.accelerator.clip_grad_norm_(self.module.parameters(),
                                                                     self.optim_cfg.max_grad_norm)))
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
        return {
            **sums.result(passes=train_cfg.mu),
            **mismatch_metrics(mismatch.result(passes=1)),
            "train/grad_norm": sum(grad_norms) / len(grad_norms),
            "train/lr": self.scheduler.get_last_lr()[0],
            "tokens/trained": float(totals.tokens * train_cfg.mu),
            "train/rows": float(totals.sequences),
        }

    # ---------------------------------------------------------------------------------------------------------
    def evaluate(self, tag: str, task: Any = None, split: str | None = None) -> dict[str, float]:
        """Accuracy (greedy, or pass@k/avg/maj with eval.samples > 1) on the held-out split (validation by default:
        checkpoints are never chosen on test), or on `split` of another `task`."""
        from gpo.evaluate import evaluate, sampling_for

        ev = self.eval_cfg
        task = task or self.task
        self.rollouts.evaluating(self.policy)
        examples = list(task.load(split or ev.split))
        examples = examples[: ev.limit] if ev.limit else examples
        sampling = sampling_for(ev, self.train_cfg.max_completion_length)
        with gathered(self.accelerator, self.policy, needed=self.backend.generates_with_policy):
            _, summary = evaluate(self.policy, self.tokenizer, self.backend, task, examples, sampling,
                                  ev.batch_size, self.train_cfg.max_prompt_length, ev.samples, ev.pass_k,
                                  agent=self.parts.agent)
        return {f"eval/{tag}/{k}": float(v) for k, v in summary.items() if isinstance(v, (int, float))}

    def save(self) -> Path:
        # the question stream, allocator and selector (per-question history: resumed selections match), and the
        # generated steps not yet trained (train_cfg.max_staleness >= 1)
        rollout_state, queued = self.rollouts.state_dict()
        state = {**rollout_state, "best_score": self.best_score, "run_name": self.run_name}
        return checkpoint.save(self.accelerator, self.run_dir / "checkpoints", self.step_index, state,
                               self.ckpt_cfg.keep_last, queued)

    def restore(self, path: Path) -> Path:
        """Load checkpoint `path` and return it. When loading fails and resume picked `path` from a folder (auto, or
        a run directory), the older complete checkpoints there are tried in turn, saying so; an explicitly named
        checkpoint gets no stand-in. If any rank's load fails (each reads its own RNG state), all move on together."""
        named = Path(str(self.cfg.resume)).expanduser()
        older = [] if named.resolve() == path.resolve() else [
            p for p in checkpoint.candidates(path.parent, say=lambda _: None)
            if checkpoint.step_of(p) < checkpoint.step_of(path)
        ]
        tries = [path, *older]
        for candidate in tries:
            error: Exception | None = None
            try:
                state = checkpoint.load(self.accelerator, candidate)
            except UserError:
                raise
            except Exception as exc:  # a damaged file: whatever torch.load or DeepSpeed raise on it
                error = exc
            if int(all_reduce_sum(int(error is not None))) == 0:
                break
            reason = f"{type(error).__name__}: {error}" if error else "it failed to load on another rank"
            if error is not None:
                checkpoint.mark_damaged(candidate, f"rank {self.rank}: {reason}")
            _say(f"could not load checkpoint {candidate} ({reason}); marked damaged, left in place"
                 + ("; trying the previous one" if candidate != tries[-1] else ""))
        else:
            raise UserError(f"no checkpoint could be loaded (tried {', '.join(str(t) for t in tries)}). Resume "
                            f"from another one with resume=PATH, or start over without resume.")
        self.step_index = int(state["step"])
        self.rollouts.load_state_dict(state, state.pop("queued"), self.step_index)
        self.best_score = state.get("best_score")
        return candidate

    def save_model(self, name: str) -> Path:
        target = self.run_dir / name
        state = full_state_dict(self.accelerator, self.module)  # collective under ZeRO-3: every rank calls it
        if self.accelerator.is_main_process:  # LoRA folded in: a plain model that any backend can load
            export_model(self.accelerator.unwrap_model(self.module).model, target, state)
            self.tokenizer.save_pretrained(target)
        self.accelerator.wait_for_everyone()
        return target

    def resume_path(self) -> Path | None:
        """The checkpoint `resume` asks for: auto = this run's newest complete checkpoint (None when there is none
        yet), a run or checkpoints folder = its newest complete one, else that checkpoint, which must be complete.
        Incomplete checkpoints passed over are named (rank 0) and left in place."""
        resume = self.cfg.resume
        if not resume:
            return None
        say = _say if self.rank == 0 else (lambda message: None)
        if resume == "auto":
            found = checkpoint.candidates(self.run_dir / "checkpoints", say)
            if not found and checkpoint.list_checkpoints(self.run_dir / "checkpoints"):
                say("no complete checkpoint to resume from: starting at step 0")
            return found[0] if found else None
        path = Path(resume).expanduser()
        if path.is_dir() and not (path / checkpoint.STATE_FILE).is_file():
            folder = path / "checkpoints" if (path / "checkpoints").is_dir() else path
            found = checkpoint.candidates(folder, say)
            if not found:
                raise UserError(f"resume={resume}: no complete checkpoint in {folder}.")
            return found[0]
        damage = checkpoint.problems(path) if (path / checkpoint.STATE_FILE).is_file() else []
        if damage:
            newest = checkpoint.latest(path.parent)
            raise UserError(f"resume={resume}: the checkpoint is incomplete ({'; '.join(damage[:3])}). "
                            + (f"The newest complete one beside it is {newest} (resume={newest}, or resume=auto)."
                               if newest else "No complete checkpoint is beside it."))
        return path

    def how_to_continue(self) -> str:
        """What a user does after the run stopped: the same command with resume=auto, from which checkpoint."""
        newest = checkpoint.latest(self.run_dir / "checkpoints")
        start = f"from {newest}" if newest else "from the start (no complete checkpoint yet)"
        return (f"The run stopped in step {self.step_index + 1}; rerun the same command with resume=auto "
                f"run_name={self.run_name} to continue {start}.")

    def run(self) -> dict[str, float]:
        """Train for train_cfg.steps with evaluation, checkpoints and tracking; return the final summary."""
        from tqdm.auto import tqdm

        train_cfg, ev, ckpt = self.train_cfg, self.eval_cfg, self.ckpt_cfg
        path = self.resume_path()
        if path is not None:
            path = self.restore(path)
            _say(f"resumed from {path} at step {self.step_index}")
        if self.accelerator.is_main_process:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.yaml").write_text(to_yaml(self.cfg))
        self.tracker.start(self.run_name, flatten(as_dict(self.cfg)), to_yaml(self.cfg))
        summary: dict[str, float] = {}
        started = time.perf_counter()
        if ev.before_and_after and self.step_index == 0:
            summary.update(self.evaluate("before"))
            self.tracker.log_metrics(summary, step=0)
        bar = tqdm(total=train_cfg.steps, initial=self.step_index, desc="gpo", disable=self.rank != 0,
                   dynamic_ncols=True)
        status = "FAILED"
        try:
            with _sigterm_as_interrupt():
                while self.step_index < train_cfg.steps:
                    metrics = self.step()
                    self.tracker.log_metrics(metrics, step=self.step_index)
                    bar.update(1)
                    bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}", kept=f"{metrics['prune/kept_frac']:.2f}",
                                    s_step=f"{metrics['time/step']:.1f}")
                    summary.update({"final/reward_mean": metrics["reward/mean"],
                                    "final/kept_frac": metrics["prune/kept_frac"]})
                    if ev.every and self.step_index % ev.every == 0 and self.step_index < train_cfg.steps:
                        self._validate()
                    if ckpt.every and self.step_index % ckpt.every == 0:
                        self.save()
            status = "FINISHED"
        except KeyboardInterrupt:
            status = "KILLED"
            _say(f"interrupted: saved {self.save()}; continue with resume=auto run_name={self.run_name}")
            raise
        finally:
            bar.close()
            if status != "FINISHED":
                self.tracker.end(status)
        self.save()
        final = self.save_model("final") if ckpt.save_final_model else None
        summary["train/seconds"] = time.perf_counter() - started
        if ev.before_and_after:
            summary.update(self.evaluate("after"))
        from gpo.evaluate import final_tasks

        for name, task in final_tasks(self.cfg, self.task):  # eval.tasks: test splits, e.g. aime24, amc23
            summary.update(self.evaluate(f"after/{name}", task=task, split="test"))
        if ev.before_and_after or ev.tasks:
            self.tracker.log_metrics({k: v for k, v in summary.items() if k.startswith("eval/")}, step=self.step_index)
        self.tracker.log_artifact(str(self.run_dir / "config.yaml"))
        self.tracker.log_summary({**summary, **({"final_model": str(final)} if final else {})})
        self.tracker.end("FINISHED")
        if self.rank == 0:
            _print_summary(self.run_dir, final, summary, self.tracker.location())
        return summary

    def close(self) -> None:
        """Stop the generator process (train_cfg.max_staleness >= 1), then free what the parts hold (a generator on
        the process group, vLLM, goes first)."""
        self.rollouts.close()
        self.parts.close()

    def _validate(self) -> None:
        scores = self.evaluate("validation")
        self.tracker.log_metrics(scores, step=self.step_index)
        score = scores.get("eval/validation/accuracy")
        if score is not None and (self.best_score is None or score > self.best_score):
            self.best_score = score
            self.save_model("best")


def train(cfg: RunConfig) -> dict[str, float]:
    """Entry point of `gpo run` (and of each study run): the machine checks of `--dry-run` first, before any model
    loads, for callers that did not go through the CLI."""
    preflight.check(cfg)
    engine: Engine | None = None
    with peer_failures_explained(lambda: engine.how_to_continue() if engine else ""):
        engine = Engine(cfg)
        try:
            return engine.run()
        finally:
            engine.close()
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()  # ZeRO-3 aborts at exit otherwise


# --- small helpers --------------------------------------------------------------------------------------------


def lr_factor(schedule: str, step: int, warmup: int, total: int) -> float:
    """The learning rate's multiple at optimizer step `step` (0-based): a linear warm-up over `warmup` steps, then
    `optim.schedule` over the rest. The same curves as transformers' `get_scheduler` (cosine, linear,
    constant_with_warmup; a test compares them), written here because importing that module also imports peft."""
    if step < warmup:
        return step / max(1, warmup)
    if schedule == "constant":
        return 1.0
    if schedule == "linear":
        return max(0.0, (total - step) / max(1, total - warmup))
    progress = (step - warmup) / max(1, total - warmup)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))  # cosine, half a period


def _scheduler(optimizer: Any, name: str, warmup_ratio: float, total: int) -> Any:
    warmup, total = math.ceil(warmup_ratio * total), max(total, 1)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(name, step, warmup, total))


@contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM (a scheduler pre-empting the job) saves a checkpoint like Ctrl-C does."""
    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _say(message: str) -> None:
    print(f"gpo: {message}", flush=True)


def _print_summary(run_dir: Path, final: Path | None, summary: dict[str, float], location: str) -> None:
    lines = [f"gpo: run finished: {run_dir}"]
    for key in ("eval/before/accuracy", "eval/after/accuracy", "final/reward_mean", "final/kept_frac", "train/seconds"):
        if key in summary:
            lines.append(f"  {key:<24} {summary[key]:.4f}")
    if final is not None:
        lines.append(f"  final model              {final}")
    if location:
        lines.append(f"  {location}")
    print("\n".join(lines), flush=True)
