"""Runtime: applying plans to real models, offload, the live-bytes tracker, verification."""
