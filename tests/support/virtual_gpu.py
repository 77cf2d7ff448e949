"""Compile the Mojo mixer ops' GPU code without a GPU (MAX's virtual device mode): the
check that the GPU decode graph's ops build, for machines without a GPU.

``python -m tests.support.virtual_gpu --virtual-gpu sm_90a`` from the repository root,
in a fresh process: virtual device mode has to be set before any device is created.
The test session starts that process once its compiles up front are done (``start``), so
that it runs beside the tests, which leave a core idle; the test then waits for it
(``outcome``).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from srm_max.files import atomic_file
from srm_max.runtime.compile_cache import cache_dir
from srm_max.runtime.kernels import OP_STEP_FUNCTIONAL, kernel_library
from tests.support.op_graph_builders import scan_op
from tests.support.paths import REPO_ROOT

ARCH = "sm_90a"
TEST = "tests/models/srm/test_kernels.py::test_gpu_path_compiles_virtual_sm90a"
_child: tuple[subprocess.Popen, object] | None = None  # the compile's process and its output file


def skip_reason() -> str | None:
    """Why the check does not run here (None: it runs)."""
    if os.environ.get("SRM_MAX_SKIP_GPU_COMPILE"):
        return "SRM_MAX_SKIP_GPU_COMPILE is set"
    from max import driver

    if not hasattr(driver, "set_virtual_device_api"):
        return "this MAX has no virtual device mode"
    return None


def start() -> None:
    """Start the compile for ``ARCH`` in a child process, unless it has been started."""
    global _child
    if _child is None:
        out = tempfile.TemporaryFile()
        proc = subprocess.Popen([sys.executable, "-m", "tests.support.virtual_gpu", "--virtual-gpu", ARCH],
                                cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT)
        _child = (proc, out)


def outcome(timeout_s: float = 600) -> tuple[int, str]:
    """Wait for the compile (started now if it was not) -> (its exit code, its output)."""
    start()
    proc, out = _child
    proc.wait(timeout=timeout_s)
    out.seek(0)
    return proc.returncode, out.read().decode(errors="replace")


def compile_for_virtual_gpu(arch: str = ARCH, mef_out: Path | None = None) -> float:
    """Compile the mixer step's and the scan's GPU paths for ``arch`` without a GPU; returns seconds.

    Must run in a fresh process: virtual device mode has to be set before any
    device (including the CPU session above) is created. Raises RuntimeError
    with the compiler's message if the GPU code does not build. The compiled
    model is kept as ``cache_dir()/mef/srm_mixer_ops_gpu-<arch>-<kernels>.mef``
    (or ``mef_out``); if that file exists nothing is recompiled (returns 0.0).
    The ``.mef`` holds SM binaries for ``arch`` and cannot be loaded on a CPU.
    Run as ``python -m tests.support.virtual_gpu --virtual-gpu sm_90a``.
    """
    import time

    from max import engine

    lib = kernel_library()
    if mef_out is None:
        tag = hashlib.sha256(f"{engine.__version__}|{arch}|{lib.name}".encode()).hexdigest()[:16]
        mef_out = cache_dir() / "mef" / f"srm_mixer_ops_gpu-{arch}-{tag}.mef"
    if mef_out.exists():
        return 0.0

    from max import driver

    driver.set_virtual_device_api("cuda")
    driver.set_virtual_device_target_arch(arch)
    driver.set_virtual_device_count(1)
    from max.driver import Accelerator
    from max.dtype import DType
    from max.engine import InferenceSession
    from max.graph import DeviceRef, Graph, TensorType, ops

    acc, gpu = Accelerator(), DeviceRef.GPU()
    f32, i64 = DType.float32, DType.int64
    types = [
        TensorType(f32, ["B", "H", "hd"], gpu),  # state
        TensorType(f32, ["B", "H", "hd"], gpu),  # u
        TensorType(i64, ["B"], gpu),  # positions
        TensorType(f32, ["B2", "T", "H", "hd"], gpu),  # u (scan)
        TensorType(i64, ["B2"], gpu),  # lengths
        TensorType(i64, ["B2"], gpu),  # start
        TensorType(f32, ["B2", "H", "hd"], gpu),  # init
        TensorType(f32, ["H", "n"], gpu),
        TensorType(f32, ["H", "n"], gpu),
        TensorType(f32, ["H"], gpu),
    ]
    with Graph("srm_mixer_ops_gpu", input_types=types, custom_extensions=[lib]) as g:
        s, u, pos, us, lens, start, init, w, beta, lam = (v.tensor for v in g.inputs)
        yt = TensorType(f32, u.shape, gpu)
        y, ns = ops.custom(OP_STEP_FUNCTIONAL, device=gpu, values=[s, u, pos, w, beta, lam], out_types=[yt, yt])
        ys, fin = scan_op(us, lens, start, init, w, beta, lam, device=gpu)
        g.output(y.tensor, ns.tensor, ys.tensor, fin.tensor)
    t0 = time.perf_counter()
    try:
        compiled = InferenceSession(devices=[acc]).compile(g)
    except Exception as e:  # the compiler's message is in __cause__
        raise RuntimeError(f"GPU compile for {arch} failed: {e}\ncause: {e.__cause__}") from None
    seconds = time.perf_counter() - t0
    mef_out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(mef_out) as tmp:
        compiled.export_mef(str(tmp))
    return seconds


if __name__ == "__main__":  # pragma: no cover - used by the virtual-GPU test
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--virtual-gpu", default=ARCH, metavar="ARCH")
    ap.add_argument("--mef-out", type=Path, default=None)
    a = ap.parse_args()
    try:
        secs = compile_for_virtual_gpu(a.virtual_gpu, a.mef_out)
    except Exception as e:
        print(f"FAILED: {e}", flush=True)
        os._exit(1)  # sys.exit after a failed compile can abort (exit 134)
    print(f"OK {a.virtual_gpu} {secs:.1f}s", flush=True)
    os._exit(0)
