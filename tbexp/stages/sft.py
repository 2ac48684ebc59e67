"""The SFT stage: fine-tuning on verified conversations with a completion-only loss.

resume → data (read the jsonl, render each conversation with weights 1 on
assistant tokens only, drop or truncate the over-long, hold out
`val_fraction` for NLL) → build the backend → loop: a batch, `forward_backward`
and `optim_step` submitted together (Tinker pipelines them), learning-rate
schedule; every `eval_every` steps the held-out NLL and a checkpoint; stop
after `patience` evaluations without improvement → choose the checkpoint with
the lowest held-out NLL, i.e. the one before NLL stopped improving, also
written as a PEFT adapter (`adapter/`, tbexp.backends.adapters) → with
`sft.eval_after`, score the base model and the chosen checkpoint on the
held-out tasks → metrics.

Re-running the same command in the same run directory resumes from the last
checkpoint (`sft_state.json` records the evaluations so far); the batches are a
function of the seed and the step, so the resumed run sees the same data.
When SLURM signals that the job is about to be killed (time limit,
preemption, `scontrol requeue`), the step in progress finishes, a checkpoint is
saved and the job stops (`tbexp.jobs.preemption`); the requeued job resumes from
it, so no step runs twice.
"""

from __future__ import annotations

import json
import logging
import random
from itertools import groupby
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tbexp.job import TrainedCheckpoint
from tbexp.jobs.preemption import interruptible
from tbexp.jobs.schedule import epoch_batch, learning_rate
from tbexp.jobs.tracking import write_summary
from tbexp.seeds import stream
from tbexp.study import trial

if TYPE_CHECKING:
    from tinker.types import Datum

    from tbexp.backends.base import TrainingBackend
    from tbexp.job import Job
    from tbexp.models.renderers import Renderer

log = logging.getLogger(__name__)


class SFTResult(TrainedCheckpoint):
    """The chosen checkpoint (lowest held-out NLL) and the run's numbers (`sft/…`)."""

    KEY = "sft/checkpoint"


def run(job: Job) -> dict[str, float]:
    from tbexp.stages.eval import compare, evaluate_checkpoint

    cfg, out = job.cfg, job.run_dir
    result = train(job, data_file(job), out)
    summary: dict[str, Any] = {"sft_training": result.summary()}
    if cfg.sft.eval_after:
        summary["base"] = evaluate_checkpoint(job, out / "eval_base", "", label="base")
        summary["sft"] = evaluate_checkpoint(job, out / "eval_sft", result.checkpoint, label="sft")
        print(compare({"base": summary["base"], "sft": summary["sft"]}))
    write_summary(out, summary)
    return {**result.summary(), **summary.get("sft", {})}


def data_file(job: Job) -> Path:
    """The file SFT trains on: `sft.data` when it names one file, the mixture it describes written to the run
    directory when it names several sources (tbexp.episodes.mixture), the oracle's verified turns when empty."""
    from omegaconf import OmegaConf

    from tbexp.episodes.mixture import mix
    from tbexp.stages.collect import oracle_trajectories

    data = job.cfg.sft.data
    if not data or data == "oracle":
        return oracle_trajectories(job)
    if isinstance(data, str):
        return Path(data)
    sources = OmegaConf.to_container(data) if OmegaConf.is_config(data) else data
    resolve = lambda path: oracle_trajectories(job) if path == "oracle" else Path(path)  # noqa: E731
    return mix(sources, job.run_dir / "sft_mixture.jsonl", job.cfg.seed, resolve)


