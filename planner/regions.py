"""Find the checkpointable blocks of a model: the repeated layers of a transformer, the residual
blocks of a CNN.

A *block container* is an `nn.ModuleList`, `nn.Sequential` or `nn.ModuleDict` (the model itself
included) with at least two children that own
parameters and are composite or repeated. The blocks are the children of the outermost block containers; when every child of a
container is itself a block container and the children differ (the stages of a ResNet), the
blocks are one level further down.
"""

from __future__ import annotations

import hashlib

from torch import nn

__all__ = ["find_region_paths", "module_signature"]

_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


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


def _blocks_of(path: str, container: nn.Module) -> list[str]:
    children = [(name, child) for name, child in container.named_children() if _owns_parameters(child)]
    signatures = {module_signature(child) for _, child in children}
    if len(signatures) > 1 and all(_is_block_container(child) for _, child in children):
        out: list[str] = []
        for name, child in children:
            out += _blocks_of(f"{path}.{name}" if path else name, child)
        return out
    return [f"{path}.{name}" if path else name for name, _ in children]


def find_region_paths(model: nn.Module) -> list[str]:
    """Module paths of the model's checkpointable blocks, in definition order."""
    found: list[str] = []

    def visit(path: str, module: nn.Module) -> None:
        if _is_block_container(module):
            found.extend(_blocks_of(path, module))
            return
        for name, child in module.named_children():
            visit(f"{path}.{name}" if path else name, child)

    visit("", model)
    return found
