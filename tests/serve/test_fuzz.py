"""Property-based tests: hostile files and requests end in the project's own errors, never a crash.

Profiles: ``ci`` (the default, bounded) and ``long`` for local runs:
    HYPOTHESIS_PROFILE=long pytest tests/serve/test_fuzz.py
"""

import json
import math
import os
import struct

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from srm_max.checkpoints.convert import convert
from srm_max.checkpoints.format import load_checkpoint, save_checkpoint
from srm_max.checkpoints.safetensors_io import SafetensorsFile
from srm_max.errors import CheckpointError, ConvertError, SRMError
from srm_max.models.srm.config import SRMConfig
from srm_max.reference.srm import SRM
from tests.support.tiny import TINY

try:
    from srm_max.serve.http import protocol
    from srm_max.serve.http.errors import APIError
except ImportError:  # the server's extra (fastapi) is not installed
    protocol = None

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


# ------------------------------------------------------------------ the server's request parser
# Every field of both endpoints gets values of the wrong type and of hostile sizes (ints past
# int64 and past every float, floats past float32 and below its smallest, NaN, text with lone
# surrogates, long strings, long and nested lists); the parser answers with a CheckedRequest whose values
# the engine can take, or a 4xx APIError, never another exception.
SERVER_MODEL = "tiny"
CHAT_TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
MAX_SAMPLES = 8

any_text = st.text(st.characters(categories=["Cs"]) | st.characters(), max_size=8)
hostile_scalars = (st.none() | st.booleans() | st.integers(-4, 4) | st.integers(-(2**70), 2**70)
                   | st.sampled_from([2**63 - 1, 2**63, 2**64, 10**400, -(10**400)])
                   | st.floats() | st.sampled_from([1e308, 1e39, 3.5e38, 1e-50, 1e-320, 2.0, 2.0000001, 0.0, -0.0])
                   | any_text | st.sampled_from(["", "ab", SERVER_MODEL, "x" * 5000, "\ud800", "a\udfffb"]))
hostile = st.recursive(hostile_scalars, lambda inner: st.lists(inner, max_size=40)
                       | st.dictionaries(any_text | st.sampled_from(["type", "include_usage", "role", "content"]),
                                         inner, max_size=4), max_leaves=30)
# values at the edges of what the engine holds, tried in every field
EDGE_VALUES = [None, True, 0, -0.0, -1, -2, 1, 2, 2**63 - 1, 2**63, 2**64, 10**400, -(10**400), 1e308, 1e39, 3.5e38,
               1e-50, 1e-320, 2.0000001, math.nan, math.inf, -math.inf, "", "\ud800", "a\udfffb", "x" * 5000,
               [], [[]], ["\ud800"], [1] * 200, [[1] * 200] * 9, {}, {"type": "text"}, {"include_usage": None}]
with_lone_surrogate = st.builds(lambda a, s, b: a + s + b, st.text(max_size=3), st.characters(categories=["Cs"]),
                                st.text(max_size=3))
field_values = st.one_of(hostile, with_lone_surrogate,
                         st.lists(with_lone_surrogate | st.text(min_size=1, max_size=3), min_size=1, max_size=3))
chat_messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]) | with_lone_surrogate,
                                                "content": st.sampled_from(["ab", "ab é"]) | any_text}),
                         max_size=3)


def hostile_bodies(fields, base):
    """``base`` with a few fields (mostly known ones) set to hostile values; or any JSON value."""
    known = st.dictionaries(st.sampled_from(sorted(fields)), field_values, min_size=1, max_size=3)
    unknown = st.dictionaries(any_text, hostile, max_size=2)
    return st.one_of(known.map(lambda values: base | values), unknown.map(lambda values: base | values), hostile)


@pytest.fixture(scope="module")
def parsing_generator():
    from tests.support.stand_ins import NoWork
    from tests.support.tokenizers import byte_level_tokenizer

    from srm_max.serve.generator import Generator

    return Generator.from_engine(NoWork(), tokenizer=byte_level_tokenizer())  # any engine use fails


