"""`epochmesh-coordinator token create --donor NAME`: a donor name is 1-64 of [A-Za-z0-9._-],
for node tokens only; anything else exits 2 with the reason, before the data dir is touched."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.main import main
from coordinator.trust.tokens import check_donor

pytestmark = pytest.mark.timeout(30)


def token_create(data_dir: Path, *extra: str) -> int:
    return main(["token", "create", "--data-dir", str(data_dir), *extra])


@pytest.mark.parametrize("name", ["alice", "a", "Lab-1.gpu_box", "x" * 64, "0"])
def test_good_donor_names(name: str) -> None:
    assert check_donor(name) == name


@pytest.mark.parametrize(
    "name", ["", "a b", "x" * 65, "donor:alice", "a/b", "élan", "tab\t", "alice\n"]
)
def test_bad_donor_names_exit_2(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, name: str
) -> None:
    with pytest.raises(ValueError, match="not a donor name"):
        check_donor(name)
    assert token_create(tmp_path / "d", "--role", "node", "--donor", name) == 2
    assert "invalid --donor: not a donor name" in caplog.text
    assert "1-64 characters" in caplog.text
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("role", ["submitter", "operator"])
def test_donor_is_for_node_tokens_only(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, role: str
) -> None:
    assert token_create(tmp_path / "d", "--role", role, "--donor", "alice") == 2
    assert f"--donor is for node tokens only (--role node), not for --role {role}" in caplog.text
    assert not (tmp_path / "d").exists()
