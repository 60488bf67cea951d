"""The attention benchmark command measures every backend and writes a complete record (sizes kept
tiny: this checks the command, not the machine's speed)."""

import json

from lib.bench.attention import attention_flops, main, markdown, run


def test_flop_count_is_four_b_h_s_squared_d_halved_when_causal():
    assert attention_flops(1, 12, 512, 64, causal=False, backward=False) == 4 * 12 * 512 * 512 * 64
    assert attention_flops(1, 12, 512, 64, causal=True, backward=False) == 2 * 12 * 512 * 512 * 64
    assert attention_flops(2, 1, 8, 16, causal=True, backward=True) == 3.5 * attention_flops(2, 1, 8, 16, True, False)


def test_cpu_run_times_every_backend_and_says_it_is_scaled_down(tmp_path):
    results = run((16, 33), layers=1, heads=2, head_dim=16, repeats=1, device="cpu")
    assert results["scaled_down"] and "scaled down" in results["note"]
    assert {(r["backend"], r["seq_len"]) for r in results["rows"]} == {
        (b, s) for b in ("naive", "sdpa", "chunked") for s in (16, 33)}
    for r in results["rows"]:
        assert "error" not in r and r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0 and r["fwd_tflops"] > 0
    table = markdown(results)
    assert table.count("\n| ") == 1 + len(results["rows"])  # header + one line per row
    out = tmp_path / "r.json"
    main(["--seq", "16", "--layers", "1", "--repeats", "1", "--out", str(out)])
    assert json.loads(out.read_text())["generated_by"] == "python -m lib.bench.attention"
