"""qsync_lab.simulate (see the package modules)."""
