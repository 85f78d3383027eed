"""`POST /servers` on the launcher's status port: add a server to a running job, or remove one.

    curl -s -X POST -H "Authorization: Bearer $TOKEN" -d '{"add": "http://10.0.0.7:8000"}' \\
        http://127.0.0.1:<status port>/servers
    pipeline-rl fleet add http://10.0.0.7:8000 --run-dir runs/latest      # the same (fleet_cli.py)

An added server must already run (e.g. `pipeline-rl serve --await-weights` with the run's token) and
answer /capabilities; it goes into <run_dir>/fleet.json (pipeline_rl/fleet.py), the trainer admits it at
its next step boundary and pushes it the current weights, and the actors use it once it serves them. A
removed server leaves the list (the trainer takes it out of the weight group, the actors stop sending
to it); a server the launcher started is then stopped, and not restarted. A job keeps at least one.
"""

from __future__ import annotations

import threading
from urllib.parse import urlsplit

import httpx

from pipeline_rl.fleet import read_fleet, write_fleet
from pipeline_rl.launch.processes import stop_all


class ServersChange:
    def __init__(self, launcher) -> None:
        self.launcher = launcher  # pipeline_rl.launch.runner.Launcher
        self._lock = threading.Lock()
        self._retire: set[str] = set()  # urls of launcher-started servers to stop (main thread does it)

    def urls(self) -> list[str]:
        return read_fleet(self.launcher.cfg.run_dir) or list(self.launcher.cfg.inference.urls)

    def handle(self, body: dict) -> tuple[int, dict]:
        """The HTTP answer (status, body) to {"add": URL} or {"remove": URL}."""
        if set(body) not in ({"add"}, {"remove"}) or not isinstance(next(iter(body.values())), str):
            return 400, {"error": "invalid_request", "detail": 'send {"add": URL} or {"remove": URL}'}
        action, url = next(iter(body.items()))
        url = url.rstrip("/")
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.port is None:
            return 422, {"error": "invalid_url", "detail": f"{url!r}: use http://HOST:PORT"}
        with self._lock:
            urls = self.urls()
            if action == "add":
                if url in urls:
                    return 409, {"error": "already_in_job", "detail": url, "servers": urls}
                try:
                    httpx.get(f"{url}/capabilities", timeout=10).raise_for_status()
                except httpx.HTTPError as e:
                    detail = f"{url}/capabilities did not answer ({type(e).__name__}: {e}); start it first"
                    return 422, {"error": "unreachable", "detail": detail}
                urls = [*urls, url]
            else:
                if url not in urls:
                    return 404, {"error": "not_in_job", "detail": url, "servers": urls}
                if len(urls) == 1:
                    return 409, {"error": "last_server", "detail": "a job keeps at least one server"}
                urls = [u for u in urls if u != url]
                self._retire.add(url)
            write_fleet(self.launcher.cfg.run_dir, urls)  # the shared run directory (several hosts)
        print(f"servers of the job: {action} {url} -> {urls}", flush=True)
        return 200, {"servers": urls}

    def retire_removed(self) -> None:
        """Stop (for good) the launcher's own servers that were removed from the job; main thread."""
        with self._lock:
            retire, self._retire = self._retire, set()
        for child in [c for c in self.launcher.children if c.spec.url and c.spec.url.rstrip("/") in retire]:
            self.launcher.children.remove(child)
            stop_all([child], grace_s=self.launcher.cfg.supervision.stop_grace_s)
            print(f"stopped {child.name}: removed from the job", flush=True)


def main(argv: list[str] | None = None) -> None:
    """`pipeline-rl fleet list|add|remove [URL] --run-dir RUN`: the launcher's POST /servers, with the
    status port and token read from the run directory (<run_dir>/status_port, secrets/run.json)."""
    import argparse
    import json
    import os
    import sys
    from pathlib import Path

    parser = argparse.ArgumentParser(prog="pipeline-rl fleet", description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=["list", "add", "remove"])
    parser.add_argument("url", nargs="?", help="the server's base URL (add, remove)")
    parser.add_argument("--run-dir", default="runs/latest", help="the running job's run directory")
    args = parser.parse_args(argv)
    run_dir = Path(args.run_dir)
    if args.action != "list" and not args.url:
        parser.error(f"{args.action} needs a URL")
    try:
        port = int((run_dir / "status_port").read_text())
    except (OSError, ValueError):
        sys.exit(f"no running launcher found: {run_dir / 'status_port'} is missing (is --run-dir right?)")
    token = os.environ.get("PIPELINE_RL_TOKEN")
    secrets = run_dir / "secrets" / "run.json"
    if token is None and secrets.exists():
        token = json.loads(secrets.read_text()).get("inference", {}).get("token")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    base = f"http://127.0.0.1:{port}"
    try:
        if args.action == "list":
            print(json.dumps(httpx.get(f"{base}/status", timeout=30).json()["job_servers"], indent=2))
            return
        answer = httpx.post(f"{base}/servers", json={args.action: args.url}, headers=headers, timeout=30)
    except httpx.HTTPError as e:
        sys.exit(f"the launcher on port {port} did not answer: {e}")
    print(json.dumps(answer.json(), indent=2))
    if answer.status_code != 200:
        sys.exit(1)
