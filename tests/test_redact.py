"""Secrets never reach what a run records: genrl.hub.redact."""

from genrl.hub.redact import REDACTED, redact_args, redact_argv, redact_text

TOKEN = "hf_SECRETabc123SECRETabc123SECRETabc1"  # the length of a real user access token


def test_both_forms_of_hub_token_and_its_abbreviations_are_redacted():
    argv = ["train_genrl.py", "--hub_token", "short", "--seed", "1", "--hub_token=other", "--hub_tok", "x", "--hub_t=y"]
    assert redact_argv(argv) == [
        "train_genrl.py", "--hub_token", REDACTED, "--seed", "1", f"--hub_token={REDACTED}",
        "--hub_tok", REDACTED, f"--hub_t={REDACTED}",
    ]


def test_token_looking_strings_are_redacted_anywhere_and_the_rest_is_kept():
    argv = ["train_genrl.py", "--reward_options", f'{{"token": "{TOKEN}"}}', f"--tracker_project_name={TOKEN}",
            "--hub_model_id", "me/model", "--output_dir", "/data/hf_cache/run", "--push_to_hub"]
    redacted = redact_argv(argv)
    assert TOKEN not in " ".join(redacted)
    assert redacted == ["train_genrl.py", "--reward_options", f'{{"token": "{REDACTED}"}}',
                        f"--tracker_project_name={REDACTED}", "--hub_model_id", "me/model",
                        "--output_dir", "/data/hf_cache/run", "--push_to_hub"]
    assert redact_text(f"Bearer {TOKEN}.") == f"Bearer {REDACTED}."
    assert redact_text("hf_home hf_cache my_hf_") == "hf_home hf_cache my_hf_"


def test_a_flag_value_that_looks_like_a_flag_is_still_the_token_and_the_input_is_untouched():
    argv = ["--hub_token", "--hub_token", "--seed", "3"]
    assert redact_argv(argv) == ["--hub_token", REDACTED, "--seed", "3"]
    assert argv == ["--hub_token", "--hub_token", "--seed", "3"]
    assert redact_argv(["--hub_model_id", "me/x", "--hub_private"]) == ["--hub_model_id", "me/x", "--hub_private"]
    assert redact_argv(["--hub_token"]) == ["--hub_token"]  # nothing follows: nothing to hide


def test_parsed_arguments_lose_the_token_and_token_looking_values():
    args = {"hub_token": TOKEN, "seed": 3, "reward_options": f"{{'t': '{TOKEN}'}}", "window": [0, 8],
            "names": ("a", TOKEN), "nested": {"k": TOKEN}, "none": None}
    assert redact_args(args) == {"seed": 3, "reward_options": f"{{'t': '{REDACTED}'}}", "window": [0, 8],
                                 "names": ("a", REDACTED), "nested": {"k": REDACTED}, "none": None}
    assert args["hub_token"] == TOKEN, "the caller's arguments are not changed"
