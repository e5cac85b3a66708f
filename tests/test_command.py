"""Launch commands are plain data: golden per-engine argv/env, the environment allow-list, redaction."""

from __future__ import annotations

from ftkit.command import LaunchInputs, build_launch, describe, forwarded_env
from ftkit.procs import exit_meaning

BASE_ENV = {
    "PATH": "/usr/bin",
    "HOME": "/root",
    "HF_TOKEN": "hf_secret",
    "NCCL_DEBUG": "INFO",
    "AWS_SECRET": "x",
    "RANDOM_VAR": "leak",
    "WANDB_API_KEY": "k",
    "GLOO_SOCKET_IFNAME": "eth0",
}


def _inputs(engine: str, hosts=(("localhost", 2),), **kw) -> LaunchInputs:
    base = dict(
        engine=engine,
        hosts=tuple(hosts),
        master_addr="127.0.0.1",
        master_port=29500,
        run_dir="/r/run",
        attempt=1,
        resume="/r/run/checkpoint-8",
        accelerator="cpu",
        python="/py",
        name="demo",
    )
    base.update(kw)
    return LaunchInputs(**base)


def test_env_is_an_allow_list_with_the_accelerator():
    env = forwarded_env(BASE_ENV, "cpu")
    assert "RANDOM_VAR" not in env and "AWS_SECRET" not in env
    assert env["DS_ACCELERATOR"] == "cpu" and env["OMP_NUM_THREADS"] == "1" and env["NCCL_DEBUG"] == "INFO"
    assert "DS_ACCELERATOR" not in forwarded_env({**BASE_ENV, "DS_ACCELERATOR": "cpu"}, "cuda")


def test_deepspeed_local_golden():
    cmd = build_launch(_inputs("deepspeed"), BASE_ENV)
    (node,) = cmd.nodes
    assert node.argv == (
        "/py",
        "-u",
        "-m",
        "deepspeed.launcher.runner",
        "--hostfile",
        "/r/run/ftkit/attempts/1/hostfile",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        "29500",
        "--no_local_rank",
        "--module",
        "--no_ssh_check",
        "ftkit.launch.train",
        "/r/run",
        "--attempt",
        "1",
        "--resume",
        "/r/run/checkpoint-8",
    )
    assert cmd.files == {"/r/run/ftkit/attempts/1/hostfile": "localhost slots=2\n"}
    text = describe(cmd)
    assert "HF_TOKEN=***" in text and "hf_secret" not in text and "WANDB_API_KEY=***" in text


def test_deepspeed_multinode_uses_pdsh_and_a_fresh_env_file():
    cmd = build_launch(
        _inputs("deepspeed", hosts=(("n0", 1), ("n1", 1)), master_addr="10.0.0.1", ssh_config="/cfg/ssh"), BASE_ENV
    )
    (node,) = cmd.nodes
    assert "--no_ssh_check" in node.argv and ("--launcher", "pdsh") == node.argv[13:15]
    env_file = "/r/run/ftkit/attempts/1/ds_env"
    assert node.env["DS_ENV_FILE"] == env_file and node.env["PDSH_SSH_ARGS_APPEND"] == "-F /cfg/ssh"
    assert "DS_ACCELERATOR=cpu\n" in cmd.files[env_file] and "RANDOM_VAR" not in cmd.files[env_file]
    assert cmd.files["/r/run/ftkit/attempts/1/hostfile"] == "n0 slots=1\nn1 slots=1\n"
    assert "hf_secret" not in describe(cmd)


def test_torchrun_per_host_over_ssh_golden():
    cmd = build_launch(
        _inputs("torchrun", hosts=(("n0", 2), ("n1", 2)), master_addr="10.0.0.1", ssh_config="/cfg/ssh"), BASE_ENV
    )
    n0, n1 = cmd.nodes
    for node, is_host in ((n0, 1), (n1, 0)):
        assert node.remote and node.argv[:7] == (
            "ssh",
            "-o",
            "BatchMode=yes",
            "-o",
            "ConnectTimeout=10",
            "-F",
            "/cfg/ssh",
        )
        remote = node.argv[-1]
        assert remote.startswith("cd /r && exec env ")
        assert (
            f"/py -m torch.distributed.run --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint "
            f"10.0.0.1:29500 --rdzv-id demo-1 --max-restarts 0 --rdzv-conf is_host={is_host} "
            f"--local-addr {node.host} -m ftkit.launch.train /r/run --attempt 1 --resume /r/run/checkpoint-8"
        ) in remote
        assert "DS_ACCELERATOR=cpu" in remote and "RANDOM_VAR" not in remote
    assert "hf_secret" not in describe(cmd) and "HF_TOKEN=***" in describe(cmd)


def test_a_single_remote_host_is_still_remote():
    ds = build_launch(_inputs("deepspeed", hosts=(("n0", 2),), master_addr="10.0.0.1"), BASE_ENV).nodes[0]
    assert "--force_multi" in ds.argv and "pdsh" in ds.argv
    tr = build_launch(_inputs("torchrun", hosts=(("n0", 2),), master_addr="10.0.0.1"), BASE_ENV).nodes[0]
    assert tr.remote and tr.argv[0] == "ssh"


def test_accelerate_machine_ranks():
    cmd = build_launch(_inputs("accelerate", hosts=(("n0", 2), ("n1", 2)), master_addr="10.0.0.1"), BASE_ENV)
    assert [n.argv[-1].split("--machine_rank ")[1].split()[0] for n in cmd.nodes] == ["0", "1"]
    local = build_launch(_inputs("accelerate"), BASE_ENV).nodes[0]
    assert local.argv[:6] == (
        "/py",
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        "/r/run/ftkit/accelerate.yaml",
        "--machine_rank",
    )


def test_exit_meanings():
    assert "SIGKILL" in exit_meaning(247) and "DeepSpeed" in exit_meaning(247)
    assert exit_meaning(-9) == "killed by SIGKILL"
    assert "SIGTERM" in exit_meaning(143)
    assert exit_meaning(1) == "exit 1"
