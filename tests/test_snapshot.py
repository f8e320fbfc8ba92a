"""Tests for planner.analysis.snapshot: safe loading and analysis of CUDA memory snapshots."""

from __future__ import annotations

import copy
import dataclasses
import io
import json
import os
import pickle
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.analysis.snapshot import analyze_snapshot, load_snapshot_bytes, read_snapshot
from planner.analysis.snapshot_advice import SnapshotReport

KiB = 1024
MiB = 1024**2
DATA = Path(__file__).parent / "data" / "snapshots"


# --------------------------------------------------------------------------- fixture builders


def frame(filename: str, line: int, name: str) -> dict[str, Any]:
    return {"filename": filename, "line": line, "name": name}


TRAIN_FRAMES = [
    frame("??", 0, "c10::cuda::CUDACachingAllocator::Native::DeviceCachingAllocator::malloc"),
    frame("/usr/src/cpython/Python/ceval.c", 5000, "_PyEval_EvalFrameDefault"),
    frame("/home/u/model.py", 42, "forward"),
    frame("/home/u/train.py", 80, "main"),
]


def block(addr: int, size: int, state: str, requested: int | None = None, frames: list | None = None) -> dict[str, Any]:
    return {
        "address": addr,
        "size": size,
        "requested_size": size if requested is None else requested,
        "state": state,
        "frames": frames or [],
    }


def segment(
    addr: int, pool: str, blocks: list[dict[str, Any]], *, device: int = 0, expandable: bool = False
) -> dict[str, Any]:
    total = sum(b["size"] for b in blocks)
    allocated = sum(b["size"] for b in blocks if b["state"] == "active_allocated")
    active = sum(b["size"] for b in blocks if b["state"] != "inactive")
    requested = sum(b["requested_size"] for b in blocks if b["state"] != "inactive")
    return {
        "device": device,
        "address": addr,
        "total_size": total,
        "allocated_size": allocated,
        "active_size": active,
        "requested_size": requested,
        "stream": 0,
        "segment_type": pool,
        "segment_pool_id": (0, 0),
        "is_expandable": expandable,
        "frames": [],
        "blocks": blocks,
    }


def current_snapshot(
    *, expandable: bool = False, max_split: int = -1, gc: float = 0.0, conf: str = ""
) -> dict[str, Any]:
    """Snapshot in the exact torch>=2.1 layout, with hand-chosen sizes.

    seg A (large, 20 MiB at 0x7f00_0000_0000):
        8 MiB active_allocated (requested 8_000_000) | 4 MiB inactive
        | 6 MiB active_allocated | 2 MiB inactive
    seg B (small, 2 MiB):
        512 KiB active_allocated (requested 500_000) | 512 KiB active_pending_free
        | 1 MiB inactive
    seg C (large, 4 MiB): 4 MiB inactive (whole segment cached, not split)
    """
    a, b, c = 0x7F00_0000_0000, 0x7F00_0200_0000, 0x7F00_0400_0000
    seg_a = segment(
        a,
        "large",
        [
            block(a, 8 * MiB, "active_allocated", 8_000_000, TRAIN_FRAMES),
            block(a + 8 * MiB, 4 * MiB, "inactive"),
            block(a + 12 * MiB, 6 * MiB, "active_allocated", frames=[frame("/home/u/model.py", 50, "backward")]),
            block(a + 18 * MiB, 2 * MiB, "inactive"),
        ],
    )
    seg_b = segment(
        b,
        "small",
        [
            block(b, 512 * KiB, "active_allocated", 500_000),
            block(b + 512 * KiB, 512 * KiB, "active_pending_free"),
            block(b + 1 * MiB, 1 * MiB, "inactive"),
        ],
    )
    seg_c = segment(c, "large", [block(c, 4 * MiB, "inactive")])
    trace = [
        {"action": "segment_alloc", "addr": a, "size": 20 * MiB, "stream": 0, "frames": [], "time_us": 1},
        {"action": "alloc", "addr": a, "size": 8 * MiB, "stream": 0, "frames": TRAIN_FRAMES, "time_us": 2},
        {"action": "alloc", "addr": a + 12 * MiB, "size": 6 * MiB, "stream": 0, "frames": [], "time_us": 3},
        {"action": "segment_alloc", "addr": b, "size": 2 * MiB, "stream": 0, "frames": [], "time_us": 4},
        {"action": "alloc", "addr": b, "size": 512 * KiB, "stream": 0, "frames": [], "time_us": 5},
        {"action": "free_requested", "addr": b + 512 * KiB, "size": 512 * KiB, "stream": 0, "frames": [], "time_us": 6},
        {"action": "segment_alloc", "addr": c, "size": 4 * MiB, "stream": 0, "frames": [], "time_us": 7},
        {"action": "oom", "device_free": 1 * MiB, "size": 8 * MiB, "stream": 0, "frames": [], "time_us": 8},
    ]
    return {
        "segments": [seg_a, seg_b, seg_c],
        "device_traces": [trace],
        "allocator_settings": {
            "PYTORCH_CUDA_ALLOC_CONF": conf,
            "max_split_size": max_split,
            "garbage_collection_threshold": gc,
            "expandable_segments": expandable,
            "pinned_num_register_threads": 1,
            "release_lock_on_cudamalloc": False,
            "pinned_use_cuda_host_register": False,
            "roundup_power2_divisions": {"1": 0, "2": 0},
        },
        "external_annotations": [],
        "some_future_key": {"ignored": True},
    }


