"""What one Prometheus scrape of `vgpu serve`'s /metrics costs when one caller has filled the node
with applications.

    python bench/metrics_scrape.py --json                      # N = 0, 4096 apps
    python bench/metrics_scrape.py --n 0 100 4096 --scrapes 20 --json
    python bench/metrics_scrape.py --n 4096 --set metrics.max_apps=5000 --json   # cap above N

What runs. `vgpu serve --backend sim:h100-80gb` as a child process on a temporary state directory.
For each N, on a fresh daemon: N applications are created the way an anonymous caller of the socket
creates them (one 1 MiB `RequestResourceAllocation` each, under an application id nobody owns yet,
no token: self-registration), with no profiler attached. Then /metrics is fetched `--scrapes` times
over HTTP, one after the other, as Prometheus would. Printed, per N:

    {"n", "apps_created", "scrape_p50_ms", "scrape_max_ms", "body_bytes", "series", "app_series",
     "apps_listed", "apps_unlisted"}

`series` counts every sample line, `app_series` those of `vgpu_app_*` families, `apps_listed` the
distinct `app` labels among them and `apps_unlisted` the sum of `vgpu_device_apps_unlisted` (absent
on a daemon without that gauge: null). `--set KEY=VALUE` passes settings to the daemon as
`VGPU_SECTION_KEY` variables. No figure is tuned here; on a slow or shared machine, say so.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from vgpu.v1 import allocator_pb2 as pb  # noqa: E402
from vgpu.v1 import allocator_pb2_grpc as pb_grpc  # noqa: E402


def _wait_serving(log_path: Path, proc: subprocess.Popen[bytes], timeout_s: float = 60.0) -> int:
    """The metrics port the daemon bound (`--metrics-port auto`), once its `serving` record says it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in log_path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # a line still being written
                continue
            if record.get("event") == "serving":
                return int(record["metrics"].rpartition(":")[2])
        if proc.poll() is not None:
            raise SystemExit(f"vgpu serve exited {proc.returncode}:\n{log_path.read_text()}")
        time.sleep(0.05)
    raise SystemExit(f"vgpu serve did not serve within {timeout_s} s:\n{log_path.read_text()}")


def scrape(port: int) -> tuple[float, bytes]:
    t0 = time.perf_counter()
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60).read()
    return time.perf_counter() - t0, bytes(body)


def run_one(n: int, scrapes: int, settings: dict[str, str]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="vgpu-metrics-bench-") as tmp_text:
        tmp = Path(tmp_text)
        sock, log_path = tmp / "vgpu.sock", tmp / "serve.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("VGPU_")}
        env.update({"PYTHONPATH": str(ROOT), "XDG_CONFIG_HOME": str(tmp / "cfg")})
        env.update({"VGPU_" + k.replace(".", "_").upper(): v for k, v in settings.items()})
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "vgpu.cli", "serve", "--socket", str(sock), "--state-dir", str(tmp / "state"),
                 "--backend", "sim:h100-80gb", "--metrics-port", "auto"],
                cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=log,
            )
        try:
            port = _wait_serving(log_path, proc)
            channel = grpc.insecure_channel(f"unix:{sock}")
            stub = pb_grpc.AllocatorStub(channel)
            created = 0
            for i in range(n):
                try:
                    stub.RequestResourceAllocation(pb.RequestResourceAllocationRequest(
                        request=pb.ResourceRequest(app_id=f"flood-{i:05d}", memory_mib=1.0)), timeout=30)
                    created += 1
                except grpc.RpcError as exc:
                    if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                        raise
                    break  # a quota of the daemon: as many as it takes
            channel.close()
            scrape(port)  # a first scrape, not timed: the HTTP server's thread and imports warm up
            times, body = [], b""
            for _ in range(scrapes):
                dt, body = scrape(port)
                times.append(dt)
            series = app_series = 0
            listed: set[str] = set()
            unlisted: float | None = None
            for family in text_string_to_metric_families(body.decode()):
                for s in family.samples:
                    series += 1
                    if family.name.startswith("vgpu_app_"):
                        app_series += 1
                        listed.add(s.labels.get("app", ""))
                    if s.name == "vgpu_device_apps_unlisted":
                        unlisted = (unlisted or 0.0) + s.value
            return {"n": n, "apps_created": created, "scrape_p50_ms": round(statistics.median(times) * 1e3, 1),
                    "scrape_max_ms": round(max(times) * 1e3, 1), "body_bytes": len(body), "series": series,
                    "app_series": app_series, "apps_listed": len(listed),
                    "apps_unlisted": int(unlisted) if unlisted is not None else None}
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, nargs="+", default=[0, 4096])
    p.add_argument("--scrapes", type=int, default=10)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--json", action="store_true", help="one JSON object per line (the default output anyway)")
    ns = p.parse_args()
    settings = dict(kv.split("=", 1) for kv in ns.set)
    for n in ns.n:
        print(json.dumps(run_one(n, ns.scrapes, settings)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
