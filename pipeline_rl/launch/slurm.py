"""Start Ray across a SLURM allocation, run `pipeline-rl launch --ray` on it, then stop Ray everywhere.

    sbatch examples/slurm/pipeline-rl-ray.sbatch run_dir=/shared/runs/r1 ...       # the usual way
    python -m pipeline_rl.launch.slurm [--ifname ib0] -- key=value ...              # inside an allocation
    python -m pipeline_rl.launch.slurm --print --nodelist 'gpu[01-02]' --head-ip 10.0.0.1 -- k=v   # review

The allocation becomes one bash script (printed by --print, otherwise written to the state directory and
run), in this order:
  1. `srun -w HEAD ray start --head --block` in the background;
  2. a wait, bounded by --head-timeout, until `ray status` answers at HEAD_IP:PORT;
  3. `srun -w WORKER ray start --address HEAD_IP:PORT --block` in the background, one per other node;
  4. a wait, bounded by --nodes-timeout, until `ray status` counts every node;
  5. the driver, `pipeline-rl launch --ray HEAD_IP:PORT <overrides>`, on the head node; its exit status
     is the script's;
  6. at exit, whatever happened (driver done, a wait's deadline, scancel): Ray stopped on every node,
     the workers first, then the head (Step says how, and why not `ray stop`).
A wait fails at once when a `ray start` step has ended: that step's output, above the error, says why.

The head is the node this runs on (the batch script's node under sbatch), else the first of the list.
Its address is --head-ip, else the IPv4 address of interface --ifname here (on the head), else what
its host name resolves to. Workers take the address of their interface that routes to the head (Ray's own choice), so
choosing the head's network chooses everyone's.

Ray's token authentication: every step runs with RAY_AUTH_MODE=token and RAY_AUTH_TOKEN_PATH naming a
0600 file on SHARED storage (--state-dir, default ~/.pipeline-rl/slurm/<job id>/, in a 0700 directory),
so every node reads the same token without it crossing argv or an environment value. The file is made
once here (`secrets.token_hex`) and removed at exit; --token-file names one of your own instead (kept).
The job's own secrets (PIPELINE_RL_TOKEN, PIPELINE_RL_API_KEY, PIPELINE_RL_REDIS_PASSWORD) reach the
driver through the environment (every srun gets --export=ALL) or are made by the launcher; a key=value
that would put one in argv is refused.

Each `ray start` gets its own --temp-dir (node-local /tmp by default: Ray's sockets, logs under
session_latest/logs), the node's CPUs and GPUs from SLURM_CPUS_ON_NODE / SLURM_GPUS_ON_NODE (the same
count on every node: ask for whole nodes, `#SBATCH --exclusive`; the steps see the node's GPUs when
the job asks for them with --gpus-per-node, which srun inherits), and an object store capped at
--object-store-gb (the job moves weights over NCCL/gloo and samples through Redis, so Ray's default of
30% of RAM would only take memory from the trainer and the engines).
"""

from __future__ import annotations

import argparse
import fcntl
import itertools
import os
import re
import secrets
import shlex
import socket
import struct
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

DEFAULT_PORT = 6379
OBJECT_STORE_CAP_GB = 8.0
HEAD_DEADLINE_S = 180  # the first `ray start` on a cold shared filesystem imports for a minute
NODES_DEADLINE_S = 300
STOP_DEADLINE_S = 60  # a node's drain on SIGTERM (Ray gives it 30 s) and the end of its processes
POLL_S = 5.0
MAX_HOSTS = 100_000
# Ray puts Unix sockets at <temp dir>/session_<date>_<pid>/sockets/plasma_store, and a socket path
# holds at most 107 bytes: 63 of them are Ray's.
MAX_TEMP_DIR = 44
_NAME = re.compile(r"[A-Za-z0-9._-]+")
_RANGE = re.compile(r"(\d+)(?:-(\d+))?")


