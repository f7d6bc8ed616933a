"""Examples of user code plugged in by import path (docs/objectives.md); not part of the posttrain package."""
