"""A command whose output cannot be written (stdout on a full disk) says so in one line on
stderr and exits 1, with no traceback, not even from the interpreter's last flush; a reader
that went away (``| head``) ends it quietly."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# srm-max verify with its work replaced by printing a lot: the output path alone is under test
COMMAND = """
import sys
from srm_max import cli
cli._verify = lambda args: print("ok   " * 40000) or 0
sys.exit(cli.main(["verify", "some-dir"]))
"""


def run_with_stdout(stdout) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", COMMAND], stdout=stdout, stderr=subprocess.PIPE, text=True,
                          env=dict(os.environ), timeout=120)


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_output_to_a_full_disk_is_one_line_of_error():
    with open("/dev/full", "w") as full:
        done = run_with_stdout(full)
    assert done.returncode == 1
    assert done.stderr == "srm-max verify: error: cannot write the output to stdout: No space left on device\n"


def test_a_reader_that_went_away_ends_the_command_quietly():
    reader, writer = os.pipe()
    os.close(reader)
    with os.fdopen(writer, "w") as closed:
        done = run_with_stdout(closed)
    assert done.returncode == 1
    assert done.stderr == ""
