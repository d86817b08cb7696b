"""A model's engine counters over its replicas: counts and seconds added up, shares worked out again."""

from gateway.serving.engine_stats_board import model_totals


def test_replicas_add_up_and_the_kv_share_is_worked_out_from_the_sums() -> None:
    a = {"num_running": 3, "kv_blocks_used": 30, "kv_blocks_total": 100, "kv_cache_usage": 0.3, "busy_seconds": 1.5,
         "ttft_p99_s": 0.2, "busy_seconds_by_account": {"t": 1.5}, "replica": "r1"}
    b = {"num_running": 1, "kv_blocks_used": 10, "kv_blocks_total": 300, "kv_cache_usage": 1 / 30, "busy_seconds": 0.5,
         "ttft_p99_s": 0.9}
    totals = model_totals([a, b])
    assert totals["num_running"] == 4 and totals["busy_seconds"] == 2.0
    assert totals["kv_cache_usage"] == 40 / 400  # not 0.3 + 0.033
    assert "ttft_p99_s" not in totals and "busy_seconds_by_account" not in totals and "replica" not in totals
    assert model_totals([]) == {}
