"""Training configuration shared by simulate, solve, diagnose and the CLI."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from costmodels.hardware import get_device
from costmodels.memory import check_optimizer, get_precision

__all__ = ["TrainConfig"]


@dataclass(frozen=True)
class TrainConfig:
    """What one training step looks like: shapes, precision, optimizer, sharding, target device."""

    batch_size: int = 1
    seq_len: int = 512
    precision: str = "fp32"
    optimizer: str = "adamw"
    zero_stage: int = 0
    dp: int = 1
    gpu: str = "cpu"

    def __post_init__(self) -> None:
        for name in ("batch_size", "seq_len", "dp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name.replace('_', ' ')} must be a positive integer, got {value!r}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero stage must be 0, 1, 2 or 3, got {self.zero_stage!r}")
        get_precision(self.precision)
        check_optimizer(self.optimizer)
        get_device(self.gpu)

    def with_(self, **changes) -> "TrainConfig":
        return replace(self, **changes)

    def to_dict(self) -> dict:
        return asdict(self)
