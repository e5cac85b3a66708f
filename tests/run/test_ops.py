"""Issue 35: DeepSpeed's compiled ops checked before any rank starts. The host facts are read for real
(``toolchain_facts`` on this machine, with fake CUDA toolkits: a CUDA_HOME without bin/nvcc, an nvcc script that
prints another release) and judged by the pure rules the preflight and ``ftkit doctor`` apply."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from ftkit.cluster.toolchain import ToolchainFacts, arch_problem, op_problems, toolchain_facts
from ftkit.plan.knobs import IMPL_CPU_ADAM, IMPL_TORCH_CPU, compiled_ops
from ftkit.plan.load import load_and_plan
from ftkit.run.doctor_checks import DoctorReport, check_ops
from ftkit.run.ops import cpu_adam_everywhere, to_build


def _fake_nvcc(home: Path, release: str) -> None:
    (home / "bin").mkdir(parents=True)
    (home / "lib64").mkdir()
    (home / "lib64" / "libcudart.so.13").write_text("")
    nvcc = home / "bin" / "nvcc"
    nvcc.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {release}, V{release}.1'\n")
    nvcc.chmod(nvcc.stat().st_mode | stat.S_IEXEC)


def _cuda_host(env: dict[str, str]) -> ToolchainFacts:
    """This machine's facts with ``env``, judged as a CUDA host whose torch was built for CUDA 13.0."""
    facts = toolchain_facts({**os.environ, **env})
    facts["torch_cuda"] = "13.0"
    facts["ds_prebuilt"] = []
    return facts


def test_a_cuda_home_without_nvcc_is_named_with_the_fix(tmp_path):
    (tmp_path / "cuda").mkdir()
    facts = _cuda_host({"CUDA_HOME": str(tmp_path / "cuda")})
    assert facts["cuda_home"] == str(tmp_path / "cuda") and facts["cuda_home_from"] == "CUDA_HOME"
    assert facts["nvcc"] is None
    assert op_problems("cpu_adam", facts, "cuda") == [
        f"CUDA_HOME={tmp_path / 'cuda'} (CUDA_HOME) has no bin/nvcc; point CUDA_HOME at a CUDA 13 toolkit"
    ]


def test_no_toolkit_at_all_is_the_gpu_log_s_cuda_home_error(tmp_path):
    facts = _cuda_host({"CUDA_HOME": "", "CUDA_PATH": "", "PATH": str(tmp_path)})  # no nvcc on PATH, no CUDA_HOME
    facts.update(cuda_home=None, nvcc=None, ninja="/bin/ninja", cxx="/bin/c++")  # (/usr/local/cuda exists here)
    assert op_problems("fused_adam", facts, "cuda") == [
        "no CUDA toolkit: CUDA_HOME is not set and no nvcc was found; install the CUDA 13 toolkit (or set CUDA_HOME)"
    ]


def test_an_nvcc_of_another_major_version_is_named(tmp_path):
    _fake_nvcc(tmp_path / "cuda-12", "12.4")
    facts = _cuda_host({"CUDA_HOME": str(tmp_path / "cuda-12")})
    assert facts["nvcc_release"] == "12.4" and facts["cudart"]
    (line,) = op_problems("cpu_adam", facts, "cuda")
    assert line.startswith("nvcc 12.4 at ") and "torch was built for CUDA 13.0" in line
    _fake_nvcc(tmp_path / "cuda-13", "13.0")
    assert op_problems("cpu_adam", _cuda_host({"CUDA_HOME": str(tmp_path / "cuda-13")}), "cuda") == []


