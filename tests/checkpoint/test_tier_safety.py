"""Issue 36: the local tier is this user's alone (items 1, 2, 5), against a second, unprivileged local user made for
the test (``useradd``, removed after). In the real /dev/shm, as the default tier lives there: its name is
predictable, so another user can make it first, or plant a symbolic link there.

* a tier directory another user made (or can write to) is refused, nothing is written into it nor removed from it;
* a symbolic link at the tier's path is never followed, by the ranks or by the end of a launch's clean-up;
* what ftkit makes is private (directories 0700, checkpoint files 0600): another user reads nothing;
* the end of a launch removes what ftkit made, never a directory it did not create (``/scratch/me`` of
  ``/scratch/me/{host}``), never a file it did not write.
"""

from __future__ import annotations

import os
import secrets
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from ftkit.checkpoint.tiers import TIER_MARK, TierUnsafe, make_private, open_tier, remove_tier
from ftkit.errors import ExitCode
from tests.helpers.ckpt import commit, make_ckpt
from tests.helpers.users import LocalUser, other_user

SHM = Path("/dev/shm")


@pytest.fixture
def mallory() -> Iterator[LocalUser]:
    with other_user() as user:
        yield user


@pytest.fixture
def shm_root() -> Iterator[Path]:
    """A run's tier root in the real /dev/shm (``/dev/shm/ftkit-<name>-<hash>``, as the plan names it); whatever
    is there is removed after the test (by root, never by the code under test)."""
    if not SHM.is_dir():
        pytest.skip("no /dev/shm")
    root = SHM / f"ftkit-test36-{secrets.token_hex(4)}"
    yield root
    if root.is_symlink():
        root.unlink()
    elif root.exists():
        shutil.rmtree(root)


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.lstat().st_mode)


def test_a_tier_directory_another_user_made_first_is_refused_and_left_as_it_was(
    mallory: LocalUser, shm_root: Path
) -> None:
    """Item 1: another user made the predictable /dev/shm path first (0777, theirs); the victim's ranks saved into
    it, and that user swapped step 27's shards for step 25's. Refused now, naming the path and its owner."""
    template = f"{shm_root}/{{host}}"
    for mode in ("0777", "0755"):
        mallory.run("mkdir", "-m", mode, str(shm_root), check=True)
        mallory.run("mkdir", "-m", "0777", str(shm_root / "localhost"), check=True)
        with pytest.raises(TierUnsafe, match=f"{shm_root}: owned by uid {mallory.uid}, not by this user") as e:
            open_tier(template, "localhost")
        assert e.value.exit_code == ExitCode.PREFLIGHT and len(str(e.value).splitlines()) == 1
        with pytest.raises(TierUnsafe):
            remove_tier(template, "localhost")
        assert os.listdir(shm_root) == ["localhost"] and os.listdir(shm_root / "localhost") == []
        assert shm_root.stat().st_uid == mallory.uid
        shutil.rmtree(shm_root)
    # this user's own directory, but writable by everyone: refused too
    shm_root.mkdir()
    shm_root.chmod(0o777)
    with pytest.raises(TierUnsafe, match=r"writable by its group or by others \(mode drwxrwxrwx\)"):
        open_tier(template, "localhost")
    assert os.listdir(shm_root) == []


def test_a_symbolic_link_planted_at_the_tier_path_is_never_followed(
    mallory: LocalUser, shm_root: Path, tmp_path: Path
) -> None:
    """Item 2: a link at the tier's path was followed: the run wrote through it, and the end of the launch removed
    ``<target>/localhost``, a directory ftkit never wrote (fs.protected_symlinks = 0)."""
    victim = tmp_path / "victim"
    (victim / "localhost").mkdir(parents=True)
    (victim / "localhost" / "thesis.tex").write_text("years of work\n")
    template = f"{shm_root}/{{host}}"
    mallory.run("ln", "-s", str(victim), str(shm_root), check=True)
    for act in (lambda: open_tier(template, "localhost"), lambda: remove_tier(template, "localhost")):
        with pytest.raises(TierUnsafe, match=f"{shm_root}: a symbolic link \\(to {victim}, made by uid {mallory.uid}"):
            act()
    assert (victim / "localhost" / "thesis.tex").read_text() == "years of work\n"
    assert sorted(p.name for p in victim.rglob("*")) == ["localhost", "thesis.tex"]
    # a link at the node's own place inside a tier this user made is never followed either
    shm_root.unlink()
    open_tier(template, "other")
    (shm_root / "localhost").symlink_to(victim / "localhost")
    for act in (lambda: open_tier(template, "localhost"), lambda: remove_tier(template, "localhost")):
        with pytest.raises(TierUnsafe, match="a symbolic link"):
            act()
    assert (victim / "localhost" / "thesis.tex").read_text() == "years of work\n"