def train(job: Job, data: Path, out: Path) -> SFTResult:
    """Run (or resume) SFT in `out` on the conversations in `data`; the checkpoint is chosen by held-out NLL."""
    from tinker import types
    from tqdm import trange

    from tbexp.episodes.trajectories import read_conversations
    from tbexp.models.renderers import make_renderer

    cfg, s = job.cfg, job.cfg.sft
    state_path = out / "sft_state.json"
    state: dict[str, Any] = json.loads(state_path.read_text()) if state_path.exists() else {"step": 0, "evals": []}

    conversations = read_conversations(data)
    backend = job.models.trainer(out / "checkpoints")
    renderer = make_renderer(cfg.model.renderer, backend.tokenizer)
    max_len = s.max_length_tokens or cfg.model.max_length_tokens
    train, val, counts, reply_lengths = _datums(conversations, renderer, max_len, s.overlong, s.val_fraction, cfg.seed)
    _warn_of_long_replies(reply_lengths, cfg.sampling.max_tokens)
    resume = state.get("resume_checkpoint") or (state["evals"][-1]["checkpoint"] if state["evals"] else "")
    if resume:  # the last checkpoint saved: an evaluation's, save_every's, or the one saved on SLURM's signal
        backend.load_state(resume)
        log.info("sft: resuming after step %d from %s", state["step"], resume)

    tracker = job.tracker(out)
    tracker.rewind(state["step"], ("train/", "optim/", "eval/nll"))  # what a killed run did after its last checkpoint
    tracker.log({f"sft/{k}": float(v) for k, v in counts.items()}, step=state["step"])
    start = s.steps if _stalled(state["evals"], s.patience) else state["step"]  # an early-stopped run stays stopped
    steps = trange(start, s.steps, desc="sft", initial=start, total=s.steps, unit="step")
    for step in interruptible(steps, checkpoint=lambda step: _save_resume_point(backend, state, state_path, step + 1)):
        batch = epoch_batch(train, step, s.batch_size, cfg.seed)
        lr = learning_rate(s, step)
        fb = backend.forward_backward(batch, "cross_entropy")
        opt = backend.optim_step(
            types.AdamParams(learning_rate=lr, weight_decay=s.weight_decay, grad_clip_norm=s.grad_clip_norm)
        )
        fb_result, opt_result = fb.result(), opt.result()
        train_nll = fb_result.loss / max(fb_result.n_tokens, 1.0)
        tracker.log(
            {"train/nll": train_nll, "optim/lr": lr, **{f"optim/{k}": v for k, v in opt_result.items()}},
            step=step + 1,
        )
        done = step + 1 == s.steps
        if (step + 1) % s.eval_every == 0 or done:
            nll = _nll(backend, val)
            state["evals"].append(
                {"step": step + 1, "val_nll": nll, "checkpoint": backend.save_state(f"step-{step + 1:05d}")}
            )
            state["step"], state["resume_checkpoint"] = step + 1, state["evals"][-1]["checkpoint"]
            state_path.write_text(json.dumps(state, indent=1))
            tracker.log({"eval/nll": nll}, step=step + 1)
            trial.report(
                cfg, "eval/nll", nll, step + 1, higher_is_better=False
            )  # in a sweep, the pruner may end the job here
            tracker.log_checkpoint(state["resume_checkpoint"], step + 1)
            if _stalled(state["evals"], s.patience):
                log.info(
                    "sft: held-out NLL has not improved for %d evaluations; stopping at step %d", s.patience, step + 1
                )
                break
        elif s.save_every and (step + 1) % s.save_every == 0:
            _save_resume_point(backend, state, state_path, step + 1)

    best = min(state["evals"], key=lambda e: e["val_nll"])
    (out / "chosen_checkpoint.txt").write_text(best["checkpoint"] + "\n")
    print(f"chosen checkpoint: step {best['step']} (held-out NLL {best['val_nll']:.4f}) -> {best['checkpoint']}")
    tracker.log_checkpoint(best["checkpoint"], best["step"], "chosen")
    tracker.finish()
    exported = backend.export_checkpoint(best["checkpoint"], str(out))  # out/adapter, for use without tbexp
    print(exported.describe())
    metrics = {
        "sft/chosen_step": float(best["step"]),
        "sft/val_nll": best["val_nll"],
        "sft/steps_run": float(state["step"]),
        **{f"sft/{k}": float(v) for k, v in counts.items()},
    }
    return SFTResult(best["checkpoint"], metrics, {exported.kind: exported.path} if exported.path else {})


Conversation = list[dict[str, str]]


