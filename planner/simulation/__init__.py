"""Simulation: what a plan's choices do to the curve (effects), the step simulator, step costs."""
