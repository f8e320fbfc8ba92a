"""A transformers TrainerCallback that plans the model on its first batch and monitors every step.

    from planner.integrations.hf import MemplanCallback
    trainer = Trainer(model, args, train_dataset=data, callbacks=[MemplanCallback(budget="8GiB", log_path="mem.jsonl")])

The plan is made at the first training forward from fake copies of that batch (see
planner.auto_checkpoint), for the Trainer's gradient_accumulation_steps, and follows the batch's
sequence length; each optimizer step (all its micro-batches) writes one line to the log (see
planner.MemoryMonitor), measured without memplan's own planning. The plan is removed when
training ends.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from planner.errors import MemplanError
from planner.runtime.auto import AutoHandle, auto_checkpoint
from planner.runtime.monitor import MemoryMonitor, seq_len_of

try:
    from transformers import TrainerCallback
except ImportError as exc:  # transformers is optional for memplan
    raise ImportError("planner.integrations.hf needs transformers: pip install transformers") from exc

__all__ = ["MemplanCallback"]


class MemplanCallback(TrainerCallback):
    """Plan under `budget` (bytes, '8GiB' or '60%') at the first batch; log memory per step.

    `config` takes TrainConfig fields (optimizer, precision, gpu, ...) as auto_checkpoint does;
    grad_accum_steps comes from the Trainer's gradient_accumulation_steps.
    """

    def __init__(
        self,
        budget: int | str,
        log_path: str | Path = "memplan.jsonl",
        adapt: bool = False,
        reserve: float = 0.05,
        follow_seq_len: bool = True,
        **config: Any,
    ) -> None:
        self.budget = budget
        self.log_path = Path(log_path)
        self.adapt = adapt
        self.reserve = reserve
        self.follow_seq_len = follow_seq_len
        self.config = config
        self.handle: AutoHandle | None = None
        self.monitor: MemoryMonitor | None = None
        self._model: nn.Module | None = None
        self._first_batch_hook: Any = None
        self._grad_accum_steps = 1  # the Trainer's, read at on_train_begin

    def on_train_begin(
        self, args: Any, state: Any, control: Any, model: nn.Module | None = None, optimizer: Any = None, **kwargs: Any
    ) -> None:
        if model is None:
            raise ValueError("MemplanCallback needs the model; use it with transformers.Trainer")
        accum = int(args.gradient_accumulation_steps)
        if self.config.get("grad_accum_steps", accum) != accum:
            raise MemplanError(
                f"grad_accum_steps={self.config['grad_accum_steps']} but the Trainer accumulates "
                f"{accum} micro-batches (gradient_accumulation_steps); leave grad_accum_steps out"
            )
        self._grad_accum_steps = accum
        self._model = model
        self.monitor = MemoryMonitor(self.log_path, reserve=self.reserve, model=model, optimizer=optimizer)
        self.monitor.__enter__()
        self._first_batch_hook = model.register_forward_pre_hook(self._plan_first_batch, with_kwargs=True)

    def _plan_first_batch(self, model: nn.Module, args: tuple, kwargs: dict) -> None:
        """At the first training forward: plan from this batch, unmeasured (this forward already
        runs under the plan, at the monitor's target when adapting)."""
        if not model.training:
            return
        self._first_batch_hook.remove()
        inputs = dict(kwargs) if kwargs else tuple(args)
        seq_len = seq_len_of(inputs) if self.follow_seq_len else None
        seq_lens = [seq_len] if seq_len else []
        assert self.monitor is not None
        with self.monitor.paused():
            config = {**self.config, "grad_accum_steps": self._grad_accum_steps}
            self.handle = auto_checkpoint(model, inputs, self.budget, seq_lens=seq_lens, **config)
            self.monitor.attach(self.handle, adapt=self.adapt)
            self.handle.install()

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.monitor is not None:
            self.monitor.begin_step()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.monitor is not None:
            self.monitor.end_step()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._first_batch_hook is not None:
            self._first_batch_hook.remove()
        if self.monitor is not None:
            self.monitor.__exit__(None, None, None)
        if self.handle is not None:
            self.handle.remove()
