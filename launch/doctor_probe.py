"""What ``ftkit doctor`` runs on every host (``python -m ftkit.launch.doctor_probe facts|rendezvous ...``).

``facts`` (standard library only, well under a second): versions, GPU model and driver (cuda), free space in the
run directory, /dev/shm size and free space, this host's clock, the network interface the collectives will use
and whether it exists here, torch extension build locks (``ftkit.cluster.buildlocks``), and what DeepSpeed's
compiled ops need here (``ftkit.cluster.toolchain``). With
``--release-dead-batons`` (the launch's preflight) it first removes the locks a killed rank of the run left here
(``ftkit.rundir.batons``).

``rendezvous``: a real ``torch.distributed`` rendezvous and all-reduce across all hosts with the engine's backend
(gloo on cpu, nccl on cuda), one process per host, bounded by ``--timeout``: rank 0 serves a TCPStore on
``--master-addr:--port``; every rank records ``joined/<rank>`` there, or ``error/<rank>`` when it fails, so rank 0
can name the hosts that never joined and why, and every rank stops early as soon as any rank reports an error.
``--bandwidth`` then times all-reduce for a few sizes across all hosts and between every pair of hosts.

Each prints one line ``FTKIT_DOCTOR {json}`` last on stdout (libraries may print before it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time

from ftkit.cluster.buildlocks import lock_states
from ftkit.cluster.pkgversions import versions
from ftkit.cluster.toolchain import toolchain_facts
from ftkit.rundir.batons import release_dead
from ftkit.rundir.layout import RunDir

MARK = "FTKIT_DOCTOR "


def _emit(obj: dict[str, object]) -> None:
    sys.stdout.write(MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


def _disk(path: str) -> dict[str, object]:
    p = path
    while p and not os.path.exists(p):  # the run directory may not exist yet: its nearest existing parent
        p = os.path.dirname(p.rstrip("/")) or "/"
        if p == "/":
            break
    try:
        u = shutil.disk_usage(p or "/")
        return {"path": p, "free": u.free, "total": u.total}
    except OSError as e:
        return {"path": p, "error": e.strerror or str(e)}


def _gpus() -> dict[str, object]:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return {"error": "nvidia-smi not found"}
    try:
        out = subprocess.run(
            [exe, "--query-gpu=name,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"error": f"nvidia-smi failed: {e}"}
    if out.returncode != 0:
        return {"error": (out.stderr or out.stdout).strip() or f"nvidia-smi exit {out.returncode}"}
    rows = [[c.strip() for c in line.split(",", 1)] for line in out.stdout.splitlines() if line.strip()]
    return {"count": len(rows), "models": sorted({r[0] for r in rows}), "drivers": sorted({r[-1] for r in rows})}


def _route_dev(addr: str) -> dict[str, object]:
    """The interface (and source address) the kernel routes ``addr`` through here."""
    out: dict[str, object] = {}
    try:
        infos = socket.getaddrinfo(addr, 1, socket.AF_INET, socket.SOCK_DGRAM)
        ip = str(infos[0][4][0])  # AF_INET: (address, port)
    except (OSError, UnicodeError) as e:
        return {"error": f"{addr} does not resolve here: {getattr(e, 'strerror', None) or e}"}
    out["ip"] = ip
    exe = shutil.which("ip") or ("/usr/sbin/ip" if os.path.exists("/usr/sbin/ip") else None)
    if exe:
        try:
            r = subprocess.run([exe, "-o", "route", "get", ip], capture_output=True, text=True, timeout=5)
            words = r.stdout.split()
            if "dev" in words:
                out["dev"] = words[words.index("dev") + 1]
            elif r.returncode != 0:
                out["error"] = f"no route to {addr} ({ip}): {r.stderr.strip()}"
        except (OSError, subprocess.TimeoutExpired):
            pass
    return out


def facts(args: argparse.Namespace) -> dict[str, object]:

    # the launch's preflight: the locks a killed rank of this run left here go first (ftkit.rundir.batons)
    released = release_dead(RunDir(args.run_dir).batons) if args.release_dead_batons else []
    shm = _disk("/dev/shm") if os.path.isdir("/dev/shm") else {"error": "no /dev/shm"}
    names = sorted(name for _, name in socket.if_nameindex())
    var = "NCCL_SOCKET_IFNAME" if args.accelerator == "cuda" else "GLOO_SOCKET_IFNAME"
    out = {
        "hostname": socket.gethostname(),
        "python_exe": sys.executable,
        "versions": versions(),
        "run_dir": _disk(args.run_dir),
        "shm": shm,
        "interfaces": names,
        "ifname_var": var,
        "ifname": os.environ.get(var),
        "route": _route_dev(args.master_addr),
        "locks": [{"path": str(p), "holder": pid} for p, pid in lock_states()],
        "locks_released": released,
        "toolchain": toolchain_facts(),  # DeepSpeed's compiled ops: prebuilt, or what a build needs here
    }
    if args.accelerator == "cuda":
        out["gpu"] = _gpus()
    out["time"] = time.time()  # last: the controller compares it with its own clock on receipt
    return out


# --------------------------------------------------------------------------------------------- rendezvous


def _busbw(nbytes: int, seconds: float, n: int) -> float:
    """NCCL's all-reduce bus bandwidth in GB/s: algorithm bandwidth x 2(n-1)/n."""
    return nbytes / seconds * (2 * (n - 1) / n) / 1e9 if seconds > 0 and n > 1 else 0.0


