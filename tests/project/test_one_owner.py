"""Decisions written once: where a copy must exist (the Mojo side of a Python constant),
a test holds the copies equal; where none need exist, a test fails if one is written again."""

from __future__ import annotations

import ast
import re

from tests.support.paths import REPO_ROOT as ROOT


def mojo_uint64_constants(source: str) -> dict[str, int]:
    """``comptime NAME: UInt64 = 0x...`` lines of a Mojo file -> {NAME: value}."""
    return {name: int(value, 0) for name, value in
            re.findall(r"^comptime (\w+): UInt64 = (0x[0-9A-Fa-f]+|\d+)\s*(?:#.*)?$", source, re.MULTILINE)}


def test_the_mojo_constant_reader_sees_a_key():
    assert mojo_uint64_constants("comptime K0: UInt64 = 0x10  # a key\ncomptime N = 3\n") == {"K0": 16}


def test_the_sampler_keys_in_mojo_are_the_graphs():
    """mojo/row_sampler.mojo draws the same uniforms as graphs/sampler.py only with the same
    Squares keys; the Mojo side keeps its own copy, so the copies are compared here."""
    from srm_max.graphs.sampler import SQUARES_KEYS

    keys = mojo_uint64_constants((ROOT / "mojo" / "row_sampler.mojo").read_text())
    assert (keys["K0"], keys["K1"]) == SQUARES_KEYS


def test_a_changed_mojo_key_would_be_seen():
    from srm_max.graphs.sampler import SQUARES_KEYS

    source = (ROOT / "mojo" / "row_sampler.mojo").read_text().replace(f"0x{SQUARES_KEYS[1]:X}", "0x1234")
    keys = mojo_uint64_constants(source)
    assert (keys["K0"], keys["K1"]) != SQUARES_KEYS


PYTHON_SOURCES = ("python/srm_max", "graphs", "bench", "scripts")


def files_spelling(pattern: str, sources: dict[str, str]) -> list[str]:
    """The files among ``sources`` (path -> text) in which ``pattern`` matches."""
    return sorted(path for path, text in sources.items() if re.search(pattern, text))


def python_sources() -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text() for folder in PYTHON_SOURCES
            for p in (ROOT / folder).rglob("*.py")}


def test_the_spelling_check_sees_a_copy():
    sources = {"graphs/sampler.py": "K = 0xC8E4FD154CE32F6D", "serve/x.py": "k = np.uint64(0xc8e4fd154ce32f6d)"}
    assert files_spelling("(?i)0xC8E4FD154CE32F6D", sources) == ["graphs/sampler.py", "serve/x.py"]


def test_the_sampler_keys_are_written_once_in_python():
    from srm_max.graphs.sampler import SQUARES_KEYS

    for key in SQUARES_KEYS:
        assert files_spelling(f"(?i)0x{key:x}", python_sources()) == ["graphs/sampler.py"]


def test_the_seed_arithmetic_is_written_once():
    """seed + k mod 2**64 (the k-th sample's seed) is serve/sampling.py's nth_seed; a seed
    masked or reduced by 2**64 elsewhere, or a second constant for it, would be a copy."""
    copy = r"(?im)^.*seed.*(1 << 64|& 0xf{16}\b|& _U64)|^_?U64\w* = \(?1 << 64"
    synthetic = {"serve/a.py": "seed = (s + k) & 0xFFFFFFFFFFFFFFFF", "serve/b.py": "_U64 = (1 << 64) - 1",
                 "serve/c.py": "mask = (1 << 64) - 1  # a hash"}
    assert files_spelling(copy, synthetic) == ["serve/a.py", "serve/b.py"]
    assert files_spelling(copy, python_sources()) == ["python/srm_max/serve/sampling.py"]


