"""Shared fixtures: the session's trace memo, a per-session trace cache and small model files for
spec-string tests."""

from __future__ import annotations

import signal
import textwrap
from pathlib import Path

import pytest
import trace_memo

trace_memo.install()

# The Ctrl-C tests need SIGINT to interrupt, here and in the processes they start. A shell that runs
# the suite in the background (`make test &`, nohup) starts it with SIGINT ignored, which Python and
# every child would keep; run as in the foreground instead (children then start with the default).
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "fresh_trace: traces afresh, past the session's trace memo (tests of tracing)")
    if not hasattr(config, "workerinput"):  # the controlling process (or the only one)
        config.trace_memo_folder = trace_memo.open_session_memo()


def pytest_unconfigure(config: pytest.Config) -> None:
    if hasattr(config, "trace_memo_folder"):
        trace_memo.close_session_memo(config.trace_memo_folder)


@pytest.fixture(autouse=True)
def _trace_memo_for_this_test(request: pytest.FixtureRequest) -> None:
    """The memo serves a test unless it patches something (its traces may differ) or asks to trace afresh."""
    trace_memo.enabled = (
        "monkeypatch" not in request.fixturenames and request.node.get_closest_marker("fresh_trace") is None
    )


_TRACES: dict = {}


def cached_trace(preset: str, batch_size: int = 1, seq_len: int = 32, precision: str = "fp32"):
    """trace() memoised on (preset, batch, seq, precision); graphs are treated as read-only."""
    from planner.tracing.recorder import trace

    key = (preset, batch_size, seq_len, precision)
    if key not in _TRACES:
        _TRACES[key] = trace(preset, batch_size=batch_size, seq_len=seq_len, precision=precision)
    return _TRACES[key]


@pytest.fixture(scope="session")
def traced():
    return cached_trace


BAD_MODELS = textwrap.dedent("""
    import torch
    from torch import nn


    class Gate(nn.Module):
        def forward(self, x):
            idx = (x > 0).nonzero()
            return x[idx[:, 0]]


    class NonzeroModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 8)
            self.gate = Gate()

        def forward(self, x):
            return self.gate(self.proj(x)).sum()


    class Branch(nn.Module):
        def forward(self, x):
            if x.mean().item() > 0:
                return x * 2
            return x


    class ItemModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 8)
            self.branch = Branch()

        def forward(self, x):
            return self.branch(self.proj(x)).sum()


    def nonzero_model(batch_size, seq_len):
        return NonzeroModel(), (torch.randn(batch_size, seq_len, 8),)


    def item_model(batch_size, seq_len):
        return ItemModel(), (torch.randn(batch_size, seq_len, 8),)


    def raises(batch_size, seq_len):
        raise RuntimeError("boom from the model function")


    class FixedSize(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def forward(self, x):
            if x.shape[1] != 16:
                raise ValueError(f"Input size ({x.shape[1]}) doesn't match model (16).")
            return self.proj(x).sum()


    def fixed_size_model(batch_size, seq_len):
        return FixedSize(), (torch.randn(batch_size, seq_len, 8),)


    def good_model(batch_size, seq_len):
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)), (torch.randn(batch_size, seq_len, 8),)
""")


@pytest.fixture
def bad_models(tmp_path: Path) -> Path:
    """A model file with FUNCs: nonzero_model, item_model, raises, fixed_size_model, good_model."""
    path = tmp_path / "bad_models.py"
    path.write_text(BAD_MODELS)
    return path