def legacy_snapshot() -> list[dict[str, Any]]:
    """Pre-2.0 layout: bare segment list, blocks without requested_size, with history.

    one large 2 MiB segment: 1.5 MiB active_allocated (history real_size 1_500_000)
    | 512 KiB inactive
    """
    return [
        {
            "device": 0,
            "address": 0x7F00_0000_0000,
            "total_size": 2 * MiB,
            "allocated_size": 1536 * KiB,
            "active_size": 1536 * KiB,
            "stream": 0,
            "segment_type": "large",
            "blocks": [
                {
                    "size": 1536 * KiB,
                    "state": "active_allocated",
                    "history": [
                        {"addr": 0x7F00_0000_0000, "real_size": 1_500_000, "frames": [frame("/old/model.py", 7, "f")]}
                    ],
                },
                {"size": 512 * KiB, "state": "inactive", "history": []},
            ],
        }
    ]


def write_pickle(tmp_path: Path, name: str, obj: object, protocol: int = 4) -> Path:
    path = tmp_path / name
    path.write_bytes(pickle.dumps(obj, protocol=protocol))
    return path


# --------------------------------------------------------------------------- figures


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_current_layout_figures(tmp_path: Path, protocol: int) -> None:
    r = read_snapshot(write_pickle(tmp_path, "snap.pickle", current_snapshot(), protocol))
    assert r.format == "current"
    # reserved: 20 + 2 + 4 MiB = 26 MiB
    assert r.reserved_bytes == 26 * MiB == 27_262_976
    # allocated: 8 + 6 MiB + 512 KiB = 14.5 MiB (pending-free block not counted)
    assert r.allocated_bytes == 14 * MiB + 512 * KiB == 15_204_352
    # requested: 8_000_000 + 6 MiB + 500_000
    assert r.requested_bytes == 8_000_000 + 6_291_456 + 500_000 == 14_791_456
    assert r.pending_free_bytes == 512 * KiB
    # free (inactive): 4 + 2 + 1 + 4 MiB = 11 MiB, largest 4 MiB
    assert r.free_bytes == 11 * MiB
    assert r.largest_free_block_bytes == 4 * MiB
    # split: inactive inside partly used segments A (4 + 2) and B (1); C is wholly free
    assert r.inactive_split_bytes == 7 * MiB
    # 1 - 4/11 = 7/11
    assert r.fragmentation_ratio == pytest.approx(7 / 11)
    assert r.num_segments == 3
    assert r.num_blocks == 8
    assert r.devices == (0,)
    pools = {p.pool: p for p in r.segments_by_pool}
    assert (pools["large"].segments, pools["large"].reserved_bytes) == (2, 24 * MiB)
    assert (pools["large"].allocated_bytes, pools["large"].free_bytes) == (14 * MiB, 10 * MiB)
    assert (pools["small"].segments, pools["small"].reserved_bytes) == (1, 2 * MiB)
    assert (pools["small"].allocated_bytes, pools["small"].free_bytes) == (512 * KiB, 1 * MiB)
    assert r.expandable_segments is False
    assert r.allocator_settings.max_split_size_bytes is None  # -1 = SIZE_MAX = unset
    assert r.allocator_settings.garbage_collection_threshold is None


