"""bench/pha_phase_times.py without a MAX compile: the decode op's switch it turns on, the
parsing of the op's lines, and the bounds each cell is weighed against."""

from __future__ import annotations

import pytest

from bench import pha_phase_times as pt
from tests.support.paths import REPO_ROOT


def test_the_copy_turns_on_the_ops_one_switch(tmp_path):
    copy = pt.switched_on_kernels(REPO_ROOT / "mojo", tmp_path)
    op = (copy / "pha_decode_step.mojo").read_text()
    assert pt.SWITCH_ON in op and pt.SWITCH_OFF not in op
    assert (REPO_ROOT / "mojo" / "pha_decode_step.mojo").read_text().count(pt.SWITCH_OFF) == 1  # shipped off
    assert (copy / "__init__.mojo").read_text() == (REPO_ROOT / "mojo" / "__init__.mojo").read_text()
    # one kind of phase timed per name, in the op's order
    assert "comptime TIMED_KINDS = PER_BLOCK + 2" in op and len(pt.KINDS) == 6 + 2


def test_without_the_switch_the_copy_is_refused(tmp_path):
    source = tmp_path / "src"
    source.mkdir()
    (source / "pha_decode_step.mojo").write_text("comptime PHASE_TIMES = True\n")
    with pytest.raises(SystemExit, match="PHASE_TIMES = False"):
        pt.switched_on_kernels(source, tmp_path / "out")


def test_each_calls_line_becomes_microseconds_per_step_and_worker():
    out = ("compiling\npha_decode_steps phase times: B=16 S=4 workers=2 ns=8000,16000,0,8,0,0,800,80"
           " waits=800,0,0,0,0,0,80,8\n"
           "pha_decode_steps phase times: B=16 S=4 workers=2 ns=4000,4000,4000,4000,4000,4000,4000,4000\n")
    (first, first_waits), (second, second_waits) = pt.parse_times(out)
    assert first["from_x"] == 1.0 and first["gss_and_attention"] == 2.0 and first["from_hidden"] == 0.001
    assert first["logits"] == 0.1 and first["choice"] == 0.01
    assert first_waits["from_x"] == 0.1 and first_waits["logits"] == 0.01 and first_waits["merge"] == 0.0
    assert set(second.values()) == {0.5} and second_waits == {}  # an op from before the waits were timed
    with pytest.raises(ValueError, match="PHASE_TIMES"):
        pt.parse_times("Segmentation fault\n")
    with pytest.raises(ValueError, match="expected 8 phase times"):
        pt.parse_times("pha_decode_steps phase times: B=1 S=1 workers=1 ns=1,2,3\n")
    with pytest.raises(ValueError, match="got 8 and 2"):
        pt.parse_times("pha_decode_steps phase times: B=1 S=1 workers=1 ns=1,2,3,4,5,6,7,8 waits=1,2\n")


def test_a_cell_is_weighed_against_streaming_the_fma_peak_and_re_reading_the_matrices():
    times = dict.fromkeys(pt.KINDS, 0.0) | {"gss_and_attention": 90.0, "merge": 10.0, "from_x": 150.0,
                                             "logits": 50.0, "norm": 5.0, "choice": 5.0}
    # 1 MB of state at 20 GB/s: 50 us; the products' 2e6 FLOPs at 1e11 FLOP/s: 20 us, their
    # 10 MB of matrices re-read at 1e11 B/s: 100 us, the slower of the two
    cell = pt.summarize(times, 1e6, 2e6, 1e7, stream=2e10, peak=1e11, reread=1e11)
    assert cell["step_us"] == 310.0 and cell["cache_us"] == 100.0 and cell["product_us"] == 200.0
    assert cell["rest_us"] == 10.0
    assert cell["cache_percent_of_streaming"] == pytest.approx(50.0)
    assert cell["product_percent_of_fma_peak"] == pytest.approx(10.0)
    assert cell["product_percent_of_bound"] == pytest.approx(50.0)  # the re-read bound, not the FLOPs
    assert cell["sum_of_bounds_us"] == pytest.approx(150.0)
    assert cell["step_percent_of_sum_of_bounds"] == pytest.approx(100 * 150 / 310)
    busy = pt.summarize(times, 1e6, 4e7, 1e7, stream=2e10, peak=1e11, reread=1e11)
    assert busy["product_percent_of_bound"] == pytest.approx(200.0)  # 4e7 FLOPs: 400 us at the peak
