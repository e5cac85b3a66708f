"""Hostfiles: which hosts a run uses and how many processes (slots) each one gets.

The grammar is DeepSpeed's (``deepspeed/launcher/runner.py``), so the same file feeds the ``deepspeed`` launcher
unchanged::

    # comment
    worker-0 slots=8      # trailing comment
    worker-1 slots=8

but parsed strictly. DeepSpeed's regex accepts ``host slots=4 anything`` and reads ``slots=4x`` as 4; a hostfile
is also spliced into pdsh and ssh command lines, so ftkit rejects, quoting the line: trailing junk, missing or
non-positive slots, duplicate hosts, ``user@host`` (the user belongs in ssh config), and host names with shell
metacharacters, spaces or other characters a host name cannot have. Every problem in the file is reported at once.

``--include``/``--exclude`` use DeepSpeed's filter syntax (``host1@host2:0,2``: ``@`` separates hosts, ``:`` selects
slot indices on a host) with the same results as ``parse_resource_filter``, but with clean errors.

Standard library only: the controller imports this on the head node.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from pathlib import Path

from ftkit.cluster.hosts import is_local
from ftkit.errors import HostfileError, Problem

__all__ = [
    "Host",
    "Hostfile",
    "apply_filters",
    "is_local",
    "local_hostfile",
    "parse_hostfile",
    "parse_hostfile_text",
]

# What a host name may contain: DNS labels (letters, digits, '-'), dots, and '_' (seen in ssh config aliases).
# Nothing that a shell, pdsh's host-list syntax (',', '[', ']', '^') or DeepSpeed's filter syntax ('@', ':')
# would read specially.
_NAME_RE = re.compile(r"[A-Za-z0-9._-]+")
_SHELL_META = set(";|&$`<>()'\"\\*?[]{}!~")


@dataclass(frozen=True)
class Host:
    """One host of a hostfile.

    ``name``: as written (an ssh/pdsh target); ``slots``: processes to start there (GPUs, or CPU ranks);
    ``line``: 1-based line in the hostfile, 0 when not read from a file; ``selected_slots``: the slot (device)
    indices an ``--include``/``--exclude`` filter kept, ``None`` meaning ``0..slots-1`` (always ``None`` when the
    selection is exactly that, so a filter that keeps slots 0 and 1 equals a plain ``slots=2`` host).
    """

    name: str
    slots: int
    line: int = 0
    selected_slots: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.selected_slots is not None:
            if len(self.selected_slots) != self.slots:
                raise ValueError(f"Host {self.name}: {self.slots} slots but selected_slots={self.selected_slots}")
            if self.selected_slots == tuple(range(self.slots)):
                object.__setattr__(self, "selected_slots", None)

    @property
    def slot_indices(self) -> tuple[int, ...]:
        """The slot (device) indices to use on this host, e.g. for ``CUDA_VISIBLE_DEVICES``."""
        return self.selected_slots if self.selected_slots is not None else tuple(range(self.slots))


@dataclass(frozen=True)
class Hostfile:
    """A parsed hostfile: ``hosts`` in file order (rank order: node rank i is ``hosts[i]``)."""

    path: str
    hosts: tuple[Host, ...]

    @property
    def world_size(self) -> int:
        """Total number of processes: the sum of every host's slots."""
        return sum(h.slots for h in self.hosts)

    @property
    def num_nodes(self) -> int:
        return len(self.hosts)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(h.name for h in self.hosts)

    @property
    def is_local_only(self) -> bool:
        """True when every host is this machine (localhost, 127.x, its hostname or FQDN): no ssh needed."""
        return all(is_local(h.name) for h in self.hosts)

    def host(self, name: str) -> Host:
        for h in self.hosts:
            if h.name == name:
                return h
        raise KeyError(name)

    def resource_pool(self) -> dict[str, list[int]]:
        """``{host: [slot indices]}`` in file order: the shape DeepSpeed's runner calls ``active_resources``."""
        return {h.name: list(h.slot_indices) for h in self.hosts}

    def to_text(self) -> str:
        """The hostfile in DeepSpeed's grammar (slot counts only: a slot *selection* needs ``--include``)."""
        return "".join(f"{h.name} slots={h.slots}\n" for h in self.hosts)


MAX_HOSTFILE_BYTES = 1 << 20  # 1 MiB: ~30,000 hosts of long names


