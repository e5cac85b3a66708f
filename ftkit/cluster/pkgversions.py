"""Installed versions of named distributions, read from the installation's ``*.dist-info`` directory names.

One home for "which torch/deepspeed/... is installed here", on this machine and on every host preflight visits.
Remote hosts run this file's source as ``python -S -c SOURCE``: no ``site`` processing and no
``importlib.metadata`` (which imports email, zipfile and csv parsing), so a probe costs ~10 ms of CPU instead of
~90 ms (measured on the dev machine: ``/usr/bin/time python -S -c "$(cat ftkit/cluster/pkgversions.py)"``), paid
once per host on every launch (benchmarks/fanout.py).

What it reads: the directories Python would search (``sys.path``, then a virtual environment's site-packages, then
the user's site directory and the installation's site-packages when Python would add them), first match wins as
with ``importlib.metadata``.
A name not found that way is looked up with ``importlib.metadata`` after ``site.main()``, so an unusual layout
(``.pth`` paths, eggs) costs time, never a wrong "missing". Standard library only: the source runs on hosts that
may not have ftkit.
"""

import os
import sys

PACKAGES = ("torch", "deepspeed", "transformers", "accelerate", "peft", "ftkit")


def _key(name):
    return name.lower().replace("-", "_").replace(".", "_")


def _search_path():
    """The directories to scan, in the order Python's import system sees them once ``site`` has run."""
    paths = [p or os.getcwd() for p in sys.path]
    if sys.flags.no_site:
        # As site.main() would: a virtual environment's site-packages first (under -S, sys.prefix is still the
        # base installation's: site.venv() is what moves it), then the user's site directory and the base
        # installation's site-packages when Python would add them.
        import site  # under -S importing site runs nothing; its helpers still say where things are

        venv, system_site = _venv()
        prefixes = [sys.prefix, sys.exec_prefix]
        if venv:
            paths += site.getsitepackages([venv])
        if system_site and site.check_enableusersite():
            paths.append(site.getusersitepackages())
        if system_site:
            paths += site.getsitepackages(prefixes)
    return list(dict.fromkeys(paths))


def _venv():
    """(the virtual environment's prefix or None, whether the base installation's packages are visible)."""
    exe_dir = os.path.dirname(os.path.abspath(sys.executable))
    for conf in (os.path.join(exe_dir, "pyvenv.cfg"), os.path.join(os.path.dirname(exe_dir), "pyvenv.cfg")):
        try:
            with open(conf, encoding="utf-8") as f:
                lines = f.read().splitlines()
        except OSError:
            continue
        system_site = False
        for line in lines:
            key, _, value = line.partition("=")
            if key.strip().lower() == "include-system-site-packages":
                system_site = value.strip().lower() == "true"
        return os.path.dirname(exe_dir), system_site
    return None, True


def versions(names=PACKAGES):
    """``{"python": "3.11.9", name: version or "missing", ...}`` for this interpreter's installation."""
    wanted = {_key(n): n for n in names}
    found = {}
    for d in _search_path():
        try:
            entries = os.listdir(d)
        except OSError:
            continue
        for e in entries:
            if not e.endswith((".dist-info", ".egg-info")):
                continue
            name, _, rest = e.rsplit(".", 1)[0].partition("-")
            key = _key(name)
            if key in wanted and key not in found and rest:
                found[key] = rest.split("-")[0]  # "2.13.0+cpu"; an egg's "1.0-py3.11" gives "1.0"
    out = {"python": ".".join(map(str, sys.version_info[:3]))}
    missing = [n for k, n in wanted.items() if k not in found]
    if missing:
        found.update(_slow(missing))
    for k, n in wanted.items():
        out[n] = found.get(k, "missing")
    return out


def _slow(names):
    if sys.flags.no_site:
        import site

        site.main()
    from importlib import metadata

    out = {}
    for n in names:
        try:
            out[_key(n)] = metadata.version(n)
        except metadata.PackageNotFoundError:
            pass
    return out


def probe_source():
    """This file as ``python -S -c`` source that prints ``name=version`` lines (python first)."""
    with open(__file__, encoding="utf-8") as f:
        return f.read()


if __name__ == "__main__":
    for _name, _version in versions().items():
        print(f"{_name}={_version}")
