"""Property-based tests: hostile files end in the project's own errors, never a crash.

Profiles: ``ci`` (the default, bounded) and ``long`` for local runs:
    HYPOTHESIS_PROFILE=long pytest tests/test_fuzz.py
"""

import json
import os
import struct

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from srm_max.checkpoints.format import load_checkpoint, save_checkpoint
from srm_max.models.srm.config import SRMConfig
from srm_max.checkpoints.convert import convert
from srm_max.errors import CheckpointError, ConvertError, SRMError
from srm_max.reference.srm import SRM
from srm_max.checkpoints.safetensors_io import SafetensorsFile

settings.register_profile(
    "ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
settings.register_profile(
    "long", max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

CONFIG = SRMConfig(16, 4, 1, 2, 8)


@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    weights = {k: v.detach().numpy() for k, v in SRM(CONFIG).state_dict().items()}
    path = tmp_path_factory.mktemp("fuzz") / "ckpt"
    save_checkpoint(path, CONFIG, weights)
    return path


def fresh_copy(src, dst):
    dst.mkdir(exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        (dst / name).write_bytes((src / name).read_bytes())
    return dst


@given(data=st.data())
def test_truncated_or_flipped_weights_fail_cleanly(good_checkpoint, tmp_path, data):
    directory = fresh_copy(good_checkpoint, tmp_path / "c")
    raw = bytearray((good_checkpoint / "model.safetensors").read_bytes())
    if data.draw(st.booleans(), label="truncate"):
        raw = raw[: data.draw(st.integers(0, len(raw) - 1), label="keep")]
    else:
        for _ in range(data.draw(st.integers(1, 8), label="flips")):
            i = data.draw(st.integers(0, len(raw) - 1), label="at")
            raw[i] ^= data.draw(st.integers(1, 255), label="mask")
    (directory / "model.safetensors").write_bytes(bytes(raw))
    try:
        loaded = load_checkpoint(directory)
    except CheckpointError as e:
        assert "model.safetensors" in str(e) or "config" in str(e)
    else:  # a flip inside the data can leave a valid, finite model: it must still be well formed
        assert all(np.isfinite(v).all() for v in loaded.weights.values())


def header_file(path, header, data: bytes = b""):
    encoded = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)
    return path


shapes = st.lists(st.one_of(st.integers(0, 8), st.integers(2**31, 2**62), st.integers(-5, -1)), max_size=4)
entries = st.fixed_dictionaries({
    "dtype": st.sampled_from(["F32", "BF16", "F16", "I64", "F8_E4M3", "complex", 7]),
    "shape": st.one_of(shapes, st.text(max_size=3), st.none()),
    "data_offsets": st.one_of(
        st.lists(st.integers(-10, 2**62), min_size=0, max_size=3), st.text(max_size=3), st.none()
    ),
})


@given(header=st.dictionaries(st.text(max_size=20), entries, max_size=4), payload=st.binary(max_size=256))
def test_bogus_headers_fail_cleanly(tmp_path, header, payload):
    path = header_file(tmp_path / "x.safetensors", header, payload)
    try:
        st_file = SafetensorsFile(path)
        for name in st_file.entries:  # whatever validated can be read, within the file's size
            assert st_file.read(name).nbytes <= len(payload)
    except CheckpointError as e:
        assert "x.safetensors" in str(e)


@given(raw=st.binary(max_size=64))
def test_random_bytes_fail_cleanly(tmp_path, raw):
    path = tmp_path / "r.safetensors"
    path.write_bytes(raw)
    try:
        SafetensorsFile(path)
    except CheckpointError as e:
        assert "r.safetensors" in str(e)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
config_dicts = st.fixed_dictionaries(
    {},
    optional={
        "vocab_size": json_values | st.integers(1, 2**40),
        "d_model": json_values | st.integers(1, 2**20),
        "n_layers": json_values | st.integers(1, 2**20),
        "n_heads": json_values | st.integers(1, 2**12),
        "context_length": json_values | st.integers(1, 2**30),
        "ffn_expansion": json_values,
        "decay": json_values,
        "layer_norm_eps": json_values,
        "architecture": json_values | st.just("srm"),
        "junk": json_values,
    },
)


@given(data=st.one_of(config_dicts, json_values))
def test_random_configs_fail_cleanly(tmp_path, data):
    (tmp_path / "config.json").write_text(json.dumps(data))
    try:
        config = SRMConfig.load(tmp_path / "config.json")
    except CheckpointError as e:
        assert "config" in str(e)
    else:
        assert config.d_model % config.n_heads == 0


@given(data=st.data())
def test_convert_of_damaged_sources_fails_cleanly(good_checkpoint, tmp_path, data):
    raw = bytearray((good_checkpoint / "model.safetensors").read_bytes())
    for _ in range(data.draw(st.integers(1, 6), label="flips")):
        i = data.draw(st.integers(0, min(len(raw) - 1, 600)), label="at")  # mostly the header
        raw[i] ^= data.draw(st.integers(1, 255), label="mask")
    (tmp_path / "src.safetensors").write_bytes(bytes(raw))
    out = tmp_path / "out"
    try:
        convert(tmp_path / "src.safetensors", out, parity_tokens=8)
    except (ConvertError, CheckpointError) as e:
        assert isinstance(e, SRMError) and str(e)
        assert not out.exists()
    else:
        load_checkpoint(out)
    if out.exists():
        import shutil

        shutil.rmtree(out)
