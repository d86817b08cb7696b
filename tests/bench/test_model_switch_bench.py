"""bench/model_switch.py's CPU mode: two engines take turns, each switch timed, each model's tokens unchanged."""

from __future__ import annotations

from bench import model_switch


def test_two_engines_take_turns_and_keep_their_greedy_tokens(tmp_path):
    result = model_switch.main(["--model", "random:llama-tiny", "--device", "cpu", "--switches", "2",
                                "--pause-s", "0", "--json", str(tmp_path / "switch.json")])
    assert [s["to"] for s in result["switches"]] == [1, 0]
    assert result["tokens_unchanged"] and all(s["tokens_unchanged"] for s in result["switches"])
    assert all(s["to_first_token_s"] >= s["wake_s"] > 0 for s in result["switches"])