@pytest.mark.parametrize("arch,ok", [("9.0a", False), ("10.0f+PTX;9.0a", False), ("8.0 9.0+PTX", True), ("9.0", True)])
def test_an_arch_list_deepspeed_cannot_parse_is_named(tmp_path, arch, ok):
    _fake_nvcc(tmp_path / "cuda", "13.0")
    facts = _cuda_host({"CUDA_HOME": str(tmp_path / "cuda"), "TORCH_CUDA_ARCH_LIST": arch})
    problems = op_problems("fused_adam", facts, "cuda")
    assert (problems == []) is ok, problems
    if not ok:
        assert problems == [f"{arch_problem(arch)}; set it to plain X.Y[+PTX] values (e.g. 9.0)"]


def test_prebuilt_ops_need_no_toolchain_and_cpu_ops_need_no_cuda(tmp_path):
    bare: ToolchainFacts = {"torch_cuda": "13.0", "ninja": None, "cxx": None, "python_h": False}
    assert op_problems("cpu_adam", {**bare, "ds_prebuilt": ["cpu_adam"], "ds_accelerator": "cuda"}, "cuda") == []
    # prebuilt for another accelerator is not prebuilt for this one (DeepSpeed's own rule in OpBuilder.load)
    assert len(op_problems("cpu_adam", {**bare, "ds_prebuilt": ["cpu_adam"], "ds_accelerator": "cpu"}, "cuda")) == 4
    here = toolchain_facts({**os.environ, "PATH": os.path.dirname(os.sys.executable) + ":" + os.environ["PATH"]})
    assert op_problems("cpu_adam", here, "cpu") == []  # this machine builds CPU ops (make install did)
    assert op_problems("cpu_adam", {**here, "cxx": None}, "cpu") == ["no C++ compiler (c++, or $CXX): install g++"]
    assert op_problems("async_io", {**here, "libaio": False}, "cpu") == [
        "libaio's headers are missing: install libaio-dev"
    ]


@pytest.mark.heavy
def test_facts_read_deepspeed_s_install_record_and_the_build_cache(tmp_path):
    """What DeepSpeed itself reads (git_version_info's installed_ops, torch's extension directory), found without
    importing either."""
    import json
    import subprocess
    import sys

    code = (
        "import json; from deepspeed.git_version_info import installed_ops as o, accelerator_name as a; "
        "print(json.dumps([sorted(k for k, v in o.items() if v), a]))"
    )
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env).stdout
    prebuilt, acc = json.loads(out.splitlines()[-1])
    ext = tmp_path / "ext"
    (ext / f"py{sys.version_info.major}{sys.version_info.minor}_cpu" / "cpu_adam").mkdir(parents=True)
    (ext / f"py{sys.version_info.major}{sys.version_info.minor}_cpu" / "cpu_adam" / "cpu_adam.so").write_text("")
    facts = toolchain_facts({**os.environ, "TORCH_EXTENSIONS_DIR": str(ext)})
    assert facts["ds_prebuilt"] == prebuilt and facts["ds_accelerator"] == acc
    assert facts["jit_cached"] == ["cpu_adam"] and facts["torch_found"] and facts["torch_cuda"] is None


def _plan(write_recipe, *overrides: str):
    return load_and_plan(str(write_recipe()), ["cluster.accelerator=cpu", "cluster.gpus_per_node=2", *overrides])


def test_what_each_plan_needs_compiled(write_recipe):
    assert compiled_ops(_plan(write_recipe)) == []  # the default: torch's fused AdamW
    auto = _plan(write_recipe, "zero.offload_optimizer=cpu")
    assert auto.knobs["optimizer.impl"].value == IMPL_TORCH_CPU and compiled_ops(auto) == []
    assert compiled_ops(_plan(write_recipe, "zero.offload_optimizer=cpu", "zero.cpu_adam=true")) == ["cpu_adam"]
    nvme = _plan(
        write_recipe, "zero.stage=3", "zero.offload_optimizer=nvme", "zero.nvme_path=/nvme", "zero.cpu_adam=false"
    )
    assert compiled_ops(nvme) == ["async_io"]


