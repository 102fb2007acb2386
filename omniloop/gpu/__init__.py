"""Runners and completion observers: device work off the loop, completions back through the doorway."""
