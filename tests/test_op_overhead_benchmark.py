"""benchmarks/op_overhead.py on the CPU (native execution): every variant measured, and the
aten calls each dispatches, which are the launches a GPU would make."""

import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def test_the_table_counts_what_each_way_of_running_an_op_dispatches(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import op_overhead

    from qsync_lab.quant.native import execution
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    with execution("native"):
        table = op_overhead.run("cpu", repeats=2)
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == before
    calls = table.set_index(["op", "variant"])["aten calls"]
    for op in ("linear", "conv2d", "matmul"):
        # a tf32 op in a rank that keeps TF32 on runs exactly what torch's TF32 mode does
        assert calls[op, "plan: tf32 kept on"] == calls[op, "torch: TF32"]
        # a bf16 op dispatches what torch.autocast does
        assert calls[op, "plan: bf16"] == calls[op, "torch: autocast bf16"]
    assert calls["linear", "plan: int8"] > calls["linear", "plan: bf16"]
    assert len(table) == 29 and (table["us"] > 0).all()  # 11 linear, 9 conv, 9 matmul


def test_the_script_writes_its_report(tmp_path):
    out = tmp_path / "op_overhead.txt"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "op_overhead.py"),
                           "--repeats", "1", "--out", str(out)], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "plan: tf32 kept on" in out.read_text() and "load after" in out.read_text()
