"""Training configuration shared by simulate, solve, diagnose and the CLI."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from costmodels.hardware import get_device
from costmodels.memory import check_optimizer, get_precision

__all__ = ["DEFAULT_RESERVE", "DEFAULT_TIME_LIMIT_S", "MP_DTYPES", "TrainConfig"]

DEFAULT_RESERVE = 0.05  # fraction of the device kept free for the allocator and the CUDA context
DEFAULT_TIME_LIMIT_S = 10.0  # CP-SAT's deterministic time limit per solve

# FSDP2 MixedPrecisionPolicy dtypes -> the precision preset whose trace gathers parameters in that dtype
MP_DTYPES = {"float32": "fp32", "bfloat16": "bf16-mixed", "float16": "fp16-mixed"}


@dataclass(frozen=True)
class TrainConfig:
    """What one training step looks like: shapes, precision, optimizer, sharding, target device."""

    batch_size: int = 1
    seq_len: int = 512
    precision: str = "fp32"
    optimizer: str = "adamw"
    zero_stage: int = 0
    dp: int = 1
    gpu: str = "cpu"  # a device name (costmodels.hardware.DEVICES) or the path of a memplan calibrate profile
    # How the trace reads the model: the busiest MoE expert's tokens over the mean (1.0: balanced
    # routing), and globs naming the checkpointable blocks (empty: found by structure).
    moe_imbalance: float = 1.0
    blocks: tuple[str, ...] = ()
    # FSDP2 (zero_stage 3): reshard each block after forward (True), keep it unsharded until its
    # backward (False) or keep a 1/N shard (an int N dividing dp); MixedPrecisionPolicy dtypes
    # (None: param_dtype from `precision`, reduce_dtype = param_dtype as in FSDP2); CPUOffloadPolicy.
    reshard_after_forward: bool | int = True
    mp_param_dtype: str | None = None
    mp_reduce_dtype: str | None = None
    cpu_offload: bool = False
    # The step runs under torch.compile: plans give each block an activation_memory_budget for the
    # min-cut partitioner (planner.solver.compiled) instead of eager checkpointing.
    compile: bool = False

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
        if (
            isinstance(self.moe_imbalance, bool)
            or not isinstance(self.moe_imbalance, (int, float))
            or not self.moe_imbalance >= 1.0
        ):
            raise ValueError(
                f"MoE imbalance must be a number >= 1.0 (1.0: balanced routing), got {self.moe_imbalance!r}"
            )
        object.__setattr__(self, "blocks", tuple(self.blocks))
        if not isinstance(self.compile, bool):
            raise ValueError(f"compile must be true or false, got {self.compile!r}")
        self._check_fsdp()

    def _check_fsdp(self) -> None:
        """FSDP2 options need ZeRO-3; mp_param_dtype picks the matching mixed precision preset."""
        raf = self.reshard_after_forward
        if not isinstance(raf, (bool, int)) or (not isinstance(raf, bool) and (raf < 1 or self.dp % raf)):
            raise ValueError(f"reshard after forward must be true, false or a divisor of dp {self.dp}, got {raf!r}")
        for name in ("mp_param_dtype", "mp_reduce_dtype"):
            if getattr(self, name) not in (None, *MP_DTYPES):
                raise ValueError(
                    f"{name.replace('_', ' ')} must be one of {', '.join(MP_DTYPES)}, got {getattr(self, name)!r}"
                )
        if self.zero_stage < 3 and (raf is not True or self.mp_param_dtype or self.mp_reduce_dtype or self.cpu_offload):
            raise ValueError(
                "reshard after forward, mixed precision dtypes and CPU offload are FSDP2 options; add --zero 3"
            )
        if self.mp_param_dtype not in (None, "float32"):
            preset = MP_DTYPES[self.mp_param_dtype]
            if self.precision not in ("fp32", preset):
                raise ValueError(
                    f"mp param dtype {self.mp_param_dtype} contradicts precision {self.precision}; "
                    f"use precision {preset} or fp32"
                )
            object.__setattr__(self, "precision", preset)

    def with_(self, **changes) -> TrainConfig:
        return replace(self, **changes)

    def to_dict(self) -> dict:
        """Every field; the trace options only when set, so other plans stay as they were."""
        d = asdict(self)
        for name, default in (
            ("moe_imbalance", 1.0),
            ("blocks", ()),
            ("reshard_after_forward", True),
            ("mp_param_dtype", None),
            ("mp_reduce_dtype", None),
            ("cpu_offload", False),
            ("compile", False),
        ):
            if d[name] == default:
                del d[name]
        if "blocks" in d:
            d["blocks"] = list(d["blocks"])
        return d
