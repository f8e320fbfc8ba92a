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
    # How the trace reads the model: the busiest MoE expert's tokens over the mean (1.0: balanced
    # routing), and globs naming the checkpointable blocks (empty: found by structure).
    moe_imbalance: float = 1.0
    blocks: tuple[str, ...] = ()

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
        if isinstance(self.moe_imbalance, bool) or not isinstance(self.moe_imbalance, (int, float)) \
                or not self.moe_imbalance >= 1.0:
            raise ValueError(f"MoE imbalance must be a number >= 1.0 (1.0: balanced routing), got {self.moe_imbalance!r}")
        object.__setattr__(self, "blocks", tuple(self.blocks))

    def with_(self, **changes) -> "TrainConfig":
        return replace(self, **changes)

    def to_dict(self) -> dict:
        """Every field; the trace options only when set, so other plans stay as they were."""
        d = asdict(self)
        for name, default in (("moe_imbalance", 1.0), ("blocks", ())):
            if d[name] == default:
                del d[name]
        if "blocks" in d:
            d["blocks"] = list(d["blocks"])
        return d