def parse_nodelist(nodelist: str | Sequence[str]) -> list[str]:
    """Host names of a SLURM nodelist, in order: 'gpu[01-03,07],cpu5' -> gpu01 gpu02 gpu03 gpu07 cpu5.

    Zero padding follows the range's first number ('n[098-101]' -> n098 ... n101); several bracket
    groups expand in order ('r[1-2]-n[1-2]' -> r1-n1 r1-n2 r2-n1 r2-n2). A sequence is a list of such
    nodelists (plain host names included). Raises ValueError on anything else, or a host named twice.
    """
    items = [nodelist] if isinstance(nodelist, str) else list(nodelist)
    hosts: list[str] = []
    for item in items:
        if not item.strip():
            raise ValueError("empty nodelist: no host to start Ray on")
        for part in _split_top(item.strip(), item):
            hosts += _expand(part, item)
            if len(hosts) > MAX_HOSTS:
                raise ValueError(f"nodelist {item!r} names more than {MAX_HOSTS} hosts")
    if not hosts:
        raise ValueError("empty nodelist: no host to start Ray on")
    twice = sorted({h for h in hosts if hosts.count(h) > 1})
    if twice:
        raise ValueError(f"nodelist names {', '.join(twice)} more than once")
    return hosts


def _split_top(text: str, whole: str) -> list[str]:
    """`text` cut at its commas outside brackets."""
    parts, start, depth = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "[]":
            depth += 1 if ch == "[" else -1
            if depth not in (0, 1):
                raise ValueError(f"nodelist {whole!r}: unbalanced or nested brackets")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"nodelist {whole!r}: a '[' is never closed")
    parts.append(text[start:])
    if any(not p for p in parts):
        raise ValueError(f"nodelist {whole!r}: empty host name (stray comma?)")
    return parts


def _expand(part: str, whole: str) -> list[str]:
    pieces: list[list[str]] = []
    for m in re.finditer(r"\[([^\]]*)\]|[^\[]+", part):
        if m.group(1) is None:
            if not _NAME.fullmatch(m.group(0)):
                raise ValueError(f"nodelist {whole!r}: {m.group(0)!r} is not a host name")
            pieces.append([m.group(0)])
        else:
            pieces.append(_numbers(m.group(1), whole))
    return ["".join(p) for p in itertools.product(*pieces)]


def _numbers(ranges: str, whole: str) -> list[str]:
    out: list[str] = []
    for r in ranges.split(","):
        m = _RANGE.fullmatch(r)
        if not m:
            raise ValueError(f"nodelist {whole!r}: [{ranges}] holds {r!r}, not N or N-M")
        lo, hi = int(m[1]), int(m[2] if m[2] is not None else m[1])
        if hi < lo:
            raise ValueError(f"nodelist {whole!r}: range {r!r} runs backwards")
        if hi - lo >= MAX_HOSTS:
            raise ValueError(f"nodelist {whole!r} names more than {MAX_HOSTS} hosts")
        out += [str(n).zfill(len(m[1])) for n in range(lo, hi + 1)]
    return out


@dataclass(frozen=True)
class Allocation:
    """What the SLURM environment says about the job's nodes."""

    job_id: str
    hosts: tuple[str, ...]  # the head first: the node this runs on if it is one of them
    cpus_per_node: int | None
    gpus_per_node: int | None
    mem_per_node_mb: int | None


def allocation(env: Mapping[str, str], nodelist: str | Sequence[str] | None = None) -> Allocation:
    """The allocation described by `env` (os.environ inside sbatch/salloc); `nodelist` replaces
    SLURM_JOB_NODELIST (for --print away from an allocation)."""
    nodes = nodelist if nodelist is not None else env.get("SLURM_JOB_NODELIST")
    if not nodes:
        raise ValueError("no SLURM_JOB_NODELIST: run inside sbatch/salloc, or give --nodelist with --print")
    hosts = parse_nodelist(nodes)
    here = env.get("SLURMD_NODENAME")
    head = here if here in hosts else hosts[0]
    return Allocation(
        job_id=env.get("SLURM_JOB_ID", "local"),
        hosts=(head, *(h for h in hosts if h != head)),
        cpus_per_node=_int_env(env, "SLURM_CPUS_ON_NODE"),
        gpus_per_node=_int_env(env, "SLURM_GPUS_ON_NODE"),
        mem_per_node_mb=_int_env(env, "SLURM_MEM_PER_NODE"),
    )