def test_the_tier_is_private_and_another_user_reads_nothing_of_it(mallory: LocalUser, shm_root: Path) -> None:
    """Item 1: tier files were 0644 (the full weights readable by every local user). Directories ftkit makes are
    0700 and marked as its own; a committed checkpoint's files are 0600, a second wall should a directory be opened
    up."""
    template = f"{shm_root}/{{host}}"
    node = open_tier(template, "localhost")
    assert node == shm_root / "localhost"
    assert _mode(shm_root) == _mode(node) == 0o700
    assert (shm_root / TIER_MARK).is_file() and _mode(node / TIER_MARK) == 0o600
    ckpt = make_ckpt(node, 5)
    commit(ckpt)
    weights = ckpt / "model.safetensors"
    assert _mode(weights) & 0o044, "the Trainer writes what it writes (umask 022 here)"
    make_private(ckpt)
    files = [p for p in ckpt.rglob("*") if p.is_file()]
    assert files and {_mode(p) for p in files} == {0o600}
    assert {_mode(p) for p in ckpt.rglob("*") if p.is_dir()} | {_mode(ckpt)} == {0o700}
    assert mallory.run("ls", str(shm_root)).returncode != 0
    assert mallory.run("cat", str(weights)).returncode != 0
    for d in (shm_root, node, ckpt):
        d.chmod(0o755)  # opened up by mistake: the files stay unreadable
    seen = mallory.run("cat", str(weights))
    assert seen.returncode != 0 and "Permission denied" in seen.stderr, seen
    assert mallory.run("ls", str(ckpt)).returncode == 0  # (the directories really were open)


def test_the_end_of_a_launch_removes_only_what_ftkit_made(tmp_path: Path) -> None:
    """Item 5: with ``checkpoint.local_dir: /scratch/me/{host}`` the end of the launch removed the (empty)
    ``/scratch/me``, which the user had made. Only what ftkit made goes: the directories it created (marked), and
    of a directory it did not create only what it wrote there."""
    me = tmp_path / "scratch" / "me"
    me.mkdir(parents=True)
    template = f"{me}/{{host}}"
    node = open_tier(template, "localhost")
    commit(make_ckpt(node, 5))
    (node / "peer" / "node1").mkdir(parents=True)
    assert remove_tier(template, "localhost") == []
    assert me.is_dir() and os.listdir(me) == []  # the user's directory stays, empty as it was

    # a tier without {host}: the user's own directory, holding the user's own files
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    (nvme / "notes.txt").write_text("mine\n")
    node = open_tier(str(nvme), "localhost")
    assert node == nvme and not (nvme / TIER_MARK).exists()  # not made by ftkit: never marked
    commit(make_ckpt(nvme, 3))
    (nvme / ".checkpoint-4.tmp").mkdir()
    (nvme / "ftkit" / "saves").mkdir(parents=True)
    (nvme / "ftkit" / "saves" / "checkpoint-3.json").write_text("{}")
    commit(make_ckpt(nvme / "peer" / "node1", 2))
    make_ckpt(nvme, 9)  # the user's own checkpoint-9 (no commit or save record), and the user's own peer/ notes
    (nvme / "peer" / "mine.txt").write_text("mine too\n")
    kept = remove_tier(str(nvme), "localhost")
    assert sorted(
        str(p.relative_to(nvme)) for p in nvme.rglob("*") if p.is_file() and "checkpoint-9" not in str(p)
    ) == [
        "notes.txt",
        "peer/mine.txt",
    ]
    assert (nvme / "checkpoint-9").is_dir() and not (nvme / "ftkit").exists() and not (nvme / "peer" / "node1").exists()
    assert kept == [f"{nvme} (not made by ftkit; holds checkpoint-9, notes.txt, peer)"]

    # the default: /dev/shm-like root and node directory both made by ftkit, both go; what holds them stays
    shm = tmp_path / "shm"
    shm.mkdir()
    shm.chmod(0o1777)
    template = f"{shm}/ftkit-run-abc/{{host}}"
    for host in ("localhost", "node1"):
        commit(make_ckpt(open_tier(template, host), 2))
    assert remove_tier(template, "localhost") == [f"{shm}/ftkit-run-abc (holds node1)"]  # node1's, on a shared fs
    assert remove_tier(template, "node1") == []
    assert os.listdir(shm) == []
