"""Worked examples of user code plugged in by import path (docs/objectives.md, docs/data.md): installed with
posttrain, so their import paths (`examples.own_data:answer_digits`) work from any directory."""
