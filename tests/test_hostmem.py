"""keep_freed_memory: a process that reuses what it frees takes no page faults in steady
state (counted by the kernel, in fresh processes)."""

import subprocess
import sys

import pytest

from qsync_lab.hostmem import keep_freed_memory

_STEP_MIB = 64  # above glibc's largest dynamic mmap threshold (32 MiB): always mmapped
_SCRIPT = f"""
import resource, sys, torch
from qsync_lab.hostmem import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
def step():
    torch.ones({_STEP_MIB} << 18).sum()  # a fresh {_STEP_MIB} MiB tensor, touched, freed
for _ in range(8):  # the heap settles (where freed blocks land) within a few steps
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", _SCRIPT, mode], check=True,
                         capture_output=True, text=True)
    return int(out.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_kept_memory_takes_no_page_faults_in_steady_steps():
    pages_per_step = (_STEP_MIB << 20) // 4096
    assert _faults("default") >= 15 * pages_per_step  # (nearly) every step maps fresh pages
    # the heap may still move a block now and then (seen: 0-2 steps in 20), never often
    assert _faults("keep") <= 5 * pages_per_step


def test_keep_freed_memory_is_idempotent():
    assert keep_freed_memory() is keep_freed_memory()
