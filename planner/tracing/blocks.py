"""Find the checkpointable blocks of a model: the repeated layers of a transformer, the residual
blocks of a CNN, wherever they live.

A *block container* is an `nn.ModuleList`, `nn.Sequential` or `nn.ModuleDict` (the model itself
included) with at least two children that own parameters and are composite or repeated. The
blocks are the children of the outermost block containers; when every child of a container is
itself a block container and the children differ (the stages of a ResNet), the blocks are one
level further down. Outside containers, two or more composite children of one module with the
same structure are blocks too (layers kept as attributes, custom containers); when each of them
holds blocks itself (an encoder and a decoder of one shape), its blocks are. `--blocks GLOB`
names them explicitly instead.
"""

from __future__ import annotations

import fnmatch
import hashlib
import math
import re
from collections.abc import Collection, Sequence

from torch import nn

from planner.errors import TraceError

__all__ = [
    "container_paths",
    "find_region_paths",
    "is_segment",
    "looped_over",
    "module_signature",
    "parse_segment",
    "runs_forward",
    "segment_children",
]

_SEGMENT = re.compile(r"^(?:(.*)\.)?(\d+):(\d+)$")


def parse_segment(path: str) -> tuple[str, int, int] | None:
    """'layers.2:4' -> ('layers', 2, 4): children 2 and 3 of an nn.Sequential run as one block."""
    m = _SEGMENT.match(path)
    if m is None:
        return None
    return m.group(1) or "", int(m.group(2)), int(m.group(3))


def is_segment(path: str) -> bool:
    return parse_segment(path) is not None


def segment_children(model: nn.Module, path: str) -> list[str]:
    """Module paths of a segment's children; ValueError when the model has no such segment."""
    parsed = parse_segment(path)
    if parsed is None:
        raise ValueError(f"'{path}' is not a segment path (PARENT.I:J)")
    parent, i, j = parsed
    try:
        container = model.get_submodule(parent)
    except AttributeError:
        container = None
    if not isinstance(container, nn.Sequential) or not 0 <= i < j <= len(container):
        raise ValueError(f"segment '{path}' needs an nn.Sequential '{parent or '<root>'}' with children {i} to {j - 1}")
    return [f"{parent}.{k}" if parent else str(k) for k in range(i, j)]


_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def runs_forward(module: nn.Module) -> bool:
    """Whether the module has a forward of its own (a ModuleList or ModuleDict only holds modules:
    its parent calls them, so it can be neither wrapped nor recomputed as one)."""
    return type(module).forward is not nn.Module.forward


def container_paths(model: nn.Module) -> list[str]:
    """Module paths of the model's submodules that have no forward of their own."""
    return [path for path, m in model.named_modules() if path and not runs_forward(m)]


def looped_over(model: nn.Module, called: Collection[str]) -> list[str]:
    """Module paths of submodules whose forward never ran while one of their submodules' did: their
    parent loops over their children (`for layer in self.layers`, an nn.Sequential iterated rather
    than called), so a plan that wraps their forward changes nothing."""
    return [
        path
        for path, _ in model.named_modules()
        if path and path not in called and any(c.startswith(path + ".") for c in called)
    ]


def module_signature(module: nn.Module) -> str:
    """A short hash of a module's structure: submodule classes and parameter shapes/dtypes."""
    parts = [f"{name}:{type(m).__name__}" for name, m in module.named_modules()]
    parts += [f"{name}:{tuple(p.shape)}:{p.dtype}" for name, p in module.named_parameters()]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:12]


def _owns_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _is_block_container(module: nn.Module) -> bool:
    """Two or more parameter-owning children that are blocks (have submodules) or repeat.

    A stem like Sequential(conv, bn, relu) is not: its children are single, different layers.
    """
    if not isinstance(module, _CONTAINERS):
        return False
    children = [child for child in module.children() if _owns_parameters(child)]
    if len(children) < 2:
        return False
    signatures = [module_signature(child) for child in children]
    composite = any(True for child in children for _ in child.children())
    return composite or len(set(signatures)) < len(signatures)


