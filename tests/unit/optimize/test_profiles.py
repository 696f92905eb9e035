"""Stage settings: what a run writes to run.json reads back the same."""

from __future__ import annotations


def test_stage_settings_read_back_the_run_json_they_write():
    from llmopt.optimize.profiles import PROFILES, SCREEN, StageSettings

    # The JSON form is what run.json and search.json held before the sizes were typed.
    assert PROFILES["full"].to_dict() == {
        "eval_windows": 16,
        "window": 512,
        "sentences": 2000,
        "bench_sentences": 512,
        "bench_repeats": 3,
        "prompt_tokens": 100,
        "new_tokens": 64,
        "bench_batch_sizes": [1, 4],
    }
    assert SCREEN["quick"].to_dict()["generation_prompts"] == 0
    settings = StageSettings.for_run("quick", 0.02, "loose", 2).run_json("quick")
    assert settings["profile"] == "quick" and settings["threads"] == 2
    assert "generation_prompts" not in settings  # full fidelity: the verifier's default
    for fidelity, sizes in (
        ("full", PROFILES["quick"]),
        ("screen", SCREEN["quick"]),
        ("reverify", PROFILES["quick"]),
    ):
        got = StageSettings.from_run_json(settings, fidelity)
        assert got.sizes == sizes and got.max_quality_drop == 0.02 and got.gates == "loose"
    # A run written before --gates existed reads as the default preset.
    older = {k: v for k, v in settings.items() if k != "gates"}
    assert StageSettings.from_run_json(older).gates == "default"
    record = SCREEN["full"].fidelity_record("screen", SCREEN["full"].VERIFY_FIELDS)
    assert record == {
        "level": "screen",
        "rung": 1,
        "eval_windows": 4,
        "window": 256,
        "sentences": 500,
        "generation_prompts": 0,
    }
