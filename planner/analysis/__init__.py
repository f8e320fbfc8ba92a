"""Analysis: diagnose, fit, CUDA snapshots (with a safe unpickler) and OOM messages."""
