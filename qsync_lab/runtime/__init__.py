"""qsync_lab.runtime (see the package modules)."""
