"""What a host has for DeepSpeed's compiled ops: prebuilt ones, and what a just-in-time build needs there.

DeepSpeed builds an op the first time a rank uses it (FusedAdam, CPU Adam, async I/O for NVMe offload) unless it
was installed prebuilt (``DS_BUILD_OPS=1``: its ``git_version_info_installed.py`` lists the op). A build needs
ninja, a C++ compiler and Python's headers; on a CUDA host also nvcc of the CUDA major version torch was built for
(``torch.utils.cpp_extension`` raises on a mismatch), found the way torch finds it (``CUDA_HOME``, ``CUDA_PATH``,
``nvcc`` on ``PATH``, ``/usr/local/cuda``), its runtime library, and a ``TORCH_CUDA_ARCH_LIST`` DeepSpeed can parse
(0.19 cannot parse arch suffixes such as ``9.0a``: :func:`ftkit.rundir.env.deepspeed_arch_list`).

:func:`toolchain_facts` reads all of that without importing torch or DeepSpeed (their version files are read as
text), so ``ftkit doctor``'s facts probe stays well under a second; :func:`op_problems` judges the facts for the ops
a plan needs. Standard library only: the probe runs it on every host.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import TypedDict

# torch's own table of named architectures (torch.utils.cpp_extension._get_cuda_arch_flags), for the parse check
NAMED_ARCHS = {
    "Kepler+Tesla": "3.7",
    "Kepler": "3.5+PTX",
    "Maxwell+Tegra": "5.3",
    "Maxwell": "5.0;5.2+PTX",
    "Pascal": "6.0;6.1+PTX",
    "Volta+Tegra": "7.2",
    "Volta": "7.0+PTX",
    "Turing": "7.5+PTX",
    "Ampere+Tegra": "8.7",
    "Ampere": "8.0;8.6+PTX",
    "Ada": "8.9+PTX",
    "Hopper": "9.0+PTX",
    "Blackwell+Tegra": "10.1",
    "Blackwell": "10.0;12.0+PTX",
}

# The ops ftkit may need, by DeepSpeed's builder name: what each is, and whether it is CUDA code on a CUDA host
OPS = {
    "cpu_adam": "DeepSpeed's CPU Adam (optimizer offload)",
    "fused_adam": "DeepSpeed's FusedAdam",
    "async_io": "DeepSpeed's async I/O (NVMe offload)",
}


class ToolchainFacts(TypedDict, total=False):
    """One host's facts for DeepSpeed's op builds (:func:`toolchain_facts`)."""

    torch_cuda: str | None  # the CUDA version torch was built for; None: a CPU build
    torch_found: bool
    cuda_home: str | None  # as torch.utils.cpp_extension finds it
    cuda_home_from: str  # CUDA_HOME, CUDA_PATH, nvcc on PATH, /usr/local/cuda, or "" when not found
    nvcc: str | None  # CUDA_HOME/bin/nvcc when it exists
    nvcc_release: str | None  # "13.0" from nvcc --version
    cudart: bool  # the CUDA runtime library under CUDA_HOME (cpu_adam links it on a CUDA host)
    ninja: str | None
    cxx: str | None
    python_h: bool
    libaio: bool
    arch_list: str | None  # TORCH_CUDA_ARCH_LIST as the ranks will see it
    ds_found: bool
    ds_version: str | None
    ds_accelerator: str | None  # the accelerator DeepSpeed's prebuilt ops were built for
    ds_prebuilt: list[str]  # ops installed prebuilt
    jit_cached: list[str]  # ops a just-in-time build left in the torch extensions directory


def _package_dir(name: str) -> Path | None:
    """Where a top-level package lives, without importing it (its spec is found, not executed)."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _assignments(path: Path) -> dict[str, object]:
    """``NAME = literal`` assignments of a Python file (torch/version.py, DeepSpeed's install record), unexecuted."""
    try:
        tree = ast.parse(path.read_text())
    except (OSError, SyntaxError, ValueError):
        return {}
    out: dict[str, object] = {}
    for node in tree.body:
        target, value = None, None
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            target, value = node.target, node.value
        if isinstance(target, ast.Name) and value is not None:
            try:
                out[target.id] = ast.literal_eval(value)
            except ValueError:
                continue
    return out


