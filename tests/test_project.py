"""The promises of the README and pixi.toml: every task's command exists."""

import re
import shlex
import tomllib
from pathlib import Path

from srm_max.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]


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
