"""Per-step metrics: ``output_dir/metrics.jsonl`` (one flushed JSON object per step), on rank 0 a tqdm bar
when the output is a terminal and else one text line per logged step (a launcher writing to a file, a
cluster's log, ``FASTRLHF_NO_PROGRESS=1``), and optional TensorBoard / W&B (offline, or online when asked
for) when those packages are installed."""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Iterable

__all__ = ["MetricsLogger", "progress_bar_wanted", "read_metrics", "step_line", "truncate_metrics"]


def _plain(value):
    """A plain scalar: tensors become floats. NaN and infinities stay numbers: written as ``NaN``,
    ``Infinity``, ``-Infinity`` (Python's json, pandas, TensorBoard and W&B read them back as floats; a
    string would turn a metric's column into text)."""
    if hasattr(value, "item"):
        value = value.item()
    return value


def read_metrics(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def truncate_metrics(path: str, last_step: int) -> None:
    """Drop records after ``last_step`` (written after the checkpoint a run resumes from) and any torn line."""
    if not os.path.exists(path):
        return
    kept = []
    with open(path) as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                break  # a line torn by a kill: everything after it is suspect
            if record.get("step", -1) <= last_step:
                kept.append(json.dumps(record) + "\n")
    from fastrlhf.engine.checkpoint import write_text_atomic

    write_text_atomic(path, "".join(kept))  # fsynced: a power cut must not leave the resumed run's file empty


def _run_id(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip() or None
    except OSError:
        return None


def progress_bar_wanted() -> bool:
    """A progress bar only on a terminal: not with ``FASTRLHF_NO_PROGRESS=1``, nor when stdout or stderr is
    a file or a pipe (a launcher's log), where each redraw would be a line of noise; there each logged step
    is one text line instead."""
    if os.environ.get("FASTRLHF_NO_PROGRESS") == "1":
        return False
    return all(getattr(stream, "isatty", lambda: False)() for stream in (sys.stdout, sys.stderr))


def _number(value) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int) or (abs(value) >= 1000 and math.isfinite(value)):
        return f"{value:.0f}"
    return f"{value:.4g}"


def step_line(step: int, total_steps: int, record: dict, line_keys: Iterable[tuple[str, str]]) -> str:
    """``step 3/20 reward=0.5 kl=0.0012 loss=-0.034 tokens/s=812 s/step=1.92``: each ``(label, key)`` of
    ``line_keys`` whose key the record has, and ``skipped`` when the step's update was skipped."""
    parts = [f"step {step}/{total_steps}"]
    parts += [f"{label}={_number(record[key])}" for label, key in line_keys if key in record]
    if record.get("skipped"):
        parts.append("skipped")
    return " ".join(parts)


def _say_dropped_wandb_steps(run, start_step: int) -> None:
    """Where the W&B run goes past the checkpoint resumed from (the killed run logged steps after it), W&B drops
    the steps logged again (its steps only increase: one warning per step, no reason given) and keeps the killed
    run's values for them: said once, with where the resumed run's values are. (TRL's W&B callback logs them again
    on a ``train/global_step`` axis, points beside the killed run's; OpenRLHF opens a new W&B run.)"""
    ahead = getattr(run, "step", 0)
    if isinstance(ahead, int) and ahead > start_step + 1:
        print(f"note: W&B run {run.id} already holds steps up to {ahead - 1}, past the checkpoint of step "
              f"{start_step}: W&B keeps the killed run's values there and drops this run's steps {start_step + 1}-"
              f"{ahead - 1} (its steps only increase); metrics.jsonl and TensorBoard have this run's", file=sys.stderr)


class MetricsLogger:
    """Writes only on the main rank; other ranks get a silent logger, so callers need no rank checks.

    ``bar_keys``: the metrics the progress bar shows; ``line_keys``: ``(label, key)`` pairs of the text
    line printed per logged step where there is no bar (default: the bar's keys). ``wandb``: false, true or
    ``"offline"`` (a local run folder, ``wandb sync`` later), or ``"online"``; ``wandb_project`` (None:
    "fastrlhf") and ``wandb_run_name`` (None: ``output_dir``'s folder name) name the run; ``resume`` goes on in
    the W&B run the output folder began (its id in ``wandb/fastrlhf-run-id``).
    """

    def __init__(self, output_dir: str, total_steps: int, start_step: int = 0, bar_keys: Iterable[str] = ("loss",),
                 enabled: bool | None = None, tensorboard: bool = False, wandb: bool | str = False,
                 run_config: dict | None = None, resume: bool = False,
                 line_keys: Iterable[tuple[str, str]] | None = None, wandb_project: str | None = None,
                 wandb_run_name: str | None = None):
        from fastrlhf import distributed as D

        self.enabled = D.is_main() if enabled is None else enabled
        self.bar_keys = tuple(bar_keys)
        self.line_keys = tuple(line_keys) if line_keys is not None else tuple((k, k) for k in self.bar_keys)
        self.total_steps = total_steps
        self.path = os.path.join(output_dir, "metrics.jsonl")
        self._file = self._bar = self._tb = self._wandb = None
        if not self.enabled:
            return
        os.makedirs(output_dir, exist_ok=True)
        # What a resumed run keeps: up to its checkpoint's step. Resumed without one it starts over, validating at
        # step 0 again (eval.before_train): the killed run's step 0 goes too, or it would be logged twice.
        kept = start_step if start_step > 0 else -1
        if resume:
            truncate_metrics(self.path, kept)
        self._file = open(self.path, "a" if resume else "w", encoding="utf-8")
        if progress_bar_wanted():
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, desc="train", dynamic_ncols=True)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                # A resumed run rewrites the steps after its checkpoint: TensorBoard hides the killed run's events
                # from purge_step on (without it both runs' steps show, the curve doubling back).
                purge = kept + 1 if resume else None
                self._tb = SummaryWriter(os.path.join(output_dir, "tensorboard"), purge_step=purge)
            except ImportError:
                print("warning: trainer.tensorboard is on but the tensorboard package is not installed; skipping it",
                      file=sys.stderr)
        if wandb:
            try:
                import wandb as wandb_module

                from fastrlhf.engine.checkpoint import write_text_atomic

                mode = "online" if wandb == "online" else "offline"
                name = wandb_run_name or os.path.basename(os.path.normpath(os.path.abspath(output_dir)))
                # A resumed run goes on in the W&B run it began, not in a new one beside it.
                id_path = os.path.join(output_dir, "wandb", "fastrlhf-run-id")
                previous = _run_id(id_path) if resume else None
                same_run = {"id": previous, "resume": "allow"} if previous else {}
                self._wandb = wandb_module.init(mode=mode, project=wandb_project or "fastrlhf", name=name,
                                                dir=output_dir, config=run_config or {}, **same_run)
                os.makedirs(os.path.dirname(id_path), exist_ok=True)
                write_text_atomic(id_path, f"{self._wandb.id}\n")
                if previous:
                    _say_dropped_wandb_steps(self._wandb, start_step)
            except ImportError:
                print("warning: trainer.wandb is on but the wandb package is not installed; skipping it",
                      file=sys.stderr)

    def log(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._bar is not None:
            shown = {k: record[k] for k in self.bar_keys if k in record}
            self._bar.set_postfix({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in shown.items()},
                                  refresh=False)
            self._bar.n = step
            self._bar.refresh()
        else:
            print(step_line(step, self.total_steps, record, self.line_keys), flush=True)
        numeric = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}
        if self._tb is not None:
            for key, value in numeric.items():
                self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(numeric, step=step)

    def message(self, text: str) -> None:
        """A line that does not break the progress bar."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        self._file = self._bar = self._tb = self._wandb = None