def find_cuda_home(env: dict[str, str] | os._Environ[str]) -> tuple[str | None, str]:
    """(CUDA_HOME, where it came from), as ``torch.utils.cpp_extension._find_cuda_home`` finds it on Linux."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if env.get(var):
            return env[var], var
    nvcc = shutil.which("nvcc", path=env.get("PATH"))
    if nvcc is not None:
        return os.path.dirname(os.path.dirname(nvcc)), "nvcc on PATH"
    if os.path.exists("/usr/local/cuda"):
        return "/usr/local/cuda", "/usr/local/cuda"
    return None, ""


def _nvcc_release(nvcc: str) -> str | None:
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"release (\d+\.\d+)", out)
    return m.group(1) if m else None


def _extensions_dir(torch_cuda: str | None, env: dict[str, str] | os._Environ[str]) -> Path:
    """torch's JIT build directory (``torch.utils.cpp_extension._get_build_directory`` without the op name)."""
    root = env.get("TORCH_EXTENSIONS_DIR")
    if not root:
        cache = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(cache, "torch_extensions")
    cu = "cpu" if not torch_cuda else "cu" + torch_cuda.replace(".", "")
    py = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(os.path.realpath(root)) / f"{py}_{cu}"


def toolchain_facts(env: dict[str, str] | os._Environ[str] | None = None) -> ToolchainFacts:
    """This host's facts for DeepSpeed's op builds, with ``env`` (default: this process's) as the ranks see it."""
    env = os.environ if env is None else env
    facts: ToolchainFacts = {}
    torch_dir = _package_dir("torch")
    facts["torch_found"] = torch_dir is not None
    tv = _assignments(torch_dir / "version.py") if torch_dir else {}
    cuda = tv.get("cuda")
    facts["torch_cuda"] = cuda if isinstance(cuda, str) else None
    home, origin = find_cuda_home(env)
    facts["cuda_home"], facts["cuda_home_from"] = home, origin
    nvcc = os.path.join(home, "bin", "nvcc") if home else None
    facts["nvcc"] = nvcc if nvcc and os.access(nvcc, os.X_OK) else None
    facts["nvcc_release"] = _nvcc_release(nvcc) if facts["nvcc"] and nvcc else None
    facts["cudart"] = bool(home) and any(
        (Path(str(home)) / d).glob("libcudart.so*") for d in ("lib64", "lib", "targets/x86_64-linux/lib")
    )
    facts["ninja"] = shutil.which("ninja", path=env.get("PATH"))
    facts["cxx"] = shutil.which(env.get("CXX") or "c++", path=env.get("PATH"))
    include = sysconfig.get_paths().get("include")
    facts["python_h"] = bool(include) and os.path.exists(os.path.join(str(include), "Python.h"))
    facts["libaio"] = any(os.path.exists(p) for p in ("/usr/include/libaio.h", "/usr/local/include/libaio.h"))
    facts["arch_list"] = env.get("TORCH_CUDA_ARCH_LIST")
    ds_dir = _package_dir("deepspeed")
    facts["ds_found"] = ds_dir is not None
    info = _assignments(ds_dir / "git_version_info_installed.py") if ds_dir else {}
    version = info.get("version")
    facts["ds_version"] = version if isinstance(version, str) else None
    acc = info.get("accelerator_name")
    facts["ds_accelerator"] = acc if isinstance(acc, str) else None
    installed = info.get("installed_ops")
    facts["ds_prebuilt"] = sorted(k for k, v in installed.items() if v) if isinstance(installed, dict) else []
    ext = _extensions_dir(facts["torch_cuda"], env)
    facts["jit_cached"] = sorted(op for op in OPS if (ext / op / f"{op}.so").is_file())
    return facts


