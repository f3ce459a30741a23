"""What a user runs: ``python -m dcredit_opt`` (``commands.py``), and profiling a user's own model for it
(``model_profile.py``). The top of the package: it may import any layer, and none imports it."""
