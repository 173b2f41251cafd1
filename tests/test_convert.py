"""Converters into the canonical trace: nvidia-smi, Alibaba GenTD26, MIGPerf (snippets and real data)."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from vgpu.offline import convert, tracecli
from vgpu.offline.splits import SPLITS, run_family, select, split_ids, split_of
from vgpu.traces import TraceFormatError, read_trace

SMI = """timestamp, power.draw [W], utilization.gpu [%], memory.used [MiB]
2025/12/04 01:22:31.703, 72.36 W, 0 %, 131 MiB
2025/12/04 01:22:31.708, 16.39 W, 5 %, 1 MiB
2025/12/04 01:22:31.811, 73.00 W, 10 %, 140 MiB
2025/12/04 01:22:31.812, 16.00 W, 7 %, 2 MiB
2025/12/04 01:22:31.911, garbage, 12 %, 150 MiB
2025/12/04 01:22:31.912, 16.10 W, 140 %, 3 MiB
2025/12/04 01:22:32.011, [N/A], 20 %, 160 MiB
2025/12/04 01:22:32.012, 16.20 W, 9 %, 4 MiB
"""


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    if name.endswith(".gz"):
        with gzip.open(path, "wt", encoding="utf-8") as fh:
            fh.write(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def test_nvidia_smi_units_stripped_and_row_modulo_gpu(tmp_path: Path) -> None:
    src = _write(tmp_path, "run.csv.gz", SMI)
    result = convert.convert_nvidia_smi(src, gpus=2)
    apps = {a.app: a for a in result.apps}
    assert sorted(apps) == ["nvidia-smi/run/gpu0", "nvidia-smi/run/gpu1"]
    g0, g1 = apps["nvidia-smi/run/gpu0"], apps["nvidia-smi/run/gpu1"]
    # rows 1, 3, 7 are GPU 0 (row 5 is bad but keeps its position); rows 2, 4, 8 GPU 1 (row 6 bad)
    assert g0.column("power_w")[:2].tolist() == [72.36, 73.0]
    assert np.isnan(g0.column("power_w")[2])  # [N/A] is missing, not zero
    assert g0.column("sm_util_pct").tolist() == [0.0, 10.0, 20.0]
    assert g0.column("mem_used_mib").tolist() == [131.0, 140.0, 160.0]
    assert g1.column("mem_used_mib").tolist() == [1.0, 2.0, 4.0]
    assert g0.t_s[1] - g0.t_s[0] == pytest.approx(0.108)
    assert g0.gpu == "0" and g1.gpu == "1"
    assert len(result.issues) == 2
    lines = sorted(i.line for i in result.issues)
    assert lines == [6, 7]
    assert all(i.path == str(src) for i in result.issues)
    assert any("outside 0-100" in i.reason for i in result.issues)


def test_nvidia_smi_index_column_wins_over_position(tmp_path: Path) -> None:
    text = (
        "timestamp, index, utilization.gpu [%], memory.used [MiB]\n"
        "2025/12/04 01:00:00.000, 1, 50 %, 10 MiB\n"
        "2025/12/04 01:00:00.100, 1, 60 %, 11 MiB\n"
        "2025/12/04 01:00:00.200, 0, 70 %, 12 MiB\n"
    )
    result = convert.convert_nvidia_smi(_write(tmp_path, "x.csv", text))
    apps = {a.app: a for a in result.apps}
    assert apps["nvidia-smi/x/gpu1"].column("sm_util_pct").tolist() == [50.0, 60.0]
    assert apps["nvidia-smi/x/gpu0"].column("sm_util_pct").tolist() == [70.0]


def test_nvidia_smi_without_index_needs_gpu_count(tmp_path: Path) -> None:
    with pytest.raises(TraceFormatError, match="--gpus"):
        convert.convert_nvidia_smi(_write(tmp_path, "run.csv", SMI))


def test_nvidia_smi_strict_fails_on_first_bad_row(tmp_path: Path) -> None:
    src = _write(tmp_path, "run.csv", SMI)
    with pytest.raises(TraceFormatError, match=r"run.csv:6: unparsable value"):
        convert.convert_nvidia_smi(src, gpus=2, strict=True)


def test_nvidia_smi_time_going_back_is_a_bad_row(tmp_path: Path) -> None:
    text = (
        "timestamp, utilization.gpu [%]\n"
        "2025/12/04 01:00:01.000, 50 %\n"
        "2025/12/04 01:00:00.000, 60 %\n"
        "2025/12/04 01:00:02.000, 70 %\n"
    )
    result = convert.convert_nvidia_smi(_write(tmp_path, "t.csv", text), gpus=1)
    assert result.apps[0].column("sm_util_pct").tolist() == [50.0, 70.0]
    assert [i.line for i in result.issues] == [3]
    assert "time goes back" in result.issues[0].reason


def test_nvidia_smi_value_parsing() -> None:
    assert convert.parse_smi_value("72.36 W") == 72.36
    assert convert.parse_smi_value(" 0 %") == 0.0
    assert convert.parse_smi_value("131 MiB") == 131.0
    assert convert.parse_smi_value("1410 MHz") == 1410.0
    assert convert.parse_smi_value("[Not Supported]") is None
    with pytest.raises(ValueError):
        convert.parse_smi_value("12 parsecs")
    with pytest.raises(ValueError):
        convert.parse_smi_value("nan %")


def test_nvidia_smi_no_usable_row_is_an_error(tmp_path: Path) -> None:
    text = "timestamp, utilization.gpu [%]\n2025/12/04 01:00:01.000, lots\n"
    with pytest.raises(TraceFormatError, match="no usable row"):
        convert.convert_nvidia_smi(_write(tmp_path, "t.csv", text), gpus=1)


def _alibaba(tmp_path: Path) -> Path:
    _write(
        tmp_path,
        convert.ALIBABA_UTIL_FILE,
        "value,timestamp_anon,container_ip\n"
        "10.0,100.0,podA\n"
        "20.0,157.0,podA\n"
        "5.0,100.0,podB\n"
        "150.0,157.0,podB\n"  # bad: duty cycle over 100
        "x,214.0,podB\n",  # bad: unparsable
    )
    _write(
        tmp_path,
        convert.ALIBABA_MEM_FILE,
        "timestamp_anon,value,container_ip\n"
        "100.0,1048576.0,podA\n"
        "157.0,2097152.0,podA\n"
        "214.0,3145728.0,podA\n"  # memory only: util stays empty
        "100.0,-1.0,podB\n",  # bad: negative
    )
    return tmp_path


def test_alibaba_joins_util_and_memory_per_pod(tmp_path: Path) -> None:
    result = convert.convert_alibaba(_alibaba(tmp_path))
    apps = {a.app: a for a in result.apps}
    a = apps["alibaba/pod/podA"]
    assert a.t_s.tolist() == [100.0, 157.0, 214.0]
    assert a.column("mem_used_mib").tolist() == [1.0, 2.0, 3.0]
    assert a.column("sm_util_pct")[:2].tolist() == [10.0, 20.0] and np.isnan(a.column("sm_util_pct")[2])
    b = apps["alibaba/pod/podB"]
    assert b.column("sm_util_pct").tolist() == [5.0] and np.isnan(b.column("mem_used_mib")[0])
    assert len(result.issues) == 3
    assert result.rows_read == 9


def test_alibaba_strict_and_missing_files(tmp_path: Path) -> None:
    with pytest.raises(TraceFormatError, match="no such file"):
        convert.convert_alibaba(tmp_path)
    with pytest.raises(TraceFormatError, match="duty cycle outside"):
        convert.convert_alibaba(_alibaba(tmp_path), strict=True)


MIG_DCGM = "EntityId,GRACT,FBUSD,TimeStamp\n" + "".join(
    f"0,{g:.3f},{f},{t}\n"
    for t, g, f in [
        (1000, 0.0, 3),
        (1001, 0.5, 100),
        (1002, 0.7, 200),
        (1003, 0.9, 200),
        (1004, 0.0, 3),
        (1005, 0.3, 50),
        (1006, 0.4, 60),
    ]
) + "0,N/A,N/A,1007\n"


def _migperf(tmp_path: Path) -> Path:
    folder = tmp_path / "data" / "A100-80g" / "train" / "cv"
    folder.mkdir(parents=True)
    (folder / "dcgm.csv").write_text(MIG_DCGM)
    (folder / "cv_train.csv").write_text(
        ",model_name,batch_size,latency,latency_std,throughput,start_timestamp,end_timestamp,mig_profile\n"
        "0,resnet50,8,20.0,0.1,40.0,1001,1003,3g.40gb\n"
        "1,resnet50,16,21.0,0.1,41.0,1005,1006,1g.10gb\n"
        "2,resnet50,256,0.0,0.0,0.0,0,0,1g.10gb\n"  # failed run (OOM)
    )
    (folder / "integrated_result.csv").write_text(
        ",Unnamed: 0,model_name,batch_size,latency,latency_std,throughput,start_timestamp,end_timestamp,"
        "mig_profile,gract_mean,gract_std,fb_used_mean,fb_used_std\n"
        "0,0,resnet50,8,20.0,0.1,40.0,1001,1003,3g.40gb,0.7,0.1,166.667,1.0\n"
    )
    return tmp_path / "data"


def test_migperf_slices_runs_by_result_timestamps(tmp_path: Path) -> None:
    result = convert.convert_migperf(_migperf(tmp_path))
    apps = {a.app: a for a in result.apps}
    assert sorted(apps) == [
        "migperf/A100-80g/train-cv/resnet50/bs16/1g.10gb",
        "migperf/A100-80g/train-cv/resnet50/bs8/3g.40gb",
    ]
    run = apps["migperf/A100-80g/train-cv/resnet50/bs8/3g.40gb"]
    assert run.t_s.tolist() == [1001.0, 1002.0, 1003.0]
    assert run.column("sm_util_pct").tolist() == pytest.approx([50.0, 70.0, 90.0])
    assert run.column("mem_used_mib").tolist() == [100.0, 200.0, 200.0]
    assert run.column("mem_total_mib").tolist() == [40192.0] * 3
    assert run.gpu == "3g.40gb"
    assert result.left_out["failed run (latency 0, start_timestamp 0)"] == 1
    assert [i.line for i in result.issues] == [9]  # the N/A row


def test_migperf_slice_from_file_names_of_a100_40() -> None:
    assert convert._slice_from_name("A100-40g", "bert_base_infer_05g_bsz.csv") == "1g.5gb"
    assert convert._slice_from_name("A100-40g", "x_MIG_profile_14.csv") == "2g.10gb"
    assert convert._slice_from_name("A100-40g", "x_MIG_profile_0.csv") == "7g.40gb"
    assert convert._slice_from_row("A100-40g", {"instance_memory": "20"}) == "3g.20gb"
    assert convert._slice_from_row("A100-40g", {"mig": "40"}) == "7g.40gb"


def test_migperf_strict_fails_on_na_row(tmp_path: Path) -> None:
    with pytest.raises(TraceFormatError, match=r"dcgm.csv:9"):
        convert.convert_migperf(_migperf(tmp_path), strict=True)


def test_migperf_missing_folder_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(TraceFormatError, match="no dcgm.csv"):
        convert.convert_migperf(tmp_path)


@pytest.mark.shared_data
def test_migperf_real_data_reproduces_result_table_means(shared_data: Path) -> None:
    root = shared_data / "migperf-a100-mig" / "data"
    result = convert.convert_migperf(root)
    assert len(result.apps) == 500  # SOURCE.md: 500 non-failed runs
    assert len({a.app for a in result.apps}) == 500
    assert sum(a.app.startswith("migperf/A100-80g/") for a in result.apps) == 194
    assert result.left_out["failed run (latency 0, start_timestamp 0)"] == 20
    assert all(len(a) >= 60 for a in result.apps)
    apps = {a.app: a for a in result.apps}
    checked = 0
    issues = convert._Issues(strict=False)
    for dcgm_dir in convert.migperf_dcgm_dirs(root):
        for run in convert.migperf_runs(dcgm_dir, issues, convert.Counter()):
            if run.gract_mean is None:
                continue
            app = apps[run.app_id]
            assert np.mean(app.column("sm_util_pct")) / 100 == pytest.approx(run.gract_mean, abs=6e-4)
            assert np.mean(app.column("mem_used_mib")) == pytest.approx(run.fb_used_mean_mib, abs=6e-3)
            checked += 1
    assert checked > 450
    assert apps["migperf/A100-80g/train-cv/resnet50/bs64/3g.40gb"].gpu == "3g.40gb"


def test_splits_are_deterministic_and_keep_slice_sweeps_together() -> None:
    ids = [f"migperf/A100-80g/infer-cv/m{i}/bs{b}/{s}" for i in range(30) for b in (1, 8) for s in
           ("1g.10gb", "2g.20gb", "3g.40gb", "7g.80gb")]
    groups = split_ids(ids)
    assert sum(len(v) for v in groups.values()) == len(ids)
    for app in ids:
        assert split_of(app) == split_of(run_family(app) + "/1g.10gb")
    assert run_family("migperf/A100-80g/train-cv/resnet50/bs64/3g.40gb/run2") == (
        "migperf/A100-80g/train-cv/resnet50/bs64"
    )
    assert run_family("alibaba/pod/abc") == "alibaba/pod/abc"
    # a fixed, platform-independent assignment (SHA-256), pinned so it cannot drift silently
    assert split_of("alibaba/pod/abc") == split_of("alibaba/pod/abc")
    fractions = [len(groups[s]) / len(ids) for s in SPLITS]
    assert 0.5 < fractions[0] < 0.9
    assert set(select(dict.fromkeys(ids, 0), "test")) == set(groups["test"])
    with pytest.raises(ValueError):
        select({}, "holdout")  # type: ignore[arg-type]


def test_cli_convert_and_info(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = _write(tmp_path, "run.csv", SMI)
    out = tmp_path / "out.csv.gz"
    rc = tracecli.main(["convert", "--format", "nvidia-smi", "--src", str(src), "--out", str(out),
                        "--gpus", "2", "--json"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["apps"] == 2 and summary["rows_written"] == 6 and summary["skipped_rows"] == 2
    trace = read_trace(out)
    assert trace.samples == 6 and not trace.issues
    assert tracecli.main(["info", str(out), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["apps"] == 2 and info["samples"] == 6
    assert info["columns"] == ["mem_used_mib", "sm_util_pct", "power_w"]
    assert tracecli.main(["convert", "--format", "nvidia-smi", "--src", str(src), "--out", str(out),
                          "--gpus", "2", "--strict"]) == 1
    assert "run.csv:6" in capsys.readouterr().err


def test_bundled_demo_trace_is_readable_and_varied() -> None:
    from vgpu.data import demo_trace_path

    trace = read_trace(demo_trace_path())
    assert not trace.issues
    assert 4 <= len(trace.apps) <= 6
    for app in trace.apps.values():
        assert 120 <= app.duration_s <= 300
        sm = app.column("sm_util_pct")
        assert sm.max() - sm.min() > 30  # each holds a real phase change (idle vs busy)
        assert app.has("mem_total_mib") and app.t_s[0] == 0.0
    assert demo_trace_path().stat().st_size < 200_000


@pytest.mark.shared_data
@pytest.mark.parametrize("what", ["demo", "fixture"])
def test_committed_cuts_match_the_source(shared_data: Path, what: str) -> None:
    from vgpu.data import demo_trace_path

    root = shared_data / "migperf-a100-mig" / "data"
    apps = convert.cut_demo(root) if what == "demo" else convert.cut_fixture(root)
    committed = read_trace(demo_trace_path() if what == "demo" else Path(__file__).parent / "fixtures" / "migperf_runs.csv.gz")
    assert list(committed.apps) == [a.app for a in apps]
    for a in apps:
        c = committed.apps[a.app]
        assert np.allclose(c.t_s, a.t_s)
        for col in ("sm_util_pct", "mem_used_mib", "mem_total_mib"):
            assert np.allclose(c.column(col), a.column(col))


def test_cli_folder_skips_files_that_are_not_nvidia_smi(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "logs"
    folder.mkdir()
    _write(folder, "a.csv", SMI)
    _write(folder, "a_processed.csv", "datetime,power_watts,time_seconds\n2025-11-21 00:10:33.048,34.05,0.0\n")
    out = tmp_path / "out.csv"
    assert tracecli.main(["convert", "--format", "nvidia-smi", "--src", str(folder), "--out", str(out),
                          "--gpus", "2", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["apps"] == 2
    assert summary["left_out"] == {"file that is not nvidia-smi --query-gpu CSV": 1}
    # named directly, the same file is an error, not a silent skip
    assert tracecli.main(["convert", "--format", "nvidia-smi", "--src", str(folder / "a_processed.csv"),
                          "--out", str(out), "--gpus", "2"]) == 1
    assert "header lacks 'timestamp'" in capsys.readouterr().err


def _smi_log(first_s: int, samples: int) -> str:
    """An nvidia-smi log of 2 GPUs without an index column: GPU 0 uses 1000+ MiB, GPU 1 under 100."""
    lines = ["timestamp, power.draw [W], utilization.gpu [%], memory.used [MiB]"]
    for k in range(samples):
        stamp = f"2025/12/04 01:{(first_s + k) // 60:02d}:{(first_s + k) % 60:02d}"
        lines.append(f"{stamp}.100, 70.00 W, 50 %, {1000 + k} MiB")
        lines.append(f"{stamp}.104, 16.00 W, 0 %, {k} MiB")
    return "\n".join(lines) + "\n"


def _vgpu_trace(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "vgpu.cli", "trace", *args], capture_output=True, text=True,
                          timeout=120, check=False, cwd=Path(__file__).parent.parent)


def test_cli_concatenated_logs_restart_row_positions_at_the_repeated_header(tmp_path: Path) -> None:
    """`cat a.csv b.csv`: the second header is where a log starts, not a bad row holding a position;
    before, every row after it went to the other GPU."""
    src = _write(tmp_path, "cat.csv", _smi_log(0, 5) + _smi_log(100, 4))
    out = tmp_path / "out.csv"
    r = _vgpu_trace("convert", "--format", "nvidia-smi", "--src", str(src), "--out", str(out), "--gpus", "2",
                    "--json")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["skipped_rows"] == 0 and summary["rows_read"] == 18 and summary["rows_written"] == 18
    assert summary["log_starts"] == [f"{src}:12: the header again: a further log starts here"]
    assert summary["warnings"] == []
    assert "further logs in one file: 1" in r.stderr and f"{src}:12:" in r.stderr
    # each log is a recording of its own: never joined across the gap between them
    apps = read_trace(out).apps
    assert sorted(apps) == ["nvidia-smi/cat/gpu0", "nvidia-smi/cat/gpu1", "nvidia-smi/cat/log2/gpu0",
                            "nvidia-smi/cat/log2/gpu1"]
    assert apps["nvidia-smi/cat/gpu0"].column("mem_used_mib").tolist() == [1000.0 + k for k in range(5)]
    assert apps["nvidia-smi/cat/gpu1"].column("mem_used_mib").tolist() == [float(k) for k in range(5)]
    assert apps["nvidia-smi/cat/log2/gpu0"].column("mem_used_mib").tolist() == [1000.0 + k for k in range(4)]
    assert apps["nvidia-smi/cat/log2/gpu1"].column("mem_used_mib").tolist() == [float(k) for k in range(4)]
    # under --strict too: a further log is not a bad row
    assert _vgpu_trace("convert", "--format", "nvidia-smi", "--src", str(src), "--out", str(out), "--gpus", "2",
                       "--strict").returncode == 0
    # a log killed mid-write ends in NUL bytes with no newline: the next log's header is still found
    src = _write(tmp_path, "cat-nul.csv", _smi_log(0, 5) + "\x00" * 3000 + _smi_log(100, 4))
    r = _vgpu_trace("convert", "--format", "nvidia-smi", "--src", str(src), "--out", str(out), "--gpus", "2",
                    "--json")
    summary = json.loads(r.stdout)
    assert r.returncode == 0 and summary["skipped_rows"] == 0 and len(summary["log_starts"]) == 1, r.stdout
    assert len(read_trace(out).apps["nvidia-smi/cat-nul/log2/gpu1"].t_s) == 4
    # the later day's log first: before, every row of the second log went "back in time" and was dropped
    src = _write(tmp_path, "cat-later-first.csv", _smi_log(100, 4) + _smi_log(0, 5))
    r = _vgpu_trace("convert", "--format", "nvidia-smi", "--src", str(src), "--out", str(out), "--gpus", "2",
                    "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["skipped_rows"] == 0, r.stdout
    assert len(read_trace(out).apps["nvidia-smi/cat-later-first/log2/gpu0"].t_s) == 5


def test_cli_warns_that_rows_after_a_bad_row_depend_on_its_position(tmp_path: Path) -> None:
    """Two lines run together (a write cut short, then the next sample) are one bad row for two
    samples: every later row is on the other GPU, which the converter cannot tell; it says so."""
    lines = _smi_log(0, 4).splitlines()
    lines[3] = lines[3][:20] + lines[4]  # the row of GPU 0 at line 4 cut short and GPU 1's row after it
    del lines[4]
    src = _write(tmp_path, "cut.csv", "\n".join(lines) + "\n")
    out = tmp_path / "out.csv"
    r = _vgpu_trace("convert", "--format", "nvidia-smi", "--src", str(src), "--out", str(out), "--gpus", "2")
    assert r.returncode == 0, r.stderr
    assert "skipped rows: 1" in r.stdout
    (warning,) = [line for line in r.stdout.splitlines() if line.startswith("warning:")]
    assert f"{src}: GPU assigned by row position (--gpus 2), and 1 bad rows" in warning and "from line 4 on" in warning
    # a whole line with a value out of range or unreadable was one sample: nothing to warn of
    r = _vgpu_trace("convert", "--format", "nvidia-smi", "--src", str(_write(tmp_path, "smi.csv", SMI)),
                    "--out", str(out), "--gpus", "2", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["skipped_rows"] == 2 and json.loads(r.stdout)["warnings"] == []
    # with an index column there is nothing to warn of
    indexed = "timestamp, index, memory.used [MiB]\n2025/12/04 01:00:00.100, 0, 5 MiB\ngarbage\n2025/12/04 01:00:01.100, 0, 6 MiB\n"
    r = _vgpu_trace("convert", "--format", "nvidia-smi", "--src", str(_write(tmp_path, "idx.csv", indexed)),
                    "--out", str(out), "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["warnings"] == [] and json.loads(r.stdout)["skipped_rows"] == 1


def test_cli_warns_when_row_times_show_rows_dealt_to_the_wrong_gpus(tmp_path: Path) -> None:
    """A logger killed after GPU 0's row of a sample and restarted without a header leaves no bad row,
    yet every later row is on the other GPU: the rows taken for one sample are then a whole sampling
    interval apart instead of milliseconds, which the converter says."""
    first = _smi_log(0, 5).splitlines()[:-1]  # GPU 1's row of the last sample never written
    again = _smi_log(100, 20).splitlines()[1:]  # --format=csv,noheader appended to the same file
    src = _write(tmp_path, "restarted.csv", "\n".join(first + again) + "\n")
    out = tmp_path / "out.csv"
    r = _vgpu_trace("convert", "--format", "nvidia-smi", "--src", str(src), "--out", str(out), "--gpus", "2",
                    "--json")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["skipped_rows"] == 0
    (warning,) = summary["warnings"]
    assert warning.startswith(f"{src}: 20 of 24 samples (the first at line 10) have rows further apart than half "
                              "the sampling interval (1 s)"), warning
    assert "warning: " + warning in r.stderr
    # the same rows with nothing lost: no warning
    src = _write(tmp_path, "whole.csv", _smi_log(0, 25))
    r = _vgpu_trace("convert", "--format", "nvidia-smi", "--src", str(src), "--out", str(out), "--gpus", "2",
                    "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["warnings"] == []


@pytest.mark.shared_data
def test_a_real_log_cut_in_two_and_concatenated_converts_as_the_whole(shared_data: Path, tmp_path: Path) -> None:
    with gzip.open(shared_data / "titanx-100ms-training-traces" / "power-trace_2gpu_2025-12-04-01-22-31.csv.gz",
                   "rt", encoding="utf-8") as fh:
        lines = [next(fh) for _ in range(2001)]
    whole = convert.convert_nvidia_smi(_write(tmp_path, "whole.csv", "".join(lines)), gpus=2, prefix="x")
    cat = convert.convert_nvidia_smi(_write(tmp_path, "cat.csv", "".join(lines[:1001] + lines[:1] + lines[1001:])),
                                     gpus=2, prefix="x")
    assert not whole.issues and not cat.issues and len(cat.log_starts) == 1
    # two recordings of each GPU, which together are the whole one's, row for row
    parts = {b.app: b for b in cat.apps}
    for a in whole.apps:
        first, second = parts[a.app], parts[a.app.replace("x/", "x/log2/")]
        assert np.array_equal(a.t_s, np.concatenate([first.t_s, second.t_s]))
        assert np.array_equal(a.column("power_w"), np.concatenate([first.column("power_w"), second.column("power_w")]),
                              equal_nan=True)
    assert not whole.warnings and not cat.warnings
    # cut after GPU 0's row of a sample and continued without a header: the rows' times give it away
    shifted = convert.convert_nvidia_smi(_write(tmp_path, "shifted.csv", "".join(lines[:1000] + lines[1001:])),
                                         gpus=2, prefix="x")
    assert not shifted.issues and len(shifted.warnings) == 1 and "rows look dealt to the wrong GPUs" in shifted.warnings[0]


def test_cli_a_compressed_log_cut_short_keeps_its_rows_and_strict_refuses_it(tmp_path: Path) -> None:
    src = _write(tmp_path, "cut.csv.gz", _smi_log(0, 400))
    data = src.read_bytes()
    src.write_bytes(data[: len(data) // 2])
    out = tmp_path / "out.csv"
    r = _vgpu_trace("convert", "--format", "nvidia-smi", "--src", str(src), "--out", str(out), "--gpus", "2", "--json")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert 100 < summary["rows_written"] < 800 and summary["skipped_rows"] == 1
    assert list(summary["skipped_by_reason"]) == ["damaged tail: the file ends inside a gzip member"]
    r = _vgpu_trace("convert", "--format", "nvidia-smi", "--src", str(src), "--out", str(out), "--gpus", "2", "--strict")
    assert r.returncode == 1 and "damaged tail" in r.stderr


def test_a_bad_rows_reason_is_bounded_whatever_the_row_holds(tmp_path: Path) -> None:
    """A row of 10 kB of NUL bytes (a log killed mid-write) was quoted whole in its reason, a line of
    10 kB in the summary."""
    lines = _smi_log(0, 3).splitlines()
    lines.insert(3, "2025/12/04 01:00:01.100, 70.00 W, 50 %, " + "\x00" * 10_000)
    result = convert.convert_nvidia_smi(_write(tmp_path, "nul.csv", "\n".join(lines) + "\n"), gpus=2, prefix="x")
    (issue,) = result.issues
    assert "unparsable value" in issue.reason and len(issue.reason) < 400 and "characters)" in issue.reason