def arch_problem(value: str | None) -> str | None:
    """Why DeepSpeed 0.19's arch parser (``OpBuilder.compute_capability_args``: ``int()`` of each part of each
    ``X.Y[+PTX]`` entry) cannot read ``value``, or None."""
    if not value or not value.strip():
        return None
    bad = [t for t in re.split(r"[;\s]+", value.strip()) if t and not re.fullmatch(r"\d+\.\d+(\+PTX)?", t)]
    return f"TORCH_CUDA_ARCH_LIST={value!r}: DeepSpeed cannot parse {', '.join(bad)}" if bad else None


def sanitize_arch_list(value: str) -> str:
    """``value`` with every entry DeepSpeed cannot parse made one it can: an arch suffix dropped (``9.0a`` ->
    ``9.0``, ``10.0f+PTX`` -> ``10.0+PTX``), a named architecture spelt out as torch spells it (``Hopper`` ->
    ``9.0+PTX``), anything else left out; ``;``-separated, duplicates removed. The same ops get built (DeepSpeed's
    kernels need no arch-specific features); "" when nothing is left (DeepSpeed then probes the devices)."""
    out: list[str] = []
    for token in re.split(r"[;\s]+", value.strip()):
        if not token:
            continue
        expanded = NAMED_ARCHS.get(token, token).split(";")
        for t in expanded:
            m = re.fullmatch(r"(\d+\.\d+)[A-Za-z]*(\+PTX)?", t)
            if m:
                clean = m.group(1) + (m.group(2) or "")
                if clean not in out:
                    out.append(clean)
    return ";".join(out)


def op_problems(op: str, facts: ToolchainFacts, accelerator: str) -> list[str]:
    """Why ``op`` can be neither loaded prebuilt nor built on a host with these facts (empty: it loads). Each
    line names the cause and the fix; the caller adds the host and the op."""
    if op in facts.get("ds_prebuilt", []) and facts.get("ds_accelerator") == accelerator:
        return []
    out = []
    if not facts.get("ninja"):
        out.append("ninja not found (it runs torch's builds): pip install ninja")
    if not facts.get("cxx"):
        out.append("no C++ compiler (c++, or $CXX): install g++")
    if not facts.get("python_h"):
        out.append("Python's headers are missing (Python.h): install python3-dev for this interpreter")
    if op == "async_io" and not facts.get("libaio"):
        out.append("libaio's headers are missing: install libaio-dev")
    cuda_host = accelerator == "cuda" and facts.get("torch_cuda")
    if cuda_host:
        want = str(facts.get("torch_cuda"))
        if not facts.get("cuda_home"):
            out.append(
                f"no CUDA toolkit: CUDA_HOME is not set and no nvcc was found; install the CUDA {want.split('.')[0]} "
                "toolkit (or set CUDA_HOME)"
            )
        elif not facts.get("nvcc"):
            out.append(
                f"CUDA_HOME={facts.get('cuda_home')} ({facts.get('cuda_home_from')}) has no bin/nvcc; point CUDA_HOME "
                f"at a CUDA {want.split('.')[0]} toolkit"
            )
        else:
            have = facts.get("nvcc_release")
            if have and have.split(".")[0] != want.split(".")[0]:
                out.append(
                    f"nvcc {have} at {facts.get('nvcc')} but torch was built for CUDA {want}: torch refuses to build "
                    f"with another major version; point CUDA_HOME at a CUDA {want.split('.')[0]} toolkit"
                )
            if not facts.get("cudart"):
                out.append(
                    f"CUDA_HOME={facts.get('cuda_home')} has no libcudart (lib64/): a full CUDA toolkit is needed"
                )
        bad = arch_problem(facts.get("arch_list"))
        if bad:
            out.append(f"{bad}; set it to plain X.Y[+PTX] values (e.g. 9.0)")
    return out
