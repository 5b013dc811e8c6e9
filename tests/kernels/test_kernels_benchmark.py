"""benchmarks/kernels.py, small: the bandwidth table and the launch-overhead table (host µs
per call; the device column only on CUDA), and the refusal of sizes it cannot view."""

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels.py"


def _run(*argv):
    return subprocess.run([sys.executable, str(SCRIPT), "--devices", "cpu", "--repeats", "1",
                           *argv], capture_output=True, text=True, timeout=300)


def test_the_launch_table_gives_host_us_per_call_of_ours_and_torchs():
    done = _run("--elements", "8192", "--launch-elements", "4096", "--only", "absmax")
    assert done.returncode == 0, done.stderr[-2000:]
    table = done.stdout.split("launch overhead: 4,096 float32 elements")[1]
    rows = {line[:34].strip(): line[34:].split() for line in table.splitlines()[3:]
            if line[:1].isalpha() and not line.startswith("load")}
    assert set(rows) == {"absmax", "int8 absmax+quantize (RNE)",
                         "int8 absmax+quantize (stochastic)",
                         "int8 absmax+quantize, per-ch. last"}
    for host, device, torch_host, torch_device in rows.values():
        assert float(host) > 0 and float(torch_host) > 0 and device == torch_device == "-"


def test_sizes_below_one_row_of_channels_are_refused_in_one_line():
    done = _run("--launch-elements", "100")
    assert done.returncode == 2
    assert "--launch-elements need at least 4096" in done.stderr.strip().splitlines()[-1]
