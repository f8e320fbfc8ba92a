"""The ranks of a parallel job: mesh coordinates, and one simulated timeline per distinct role.

Mesh order is ``[pp, dp, cp, tp]`` (torchtitan): global rank
``((pp_i · dp + dp_i) · cp + cp_i) · tp + tp_i``. Expert parallel borrows its ranks from the
``dp × cp`` ranks of one pipeline stage, so a rank's expert-parallel index is
``(dp_i · cp + cp_i) mod ep``. Ranks whose local graph and state are the same (a *role*) share one
trace and one timeline: the JSON lists each role once with all its global ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass

from planner.config import TrainConfig
from planner.simulation.step import Timeline

__all__ = ["MESH_DIMS", "RankCoords", "RankRole", "LayoutTimeline", "mesh_coords", "group_roles"]

MESH_DIMS = ("pp", "dp", "cp", "tp")


@dataclass(frozen=True)
class RankCoords:
    """Where one global rank sits in the mesh."""

    rank: int
    pp: int
    dp: int
    cp: int
    tp: int
    ep: int

    def to_dict(self) -> dict[str, int]:
        return {"pp": self.pp, "dp": self.dp, "cp": self.cp, "tp": self.tp, "ep": self.ep}


def mesh_coords(config: TrainConfig) -> Iterator[RankCoords]:
    """Every global rank of the job in rank order, with its coordinates."""
    rank = 0
    for pp_i in range(config.pp):
        for dp_i in range(config.dp):
            for cp_i in range(config.cp):
                for tp_i in range(config.tp):
                    ep_i = (dp_i * config.cp + cp_i) % config.ep
                    yield RankCoords(rank, pp_i, dp_i, cp_i, tp_i, ep_i)
                    rank += 1


def group_roles(config: TrainConfig, role_of: Callable[[RankCoords], Hashable]) -> list[list[RankCoords]]:
    """Ranks grouped by ``role_of(coords)`` (ranks with equal keys run the same local step), in rank order."""
    groups: dict[Hashable, list[RankCoords]] = {}
    for coords in mesh_coords(config):
        groups.setdefault(role_of(coords), []).append(coords)
    return list(groups.values())


@dataclass(frozen=True)
class RankRole:
    """One distinct role: the global ranks that share it, the first one's coordinates, its stages and timeline."""

    ranks: tuple[int, ...]
    coords: RankCoords
    stages: tuple[int, ...]
    timeline: Timeline

    @property
    def peak_bytes(self) -> int:
        return self.timeline.peak_bytes

    def to_dict(self) -> dict:
        t = self.timeline
        return {
            "ranks": list(self.ranks),
            "coords": self.coords.to_dict(),
            "stage": list(self.stages),
            "peak_bytes": t.peak_bytes,
            "peak_op": t.peak_op,
            "peak_phase": t.peak_phase,
            "breakdown_at_peak": dict(t.breakdown_at_peak),
        }


@dataclass(frozen=True)
class LayoutTimeline:
    """Every role of a parallel job; the job's peak is its worst rank's."""

    config: TrainConfig
    roles: tuple[RankRole, ...]

    def __post_init__(self) -> None:
        if not self.roles:
            raise ValueError("a layout needs at least one rank role")

    @property
    def worst(self) -> RankRole:
        return max(self.roles, key=lambda r: r.peak_bytes)

    @property
    def peak_bytes(self) -> int:
        return self.worst.peak_bytes

    def timelines(self) -> Sequence[Timeline]:
        return [r.timeline for r in self.roles]

    def to_dict(self, max_points: int = 2000) -> dict:
        """The worst rank's timeline fields at the top level (peak_bytes is the job's), plus ``"ranks"``."""
        worst = self.worst
        out = worst.timeline.to_dict(max_points)
        out["peak_bytes"] = worst.peak_bytes
        out["worst_rank"] = worst.ranks[0]
        out["ranks"] = [r.to_dict() for r in self.roles]
        out["layout"] = {
            "world_size": self.config.world_size,
            **{d: getattr(self.config, d) for d in MESH_DIMS},
            "ep": self.config.ep,
        }
        return out
