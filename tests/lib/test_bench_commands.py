"""The benchmarks that lesson records come from (`python -m lib.course.bench.<name>`) run at a tiny size
and write a record that names its command and describes its machine."""

import json
import statistics

import torch

import lib.course.bench.kv_cache
import lib.course.bench.moe
import lib.course.bench.ssm

MACHINE_KEYS = {"device", "cpu_cores", "torch_threads", "torch", "python", "platform"}


def test_kv_cache_benchmark_writes_its_record(tmp_path):
    out = tmp_path / "kv.json"
    lib.course.bench.kv_cache.main(["--new-tokens", "3", "--prompt", "4", "--repeats", "3", "--out", str(out)])
    r = json.loads(out.read_text())
    assert r["generated_by"] == "python -m lib.course.bench.kv_cache" and MACHINE_KEYS <= set(r["machine"])
    assert set(r["seconds"]) == {"cached", "uncached"} and all(len(v) == 3 for v in r["seconds"].values())
    # an odd count: the median is one of the (rounded) times themselves
    assert r["median_seconds"] == {k: round(statistics.median(v), 4) for k, v in r["seconds"].items()}


def test_ssm_benchmark_writes_its_record(tmp_path):
    out = tmp_path / "ssm.json"
    lib.course.bench.ssm.main(
        ["--lengths", "40", "--repeats", "1", "--threads", "1", "--sweep", "8", "--out", str(out)]
    )
    r = json.loads(out.read_text())
    assert r["generated_by"] == "python -m lib.course.bench.ssm" and MACHINE_KEYS <= set(r["machine"])
    [row] = r["results"]
    assert row["L"] == 40 and set(row["forward"]["median_seconds"]) >= {"ref", "chunked"}
    assert row["max_abs_diff_fwd"] < 1e-4  # the chunked scan computed the reference's outputs (fp32)


def test_moe_benchmark_writes_its_record(tmp_path, monkeypatch):
    monkeypatch.setattr(
        lib.course.bench.moe, "SETTINGS", {"tiny": dict(tokens=64, d_model=16, d_ff=32, num_experts=4, top_k=2)}
    )
    out = tmp_path / "moe.json"
    lib.course.bench.moe.main(["--repeats", "2", "--threads", "1", "--out", str(out)])
    r = json.loads(out.read_text())
    assert r["generated_by"] == "python -m lib.course.bench.moe" and MACHINE_KEYS <= set(r["machine"])
    tiny = r["results"]["threads_1"]["tiny"]
    assert set(tiny["seconds"]) == {
        "forward_loop",
        "forward_grouped",
        "forward_backward_loop",
        "forward_backward_grouped",
        "forward_experts_only",
    }
    assert all(len(v) == 2 for v in tiny["seconds"].values())


def test_a_benchmark_leaves_torch_threads_as_it_found_them(tmp_path):
    before = torch.get_num_threads()
    lib.course.bench.ssm.main(
        ["--lengths", "8", "--repeats", "1", "--threads", str(before + 1), "--sweep", "--out", str(tmp_path / "s.json")]
    )
    assert torch.get_num_threads() == before