def assert_refused_or_runnable(parse):
    """``parse()`` gives a CheckedRequest the engine can run as asked, or raises a 4xx APIError."""
    try:
        job = parse()
    except APIError as e:
        assert 400 <= e.status < 500 and e.message
        json.dumps(e.body())  # the app sends it as JSON
        return
    assert job.n >= 1 and 1 <= len(job.prompts) * job.n <= MAX_SAMPLES
    assert 0 <= job.temperature <= 2 and 0 < np.float32(job.top_p) and job.top_p <= 1
    assert 0 <= job.top_k < 2**63 and 0 <= job.seed < 2**64 and job.max_new >= 0
    for p in job.prompts:
        assert p and len(p) <= TINY.context_length and all(0 <= t < TINY.vocab_size for t in p)
    assert all(s and s.encode("utf-8") for s in job.stop)
    assert isinstance(job.stream, bool) and isinstance(job.include_usage, bool)


needs_server = pytest.mark.skipif(protocol is None, reason="needs the server's extra: pip install 'srm-max[serve]'")


COMPLETION_BASES = [{"prompt": "ab"}, {"prompt": [[1, 2], [3]], "max_tokens": 4, "model": SERVER_MODEL}]
ALL_FIELDS = sorted(protocol.COMPLETION_FIELDS | protocol.CHAT_FIELDS) if protocol else []


def parse_either(generator, body, chat: bool):
    if chat:
        return protocol.parse_chat(body, generator, SERVER_MODEL, CHAT_TEMPLATE, MAX_SAMPLES)
    return protocol.parse_completion(body, generator, SERVER_MODEL, MAX_SAMPLES)


@needs_server
@pytest.mark.parametrize("field", ALL_FIELDS)
@settings(max_examples=settings.default.max_examples // 2)  # for each of the fields
@given(data=st.data())
def test_every_field_takes_hostile_values_with_a_4xx(parsing_generator, field, data):
    """One field at a time, in a body that is otherwise valid, on the endpoint(s) that have it."""
    value = data.draw(field_values, label=field)
    if field in protocol.COMPLETION_FIELDS:
        body = data.draw(st.sampled_from(COMPLETION_BASES)) | {field: value}
        assert_refused_or_runnable(lambda: parse_either(parsing_generator, body, chat=False))
    if field in protocol.CHAT_FIELDS:
        body = {"messages": [{"role": "user", "content": "ab"}]} | {field: value}
        assert_refused_or_runnable(lambda: parse_either(parsing_generator, body, chat=True))


@needs_server
def test_every_field_takes_every_edge_value_with_a_4xx(parsing_generator):
    for field in ALL_FIELDS:
        for value in EDGE_VALUES:
            if field in protocol.COMPLETION_FIELDS:
                for base in COMPLETION_BASES:
                    assert_refused_or_runnable(lambda: parse_either(parsing_generator, base | {field: value}, False))
            if field in protocol.CHAT_FIELDS:
                body = {"messages": [{"role": "user", "content": "ab"}], field: value}
                assert_refused_or_runnable(lambda: parse_either(parsing_generator, body, chat=True))


@needs_server
@given(data=st.data())
def test_completion_parser_answers_hostile_bodies_with_a_4xx(parsing_generator, data):
    body = data.draw(hostile_bodies(protocol.COMPLETION_FIELDS, data.draw(st.sampled_from(COMPLETION_BASES))))
    assert_refused_or_runnable(lambda: parse_either(parsing_generator, body, chat=False))


@needs_server
@given(data=st.data())
def test_chat_parser_answers_hostile_bodies_with_a_4xx(parsing_generator, data):
    base = {"messages": data.draw(chat_messages), "model": SERVER_MODEL}
    body = data.draw(hostile_bodies(protocol.CHAT_FIELDS, base))
    assert_refused_or_runnable(lambda: parse_either(parsing_generator, body, chat=True))


@needs_server
@given(data=st.data())
def test_request_bytes_are_parsed_or_refused_with_a_4xx(parsing_generator, data):
    """Raw bodies: JSON with bytes inserted (invalid UTF-8, deep nesting, an escaped lone surrogate)."""
    raw = bytearray(json.dumps(data.draw(hostile_bodies(protocol.COMPLETION_FIELDS, {"prompt": "ab"})),
                               ensure_ascii=data.draw(st.booleans())).encode("utf-8", "surrogatepass"))
    for _ in range(data.draw(st.integers(0, 3), label="edits")):
        at = data.draw(st.integers(0, len(raw)), label="at")
        raw[at:at] = data.draw(st.sampled_from([b"\xed\xa0\x80", b"\xff", b"[" * 3000, b"\\ud800", b"\xc3"]))
    assert_refused_or_runnable(lambda: parse_either(parsing_generator, protocol.parse_body(bytes(raw)), chat=False))
