"""qsync_lab.indicator (see the package modules)."""
