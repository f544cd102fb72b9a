"""`python -m shardwise.smoke --dry` on a CPU: the checks that can run pass, the CUDA ones are SKIP, the JSON says so.

The dry mode is what keeps the GPU smoke test (shardwise/smoke) from rotting between the rare GPU runs:
its launch check forks 2 gloo ranks from the fork server, trains the bundled GPT with FSDP bf16-mixed and
plants a NaN loss on rank 1 in step 3, which the health check must stop at, naming the step and the rank
on every rank. In-process (no subprocess per check) to keep it to one launch.
"""

import json

import pytest

from shardwise import smoke

CPU_CHECKS = {"environment", "fsdp_bf16_planted_nan"}


def test_dry_run_passes_on_cpu_and_skips_the_cuda_checks(tmp_path, capsys):
    out = tmp_path / "smoke.json"
    code = smoke.main(["--dry", "--in-process", "--json", str(out)])
    summary = json.loads(out.read_text())
    checks = summary["checks"]
    assert list(checks) == smoke.NAMES  # every check reported, in the order of risk
    for name, result in checks.items():
        if name in CPU_CHECKS:
            assert result["status"] == "PASS", (name, result)
        else:
            assert result["status"] == "SKIP" and "CUDA" in result["detail"], (name, result)
    assert code == 0 and summary["ok"] and summary["mode"] == "dry"
    assert summary["counts"] == {"PASS": len(CPU_CHECKS), "FAIL": 0, "SKIP": len(smoke.NAMES) - len(CPU_CHECKS)}
    ranks = checks["fsdp_bf16_planted_nan"]["data"]["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all("step 3" in r["error"] and "rank 1" in r["error"] for r in ranks), ranks
    printed = capsys.readouterr().out
    assert "PASS fsdp_bf16_planted_nan" in printed and "SKIP qlora_cuda_codes" in printed


def test_a_failing_check_is_a_fail_line_and_a_nonzero_exit(tmp_path, monkeypatch):
    def broken(dry, limit_s):
        raise RuntimeError("planted failure")

    monkeypatch.setattr(smoke, "CHECKS", [("environment", broken, 5, True)] + smoke.CHECKS[1:])
    out = tmp_path / "smoke.json"
    assert smoke.main(["--dry", "--in-process", "--only", "environment", "--json", str(out)]) == 1
    result = json.loads(out.read_text())["checks"]["environment"]
    assert result["status"] == "FAIL" and result["detail"] == "RuntimeError: planted failure"
    assert "planted failure" in result["data"]["traceback"]


def test_unknown_check_names_are_refused():
    with pytest.raises(SystemExit):
        smoke.main(["--dry", "--only", "no_such_check"])
