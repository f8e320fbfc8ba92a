"""Training configuration shared by simulate, solve, diagnose and the CLI."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from costmodels.hardware import get_device
from costmodels.memory import check_optimizer, get_precision

__all__ = [
    "CP_ROTATE_METHODS",
    "DEFAULT_RESERVE",
    "DEFAULT_TIME_LIMIT_S",
    "MP_DTYPES",
    "PP_SCHEDULES",
    "V_SHAPED_SCHEDULES",
    "TrainConfig",
]

DEFAULT_RESERVE = 0.05  # fraction of the device kept free for the allocator and the CUDA context
DEFAULT_TIME_LIMIT_S = 10.0  # CP-SAT's deterministic time limit per solve

# FSDP2 MixedPrecisionPolicy dtypes -> the precision preset whose trace gathers parameters in that dtype
MP_DTYPES = {"float32": "fp32", "bfloat16": "bf16-mixed", "float16": "fp16-mixed"}

# torch.distributed.pipelining schedules by their CLI names -> torch's class names (schedules.py).
PP_SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "looped-bfs": "ScheduleLoopedBFS",
    "interleaved-zero-bubble": "ScheduleInterleavedZeroBubble",
    "zbv-zero-bubble": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
# Schedules whose rank r holds stages r and 2·pp−1−r (two stages per rank, V-shaped).
V_SHAPED_SCHEDULES = ("zbv-zero-bubble", "dualpipev")
# How context parallel's ring attention exchanges K/V (torch's set_rotate_method; allgather is its default).
CP_ROTATE_METHODS = ("allgather", "alltoall")
# Schedules that run one stage per rank.
SINGLE_STAGE_SCHEDULES = ("gpipe", "1f1b")


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
    # Micro-batches of batch_size whose gradients accumulate before one optimizer step: from the
    # second on, every gradient is live from the start of the forward.
    grad_accum_steps: int = 1
    # Parallel layout, mesh order [pp, dp, cp, tp] as torchtitan. tp: tensor-parallel degree with
    # sequence parallel on (sequence_parallel), the loss computed on vocabulary-sharded logits under
    # torch's loss_parallel() (loss_parallel, torchtitan's default) and a sharding plan (tp_plan:
    # "auto" or a PATH.py:FUNC / package.module:FUNC spec of FUNC(model, tp_mesh)); cp: context-parallel degree
    # (torch's context_parallel; cp_rotate: how its ring attention exchanges K/V, see CP_ROTATE_METHODS);
    # ep: expert-parallel degree, borrowed from dp × cp, with ep_plan as tp_plan (FUNC(model, ep_mesh)).
    # pp: pipeline stages on pp ranks under pp_schedule; batch_size is one data-parallel replica's
    # batch, split into microbatches (None: pp); stages_per_rank (None: 2 for V-shaped schedules,
    # else 1); pp_split: "uniform", "auto" or blocks per stage "N1,N2,...".
    tp: int = 1
    sequence_parallel: bool = True
    loss_parallel: bool = True
    tp_plan: str = "auto"
    cp: int = 1
    cp_rotate: str = "allgather"
    ep: int = 1
    ep_plan: str = "auto"
    pp: int = 1
    pp_schedule: str = "1f1b"
    microbatches: int | None = None
    stages_per_rank: int | None = None
    pp_split: str = "uniform"

    def __post_init__(self) -> None:
        for name in ("batch_size", "seq_len", "dp", "grad_accum_steps"):
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
        self._check_layout()

    @property
    def world_size(self) -> int:
        """Ranks of the whole job: pp × dp × cp × tp."""
        return self.pp * self.dp * self.cp * self.tp

    @property
    def shard_ranks(self) -> int:
        """Ranks that shard parameters, gradients and optimizer states under ZeRO / FSDP2: dp × cp
        (torchtitan's ``dp_shard_cp`` mesh; a context-parallel rank holds the same model as its peers)."""
        return self.dp * self.cp

    @property
    def layout_flags(self) -> str:
        """The tensor, context, expert and pipeline parallel flags of this layout ('--tp 2 --pp 4'), '' for data parallel."""
        return " ".join(
            f"--{name} {getattr(self, name)}" for name in ("tp", "cp", "ep", "pp") if getattr(self, name) > 1
        )

    @property
    def num_microbatches(self) -> int:
        return self.microbatches if self.microbatches is not None else self.pp

    @property
    def num_stages_per_rank(self) -> int:
        if self.stages_per_rank is not None:
            return self.stages_per_rank
        return 2 if self.pp_schedule in V_SHAPED_SCHEDULES else 1

    def _check_layout(self) -> None:
        """The parallel degrees and the pipeline's shape, each with the flag that fixes it."""
        for name in ("tp", "cp", "ep", "pp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"--{name} must be a positive integer, got {value!r}")
        for name in ("microbatches", "stages_per_rank"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
        for name in ("sequence_parallel", "loss_parallel"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name.replace('_', ' ')} must be true or false, got {getattr(self, name)!r}")
        for name in ("tp_plan", "ep_plan"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name).strip():
                raise ValueError(f"--{name.replace('_', '-')} must be auto, PATH.py:FUNC or package.module:FUNC")
        if self.ep > 1 and (self.dp * self.cp) % self.ep:
            raise ValueError(
                f"--ep {self.ep} must divide --dp {self.dp} × --cp {self.cp}: expert parallel borrows its ranks "
                f"from data parallel; use a --dp that --ep divides (e.g. --dp {self.ep})"
            )
        if self.ep > 1 and self.zero_stage in (1, 2):
            raise ValueError(f"--ep with --zero {self.zero_stage} is not modelled; use --zero 3 (FSDP2) or --zero 0")
        self._check_context_parallel()
        if self.pp_schedule not in PP_SCHEDULES:
            raise ValueError(f"unknown --pp-schedule '{self.pp_schedule}'; use one of: {', '.join(PP_SCHEDULES)}")
        v = self.num_stages_per_rank
        if self.pp_schedule in V_SHAPED_SCHEDULES and v != 2:
            raise ValueError(f"--pp-schedule {self.pp_schedule} runs 2 stages per rank; use --stages-per-rank 2")
        if self.pp_schedule in SINGLE_STAGE_SCHEDULES and v != 1:
            raise ValueError(
                f"--pp-schedule {self.pp_schedule} runs 1 stage per rank; use interleaved-1f1b, looped-bfs or "
                f"interleaved-zero-bubble for --stages-per-rank {v}"
            )
        if self.pp == 1 and (self.microbatches not in (None, 1) or v != 1 and self.stages_per_rank is not None):
            raise ValueError("--microbatches and --stages-per-rank shape a pipeline; add --pp N (N > 1)")
        if self.num_microbatches > self.batch_size:
            raise ValueError(
                f"--microbatches {self.num_microbatches} exceeds --batch-size {self.batch_size}: each microbatch "
                "needs at least one sample; raise --batch-size or lower --microbatches"
            )
        if self.batch_size % self.num_microbatches:
            raise ValueError(
                f"--batch-size {self.batch_size} does not split into {self.num_microbatches} equal microbatches; "
                "use a batch size that --microbatches divides"
            )
        split = self.pp_split.strip() if isinstance(self.pp_split, str) else None
        if split not in ("uniform", "auto"):
            parts = split.split(",") if split else []
            if not parts or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
                raise ValueError(
                    f"--pp-split must be uniform, auto or positive blocks per stage N1,N2,..., got {self.pp_split!r}"
                )
            if len(parts) != self.pp * v:
                raise ValueError(
                    f"--pp-split names {len(parts)} stages but --pp {self.pp} × --stages-per-rank {v} "
                    f"makes {self.pp * v}; give one block count per stage"
                )

    def _check_context_parallel(self) -> None:
        """torch's context_parallel cuts the sequence into cp equal shards (2·cp chunks, load-balanced)."""
        if self.cp_rotate not in CP_ROTATE_METHODS:
            raise ValueError(f"unknown --cp-rotate {self.cp_rotate!r}; use one of: {', '.join(CP_ROTATE_METHODS)}")
        if self.cp == 1:
            return
        if self.seq_len % self.cp:
            raise ValueError(
                f"--seq-len {self.seq_len} does not split into --cp {self.cp} equal shards; use a multiple of "
                f"{2 * self.cp} (context parallel's load balancing cuts the sequence into 2·cp chunks)"
            )
        if self.compile:
            raise ValueError(
                "--cp under --compile is not simulated (context parallel traces eager ring attention); drop one"
            )

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
            ("grad_accum_steps", 1),
            ("tp", 1),
            ("sequence_parallel", True),
            ("loss_parallel", True),
            ("tp_plan", "auto"),
            ("cp", 1),
            ("cp_rotate", "allgather"),
            ("ep", 1),
            ("ep_plan", "auto"),
            ("pp", 1),
            ("pp_schedule", "1f1b"),
            ("microbatches", None),
            ("stages_per_rank", None),
            ("pp_split", "uniform"),
        ):
            if d[name] == default:
                del d[name]
        if "blocks" in d:
            d["blocks"] = list(d["blocks"])
        return d
