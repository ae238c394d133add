"""The soak's memory trends: the second half, and the load's last ten minutes after warm-up."""

from __future__ import annotations

from bench.soak import summarize


def sample(t_s: float, pipeline_mib: float) -> dict[str, float]:
    return {
        "t_s": t_s,
        "journal_bytes": 1,
        "segments": 1,
        "edge_rss_kib": 40 * 1024,
        "pipeline_rss_kib": pipeline_mib * 1024,
        "pipeline_pss_kib": pipeline_mib * 1024,
        "lag_records": 0,
        "messages_log_entries": 100,
    }


def test_the_last_ten_minutes_of_load_leave_the_warm_up_and_the_catch_up_out() -> None:
    # 20 minutes of load: +10 MiB a minute for 8 minutes, then flat; after the load the
    # catch-up samples (not load) drop by 50 MiB.
    ramp = [sample(60 * m, 3000 + 10 * min(m, 8)) for m in range(21)]
    after = [sample(60 * m, 3030) for m in (21, 22)]
    summary = summarize(ramp + after, load_s=20 * 60)

    assert summary["last_10_minutes_of_load_mib_per_min"] == {
        "edge_rss_kib": 0.0,
        "pipeline_pss_kib": 0.0,
    }
    # The second half (from minute 11) still holds the ramp's end and the drop after the load.
    assert summary["second_half_mib_per_min"]["pipeline_pss_kib"] != 0.0
    assert summary["pipeline_pss_kib"]["max"] == 3080 * 1024


def test_a_growth_in_the_last_ten_minutes_is_its_slope() -> None:
    growing = [sample(60 * m, 3000 + 2.5 * m) for m in range(31)]
    summary = summarize(growing, load_s=30 * 60)
    assert summary["last_10_minutes_of_load_mib_per_min"]["pipeline_pss_kib"] == 2.5


def test_a_run_shorter_than_twice_the_window_has_no_steady_trend() -> None:
    ten_minutes = [sample(60 * m, 1000 + 300 * min(m, 3)) for m in range(11)]
    summary = summarize(ten_minutes, load_s=10 * 60)
    assert summary["last_10_minutes_of_load_mib_per_min"] == {
        "edge_rss_kib": None,
        "pipeline_pss_kib": None,
    }