def _int_env(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name)
    if value is None or value == "":
        return None
    if not value.isdigit():
        raise ValueError(f"${name}={value!r} is not a count")
    return int(value)


def object_store_bytes(mem_per_node_mb: int | None, cap_gb: float = OBJECT_STORE_CAP_GB) -> int:
    """The object store of each node: `cap_gb`, or Ray's 30% of the node's SLURM memory if less."""
    cap = int(cap_gb * 2**30)
    return cap if mem_per_node_mb is None else min(cap, int(mem_per_node_mb * 2**20 * 0.3))


@dataclass(frozen=True)
class Step:
    """One step of the script, for node `host`.

    start: `argv` in the background for the job's life (the srun step of `ray start --block`).
    wait:  `argv` re-run every few seconds until it succeeds; after `deadline_s`, or as soon as a start
           step has ended, the script fails with `hint`.
    run:   `argv` in the foreground; its exit status ends the script.
    stop:  (no argv) at exit, whatever happened: SIGTERM to `host`'s start step, SIGKILL after
           `deadline_s`. srun passes the signal on, and `ray start --block` drains its node and ends
           that node's Ray processes and no one else's (`ray stop` ends every Ray process it may
           signal on the machine, another job's too). All stop steps but the last go together, then
           the last: the head, whose GCS the others' drain asks.
    """

    kind: Literal["start", "wait", "run", "stop"]
    host: str
    argv: tuple[str, ...]
    what: str
    deadline_s: int | None = None
    hint: str = ""


def _srun(host: str, cpus: int | None = None) -> tuple[str, ...]:
    # --overlap: the waits and the driver run beside the `ray start` steps, which hold the node's
    # resources for the whole job. --export=ALL: sbatch --export=NONE would otherwise leave the steps
    # without PATH and the Ray token's variables. --cpus-per-task: srun no longer inherits sbatch's.
    cpu = (f"--cpus-per-task={cpus}",) if cpus else ()
    return ("srun", "--nodes=1", "--ntasks=1", "--overlap", "--export=ALL", *cpu, "-w", host)


def ray_commands(
    hosts: Sequence[str],
    head_ip: str,
    overrides: Sequence[str] = (),
    *,
    port: int = DEFAULT_PORT,
    num_cpus: int | None = None,
    num_gpus: int | None = None,
    object_store: int = int(OBJECT_STORE_CAP_GB * 2**30),
    temp_root: str = "/tmp",
    job_id: str = "local",
    head_deadline_s: int = HEAD_DEADLINE_S,
    nodes_deadline_s: int = NODES_DEADLINE_S,
) -> list[Step]:
    """The script's steps for Ray on `hosts` (the head first, at `head_ip`), then the driver with
    `overrides` passed through as they are. `num_cpus`/`num_gpus` None: Ray counts the machine's."""
    address = f"{head_ip}:{port}"
    head, workers = hosts[0], list(hosts[1:])
    for host in hosts:
        if not _NAME.fullmatch(host):
            raise ValueError(f"{host!r} is not a host name")

    temp_dir = {h: f"{temp_root.rstrip('/')}/ray-{job_id}-{h}" for h in hosts}
    for path in temp_dir.values():
        if len(path) > MAX_TEMP_DIR:
            raise ValueError(
                f"Ray's temp dir {path} is over {MAX_TEMP_DIR} characters: its Unix sockets would not "
                "fit the 107 bytes of a socket path; choose a shorter --temp-root"
            )

    def node(host: str) -> tuple[str, ...]:
        resources = [f"--num-cpus={num_cpus}"] if num_cpus is not None else []
        resources += [f"--num-gpus={num_gpus}"] if num_gpus is not None else []
        return (f"--temp-dir={temp_dir[host]}", f"--object-store-memory={object_store}", *resources)

    def check(n: int) -> tuple[str, ...]:
        checker = ("python", "-m", "pipeline_rl.launch.slurm", "--check-nodes", str(n), "--address", address)
        return (*_srun(head), *checker)

    head_start = ("ray", "start", "--head", f"--node-ip-address={head_ip}", f"--port={port}")
    steps = [
        Step(
            "start",
            head,
            (*_srun(head, num_cpus), *head_start, f"--dashboard-host={head_ip}", *node(head),
             "--disable-usage-stats", "--block"),
            f"start the Ray head on {head} at {address}",
        ),
        Step(
            "wait",
            head,
            check(1),
            f"wait for the Ray head at {address}",
            head_deadline_s,
            f"Read the head's output above and its logs on {head} ({temp_dir[head]}/session_latest/logs); "
            "'address already in use' means another Ray there: pass --port, or ask for whole nodes.",
        ),
    ]  # fmt: skip
    for w in workers:
        argv = ("ray", "start", f"--address={address}", *node(w), "--disable-usage-stats", "--block")
        steps.append(Step("start", w, (*_srun(w, num_cpus), *argv), f"start a Ray worker on {w}"))
    if workers:
        steps.append(
            Step(
                "wait",
                head,
                check(len(hosts)),
                f"wait for all {len(hosts)} Ray nodes",
                nodes_deadline_s,
                f"A worker that cannot reach {address} (a firewall; another network: choose it with "
                "--ifname or --head-ip) or read RAY_AUTH_TOKEN_PATH (--state-dir must be shared "
                "storage) says so in its output above.",
            )
        )
    driver = ("pipeline-rl", "launch", "--ray", address, *overrides)
    steps.append(Step("run", head, (*_srun(head, num_cpus), *driver), f"run pipeline-rl on Ray at {address}"))
    steps += [Step("stop", h, (), f"stop Ray on {h}", STOP_DEADLINE_S) for h in [*workers, head]]
    return steps


