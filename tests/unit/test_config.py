"""LaunchConfig's derived values."""

from launcher.core.config import EntryKind, default_run_name


def test_a_script_whose_name_has_spaces_gets_a_plain_run_name():
    name = default_run_name(EntryKind.SCRIPT, "/data/my train script.py", ["--lr", "1"])
    assert name.startswith("my_train_script-") and " " not in name and "/" not in name


def test_the_same_command_names_the_same_run_and_other_arguments_another():
    a = default_run_name(EntryKind.MODULE, "pkg.train", ["--lr", "1"])
    assert a == default_run_name(EntryKind.MODULE, "pkg.train", ["--lr", "1"]) and a.startswith("train-")
    assert a != default_run_name(EntryKind.MODULE, "pkg.train", ["--lr", "2"])
