"""Subcommands of the ``chainswarm`` CLI that belong to the control plane."""
