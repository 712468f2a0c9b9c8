"""The call-site measurement's arithmetic and report (benchmarks/resume_benchmark/call_sites.py).

The GPU phases themselves run on the H200 (docs/gpu-report.md, session 11); here the rows are
computed from phase records shaped as the worker writes them.
"""

from typing import Any, Dict, Optional

import pytest

from benchmarks.resume_benchmark import call_sites

MIB = 2**20
ELEMENTS = 1000


def _resume(extra_bytes: int, fingerprint: Dict[str, str], loss: str = "0x1.0p+3", rss: Optional[int] = 40_000) -> Dict[str, Any]:
    return {
        "path": "float16_wrapper",
        "wrapper": ["Float16OptimizerWithFloat16Params"],
        "inner": ["FusedAdam"],
        "optimizer_elements": ELEMENTS,
        "load": {"baseline_bytes": 10 * MIB, "peak_bytes": 10 * MIB + extra_bytes, "rss_baseline_bytes": 1_000_000, "rss_peak_bytes": None if rss is None else 1_000_000 + rss, "seconds": 1.0},
        "next_step": {"loss_hex": loss, "peak_bytes": 20 * MIB},
        "restored_fingerprint": fingerprint,
        "next_step_fingerprint": fingerprint,
        "outcomes": [{"hook_point": "load", "adopter": "te_fused_adam_fp32", "fallback_reason": None}],
    }


TRAIN = {"post_save_fingerprint": {"a": "1"}, "next_step_fingerprint": {"a": "1"}, "next_step": {"loss_hex": "0x1.0p+3"}}


def test_a_row_gives_the_saving_over_8_bytes_per_parameter_and_the_bitwise_checks() -> None:
    phases = {"train": TRAIN, "upstream": _resume(16 * ELEMENTS, {"a": "1"}), "build": _resume(8 * ELEMENTS, {"a": "1"}, rss=36_000)}
    upstream, build = call_sites.summarise("float16_wrapper", phases)
    assert upstream["load_over_baseline_b_per_param"] == 16.0 and "saving_vs_8b" not in upstream
    assert build["load_over_baseline_b_per_param"] == 8.0 and build["saving_vs_8b"] == 1.0
    assert build["rss_over_baseline_b_per_param"] == 36.0 and build["rss_saving_vs_8b"] == 0.5
    assert build["restored_equal"] and build["next_step_equal"] and build["next_step_equals_upstream"]
    assert build["adopters"] == ["te_fused_adam_fp32"] and build["hook_points"] == ["load"]


def test_a_differing_tensor_or_loss_is_reported_as_not_bitwise() -> None:
    phases = {"train": TRAIN, "upstream": _resume(16 * ELEMENTS, {"a": "1"}), "build": _resume(8 * ELEMENTS, {"a": "2"}, loss="0x1.1p+3")}
    build = call_sites.summarise("float16_wrapper", phases)[1]
    assert not build["restored_equal"] and not build["next_step_equal"] and not build["next_step_equals_upstream"]
    assert "| NO | NO | NO |" in call_sites.markdown([build])


def test_a_failed_phase_is_a_row_with_its_error_and_the_report_says_so() -> None:
    rows = call_sites.summarise("megatron_fsdp", {"train": {"path": "megatron_fsdp", "error": "NotImplementedError: x"}})
    assert rows == [{"path": "megatron_fsdp", "side": "train", "error": "NotImplementedError: x"}]
    assert "| megatron_fsdp | train | error: NotImplementedError: x |" in call_sites.markdown(rows)


def test_without_a_resettable_rss_peak_the_host_column_is_empty() -> None:
    phases = {"train": TRAIN, "upstream": _resume(16 * ELEMENTS, {"a": "1"}, rss=None), "build": _resume(8 * ELEMENTS, {"a": "1"}, rss=None)}
    build = call_sites.summarise("float16_wrapper", phases)[1]
    assert build["rss_over_baseline_b_per_param"] is None and "rss_saving_vs_8b" not in build
    assert "| 8.00 B/param | 1.0000 |" in call_sites.markdown([build])


def test_the_driver_refuses_an_unknown_path(tmp_path: Any) -> None:
    with pytest.raises(SystemExit):
        call_sites.main(["--upstream", "a", "--build", "b", "--paths", "zero3", "--work-dir", str(tmp_path), "--json-out", str(tmp_path / "o.json"), "--markdown-out", str(tmp_path / "o.md")])