def test_the_default_steps_per_call_is_written_once():
    """The package's default decode steps per engine call is serve/sampling.py's
    DEFAULT_STEPS_PER_CALL; a literal default above 1 for steps_per_call (or --steps-per-call)
    in the package would be a copy (1, a step per call, is stream's and SlotPool's own choice)."""
    copy = r"steps_per_call: int = (?!1\b)\d|steps-per-call\", type=int, default=(?!1\b)\d"
    synthetic = {"serve/a.py": "def f(steps_per_call: int = 8):", "serve/b.py": "def f(steps_per_call: int = S):",
                 "serve/c.py": "def stream(steps_per_call: int = 1):"}
    assert files_spelling(copy, synthetic) == ["serve/a.py"]
    package = {path: text for path, text in python_sources().items() if not path.startswith(("bench/", "scripts/"))}
    assert files_spelling(copy, package) == []


def test_integer_but_not_bool_is_written_once():
    """"An integer (or a number) but not a bool" is srm_max/scalars.py's; an isinstance check
    for int paired with one for bool elsewhere would be a copy."""
    copy = r"isinstance\([^)]*\bint\b[^)]*\)\)? (and not|or) isinstance\([^)]*\bbool"
    synthetic = {"a.py": "ok = isinstance(v, int) and not isinstance(v, bool)",
                 "b.py": "bad = not isinstance(v, (int, float)) or isinstance(v, bool)",
                 "c.py": "flag = isinstance(v, bool)"}
    assert files_spelling(copy, synthetic) == ["a.py", "b.py"]
    assert files_spelling(copy, python_sources()) == ["python/srm_max/scalars.py"]


def test_bfloat16_rounding_is_written_once():
    """float32 <-> bfloat16 bits (round to nearest even) is srm_max/bfloat16.py's; the
    checkpoint files and the engines' weights both ask it."""
    copy = r"0x7FFF|0x7fff|<< 16\)\.view\(np\.float32\)"
    assert files_spelling(copy, {"a.py": "r = bits + 0x7FFF + ((bits >> 16) & 1)", "b.py": "x = 1 << 16"}) == ["a.py"]
    assert files_spelling(copy, python_sources()) == ["python/srm_max/bfloat16.py"]


def test_the_tokenizer_is_read_and_checked_once():
    """Reading a tokenizer.json and holding it to the model's vocabulary is
    checkpoints/tokenizer.py's (convert and Generator both ask it)."""
    copy = r"get_vocab_size\(\) >|Tokenizer\.from_file"
    assert files_spelling(copy, {"a.py": "if tok.get_vocab_size() > V:", "b.py": "n = tok.get_vocab_size()"}) == ["a.py"]
    package = {path: text for path, text in python_sources().items() if path.startswith("python/srm_max/")}
    assert files_spelling(copy, package) == ["python/srm_max/checkpoints/tokenizer.py"]


def test_weight_shapes_are_checked_once():
    """Holding weights to their schema is srm_max/weight_shapes.py's (the checkpoint reader
    and the engines word it the same way)."""
    copy = r"but the config implies|for \w+, \w+ in expected\w*\.items\(\):"
    synthetic = {"a.py": "for key, shape in expected.items():\n    if key not in weights:",
                 "b.py": 'raise E(f"{k!r} has shape {s} but the config implies {t}")', "c.py": "missing = []"}
    assert files_spelling(copy, synthetic) == ["a.py", "b.py"]
    assert files_spelling(copy, python_sources()) == ["python/srm_max/weight_shapes.py"]


def registered_ops(mojo_sources: dict[str, str]) -> set[str]:
    """The op names ``@register("...")`` registers in the Mojo files (path -> text)."""
    return {name for text in mojo_sources.values() for name in re.findall(r'^@register\("(\w+)"\)', text, re.MULTILINE)}


def string_literals(source: str) -> set[str]:
    """Every string constant of a Python file."""
    return {node.value for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Constant)
            and isinstance(node.value, str)}