def _time_allreduce(dist, torch, t, group, iters: int, sync) -> float:
    dist.all_reduce(t, group=group)  # warm-up (connection set-up, allocation)
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(t, group=group)
    sync()
    return (time.perf_counter() - t0) / iters


def _collective(args: argparse.Namespace, store, result: dict[str, object]) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=args.timeout)
    cuda = args.backend == "nccl"
    if cuda:
        torch.cuda.set_device(0)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    t0 = time.monotonic()
    dist.init_process_group(args.backend, store=store, rank=args.rank, world_size=args.world, timeout=timeout)
    x = torch.ones(4, device=device) * (args.rank + 1)
    dist.all_reduce(x)
    sync()
    want = args.world * (args.world + 1) / 2
    result["allreduce_s"] = time.monotonic() - t0
    if float(x[0]) != want:
        raise RuntimeError(f"all-reduce returned {float(x[0])}, expected {want}")
    if args.bandwidth:
        rows = []
        for mib in args.sizes_mib:
            t = torch.ones(mib * 2**18, dtype=torch.float32, device=device)  # mib MiB of float32
            s = _time_allreduce(dist, torch, t, None, args.iters, sync)
            rows.append({"bytes": t.numel() * 4, "seconds": s, "busbw_gbs": _busbw(t.numel() * 4, s, args.world)})
        result["all"] = rows
        pairs = []
        if args.world > 2:
            mib = args.pair_mib
            t = torch.ones(mib * 2**18, dtype=torch.float32, device=device)
            for i in range(args.world):
                for j in range(i + 1, args.world):
                    g = dist.new_group([i, j])  # every rank creates every group, in the same order
                    if args.rank in (i, j):
                        s = _time_allreduce(dist, torch, t, g, args.iters, sync)
                        if args.rank == i:
                            pairs.append(
                                {
                                    "ranks": [i, j],
                                    "bytes": t.numel() * 4,
                                    "seconds": s,
                                    "busbw_gbs": _busbw(t.numel() * 4, s, 2),
                                }
                            )
                    dist.barrier()
        result["pairs"] = pairs
    dist.barrier()
    dist.destroy_process_group()


