"""qsync_lab.costs (see the package modules)."""