def parse_hostfile(path: str | Path) -> Hostfile:
    """Read and strictly parse the hostfile at ``path``; raises HostfileError listing every problem."""
    p = Path(path)
    try:
        with open(p, "rb") as fh:  # at most the cap (+1 to notice more): never /dev/zero or a pipe without end
            blob = fh.read(MAX_HOSTFILE_BYTES + 1)
        if len(blob) > MAX_HOSTFILE_BYTES:
            raise HostfileError(
                Problem(
                    f"larger than {MAX_HOSTFILE_BYTES >> 20} MiB: a hostfile is one 'HOST slots=N' line per host; "
                    "is this the right file?",
                    file=str(path),
                )
            )
        text = blob.decode("utf-8")
    except FileNotFoundError:
        raise HostfileError(Problem("hostfile not found", file=str(path))) from None
    except IsADirectoryError:
        raise HostfileError(Problem("is a directory, not a hostfile", file=str(path))) from None
    except UnicodeDecodeError as e:
        raise HostfileError(Problem(f"not UTF-8 text ({e.reason} at byte {e.start})", file=str(path))) from None
    except OSError as e:
        raise HostfileError(Problem(f"cannot read hostfile: {e.strerror}", file=str(path))) from None
    return parse_hostfile_text(text, path=str(path))


def parse_hostfile_text(text: str, path: str = "<hostfile>") -> Hostfile:
    """Parse hostfile text (``path`` only labels the problems); raises HostfileError listing every problem."""
    problems: list[Problem] = []
    hosts: list[Host] = []
    seen: dict[str, Host] = {}  # lower-cased name -> first host with it (host names are case-insensitive)

    for lineno, raw in enumerate(text.removeprefix("\ufeff").splitlines(), start=1):
        content = raw.split("#", 1)[0].strip()
        if not content:
            continue
        quoted = raw.strip()

        def bad(message: str, lineno: int = lineno, quoted: str = quoted) -> None:
            problems.append(Problem(f'{message} in "{quoted}"', file=path, line=lineno))

        tokens = content.split()
        slot_pos = [i for i, t in enumerate(tokens) if t.startswith("slots=")]
        if not slot_pos:
            if len(tokens) == 1:
                bad("missing slots=N after the host name")
            elif tokens[1].startswith("slots"):
                bad("write slots=N with no spaces around '='")
            else:
                bad(f"expected slots=N after the host name, got {tokens[1]!r}")
            continue
        first = slot_pos[0]
        if first == 0:
            bad("missing host name before slots=N")
            continue
        name = " ".join(tokens[:first])
        if len(slot_pos) > 1 or first < len(tokens) - 1:
            junk = " ".join(tokens[first + 1 :])
            bad(f"unexpected text {junk!r} after {tokens[first]} (only 'HOST slots=N' and a # comment are allowed)")
            continue

        line_ok = True
        name_problem = _name_problem(name)
        if name_problem:
            bad(name_problem)
            line_ok = False

        value = tokens[first].removeprefix("slots=")
        slots = 0
        if not value:
            bad("slots= needs a number of processes")
            line_ok = False
        elif re.fullmatch(r"[0-9]+", value) is None:
            bad(f"slots must be a positive integer, got {value!r}")
            line_ok = False
        else:
            slots = int(value)
            if slots == 0:
                bad("slots must be at least 1, got 0 (leave the host out, or comment it out, to skip it)")
                line_ok = False

        if not line_ok:
            continue
        earlier = seen.get(name.lower())
        if earlier is not None:
            as_written = "" if earlier.name == name else f" as {earlier.name!r}"
            bad(f"duplicate host {name!r} (already listed on line {earlier.line}{as_written})")
            continue
        here = next((h for h in hosts if is_local(h.name)), None) if is_local(name) else None
        if here is not None:
            bad(
                f"{name!r} and {here.name!r} (line {here.line}) are both this machine: one line per machine, with "
                "all its slots"
            )
            continue
        host = Host(name=name, slots=slots, line=lineno)
        seen[name.lower()] = host
        hosts.append(host)

    if not problems and not hosts:
        problems.append(Problem("hostfile lists no hosts (expected lines like 'worker-0 slots=8')", file=path))
    if problems:
        raise HostfileError(problems)
    return Hostfile(path=path, hosts=tuple(hosts))


def _name_problem(name: str) -> str | None:
    """What is wrong with a host name as written in a hostfile, or None."""
    if "@" in name:
        user, _, host = name.rpartition("@")
        return (
            f"{name!r} names a user; write just the host ({host!r}) and put the user in ssh config "
            f"(~/.ssh/config: 'Host {host}' / 'User {user}')"
        )
    if " " in name:
        return f"host name {name!r} contains a space"
    if _NAME_RE.fullmatch(name):
        if name.startswith("-"):
            return f"host name {name!r} starts with '-' (ssh and pdsh would read it as an option)"
        return None
    meta = sorted({c for c in name if c in _SHELL_META})
    if meta:
        return f"host name {name!r} contains shell metacharacter(s) {' '.join(meta)}"
    if ":" in name:
        return (
            f"host name {name!r} contains ':' (IPv6 literals and ports do not work with DeepSpeed's hostfile "
            "or --include syntax; use a name from /etc/hosts or ssh config)"
        )
    others = sorted({c for c in name if not _NAME_RE.fullmatch(c)})
    return f"host name {name!r} contains {' '.join(map(repr, others))} (allowed: letters, digits, '.', '-', '_')"


