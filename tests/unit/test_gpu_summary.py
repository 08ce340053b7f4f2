"""The one-screen end of tests/bench/gpu_checks.sh (tests/bench/gpu_summary.py): each part's status as the script
recorded it, its figures from the file it wrote, and no part's trouble hidden: a failed, timed-out or fallback part
makes the run not all ok, and a file that was not written says so."""

from __future__ import annotations

import json

from tests.bench.gpu_summary import read_parts, render, summarize

MOE = {"precision": "bf16", "batch": 32,
       "steps_compared": {"tiny": {"tokens_per_s": {"median": 1000.0}},
                          "tiny-moe/grouped": {"tokens_per_s": {"median": 800.0}},
                          "tiny-moe/loop": {"tokens_per_s": {"median": 400.0}},
                          "grouped_over_loop_tokens_per_s": 2.0},
       "moe_layer_split": {"forward_ms": {"expert_gemms_grouped": 0.5, "expert_gemms_loop": 1.5}}}


def test_statuses_files_and_figures(tmp_path):
    (tmp_path / "moe.json").write_text(json.dumps(MOE))
    (tmp_path / "kernel_cases.json").write_text(json.dumps({"cases": 28, "failed": ["rope-bf16"]}))
    parts = read_parts("kernels_cases\tfailed (rc 1)\t40\tkernel_cases.json\t\n"
                       "vs_torchtitan\ttimeout\t230\tvs_torchtitan.json\tTorchTitan 0.3.0 timeout;\n"
                       "moe\tok\t12\tmoe.json\t\n"
                       "packing\tskipped\t0\t\tCUDA only\n")
    summary = summarize(parts, tmp_path)
    by = {p["part"]: p for p in summary["parts"]}
    assert [p["status"] for p in summary["parts"]] == ["failed (rc 1)", "timeout", "ok", "skipped"]
    assert by["kernels_cases"]["figures"] == ["28 cases, 1 failed: rope-bf16"]
    assert by["vs_torchtitan"]["figures"] == ["vs_torchtitan.json was not written"]
    assert "grouped_over_loop_tokens_per_s 2.000" in by["moe"]["figures"][1]
    assert "figures" not in by["packing"]
    assert summary["all_ok"] is False
    screen = render(summary)
    assert "tiny-moe/grouped 800, tiny-moe/loop 400" in screen and "CUDA only" in screen


def test_all_ok_only_when_every_part_ran_or_was_skipped(tmp_path):
    ok = read_parts("moe\tok\t1\t\t\npacking\tskipped\t0\t\tCUDA only\n")
    assert summarize(ok, tmp_path)["all_ok"] is True
    fallback = read_parts("vs_torchtitan\tfallback ok\t100\ttrainer.json\tTorchTitan 0.3.0 failed (rc 1);\n")
    assert summarize(fallback, tmp_path)["all_ok"] is False  # the TorchTitan comparison itself did not run


def test_an_unreadable_file_is_reported_not_raised(tmp_path):
    (tmp_path / "moe.json").write_text("{not json")
    summary = summarize(read_parts("moe\tok\t1\tmoe.json\t\n"), tmp_path)
    assert summary["parts"][0]["figures"][0].startswith("could not read moe.json: JSONDecodeError")
