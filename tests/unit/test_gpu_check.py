"""bench/gpu_check.py runs end to end on a CPU: ``--dry-run`` takes every section (kernel tests, engine vs HF,
decode bandwidth, tokens/s) through TRITON_INTERPRET=1, a tiny random Llama and tiny sizes. Its figures mean nothing;
what is checked is that the script a GPU machine will run works, and that its results file has the promised shape.
"""

import json
import subprocess
import sys

import pytest

from tests.server_harness import REPO_ROOT


@pytest.mark.slow
def test_gpu_check_dry_run_writes_its_results(tmp_path, smollm2_dir):
    out = tmp_path / "gpu_check.json"
    cmd = [sys.executable, "-m", "bench.gpu_check", "--dry-run", "--model", str(smollm2_dir), "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert f"results written to {out}" in proc.stdout
    results = json.loads(out.read_text())
    assert results["dry_run"] and results["passed"]
    assert results["kernel_tests"]["passed"] > 0 and results["kernel_tests"]["returncode"] == 0
    for dtype in ("float32", "bfloat16"):
        assert set(results["engine_vs_hf"][dtype]) == {"as_wired", "all_kernels"}
    assert results["engine_vs_hf"]["float32"]["all_kernels"]["greedy_match"]
    assert results["decode_bandwidth"]["copy_gbs"] > 0
    assert all(r["kernel_gbs"] >= 0 and "max_abs_err_vs_reference" in r for r in results["decode_bandwidth"]["rows"])
    rows = results["throughput"]["rows"]
    assert [r["batch"] for r in rows] == [1, 2]
    assert all(r["engine_tok_s"] > 0 and r["engine_all_kernels_tok_s"] > 0 and r["hf_generate_tok_s"] > 0 for r in rows)
