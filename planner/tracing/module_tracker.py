"""torch's ModTracker, without its false alarm on modules a library makes of functions."""

from __future__ import annotations

import warnings

from memplan_compat import ModTracker

__all__ = ["ModuleTracker"]

# ModTracker warns when a module is entered while one of the same name is running. Hugging Face's
# hub kernels (the `kernels` package transformers installs) turn functions such as the rotary
# embedding into parameterless `Func` modules that call a private `Func` copy: that nesting is
# expected, and memplan attributes such modules to their caller (tracing/dispatch.py).
_NESTED_NAME_WARNING = "The module hierarchy tracking maybe be messed up"


class ModuleTracker(ModTracker):
    """A ModTracker that does not print the nested-name warning, and leaves `warnings.formatwarning`
    as it found it (ModTracker replaces it, process-wide, each time it warns)."""

    def __enter__(self) -> ModuleTracker:
        self._caught = warnings.catch_warnings()
        self._caught.__enter__()
        warnings.filterwarnings("ignore", message=_NESTED_NAME_WARNING, category=UserWarning)
        self._formatwarning = warnings.formatwarning
        return super().__enter__()

    def __exit__(self, *args) -> None:
        try:
            super().__exit__(*args)
        finally:
            warnings.formatwarning = self._formatwarning
            self._caught.__exit__(None, None, None)
