"""Inputs outside the options model that must stop with a message naming what is wrong and the fix (issue #27): a
damaged checkpoint side file, and a ds_config the example script cannot read."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ds_lioncub.integration import checkpoint


def test_a_truncated_side_file_names_torchs_first_sentence_whole(tmp_path: Path) -> None:
    path = tmp_path / "lioncub_dp_rank_00000.pt"
    torch.save({"format": 2, "world_size": 1, "exp_avg": [torch.zeros(4096)]}, path)
    data = path.read_bytes()
    path.write_bytes(data[:1024])  # the zip's central directory is gone: torch's message runs on for 300 characters
    with pytest.raises(Exception) as loaded:  # what torch itself says about the file
        torch.load(path, map_location="cpu", weights_only=True)
    torch_message = str(loaded.value).strip().splitlines()[0]
    assert len(torch_message) > 200, torch_message  # long enough that a cut at a character count would fall mid-word
    with pytest.raises(checkpoint._Problems) as raised:
        checkpoint._read(str(path))
    message = str(raised.value)
    assert message.startswith("lioncub_dp_rank_00000.pt is truncated or unreadable (") and message.endswith(")")
    detail = message.split("(", 1)[1][:-1]
    # Torch's text from its start to a sentence's end, not cut at a character count mid-word.
    assert detail and torch_message.startswith(detail), (detail, torch_message)
    assert torch_message[len(detail) :][:1] in ("", "."), (detail, torch_message)


def test_a_long_first_sentence_is_shortened_at_a_word() -> None:
    text = "word " * 100 + "end. Advice follows."
    shortened = checkpoint._first_sentence(text, limit=50)
    assert shortened.endswith(" ...") and len(shortened) <= 54
    assert all(part == "word" for part in shortened.removesuffix(" ...").split())


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ('{"optimizer": {"type": "LionCub",}}', ["is not valid JSON", "line 1, column 34"]),
        (
            '{\n  "train_batch_size": 8\n  "optimizer": {}\n}',
            ["is not valid JSON", "Expecting ',' delimiter", "line 3"],
        ),
        ("[1, 2]", ["must hold a JSON object"]),
    ],
)
def test_the_example_names_a_ds_config_it_cannot_read(
    text: str, words: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from examples import train_gpt

    path = tmp_path / "broken.json"
    path.write_text(text)
    with pytest.raises(SystemExit) as exited:
        train_gpt.parse_args(["--deepspeed_config", str(path)])
    assert exited.value.code == 2  # argparse's exit, before any rank joins the process group
    error = capsys.readouterr().err
    assert f"--deepspeed_config {path}" in error and "Traceback" not in error, error
    for word in words:
        assert word in error, error


def test_the_example_names_a_missing_ds_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from examples import train_gpt

    missing = tmp_path / "nowhere.json"
    with pytest.raises(SystemExit):
        train_gpt.parse_args(["--deepspeed_config", str(missing)])
    assert f"--deepspeed_config {missing}: cannot read it" in capsys.readouterr().err


def test_the_example_reads_every_ready_config() -> None:
    from examples import train_gpt

    for path in sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.json")):
        args = train_gpt.parse_args(["--deepspeed_config", str(path)])
        assert args.ds_config["optimizer"]["type"].lower() == "lioncub"