def local_hostfile(slots: int) -> Hostfile:
    """A one-host hostfile for this machine: ``localhost slots=<slots>``."""
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
        raise HostfileError(Problem(f"slots must be a positive integer, got {slots!r}", file="<local>"))
    return Hostfile(path="<local>", hosts=(Host("localhost", slots, 0),))


def apply_filters(hostfile: Hostfile, include: str | None = None, exclude: str | None = None) -> Hostfile:
    """Apply DeepSpeed's ``--include`` or ``--exclude`` to a hostfile.

    Syntax ``NODE_SPEC[@NODE_SPEC ...]`` with ``NODE_SPEC = NAME[:SLOT[,SLOT ...]]``; a bare NAME means all its
    slots. ``include="w0@w1:0,2"`` keeps all of w0 and slots 0 and 2 of w1; ``exclude="w1:0"`` drops slot 0 of
    w1, ``exclude="w1"`` drops w1. Results equal DeepSpeed's ``parse_resource_filter``: host order stays the
    hostfile's, each host's ``slots`` becomes the number of kept indices, hosts left with none disappear.

    Errors (all reported at once): both filters given, unknown host (with a suggestion), unknown slot index,
    malformed specs, a host named both bare and with slots in one filter (DeepSpeed silently takes only the
    listed slots), and a filter that leaves nothing to run on. ``None`` or ``""`` means no filter.
    """
    if include and exclude:
        raise HostfileError(
            Problem("--include and --exclude cannot be used together; use one of them", key="--include/--exclude")
        )
    if not include and not exclude:
        return hostfile
    flag = "--include" if include else "--exclude"
    spec = include or exclude or ""
    problems: list[Problem] = []
    wanted = _parse_filter(spec, hostfile, flag, problems)
    if problems:
        raise HostfileError(problems)

    kept: list[Host] = []
    for h in hostfile.hosts:
        current = set(h.slot_indices)
        if include:
            if h.name not in wanted:
                continue
            chosen = wanted[h.name]
            selected = current if chosen is None else chosen
        else:
            chosen = wanted.get(h.name, set())
            selected = set() if chosen is None else current - chosen
        if selected:
            ordered = tuple(sorted(selected))
            kept.append(Host(h.name, len(ordered), h.line, ordered))
    if not kept:
        raise HostfileError(Problem(f"{spec!r} leaves no slot on any host; nothing to run on", key=flag))
    return Hostfile(path=hostfile.path, hosts=tuple(kept))


def _parse_filter(spec: str, hostfile: Hostfile, flag: str, problems: list[Problem]) -> dict[str, set[int] | None]:
    """Parse a filter into ``{host: slot indices, or None for the whole host}``, appending to ``problems``."""
    known = {h.name: h for h in hostfile.hosts}
    wanted: dict[str, set[int] | None] = {}
    whole_and_slots: set[str] = set()

    def bad(message: str) -> None:
        problems.append(Problem(message, key=flag))

    for part in spec.split("@"):
        name, colon, slot_text = part.partition(":")
        name = name.strip()
        if not name:
            bad(f"empty host name in {spec!r} (hosts are separated by '@', e.g. 'worker-0@worker-1:0,1')")
            continue
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else f" (hosts: {', '.join(known)})"
            bad(f"unknown host {name!r}{hint}")
            continue
        host = known[name]
        if not colon:
            if wanted.get(name, None) is not None:
                whole_and_slots.add(name)
            wanted[name] = None
            continue
        indices: set[int] = set()
        items = slot_text.split(",")
        if ":" in slot_text or not slot_text or any(re.fullmatch(r"\s*[0-9]+\s*", s) is None for s in items):
            bad(f"bad slot list {slot_text!r} for host {name!r} (expected comma-separated indices, e.g. '{name}:0,2')")
            continue
        for s in items:
            i = int(s)
            if i not in host.slot_indices:
                bad(f"host {name!r} has no slot {i} (its slots: {_ranges(host.slot_indices)})")
            else:
                indices.add(i)
        if name in wanted and wanted[name] is None:
            whole_and_slots.add(name)
        else:
            previous = wanted.get(name) or set()
            wanted[name] = previous | indices
    for name in sorted(whole_and_slots):
        bad(f"host {name!r} is named both whole and with slot indices; name it once")
    return wanted


def _ranges(indices: tuple[int, ...]) -> str:
    if indices == tuple(range(indices[0], indices[-1] + 1)) and len(indices) > 2:
        return f"{indices[0]}-{indices[-1]}"
    return ",".join(map(str, indices))
