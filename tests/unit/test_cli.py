"""The command line's shared conventions, for every command: spellings, exit status, one-line errors."""

import re

import pytest

from shardwise.cli import COMMANDS, main, normalise


def test_dashes_become_underscores_and_bare_booleans_true():
    flags = {"--json", "--all"}
    assert normalise(["--device-memory", "80GiB", "--json", "--seq-len=2048"], flags) == [
        "--device_memory",
        "80GiB",
        "--json",
        "true",
        "--seq_len=2048",
    ]
    assert normalise(["--json", "false", "--all"], flags) == ["--json", "false", "--all", "true"]
    assert normalise(["--trainer.max-steps", "3"], flags) == ["--trainer.max_steps", "3"]


def test_a_launched_programs_own_arguments_are_passed_on_as_given():
    argv = ["--nproc-per-node", "2", "-m", "pkg.train", "--lr-max", "1", "--json"]
    assert normalise(argv, {"--json"}, passthrough=True) == [
        "--nproc_per_node",
        "2",
        "-m",
        "pkg.train",
        "--lr-max",
        "1",
        "--json",
    ]
    assert normalise(["train.py", "--node-rank", "3"], set(), passthrough=True) == ["train.py", "--node-rank", "3"]


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_has_help_for_users(command, capsys):
    assert main([command, "--help"]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"usage: shardwise {command}")
    # Users never saw the documents the project started from: no "the seed" / "seed's" in help.
    assert not re.search(r"\bthe seed\b|\bseed's\b|\bseed (recipe|script|example|demo)", text, re.I)


def test_usage_mistakes_exit_2_with_one_line(capsys):
    assert main(["no-such-command"]) == 2
    assert "unknown command 'no-such-command'" in capsys.readouterr().err
    assert main(["inspect", "x.ckpt", "--no-such-option", "1"]) == 2
    assert "no_such_option" in capsys.readouterr().err
    assert main(["plan", "--model", "no-such-model"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shardwise plan: error:") and "Traceback" not in err and len(err.splitlines()) == 1


def test_a_failed_run_exits_1_with_one_line(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "missing.ckpt")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("shardwise inspect: error:") and "missing.ckpt" in err and "Traceback" not in err


def test_a_bug_keeps_its_traceback(monkeypatch):
    from shardwise.cli import inspect as inspect_command

    def broken(cfg):
        raise KeyError("a bug, not a user mistake")

    monkeypatch.setattr(inspect_command, "run", broken)
    with pytest.raises(KeyError):
        main(["inspect", "x.ckpt"])
