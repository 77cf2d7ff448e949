"""Which CPU the MAX CPU kernels are compiled for.

By default MAX compiles CPU kernels for the host's own CPU. MAX 26.7's
``max.driver.set_virtual_cpu_target(name)`` compiles them for another LLVM CPU
instead (``x86-64-v3``: AVX2 + FMA, ``x86-64-v4``: AVX-512), so one machine can
build and test the code another machine will run. ``SRM_MAX_CPU_TARGET`` sets it
for this process and every compile worker it starts; it is applied when
``compile_cache`` is imported, before anything is compiled.

A compiled graph is only valid for the CPU it was compiled for, so the target
(or, without one, the host's identity) is part of every compiled graph's cache
key (``compile_cache.graph_key``).
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform

ENV = "SRM_MAX_CPU_TARGET"

# x86-64 micro-architecture levels, lowest first, by the CPU flags (Linux /proc/cpuinfo)
# that define them: a CPU runs code compiled for its level or any below it
_LEVEL_FLAGS = {
    "x86-64-v2": {"cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3"},
    "x86-64-v3": {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "movbe", "xsave"},
    "x86-64-v4": {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"},
}
X86_LEVELS = tuple(_LEVEL_FLAGS)


@functools.lru_cache(maxsize=None)
def _cpuinfo() -> tuple[str, frozenset[str]]:
    """(model name, flags) of the first CPU in /proc/cpuinfo; ("", {}) elsewhere."""
    model, flags = "", frozenset()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not model:
                    model = value.strip()
                elif key == "flags" and not flags:
                    flags = frozenset(value.split())
                if model and flags:
                    break
    except OSError:
        pass
    return model, flags


def host_x86_level() -> str | None:
    """The highest x86-64 level (``x86-64-v2`` .. ``x86-64-v4``) this CPU supports;
    None on other architectures or when the flags cannot be read."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    _, flags = _cpuinfo()
    for level in reversed(X86_LEVELS):
        if _LEVEL_FLAGS[level] <= flags:
            return level
    return None


def runs_on(level: str, host_level: str | None) -> bool:
    """Whether code compiled for the x86-64 ``level`` runs on a CPU of ``host_level``."""
    return level in X86_LEVELS and host_level in X86_LEVELS and X86_LEVELS.index(level) <= X86_LEVELS.index(host_level)


def requested() -> str:
    """The target ``SRM_MAX_CPU_TARGET`` asks for ("" = the host's own CPU)."""
    return os.environ.get(ENV, "").strip()


def apply_requested() -> None:
    """Compile CPU kernels for ``SRM_MAX_CPU_TARGET`` from now on, if it is set."""
    target = requested()
    if target:
        from max.driver import get_virtual_cpu_target, set_virtual_cpu_target

        if get_virtual_cpu_target() != target:
            set_virtual_cpu_target(target)


def current() -> str:
    """What compiled CPU code is valid for: the virtual target if one is set, else
    this host (its architecture, CPU model and flags, hashed)."""
    from max.driver import get_virtual_cpu_target

    target = get_virtual_cpu_target()
    if target:
        return target
    model, flags = _cpuinfo()
    digest = hashlib.sha256(f"{model}|{' '.join(sorted(flags))}".encode()).hexdigest()[:12]
    return f"host-{platform.machine()}-{digest}"


__all__ = ["ENV", "X86_LEVELS", "apply_requested", "current", "host_x86_level", "requested", "runs_on"]
