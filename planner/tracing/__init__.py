"""Tracing: model specs and presets, Hugging Face support, the recorder, the OpGraph, blocks, fingerprints."""