def test_top_allocations_biggest_first_with_python_frames(tmp_path: Path) -> None:
    r = read_snapshot(write_pickle(tmp_path, "snap.pickle", current_snapshot()))
    sizes = [(a.size, a.requested_size) for a in r.top_allocations]
    assert sizes == [(8 * MiB, 8_000_000), (6 * MiB, 6 * MiB), (512 * KiB, 500_000)]
    # C++ and interpreter frames dropped when Python frames exist; basename:line:name
    assert r.top_allocations[0].frames == ("model.py:42:forward", "train.py:80:main")
    assert r.top_allocations[1].frames == ("model.py:50:backward",)
    assert r.top_allocations[2].frames == ()


def test_top_allocations_capped_at_ten_and_frames_at_ten() -> None:
    frames = [frame(f"/x/f{i}.py", i, "g") for i in range(15)]
    blocks = [block(i * MiB, (i + 1) * MiB, "active_allocated", frames=frames) for i in range(12)]
    r = analyze_snapshot({"segments": [segment(0, "large", blocks)]})
    assert len(r.top_allocations) == 10
    assert [a.size // MiB for a in r.top_allocations] == list(range(12, 2, -1))
    assert len(r.top_allocations[0].frames) == 10
    assert r.top_allocations[0].frames[0] == "f0.py:0:g"
    assert r.device_trace_summary is None


def test_trace_summary(tmp_path: Path) -> None:
    t = read_snapshot(write_pickle(tmp_path, "s.pickle", current_snapshot())).device_trace_summary
    assert t is not None
    assert t.num_entries == 8
    assert dict(t.counts) == {"alloc": 3, "free_requested": 1, "oom": 1, "segment_alloc": 3}
    assert t.has_oom is True
    assert t.last_oom_requested_bytes == 8 * MiB
    assert t.last_oom_device_free_bytes == 1 * MiB


def test_advice_fragmented_without_expandable(tmp_path: Path) -> None:
    r = read_snapshot(write_pickle(tmp_path, "s.pickle", current_snapshot()))
    text = " ".join(r.advice)
    # 11 MiB free >= 10% of 26 MiB and ratio 0.64 >= 0.5 -> fragmentation advice
    assert "expandable_segments:True" in r.advice[0]
    assert "ratio 0.64" in r.advice[0]
    # 7 MiB split >= 10% of 26 MiB -> split advice, offering max_split_size_mb
    assert "7.0 MiB is free but stuck" in text and "max_split_size_mb" in text
    assert "records an OOM" in text


def test_advice_expandable_with_max_split_and_gc(tmp_path: Path) -> None:
    snap = current_snapshot(expandable=True, max_split=256 * MiB, gc=0.6)
    r = read_snapshot(write_pickle(tmp_path, "s.pickle", snap))
    assert r.expandable_segments is True
    assert r.allocator_settings.max_split_size_bytes == 256 * MiB
    assert r.allocator_settings.garbage_collection_threshold == 0.6
    text = " ".join(r.advice)
    assert "pytorch#134338" in text
    assert "set_per_process_memory_fraction" in text
    assert "stuck" not in text  # no split advice when segments are expandable


def test_settings_read_from_conf_string_when_fields_absent() -> None:
    snap = current_snapshot()
    snap["allocator_settings"] = {
        "PYTORCH_CUDA_ALLOC_CONF": "roundup_power2_divisions:[256:1,512:2],"
        "expandable_segments:True,max_split_size_mb:128"
    }
    r = analyze_snapshot(snap)
    assert r.allocator_settings.expandable_segments is True
    assert r.allocator_settings.max_split_size_bytes == 128 * MiB
    assert r.expandable_segments is True


def test_expandable_from_segments_when_no_settings() -> None:
    snap = current_snapshot()
    del snap["allocator_settings"]
    for seg in snap["segments"]:
        seg["is_expandable"] = True
    r = analyze_snapshot(snap)
    assert r.expandable_segments is True
    assert r.allocator_settings.alloc_conf is None


def test_clean_snapshot_gets_no_advice() -> None:
    blocks = [block(0, 2 * MiB, "active_allocated")]
    r = analyze_snapshot({"segments": [segment(0, "large", blocks)], "device_traces": [[]]})
    assert (r.free_bytes, r.fragmentation_ratio, r.inactive_split_bytes) == (0, 0.0, 0)
    assert r.advice == ()
    assert r.device_trace_summary is not None and r.device_trace_summary.has_oom is False


def test_legacy_list_format(tmp_path: Path) -> None:
    r = read_snapshot(write_pickle(tmp_path, "legacy.pickle", legacy_snapshot(), protocol=2))
    assert r.format == "legacy"
    assert r.reserved_bytes == 2 * MiB
    assert r.allocated_bytes == 1536 * KiB
    assert r.requested_bytes == 1_500_000  # from history[0].real_size
    assert r.free_bytes == r.largest_free_block_bytes == r.inactive_split_bytes == 512 * KiB
    assert r.fragmentation_ratio == 0.0  # one free block: 1 - 512K/512K
    assert r.top_allocations[0].frames == ("model.py:7:f",)
    assert r.device_trace_summary is None


def test_checked_in_fixtures_match_builders() -> None:
    legacy = DATA / "legacy_segments.pickle"
    current = DATA / "current_small.pickle"
    assert pickle.loads(legacy.read_bytes()) == legacy_snapshot()
    loaded = pickle.loads(current.read_bytes())
    assert loaded == current_snapshot()
    assert read_snapshot(current).to_dict() == analyze_snapshot(current_snapshot()).to_dict()
    assert read_snapshot(legacy).requested_bytes == 1_500_000


def test_to_dict_is_json_and_frozen(tmp_path: Path) -> None:
    r = read_snapshot(write_pickle(tmp_path, "s.pickle", current_snapshot()))
    d = json.loads(json.dumps(r.to_dict()))
    assert set(d) == {f.name for f in dataclasses.fields(SnapshotReport)}
    assert d["segments_by_pool"]["large"]["reserved_bytes"] == 24 * MiB
    assert d["device_trace_summary"]["counts"]["alloc"] == 3
    assert d["top_allocations"][0]["frames"] == ["model.py:42:forward", "train.py:80:main"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.reserved_bytes = 0  # type: ignore[misc]


def test_bytes_and_file_agree(tmp_path: Path) -> None:
    path = write_pickle(tmp_path, "s.pickle", current_snapshot())
    assert load_snapshot_bytes(path.read_bytes()) == read_snapshot(path)


# --------------------------------------------------------------------------- safety


class _WriteMarker:
    """Pickles to ``open(marker, 'w')``: a global call that creates a file."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (open, (str(self.path), "w"))


class _SystemMarker:
    """Pickles to ``os.system('touch marker')``; never unpickled unrestricted here."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.path}",))


