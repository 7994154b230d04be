"""API keys carry an admission priority class and a fair-share weight: the key file, the CLI, the principal."""

from __future__ import annotations

import pytest

from orchestrator.cli import main as cli_main
from orchestrator.security import KeyStore, load_key_file


def test_cli_sets_and_lists_priority_and_weight(tmp_path, capsys):
    path = tmp_path / "keys.yaml"
    assert cli_main(["keys", "create", "--file", str(path), "--name", "vip", "--priority", "high", "--weight", "3"]) == 0
    key = capsys.readouterr().out.strip()
    rec = load_key_file(path).keys[0]
    assert (rec.priority, rec.weight) == ("high", 3.0)
    principal, why = KeyStore(path).verify(key)
    assert why == "" and (principal.priority, principal.weight) == ("high", 3.0)
    assert cli_main(["keys", "list", "--file", str(path)]) == 0
    listing = capsys.readouterr().out
    assert "priority" in listing and "high" in listing
    assert cli_main(["keys", "set-limits", rec.id, "--file", str(path), "--priority", "low"]) == 0
    assert "priority low, weight 3" in capsys.readouterr().out
    assert load_key_file(path).keys[0].priority == "low" and load_key_file(path).keys[0].weight == 3.0


@pytest.mark.parametrize("args", [["--priority", "urgent"], ["--weight", "0"], ["--weight", "abc"], ["--weight", "5000"]])
def test_cli_refuses_bad_priority_or_weight(tmp_path, args, capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["keys", "create", "--file", str(tmp_path / "k.yaml"), *args])
    assert e.value.code == 2


def test_old_key_files_load_with_the_defaults(tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text("version: 1\nkeys:\n  - id: 0123456789ab\n    name: x\n    hash: sha256:" + "0" * 64 + "\n")
    rec = load_key_file(path).keys[0]
    assert (rec.priority, rec.weight) == ("normal", 1.0)


def test_a_bad_class_in_the_file_names_the_field(tmp_path):
    from orchestrator.security import KeyFileError

    path = tmp_path / "bad.yaml"
    path.write_text("keys:\n  - id: 0123456789ab\n    hash: sha256:" + "0" * 64 + "\n    priority: urgent\n")
    with pytest.raises(KeyFileError, match="keys.0.priority"):
        load_key_file(path)