def test_the_op_name_readers_see_names():
    assert registered_ops({"a.mojo": '@register("srm_x")\nstruct X:\n    pass\n# @register("no")\n'}) == {"srm_x"}
    assert "srm_x" in string_literals('ops.custom("srm_x", device=d)\n"""docs name `srm_x`"""\n')
    assert "srm_y" not in string_literals('"""docs name srm_y in a sentence"""\n')


def test_every_op_name_is_a_mojo_registration_and_back():
    """graphs/op_names.py names exactly the ops mojo/ registers: a renamed op fails here, not
    in a graph compile minutes later."""
    from srm_max.graphs import op_names

    registered = registered_ops({str(p): p.read_text() for p in (ROOT / "mojo").glob("*.mojo")})
    assert len(op_names.ALL_OPS) == len(set(op_names.ALL_OPS))
    assert set(op_names.ALL_OPS) == registered


def ops_listed(text: str, pattern: str) -> set[str]:
    """The op names a listing names: each match of ``pattern``'s group."""
    return set(re.findall(pattern, text, re.MULTILINE))


def test_the_op_listings_name_every_registered_op():
    """mojo/__init__.mojo's list and docs/kernels.md's table name exactly the ops mojo/
    registers: a new op is not left out of either."""
    from srm_max.graphs import op_names

    package = ops_listed((ROOT / "mojo" / "__init__.mojo").read_text(), r"^    (\w+) +\(\w+\.mojo\)")
    table = ops_listed((ROOT / "docs" / "kernels.md").read_text(), r"^\| `(\w+)` \| \w+\.mojo \|")
    assert ops_listed("    srm_a   (a.mojo)  x\n  srm_b (b.mojo)\n", r"^    (\w+) +\(\w+\.mojo\)") == {"srm_a"}
    assert package == set(op_names.ALL_OPS)
    assert table == set(op_names.ALL_OPS)


def test_op_names_are_spelled_only_in_their_owner():
    """No graph or runtime module writes an op's name as a string of its own: each imports it
    from graphs/op_names.py."""
    from srm_max.graphs import op_names

    spelled = sorted(path for path, text in python_sources().items()
                     if path.startswith(("graphs/", "python/srm_max/")) and path != "graphs/op_names.py"
                     and string_literals(text) & set(op_names.ALL_OPS))
    assert spelled == []


def test_choices_are_written_by_their_owners():
    """The embedded-model fallback (embedded.py), the device and dtype names (runtime/device.py,
    and the stored dtypes of checkpoints/safetensors_io.py), the x86-64 levels
    (runtime/cpu_target.py) and the list of graph kinds (runtime/compiled.py) are each
    spelled by their owner only."""
    copies = {
        r"default_model_path\(\)": ["python/srm_max/embedded.py"],
        r"\"auto\", \"cpu\"|\"cpu\", \"gpu\"": ["python/srm_max/runtime/device.py"],
        r"\[\"float32\", \"bfloat16\"|\(\"float32\", \"bfloat16\"\)": [],
        r"\"x86-64-v2\"": ["python/srm_max/runtime/cpu_target.py"],
        r"\"prefill\", \"sample\", \"regroup\"": ["python/srm_max/runtime/compiled.py"],  # the graph kinds
    }
    synthetic = {"cli.py": 'g.add_argument("--device", default="auto", choices=["auto", "cpu", "gpu"])',
                 "run.py": 'if dtype in ("float32", "bfloat16"):', "gen.py": "path = default_model_path()"}
    assert files_spelling(r"\"auto\", \"cpu\"", synthetic) == ["cli.py"]
    assert files_spelling(r"\(\"float32\", \"bfloat16\"\)", synthetic) == ["run.py"]
    assert files_spelling(r"default_model_path\(\)", synthetic) == ["gen.py"]
    package = {path: text for path, text in python_sources().items() if path.startswith(("python/", "graphs/"))}
    assert {copy: files_spelling(copy, package) for copy in copies} == copies
