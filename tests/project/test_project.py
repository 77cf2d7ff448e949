"""The promises of the README, pixi.toml and the docs: every task's command exists, every
bench/results file a page names is there."""

import os
import re
import shlex
import tomllib
from pathlib import Path

from srm_max.cli import build_parser
from tests.support.paths import REPO_ROOT as ROOT


def subcommands() -> set[str]:
    parser = build_parser()
    action = next(a for a in parser._actions if a.dest == "command")
    return set(action.choices)


def check_command(command: str) -> None:
    words = shlex.split(command)
    if words[0] == "srm-max":
        assert words[1] in subcommands(), f"srm-max has no subcommand {words[1]!r}"
    elif words[0] in ("python", ".venv/bin/python"):
        if words[1] == "-m" and words[2].startswith("bench."):
            assert (ROOT / "bench" / f"{words[2].removeprefix('bench.')}.py").is_file(), f"{words[2]} does not exist"
        elif words[1] == "-m":
            assert words[2] in ("pytest", "srm_max.train"), words
        else:
            assert (ROOT / words[1]).is_file(), f"{words[1]} does not exist"
    elif words[0] == "bash":
        assert (ROOT / words[1]).is_file(), f"{words[1]} does not exist"
    else:
        raise AssertionError(f"unknown command {command!r}")


def test_pixi_tasks_exist():
    tasks = tomllib.loads((ROOT / "pixi.toml").read_text())["tasks"]
    assert {"test", "demo", "bench", "bench-h100"} <= set(tasks)
    for command in tasks.values():
        check_command(command)


def test_quick_start_commands_are_the_ci_and_pixi_commands():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)\n```", readme, re.S)
    run_main, run_tests = blocks[0], blocks[1]
    ci = (ROOT / ".ci" / "run").read_text()
    assert run_tests in ci, ".ci/run must run the README's test command"
    for part in (run_main + " && " + run_tests).split(" && "):
        check_command(part.replace(".venv/bin/srm-max", "srm-max"))


RESULT_LINK = re.compile(r"\]\(([^)\s]*bench/results/[^)\s]*)\)")
RESULT_NAME = re.compile(r"bench/results/[\w./-]+")
SKIP_DIRS = {"node_modules", "build", "dist", "__pycache__"}


def markdown_files() -> list[Path]:
    found = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in SKIP_DIRS]
        found += [Path(folder) / f for f in files if f.endswith(".md")]
    return found


def missing_results(md: Path, text: str) -> list[str]:
    """The bench/results/ files that ``text`` (the contents of ``md``) names but that do not
    exist: a link's target resolved from ``md``'s folder, any other mention from the root.
    Patterns such as ``cpu_decode[_bf16].json`` and the bare folder name no file."""
    links = RESULT_LINK.findall(text)
    missing = [t for t in links if not (md.parent / t.split("#")[0]).exists()]
    for m in RESULT_NAME.finditer(RESULT_LINK.sub("]()", text)):
        name = m.group().rstrip(".")
        is_pattern = m.string[m.end():m.end() + 1] in ("[", "{", "<", "*")
        if is_pattern or "." not in name.rsplit("/", 1)[-1]:
            continue
        if not (ROOT / name).exists():
            missing.append(name)
    return missing


def test_linked_bench_results_exist():
    """Docs name only the results that bench/results/ holds (older runs live in git history)."""
    problems = [f"{md.relative_to(ROOT)}: {name}" for md in markdown_files()
                for name in missing_results(md, md.read_text(encoding="utf-8"))]
    assert not problems, "docs name bench/results files that do not exist:\n" + "\n".join(problems)


def test_missing_bench_result_is_reported():
    md = ROOT / "docs" / "synthetic.md"
    text = ("[old](../bench/results/no_such_run.json), `bench/results/gone.json`, "
            "`bench/results/cpu_decode[_bf16].json`, `bench/results/`, "
            "[kept](../bench/results/soak.json)")
    assert missing_results(md, text) == ["../bench/results/no_such_run.json", "bench/results/gone.json"]


def test_a_command_whose_reader_goes_away_ends_without_a_traceback():
    """``srm-max ... | head``: the closed pipe ends the command with status 1, quietly."""
    import subprocess
    import sys

    chatty = ("import sys, srm_max.cli as cli; cli._verify = lambda args: [print('x' * 80) for _ in range(100_000)];"
              "sys.exit(cli.main(['verify', 'dir']))")
    proc = subprocess.run(f"{shlex.quote(sys.executable)} -c {shlex.quote(chatty)} | head -c 1", shell=True,
                          capture_output=True, cwd=ROOT, timeout=120, env=os.environ | {"PYTHONPATH": str(ROOT)})
    assert proc.stdout == b"x" and b"Traceback" not in proc.stderr, proc.stderr.decode()