def ray_env(token_path: str, ifname: str | None = None) -> dict[str, str]:
    """The environment every step runs with (exported by the script, passed on by srun)."""
    env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": token_path}
    if ifname:  # gloo and NCCL otherwise pick their interface from the host name, often another network
        env |= {"GLOO_SOCKET_IFNAME": ifname, "NCCL_SOCKET_IFNAME": ifname}
    return env


_FUNCTIONS = r"""declare -A started=()  # host -> pid of its `ray start --block` srun step

# wait_for SECONDS WHAT HINT COMMAND...: re-run COMMAND until it succeeds, for at most SECONDS
wait_for() {
  local limit=$1 what=$2 hint=$3 out pid
  shift 3
  local deadline=$((SECONDS + limit))
  until out=$("$@" 2>&1); do
    for pid in "${started[@]}"; do
      if ! kill -0 "$pid" 2>/dev/null; then
        printf 'error: %s: a `ray start` step ended; its output above says why\n' "$what" >&2
        exit 1
      fi
    done
    if ((SECONDS >= deadline)); then
      printf 'error: %s: gave up after %ss. %s\nThe last check said: %s\n' "$what" "$limit" "$hint" "$out" >&2
      exit 1
    fi
    sleep @POLL@
  done
}

# stop_ray SECONDS PID...: SIGTERM, then SIGKILL to those still there after SECONDS
stop_ray() {
  local limit=$1 pids=() pid
  shift
  for pid in "$@"; do [[ -n $pid ]] && pids+=("$pid"); done
  ((${#pids[@]})) || return 0
  kill -TERM "${pids[@]}" 2>/dev/null
  local deadline=$((SECONDS + limit))
  while kill -0 "${pids[@]}" 2>/dev/null; do
    if ((SECONDS >= deadline)); then
      echo "warning: Ray did not stop within ${limit}s; killing its srun step" >&2
      kill -KILL "${pids[@]}" 2>/dev/null
      return 0
    fi
    sleep @STOP_POLL@
  done
}
"""


