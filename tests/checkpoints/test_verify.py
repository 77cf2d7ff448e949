"""``srm-max verify``: integrity, recomputed parity, and MAX against the reference."""

import torch

from srm_max.checkpoints.convert import convert
from srm_max.cli import main
from tests.support.graphs import graphs
from tests.support.tiny import TINY, make_reference

pytestmark = graphs(TINY)


def test_verify_passes_then_catches_tampering(tmp_path, capsys):
    torch.save(make_reference(TINY).state_dict(), tmp_path / "m.pt")
    convert(tmp_path / "m.pt", tmp_path / "model", parity_tokens=32)
    assert main(["verify", str(tmp_path / "model")]) == 0
    out = capsys.readouterr().out
    assert "ok   integrity" in out and "ok   parity" in out and "ok   engine" in out

    other = make_reference(TINY, seed=7)
    torch.save(other.state_dict(), tmp_path / "other.pt")
    convert(tmp_path / "other.pt", tmp_path / "other", parity_tokens=32)
    (tmp_path / "model" / "model.safetensors").write_bytes((tmp_path / "other" / "model.safetensors").read_bytes())
    assert main(["verify", str(tmp_path / "model"), "--no-engine"]) == 1
    assert "FAIL integrity" in capsys.readouterr().out