def test_payload_is_live_under_plain_pickle(tmp_path: Path) -> None:
    # Proves the hostile test payload works, so its refusal below means something.
    marker = tmp_path / "proof"
    f = pickle.loads(pickle.dumps(_WriteMarker(marker)))
    f.close()
    assert marker.exists()


@pytest.mark.parametrize("payload_cls", [_WriteMarker, _SystemMarker])
@pytest.mark.parametrize("protocol", [0, 2, 5])
def test_hostile_pickle_is_refused_without_running(tmp_path: Path, payload_cls: type, protocol: int) -> None:
    marker = tmp_path / "marker"
    snap = current_snapshot()
    snap["segments"][0]["blocks"][0]["frames"] = [payload_cls(marker)]  # buried deep inside
    path = tmp_path / "evil.pickle"
    path.write_bytes(pickle.dumps(snap, protocol=protocol))
    with pytest.raises(
        ValueError,
        match=r"^refusing to load (builtins|io)\.open|^refusing to load "
        r"(posix|os|nt)\.system",
    ):
        read_snapshot(path)
    with pytest.raises(ValueError, match="only plain data is allowed"):
        load_snapshot_bytes(path.read_bytes())
    assert not marker.exists()


def test_protocol0_global_is_refused(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    raw = f"cos\nsystem\n(S'touch {marker}'\ntR.".encode()
    with pytest.raises(ValueError, match=r"refusing to load os\.system"):
        load_snapshot_bytes(raw)
    assert not marker.exists()


def test_persistent_id_is_refused() -> None:
    buf = io.BytesIO()

    class P(pickle.Pickler):
        def persistent_id(self, obj: object) -> str | None:
            return "storage0" if obj == "PID" else None

    P(buf, protocol=2).dump({"segments": ["PID"]})
    with pytest.raises(ValueError, match="persistent id"):
        load_snapshot_bytes(buf.getvalue())


@pytest.mark.parametrize(
    "raw, fragment",
    [
        (b"\x80\x02N)R.", "opcode REDUCE"),
        (b"\x80\x02\x82\x01.", "opcode EXT1"),  # could hit copyreg's cache without find_class
        (b"\x80\x02}b.", "opcode BUILD"),
        (b"\x80\x05\x97.", "opcode NEXT_BUFFER"),
    ],
)
def test_code_paths_without_find_class_are_refused(raw: bytes, fragment: str) -> None:
    with pytest.raises(ValueError, match=f"refusing to load pickle {fragment}"):
        load_snapshot_bytes(raw)


def test_memo_and_length_bombs_stay_small() -> None:
    # The C unpickler would grow its memo array to ~4e9 entries (tens of GB) for this
    # LONG_BINPUT, and pickle._Unpickler would zero-fill a 1 TiB BYTEARRAY8.
    memo_bomb = b"\x80\x02]r\x00\x00\x00\xf0."
    r = load_snapshot_bytes(memo_bomb)  # an empty legacy segment list, memo id ignored
    assert r.num_segments == 0 and r.format == "legacy"
    bytearray_bomb = b"\x80\x05\x96" + (2**40).to_bytes(8, "little") + b"."
    with pytest.raises(ValueError, match="truncated"):
        load_snapshot_bytes(bytearray_bomb)


def test_shared_references_are_refused() -> None:
    # 3 bytes per extra reference would otherwise multiply blocks x segments of work.
    seg = segment(0, "large", [block(0, 2 * MiB, "inactive")])
    with pytest.raises(ValueError, match=re.escape("segments[1] repeats an object")):
        analyze_snapshot({"segments": [seg, seg]})
    blocks = [block(0, MiB, "inactive")]
    twin = [segment(0, "large", blocks), segment(0, "large", blocks)]
    with pytest.raises(ValueError, match=re.escape("segments[1].blocks repeats")):
        analyze_snapshot(twin)
    trace: list = []
    with pytest.raises(ValueError, match=re.escape("device_traces[1] repeats")):
        analyze_snapshot({"segments": [], "device_traces": [trace, trace]})


@pytest.mark.parametrize(
    "raw, fragment",
    [
        (b"", "empty"),
        (b"\x80\x04", "not a CUDA memory snapshot"),
        (b"not a pickle at all", "not a CUDA memory snapshot"),
        (b'{"segments": []}', "not a CUDA memory snapshot"),
        (pickle.dumps(current_snapshot())[:100], "not a CUDA memory snapshot"),
        (b"\x80\x06N.", "not a CUDA memory snapshot"),  # unsupported protocol
        (pickle.dumps(12), "top level is int"),
        (pickle.dumps({"segmentz": []}), "lacks 'segments'"),
    ],
)
def test_garbage_is_a_value_error(raw: bytes, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment) as info:
        load_snapshot_bytes(raw)
    assert "\n" not in str(info.value)


def test_file_checks(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        read_snapshot(tmp_path / "missing.pickle")
    empty = tmp_path / "empty.pickle"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="is empty"):
        read_snapshot(empty)
    big = write_pickle(tmp_path, "big.pickle", current_snapshot())
    with pytest.raises(ValueError, match="max_bytes"):
        read_snapshot(big, max_bytes=100)
    with pytest.raises(ValueError, match="_dump_snapshot"):
        read_snapshot(DATA.parent.parent / "test_snapshot.py")


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda s: s.update(segments={}), "snapshot.segments must be a list"),
        (lambda s: s["segments"].__setitem__(1, 5), "segments[1] must be a dict"),
        (lambda s: s["segments"][0].update(total_size="20"), "segments[0].total_size"),
        (lambda s: s["segments"][0].update(total_size=-1), "segments[0].total_size"),
        (lambda s: s["segments"][0].pop("blocks"), "segments[0] lacks 'blocks'"),
        (lambda s: s["segments"][2]["blocks"][0].update(size=True), "segments[2].blocks[0].size"),
        (lambda s: s["segments"][0]["blocks"][1].update(state="free"), "segments[0].blocks[1].state"),
        (lambda s: s["segments"][1]["blocks"][0].update(requested_size=1.5), "segments[1].blocks[0].requested_size"),
        (lambda s: s["segments"][0].update(segment_type=3), "segments[0].segment_type"),
        (lambda s: s["segments"][0].update(is_expandable="yes"), "segments[0].is_expandable"),
        (
            lambda s: s["segments"][0]["blocks"][0]["frames"][2].update(line="42"),
            "segments[0].blocks[0].frames[2].line",
        ),
        (lambda s: s.update(device_traces=[{}]), "device_traces[0] must be a list"),
        (lambda s: s["device_traces"][0].append({"size": 1}), "lacks 'action'"),
        (lambda s: s.update(allocator_settings=[]), "allocator_settings must be a dict"),
        (lambda s: s["allocator_settings"].update(expandable_segments=1), "allocator_settings.expandable_segments"),
    ],
)
def test_wrong_structure_names_the_field(mutate: Any, field: str) -> None:
    snap = copy.deepcopy(current_snapshot())
    mutate(snap)
    with pytest.raises(ValueError, match=re.escape(field)):
        analyze_snapshot(snap)