def render_script(
    steps: Sequence[Step],
    env: Mapping[str, str],
    *,
    bin_dir: str,
    poll_s: float = POLL_S,
    remove_at_exit: Sequence[str] = (),
) -> str:
    """The bash script that runs `steps` with `env` exported and `bin_dir` first on PATH (the venv of
    `ray`, `python` and `pipeline-rl`); `remove_at_exit`: files deleted once every node has stopped."""
    q = shlex.quote

    def stop_line(group: Sequence[Step]) -> str:
        if not group:
            return ""
        pids = " ".join(f'"${{started[{q(s.host)}]:-}}"' for s in group)
        return f"  stop_ray {max(s.deadline_s or 0 for s in group)} {pids}"

    stops = [s for s in steps if s.kind == "stop"]
    lines = [
        "#!/usr/bin/env bash",
        "# Ray across a SLURM allocation, then pipeline-rl on it (python -m pipeline_rl.launch.slurm).",
        "# No secret here: the Ray token is in the 0600 file that RAY_AUTH_TOKEN_PATH names.",
        "set -uo pipefail",
        f'export PATH={q(bin_dir)}:"$PATH"',
        "export " + " ".join(f"{k}={q(v)}" for k, v in env.items()),
        _FUNCTIONS.replace("@POLL@", f"{poll_s:g}").replace("@STOP_POLL@", f"{min(poll_s, 0.2):g}"),
        "cleanup() {",
        "  local rc=$?",
        "  trap - EXIT INT TERM",
        "  echo '== stop Ray on every node' >&2",
        *filter(None, [stop_line(stops[:-1]), stop_line(stops[-1:])]),
        *[f"  rm -f -- {q(path)}" for path in remove_at_exit],
        '  exit "$rc"',
        "}",
        "trap cleanup EXIT",
        "trap 'exit 143' TERM",
        "trap 'exit 130' INT",
        "",
    ]
    for step in steps:
        cmd = " ".join(map(q, step.argv))
        if step.kind != "stop":
            lines.append(f"echo {q('== ' + step.what)} >&2")
        if step.kind == "start":
            lines.append(f"{cmd} & started[{q(step.host)}]=$!")
        elif step.kind == "wait":
            lines.append(f"wait_for {step.deadline_s} {q(step.what)} {q(step.hint)} {cmd}")
        elif step.kind == "run":
            lines.append(f"{cmd} || exit $?")
    return "\n".join(lines) + "\n"


def active_nodes(status: str) -> int:
    """Nodes that `ray status` lists as active or idle (the rest are pending or failed)."""
    count, section = 0, ""
    for line in status.splitlines():
        if line and not line.startswith(" "):
            section = line.strip()
        elif section in ("Active:", "Idle:") and (m := re.fullmatch(r" (\d+) \S+", line)):
            count += int(m[1])
    return count


def check_nodes(address: str, want: int, timeout_s: float = 60.0) -> int:
    """Exit status 0 when the Ray cluster at `address` counts at least `want` nodes; 1 (and why) if not."""
    try:
        proc = subprocess.run(
            ["ray", "status", "--address", address], capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired:
        print(f"`ray status --address {address}` did not answer within {timeout_s:g}s")
        return 1
    except OSError as e:
        print(f"cannot run `ray status`: {e} (is the venv's bin directory on PATH?)")
        return 1
    if proc.returncode != 0:
        print(f"`ray status` exited {proc.returncode}: {(proc.stderr or proc.stdout).strip()[-400:]}")
        return 1
    have = active_nodes(proc.stdout)
    if have < want:
        print(f"{have} of {want} Ray nodes up")
        return 1
    return 0


def interface_ip(ifname: str) -> str:
    """The IPv4 address of network interface `ifname` on this machine (Linux)."""
    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), siocgifaddr, struct.pack("256s", ifname.encode()[:15]))
        except OSError:
            names = ", ".join(name for _, name in socket.if_nameindex())
            raise ValueError(
                f"interface {ifname!r} has no IPv4 address on {socket.gethostname()} (interfaces: {names})"
            ) from None
    return socket.inet_ntoa(packed[20:24])