def _datums(
    conversations: list[Conversation], renderer: Renderer, max_len: int, overlong: str, val_fraction: float, seed: int
) -> tuple[list[Datum], list[Datum], dict[str, int], list[int]]:
    from tinker import types

    train_rows, val_rows = _split(conversations, val_fraction, seed)
    dropped, truncated = 0, 0
    reply_lengths: list[int] = []  # every reply's tokens, end of turn included, before any truncation

    def render(rows: list[Conversation]) -> list[Datum]:
        nonlocal dropped, truncated
        datums = []
        for messages in rows:
            tokens, weights = renderer.supervised(messages)
            reply_lengths.extend(_reply_lengths(weights))
            if len(tokens) > max_len:
                if overlong == "drop":
                    dropped += 1
                    continue
                tokens, weights = tokens[:max_len], weights[:max_len]
                truncated += 1
            if sum(weights[1:]) == 0:
                dropped += 1  # nothing of the reply survived truncation
                continue
            datums.append(
                types.Datum(
                    model_input=types.ModelInput.from_ints(tokens[:-1]),
                    # lists, which the Datum turns into TensorData on construction
                    loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights[1:]},  # type: ignore[dict-item]
                )
            )
        return datums

    train, val = render(train_rows), render(val_rows)
    if not train or not val:
        from tbexp.episodes.trajectories import DataError

        raise DataError(
            f"{len(train)} train and {len(val)} held-out conversations left after dropping {dropped} over {max_len} tokens; need at least one of each"
        )
    return (
        train,
        val,
        {
            "train_conversations": len(train),
            "val_conversations": len(val),
            "dropped_overlong": dropped,
            "truncated_overlong": truncated,
        },
        reply_lengths,
    )


def _reply_lengths(weights: list[float]) -> list[int]:
    """The length of each reply in a rendered conversation: its runs of weight-1 tokens."""
    return [len(list(run)) for weight, run in groupby(weights) if weight]


def _warn_of_long_replies(lengths: list[int], max_tokens: int) -> None:
    """Say when the data's replies are longer than the sampler lets the trained policy write.

    The checkpoint would learn replies that evaluation and RL cut at `sampling.max_tokens`: terminus-2's JSON
    replies, for one, run to 100-200 tokens of the tiny model where a raw command is a few dozen.
    """
    long = [n for n in lengths if n > max_tokens]
    if long:
        log.warning(
            "sft: %d of %d replies in the data are longer than sampling.max_tokens=%d (the longest %d tokens, end "
            "of turn included): the trained policy's replies will be cut there; raise sampling.max_tokens",
            len(long),
            len(lengths),
            max_tokens,
            max(long),
        )


def _split(
    conversations: list[Conversation], val_fraction: float, seed: int
) -> tuple[list[Conversation], list[Conversation]]:
    """Hold out `val_fraction` of the conversations for NLL, shuffled by `seed`.

    A conversation goes to the held-out side only if every word of its replies
    also occurs in a reply that stays in training. Otherwise its NLL would be
    dominated by a name the model cannot have seen (we measured one such name
    make held-out NLL rise from the first epoch on while accuracy still
    improved), and "the checkpoint before held-out NLL stops improving" would
    stop far too early. This is what held-out means for the tasks too: new
    combinations of known names.
    """
    import re
    from collections import Counter

    words = [
        Counter(w for m in c if m["role"] == "assistant" for w in re.findall(r"[A-Za-z0-9_]+", m["content"]))
        for c in conversations
    ]
    in_train: Counter[str] = Counter()
    for counts in words:
        in_train.update(counts.keys())
    order = list(range(len(conversations)))
    random.Random(stream(seed, "val_split")).shuffle(order)
    n_val = max(1, round(len(conversations) * val_fraction))
    val_index: list[int] = []
    for i in order:
        if len(val_index) == n_val:
            break
        if all(in_train[w] > 1 for w in words[i]):  # another conversation keeps each word in training
            val_index.append(i)
            in_train.subtract(words[i].keys())
    if not val_index:  # nothing qualifies (tiny or all-unique data): fall back to a plain random split
        val_index = order[:n_val]
    chosen = set(val_index)
    return [c for i, c in enumerate(conversations) if i not in chosen], [conversations[i] for i in sorted(chosen)]


def _save_resume_point(backend: TrainingBackend, state: dict[str, Any], state_path: Path, steps_done: int) -> None:
    """A checkpoint to resume from after `steps_done` steps (save_every, SLURM's signal); not a candidate to choose."""
    if state["step"] == steps_done:  # this step's evaluation saved one already
        return
    state["step"], state["resume_checkpoint"] = steps_done, backend.save_state(f"step-{steps_done:05d}")
    state_path.write_text(json.dumps(state, indent=1))


def _nll(backend: TrainingBackend, val: list[Datum]) -> float:
    result = backend.forward(val, "cross_entropy").result()
    return float(result.loss / max(result.n_tokens, 1.0))


def _stalled(evals: list[dict[str, Any]], patience: int) -> bool:
    if not patience or len(evals) <= patience:
        return False
    best_index = min(range(len(evals)), key=lambda i: evals[i]["val_nll"])
    return len(evals) - 1 - best_index >= patience