# --------------------------------------------------------------------------- fuzz

FUZZ = settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)


def _check(fn: Any, arg: object) -> None:
    try:
        r = fn(arg)
    except ValueError as exc:
        assert "\n" not in str(exc)
        return
    assert isinstance(r, SnapshotReport)
    json.dumps(r.to_dict())


@FUZZ
@given(st.binary(max_size=512))
def test_fuzz_any_bytes(data: bytes) -> None:
    _check(load_snapshot_bytes, data)


_VALID_PICKLE = pickle.dumps(current_snapshot(), protocol=4)


@FUZZ
@given(st.integers(0, len(_VALID_PICKLE) - 1), st.integers(0, 255), st.booleans())
def test_fuzz_mutated_real_pickle(pos: int, value: int, truncate: bool) -> None:
    raw = bytearray(_VALID_PICKLE)
    if truncate:
        del raw[pos:]
    else:
        raw[pos] = value
    _check(load_snapshot_bytes, bytes(raw))


_KEYS = st.sampled_from(
    [
        "segments",
        "blocks",
        "size",
        "state",
        "total_size",
        "requested_size",
        "frames",
        "history",
        "real_size",
        "allocator_settings",
        "device_traces",
        "action",
        "filename",
        "line",
        "name",
        "segment_type",
        "is_expandable",
        "device",
        "expandable_segments",
        "max_split_size",
        "garbage_collection_threshold",
        "PYTORCH_CUDA_ALLOC_CONF",
        "device_free",
    ]
) | st.text(max_size=5)
_LEAVES = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8)
    | st.sampled_from(
        [
            "active_allocated",
            "active_pending_free",
            "inactive",
            "oom",
            "large",
            "small",
            "expandable_segments:True,max_split_size_mb:x",
            "garbage_collection_threshold:1.2.3",
        ]
    )
)
_TREES = st.recursive(
    _LEAVES,
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(_KEYS, kids, max_size=6) | st.tuples(kids, kids),
    max_leaves=40,
)


@FUZZ
@given(_TREES)
def test_fuzz_structured_data(tree: object) -> None:
    _check(analyze_snapshot, tree)
    _check(load_snapshot_bytes, pickle.dumps(tree, protocol=5))


@pytest.mark.slow
@FUZZ
@given(st.lists(st.dictionaries(_KEYS, _TREES, max_size=6), max_size=3), _TREES, _TREES)
def test_fuzz_near_valid_snapshots(blocks: list, settings_: object, traces: object) -> None:
    snap = current_snapshot()
    snap["segments"][0]["blocks"].extend(blocks)
    snap["allocator_settings"] = settings_
    snap["device_traces"] = traces
    _check(analyze_snapshot, snap)