def test_auto_takes_cpu_adam_only_where_every_host_can_load_it(write_recipe):
    plan = _plan(write_recipe, "zero.offload_optimizer=cpu")
    good: ToolchainFacts = {"ninja": "/n", "cxx": "/c", "python_h": True, "jit_cached": ["cpu_adam"]}
    assert cpu_adam_everywhere(plan, {"localhost": good}) is True
    assert cpu_adam_everywhere(plan, {"localhost": {**good, "cxx": None}}) is False
    assert cpu_adam_everywhere(plan, {}) is False  # a host without facts cannot be assumed
    assert cpu_adam_everywhere(_plan(write_recipe), {"localhost": good}) is None  # no offload: no question
    built = load_and_plan(str(write_recipe()), ["cluster.accelerator=cpu", "zero.offload_optimizer=cpu"])
    assert built.knobs["optimizer.impl"].value == IMPL_TORCH_CPU
    from ftkit.plan.plan import build_plan

    assert build_plan(plan.recipe, cpu_adam_ok=True).knobs["optimizer.impl"].value == IMPL_CPU_ADAM
    # built once already: nothing to build; otherwise the host builds it once
    need = build_plan(plan.recipe, cpu_adam_ok=True)
    assert to_build(need, {"localhost": good}) == {}
    assert to_build(need, {"localhost": {**good, "jit_cached": []}}) == {"localhost": ["cpu_adam"]}


def test_doctor_names_the_host_the_op_the_cause_and_the_fix():
    rep = DoctorReport(hosts=["w0", "w1"])
    rep.cells = {"w0": {}, "w1": {}}
    good: ToolchainFacts = {"ninja": "/n", "cxx": "/c", "python_h": True}
    check_ops(rep, "w0", good, ["cpu_adam"], "cpu", "zero.cpu_adam true")
    check_ops(rep, "w1", {**good, "ninja": None}, ["cpu_adam"], "cpu", "zero.cpu_adam true")
    assert rep.cells["w0"]["ops"] == "cpu_adam buildable" and rep.cells["w1"]["ops"] == "FAIL"
    assert [f.line() for f in rep.failures] == [
        "host w1: ops: cpu_adam (DeepSpeed's CPU Adam (optimizer offload), zero.cpu_adam true) cannot be built: "
        "ninja not found (it runs torch's builds): pip install ninja"
    ]
    check_ops(rep, "w0", good, [], "cpu")
    assert rep.cells["w0"]["ops"] == "none needed"


def test_the_launch_settles_auto_with_the_hosts_and_says_so(write_recipe):
    from ftkit.plan.plan import build_plan
    from ftkit.run.ops import settle_optimizer

    plan = _plan(write_recipe, "zero.offload_optimizer=cpu")
    replans: list[bool] = []

    def replan(ok: bool):
        replans.append(ok)
        return build_plan(plan.recipe, cpu_adam_ok=ok)

    good: ToolchainFacts = {"ninja": "/n", "cxx": "/c", "python_h": True}
    new, note = settle_optimizer(plan, {"localhost": good}, replan)
    assert new.knobs["optimizer.impl"].value == IMPL_CPU_ADAM and "DeepSpeed's CPU Adam" in str(note)
    new, note = settle_optimizer(plan, {"localhost": {**good, "cxx": None}}, replan)
    assert new.knobs["optimizer.impl"].value == IMPL_TORCH_CPU
    assert note == (
        "optimizer: torch's AdamW steps the offloaded states on the CPU (slower): DeepSpeed's CPU Adam cannot be "
        "built on localhost (ftkit doctor says why; zero.cpu_adam true requires it)"
    )
    assert "zero.cpu_adam auto: a host cannot build DeepSpeed's CPU Adam" in new.knobs["optimizer.impl"].why
    assert replans == [True, False]
    no_offload = _plan(write_recipe)
    assert settle_optimizer(no_offload, {"localhost": good}, replan) == (no_offload, None) and replans == [True, False]