def write_token(path: Path) -> None:
    """A new Ray token in `path` (mode 0600 from creation; its directory 0700)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    path.parent.chmod(0o700)
    path.unlink(missing_ok=True)  # a requeued job keeps its id: a stale token of the same name
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))


def _head_ip(args: argparse.Namespace, head: str, env: Mapping[str, str]) -> str:
    if args.head_ip:
        try:
            return socket.gethostbyname(args.head_ip)  # an IP comes back as it is
        except OSError:
            raise ValueError(f"--head-ip {args.head_ip} does not resolve here") from None
    if args.ifname:
        if env.get("SLURMD_NODENAME") != head:
            raise ValueError(f"--ifname reads the interface here, not on the head {head}: give --head-ip")
        return interface_ip(args.ifname)
    try:
        return socket.gethostbyname(head)
    except OSError:
        raise ValueError(f"host name {head} does not resolve here: give --head-ip or --ifname") from None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pipeline_rl.launch.slurm",
        description="Start Ray across this SLURM allocation and run `pipeline-rl launch --ray` on it. "
        "Everything after -- goes to pipeline-rl launch.",
    )
    p.add_argument("--print", action="store_true", help="print the script instead of running it")
    p.add_argument("--nodelist", help="hosts (SLURM syntax, e.g. 'gpu[01-04]'); default $SLURM_JOB_NODELIST")
    p.add_argument("--head-ip", help="the head's address (IP or host name) on the cluster network")
    p.add_argument("--ifname", help="the cluster network's interface: the head's address is its IPv4")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="the head's GCS port")
    p.add_argument("--num-cpus", type=int, help="CPUs per node for Ray; default $SLURM_CPUS_ON_NODE")
    p.add_argument("--num-gpus", type=int, help="GPUs per node for Ray; default $SLURM_GPUS_ON_NODE")
    p.add_argument(
        "--object-store-gb", type=float, default=OBJECT_STORE_CAP_GB, help="object store cap per node"
    )
    p.add_argument("--temp-root", default="/tmp", help="node-local directory for Ray's per-node temp dir")
    p.add_argument(
        "--state-dir", help="shared directory for the token and script; default ~/.pipeline-rl/slurm/<job>"
    )
    p.add_argument("--token-file", help="an existing 0600 Ray token file on shared storage (kept at exit)")
    p.add_argument("--head-timeout", type=int, default=HEAD_DEADLINE_S, help="seconds for the head to answer")
    p.add_argument(
        "--nodes-timeout", type=int, default=NODES_DEADLINE_S, help="seconds for every node to join"
    )
    p.add_argument("--check-nodes", type=int, help=argparse.SUPPRESS)  # the script's waits
    p.add_argument("--address", help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    args, overrides = _parser().parse_args(argv[:cut]), argv[cut + 1 :]
    try:
        if args.check_nodes is not None:
            if not args.address:
                raise ValueError("--check-nodes needs --address HOST:PORT")
            sys.exit(check_nodes(args.address, args.check_nodes))
        from pipeline_rl.launch.cluster import public_secrets  # not at import: the node checker stays light

        problems = public_secrets(list(overrides))
        if problems:
            raise ValueError("; ".join(problems))
        alloc = allocation(os.environ, args.nodelist)
        head_ip = _head_ip(args, alloc.hosts[0], os.environ)
        state_dir = Path(args.state_dir or Path.home() / ".pipeline-rl" / "slurm" / alloc.job_id).absolute()
        token = Path(args.token_file).absolute() if args.token_file else state_dir / "ray_token"
        steps = ray_commands(
            alloc.hosts,
            head_ip,
            overrides,
            port=args.port,
            num_cpus=args.num_cpus if args.num_cpus is not None else alloc.cpus_per_node,
            num_gpus=args.num_gpus if args.num_gpus is not None else alloc.gpus_per_node,
            object_store=object_store_bytes(alloc.mem_per_node_mb, args.object_store_gb),
            temp_root=args.temp_root,
            job_id=alloc.job_id,
            head_deadline_s=args.head_timeout,
            nodes_deadline_s=args.nodes_timeout,
        )
        script = render_script(
            steps,
            ray_env(str(token), args.ifname),
            bin_dir=str(Path(sys.executable).parent),
            remove_at_exit=() if args.token_file else (str(token),),
        )
        if args.print:
            print(script, end="")
            return
        if args.token_file:
            if not token.is_file() or token.stat().st_mode & 0o077:
                raise ValueError(f"--token-file {token}: must be a file only you can read (chmod 600)")
        else:
            write_token(token)
    except ValueError as e:
        sys.exit(f"error: {e}")
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = state_dir / "ray_job.sh"
    path.write_text(script)
    print(
        f"{len(alloc.hosts)} node(s), head {alloc.hosts[0]} at {head_ip}:{args.port}; running {path}",
        file=sys.stderr,
    )
    os.execvp("bash", ["bash", str(path)])


if __name__ == "__main__":
    main()