def _flat_segments(path: str, container: nn.Sequential) -> list[str]:
    """A Sequential of single layers (Linear, ReLU, Linear, ...): checkpointing one layer frees
    nothing, so its blocks are runs of the repeats of its first layers' pattern, as `PATH.I:J`
    segments."""
    signatures = [module_signature(child) for child in container]
    period = next((k for k in range(1, len(signatures)) if signatures[k] == signatures[0]), 0)
    if period < 1:
        return []
    repeats = 0  # how many times the first pattern repeats from the start
    while signatures[repeats * period : (repeats + 1) * period] == signatures[:period]:
        repeats += 1
    # A one-pattern segment only saves its own input, which the next one saves too: group about
    # sqrt(repeats) patterns per segment (Chen et al.), at least two.
    group = max(2, round(math.sqrt(repeats)))
    prefix = f"{path}." if path else ""
    size = group * period
    return [f"{prefix}{start}:{start + size}" for start in range(0, (repeats // group) * size, size)]


def _blocks_of(path: str, container: nn.Module) -> list[str]:
    if isinstance(container, nn.Sequential) and not any(True for c in container for _ in c.children()):
        return _flat_segments(path, container)
    children = [(name, child) for name, child in container.named_children() if _owns_parameters(child)]
    signatures = {module_signature(child) for _, child in children}
    if len(signatures) > 1 and all(_is_block_container(child) for _, child in children):
        out: list[str] = []
        for name, child in children:
            out += _blocks_of(f"{path}.{name}" if path else name, child)
        return out
    return [f"{path}.{name}" if path else name for name, _ in children]


def _repeated_children(module: nn.Module) -> set[str]:
    """Children of a plain module that repeat: two or more composite, parameter-owning children
    with the same structure (layers kept as attributes `self.layer0`, `self.layer1`, ...)."""
    groups: dict[str, list[str]] = {}
    for name, child in module.named_children():
        if _owns_parameters(child) and any(True for _ in child.children()):
            groups.setdefault(module_signature(child), []).append(name)
    return {name for names in groups.values() if len(names) >= 2 for name in names}


def _found_in(path: str, module: nn.Module) -> list[str]:
    if _is_block_container(module):
        return _blocks_of(path, module)
    repeated = _repeated_children(module)
    inner = {name: _found_in(f"{path}.{name}" if path else name, child) for name, child in module.named_children()}
    # Repeated stacks that hold blocks themselves (an encoder and a decoder of one shape): their blocks.
    descend = bool(repeated) and all(len(inner[name]) >= 2 for name in repeated)
    found: list[str] = []
    for name, blocks in inner.items():
        if name in repeated and not descend:
            found.append(f"{path}.{name}" if path else name)
        else:
            found.extend(blocks)
    return found


def _matching(model: nn.Module, patterns: Sequence[str]) -> list[str]:
    """The outermost modules whose paths match one of the glob patterns, in definition order."""
    names = [name for name, _ in model.named_modules() if name]
    found: list[str] = []
    for pattern in patterns:
        if not any(fnmatch.fnmatchcase(name, pattern) for name in names):
            tops = ", ".join(name for name, _ in model.named_children())
            raise TraceError(
                f"--blocks '{pattern}' matches no module of the model; its top-level "
                f"modules are: {tops} (paths are dotted, e.g. 'encoder.layer*')"
            )
    for name in names:
        if any(fnmatch.fnmatchcase(name, p) for p in patterns) and not any(name.startswith(f + ".") for f in found):
            found.append(name)
    return found


def find_region_paths(model: nn.Module, patterns: Sequence[str] = ()) -> list[str]:
    """Module paths of the model's checkpointable blocks, in definition order.

    With `patterns` (globs over module paths, `--blocks`) the blocks are the outermost modules
    that match; otherwise they are found by structure: the children of block containers, and
    repeated composite children of any module (attribute layers, custom containers).
    """
    if patterns:
        return _matching(model, patterns)
    return _found_in("", model)
