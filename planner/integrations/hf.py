"""A transformers TrainerCallback that plans the model on its first batch and monitors every step.

    from planner.integrations.hf import MemplanCallback
    trainer = Trainer(model, args, train_dataset=data, callbacks=[MemplanCallback(budget="8GiB", log_path="mem.jsonl")])

The plan is made at the first training forward from fake copies of that batch (see
planner.auto_checkpoint) and follows the batch's sequence length; each optimizer step writes one
line to the log (see planner.MemoryMonitor). The plan is removed when training ends.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from planner.runtime.auto import AutoHandle, auto_checkpoint
from planner.runtime.monitor import MemoryMonitor, seq_len_of

try:
    from transformers import TrainerCallback
except ImportError as exc:  # transformers is optional for memplan
    raise ImportError("planner.integrations.hf needs transformers: pip install transformers") from exc

__all__ = ["MemplanCallback"]


class MemplanCallback(TrainerCallback):
    """Plan under `budget` (bytes, '8GiB' or '60%') at the first batch; log memory per step.

    `config` takes TrainConfig fields (optimizer, precision, gpu, ...) as auto_checkpoint does.
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

    def on_train_begin(
        self, args: Any, state: Any, control: Any, model: nn.Module | None = None, optimizer: Any = None, **kwargs: Any
    ) -> None:
        if model is None:
            raise ValueError("MemplanCallback needs the model; use it with transformers.Trainer")
        self._model = model
        self.monitor = MemoryMonitor(self.log_path, reserve=self.reserve, model=model, optimizer=optimizer)
        self.monitor.__enter__()
        self._first_batch_hook = model.register_forward_pre_hook(self._plan_first_batch, with_kwargs=True)

    def _plan_first_batch(self, model: nn.Module, args: tuple, kwargs: dict) -> None:
        """At the first training forward: plan from this batch (this forward already runs under the plan)."""
        if not model.training:
            return
        self._first_batch_hook.remove()
        inputs = dict(kwargs) if kwargs else tuple(args)
        seq_len = seq_len_of(inputs) if self.follow_seq_len else None
        seq_lens = [seq_len] if seq_len else []
        self.handle = auto_checkpoint(model, inputs, self.budget, seq_lens=seq_lens, **self.config)
        assert self.monitor is not None
        self.monitor.attach(self.handle, adapt=self.adapt)

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