def rendezvous(args: argparse.Namespace) -> dict[str, object]:
    result: dict[str, object] = {"rank": args.rank, "world": args.world, "ok": False}
    t_start = time.monotonic()
    try:
        import datetime

        import torch.distributed as dist
    except Exception as e:  # a broken or different torch on this host
        result["stage"] = "import"
        result["error"] = f"import torch.distributed failed: {type(e).__name__}: {e}"
        return result
    timeout = datetime.timedelta(seconds=args.timeout)
    try:
        store = dist.TCPStore(
            args.master_addr, args.port, args.world, is_master=args.rank == 0, timeout=timeout, wait_for_workers=False
        )
    except Exception as e:
        result["stage"] = "store"
        where = "serve" if args.rank == 0 else "reach"
        result["error"] = f"cannot {where} the rendezvous at {args.master_addr}:{args.port}: {_short(e)}"
        return result
    store.set(f"joined/{args.rank}", socket.gethostname())
    # The collective's thread blocks in store gets (gloo's address exchange, up to the timeout) and a store client
    # serves one request at a time: this thread watches for peers' errors on a connection of its own, or it would
    # learn of a failed peer only when the collective times out (and then report its own timeout as a cause).
    try:
        watch = dist.TCPStore(args.master_addr, args.port, args.world, is_master=False, timeout=timeout)
    except Exception:  # noqa: BLE001 - the store's host went away already: the collective will say so
        watch = store
    box: dict[str, object] = {}

    def work() -> None:
        try:
            _collective(args, store, result)
            box["done"] = True
        except Exception as e:  # noqa: BLE001 - reported, not raised: this is a probe
            box["error"] = _short(e)

    th = threading.Thread(target=work, daemon=True)
    th.start()
    end = t_start + args.timeout + (args.bandwidth_budget if args.bandwidth else 0)
    others: dict[int, str] = {}
    polling = True
    while th.is_alive() and time.monotonic() < end:
        th.join(0.2)
        if not polling:
            continue
        try:  # a peer that failed: stop waiting for it now, not at the timeout
            for r in range(args.world):
                if r != args.rank and r not in others and watch.check([f"error/{r}"]):
                    others[r] = watch.get(f"error/{r}").decode(errors="replace")
        except Exception:  # noqa: BLE001 - the store's host went away: the collective will say so
            polling = False
        if others:
            break
    if box.get("done"):
        result["ok"] = True
        try:  # rank 0 serves the store: it leaves only when every rank is done with it (bounded)
            watch.set(f"done/{args.rank}", "1")
            if args.rank == 0:
                until = time.monotonic() + 10
                while time.monotonic() < until and not watch.check([f"done/{r}" for r in range(args.world)]):
                    time.sleep(0.05)
        except Exception:  # noqa: BLE001
            pass
    else:
        result["stage"] = "collective"
        error = str(
            box.get("error")
            or ("peer(s) failed first" if others else f"timed out after {args.timeout:g}s in the collective")
        )
        result["error"] = error
        try:
            watch.set(f"error/{args.rank}", error)
        except Exception:  # noqa: BLE001
            pass
    if args.rank == 0 or others:
        missing = []
        for r in range(args.world):
            try:
                if not watch.check([f"joined/{r}"]):
                    missing.append(r)
            except Exception:  # noqa: BLE001
                break
        result["missing"] = missing
    result["peer_errors"] = {str(r): m for r, m in others.items()}
    result["seconds"] = time.monotonic() - t_start
    return result


def _short(e: BaseException) -> str:
    """An exception as one line, torch's C++ frames and hints cut."""
    text = " ".join(str(e).split("\n")[0:2]).strip()
    cut = text.find("Exception raised from")
    if cut > 0:
        text = text[:cut].strip()
    return f"{type(e).__name__}: {text}"[:400]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ftkit.launch.doctor_probe")
    sub = ap.add_subparsers(dest="what", required=True)
    f = sub.add_parser("facts")
    f.add_argument("--run-dir", required=True)
    f.add_argument("--master-addr", required=True)
    f.add_argument("--accelerator", default="cpu")
    f.add_argument("--release-dead-batons", action="store_true")
    r = sub.add_parser("rendezvous")
    r.add_argument("--rank", type=int, required=True)
    r.add_argument("--world", type=int, required=True)
    r.add_argument("--master-addr", required=True)
    r.add_argument("--port", type=int, required=True)
    r.add_argument("--backend", default="gloo")
    r.add_argument("--timeout", type=float, default=10.0)
    r.add_argument("--bandwidth", action="store_true")
    r.add_argument("--sizes-mib", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    r.add_argument("--pair-mib", type=int, default=8)
    r.add_argument("--iters", type=int, default=3)
    r.add_argument("--bandwidth-budget", type=float, default=60.0)
    args = ap.parse_args(argv)
    out = facts(args) if args.what == "facts" else rendezvous(args)
    _emit(out)
    # A daemon thread may still sit in a collective: leave without joining it (or running torch's atexit hooks).
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
