"""Run every zoo job under `vgpu record` on a real GPU and write the traces (JSON summary on stdout).

    python bench/zoo/run.py --out-dir bench/zoo/traces [--seconds 300] [--only resnet18-bs32,...]

For each job: `vgpu record --backend nvml` starts, the job runs alone on the GPU for `--seconds`, the
recorder keeps going `--tail-s` more (the teardown), then stops; the trace is gzipped beside a
RECORDING.md line with the command, the GPU and the driver (nvidia-smi). Needs a CUDA GPU, NVML, torch
(and torchvision for ResNet-18).
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
JOBS: dict[str, list[str]] = {
    "resnet18-train-bs32": ["resnet18_train.py", "--batch", "32"],
    "resnet18-train-bs128": ["resnet18_train.py", "--batch", "128"],
    "transformer-infer-l12": ["transformer_infer.py", "--layers", "12"],
    "transformer-infer-l24-w1024": ["transformer_infer.py", "--layers", "24", "--width", "1024", "--rate", "40"],
    "gpt-train-bs16": ["gpt_train.py", "--batch", "16"],
}


def _gpu_facts() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unknown ({exc})"
    return out.replace("\n", "; ")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out-dir", type=Path, default=HERE / "traces")
    p.add_argument("--seconds", type=float, default=300.0, help="each job's run time")
    p.add_argument("--tail-s", type=float, default=10.0, help="recording after the job ends")
    p.add_argument("--only", default="", help="comma-separated job names (default: all)")
    args = p.parse_args()
    wanted = [j for j in (args.only.split(",") if args.only else JOBS) if j]
    unknown = set(wanted) - set(JOBS)
    if unknown:
        p.error(f"unknown jobs {sorted(unknown)}; known: {', '.join(JOBS)}")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    gpu = _gpu_facts()
    summary = []
    for name in wanted:
        inapp = Path(tempfile.mkdtemp(prefix="vgpu-zoo-inapp-"))
        csv_path = args.out_dir / f"{name}.csv"
        record_cmd = [sys.executable, "-m", "vgpu.cli", "record", "--backend", "nvml", "--out", str(csv_path),
                      "--inapp-dir", str(inapp)]
        job_cmd = [sys.executable, str(HERE / JOBS[name][0]), *JOBS[name][1:], "--seconds", str(args.seconds),
                   "--app-id", f"zoo/{name}", "--inapp-dir", str(inapp)]
        recorder = subprocess.Popen(record_cmd)
        time.sleep(2.0)
        started = time.time()
        job = subprocess.run(job_cmd, check=False)
        time.sleep(args.tail_s)
        recorder.send_signal(signal.SIGINT)
        rc = recorder.wait(timeout=60)
        with open(csv_path, "rb") as src, gzip.open(f"{csv_path}.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        csv_path.unlink()
        shutil.rmtree(inapp, ignore_errors=True)
        with open(args.out_dir / "RECORDING.md", "a", encoding="utf-8") as fh:
            fh.write(f"- `{name}.csv.gz`: `{' '.join(job_cmd[1:])}` under `{' '.join(record_cmd[1:])}`; GPU {gpu}; "
                     f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(started))}; job exit {job.returncode}\n")
        summary.append({"job": name, "trace": f"{csv_path}.gz", "job_rc": job.returncode, "record_rc": rc,
                        "wall_s": round(time.time() - started, 1)})
    print(json.dumps({"gpu": gpu, "jobs": summary}))
    return 0 if all(s["job_rc"] == 0 and s["record_rc"] == 0 for s in summary) else 1


if __name__ == "__main__":
    sys.exit(main())
