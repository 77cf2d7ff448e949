"""Compiled graphs shipped inside the package, for the embedded model's shape.

A cold compile of the CPU graphs that ``srm-max generate`` runs (``runtime.compiled``'s
kinds with the Mojo ops: prefill, sample, regroup and decode_steps, float32) takes minutes on a small CPU, so
the package carries them, compiled by ``scripts/build_shipped_graphs.py`` for
portable CPU targets: code compiled for ``x86-64-v3`` (AVX2 + FMA) runs on every
CPU of that level or above. They live in
``model/compiled/max-<MAX version>/<target>/``, each named as a cache entry
compiled for that target would be, ``<graph name>-<graph_key(..., target)>.mef``:
a shipped file serves only a graph with the same MLIR, kernel sources, MAX
version and graph-key salt.

When the local cache misses, ``install`` looks for a matching shipped file under
each target this process may run (best first), checks it once against a known
answer and copies it into the local cache, so every later run loads it as any
cache hit. The known answer (``known_answer.npz``) is what the float64 PyTorch
reference computes for the embedded model on a fixed prompt: prefill logits and
states, then greedy decode tokens and states; it was computed independently of
the code under test, so a miscompiled or mismatched file fails it. A file that
fails is not used and the graph compiles as usual.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import time
from pathlib import Path

import numpy as np

from .checkpoints.format import CONFIG_FILE, load_checkpoint
from .embedded import EMBEDDED_MODEL_DIR
from .files import atomic_file
from .models import registry
from .models.srm.engine import Engine
from .runtime import cpu_target
from .runtime.call_types import SamplingArrays
from .runtime.compiled import graph_kinds
from .runtime.precompile import GraphJob

log = logging.getLogger(__name__)

SHIPPED_DIR = EMBEDDED_MODEL_DIR / "compiled"
KNOWN_ANSWER = SHIPPED_DIR / "known_answer.npz"
# what scripts/build_shipped_graphs.py builds by default: AVX2 + FMA, which most
# x86-64 CPUs of the last decade have (x86-64-v4 would need an AVX-512 machine to check it)
DEFAULT_TARGETS = ("x86-64-v3",)
# the graphs the default CPU engine loads: with the Mojo ops every decode step runs in one op
KINDS = graph_kinds(steps_in_one_op=True)
# relative to max(1, max |expected|): the float32 engine against the float64 reference
RTOL = 1e-4


def version_dir(max_version: str | None = None) -> Path:
    """Where the graphs shipped for ``max_version`` (default: the installed MAX) are."""
    if max_version is None:
        from max import engine

        max_version = engine.__version__
    return SHIPPED_DIR / f"max-{max_version}"


def shipped_targets() -> list[str]:
    """The targets with graphs shipped for the installed MAX."""
    directory = version_dir()
    return sorted(p.name for p in directory.iterdir() if p.is_dir()) if directory.is_dir() else []


def usable_targets() -> list[str]:
    """The shipped targets whose code this process may load, best first.

    With ``SRM_MAX_CPU_TARGET`` (a virtual target) only that target: the code is
    meant to be exactly what it names. Otherwise every shipped x86-64 level the
    host's CPU supports."""
    from max.driver import get_virtual_cpu_target

    shipped = shipped_targets()
    virtual = get_virtual_cpu_target()
    if virtual:
        return [virtual] if virtual in shipped else []
    host = cpu_target.host_x86_level()
    runnable = [t for t in shipped if cpu_target.runs_on(t, host)]
    return sorted(runnable, key=cpu_target.X86_LEVELS.index, reverse=True)


def embedded_jobs() -> list[GraphJob]:
    """The shipped graph jobs: the embedded model's shape, float32, CPU, Mojo ops."""
    config = registry.load_config(EMBEDDED_MODEL_DIR / CONFIG_FILE)
    return [registry.of(config).graph_job(kind, config, "float32", "cpu", kernels=True) for kind in KINDS]


def shipped_file(job: GraphJob, target: str) -> Path:
    """Where the graph of ``job`` compiled for ``target`` is (or would be) shipped."""
    # the name its cache entry has when compiled for ``target``
    return version_dir() / target / dataclasses.replace(job, cpu_target=target).mef_path().name


def install(jobs: list[GraphJob]) -> list[GraphJob]:
    """Put a checked shipped graph into the local cache for every job missing there
    that one matches; -> those jobs (the others still need compiling)."""
    shippable = set(embedded_jobs())
    remaining = [j for j in dict.fromkeys(jobs) if j in shippable and not j.cached()]
    if not remaining:
        return []
    installed: list[GraphJob] = []
    for target in usable_targets():
        found = {job: path for job in remaining if (path := shipped_file(job, target)).is_file()}
        if not found:
            continue
        t = time.perf_counter()
        problem = check(found)
        names = ", ".join(job.kind for job in found)
        if problem:
            log.warning("the shipped %s graphs compiled for %s fail their known-answer check (%s); "
                        "not using them", names, target, problem)
            continue
        cache = next(iter(found)).mef_path().parent
        try:
            for job, path in found.items():
                _copy_into_cache(path, job.mef_path())
                installed.append(job)
        except OSError as e:
            log.warning("cannot copy the shipped graphs into %s (%s)", cache, e)
            break
        log.info("using the shipped %s graphs compiled for %s (known answer checked in %.1f s), "
                 "now cached under %s", names, target, time.perf_counter() - t, cache)
        remaining = [j for j in remaining if j not in found]
        if not remaining:
            break
    remaining = [j for j in remaining if j not in installed]
    if remaining:
        log.info("no shipped compiled graph matches the %s graph%s here (shipped for MAX %s: %s; "
                 "usable on this CPU: %s)", ", ".join(j.kind for j in remaining), "s" if len(remaining) > 1 else "",
                 version_dir().name.removeprefix("max-"), ", ".join(shipped_targets()) or "none",
                 ", ".join(usable_targets()) or "none")
    return installed


def _copy_into_cache(src: Path, dst: Path) -> None:
    """Atomically, as compile_cache writes: a concurrent process never sees half a file."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(dst) as tmp:
        shutil.copyfile(src, tmp)


def check(files: dict[GraphJob, Path], answer: Path | None = None) -> str | None:
    """Run the compiled ``files`` (any of the shipped kinds) with the embedded model's
    weights on the known answer's prompt; -> None when every output matches, else
    what does not."""
    try:
        expected = dict(np.load(answer or KNOWN_ANSWER))
        return _check(files, expected)
    except Exception as e:  # a damaged file or a graph with other inputs: not usable
        return f"{type(e).__name__}: {e}"


def _check(files: dict[GraphJob, Path], expected: dict[str, np.ndarray]) -> str | None:
    from max import engine as max_engine

    class Checker(Engine):
        """An engine whose models are set by hand, and which decodes greedily with
        the decode_steps graph or the decode graph's loop, as told."""

        one_op = True

        @property
        def steps_in_one_op(self) -> bool:
            return self.one_op

    ckpt = load_checkpoint(EMBEDDED_MODEL_DIR)
    eng = Checker(ckpt.config, ckpt.weights, "float32", "cpu", kernels=True)
    for job, path in files.items():
        eng._models[job.kind] = eng.session.init(max_engine.read(path), weights_registry=eng.weights)

    prompt = expected["prompt_ids"].tolist()
    tokens = expected["tokens"]  # the first new token (from prefill), then the decoded ones
    problems = []

    def compare(what: str, got, want) -> None:
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        if got.shape != want.shape:
            problems.append(f"{what}: shape {got.shape}, expected {want.shape}")
            return
        err = float(np.abs(got - want).max()) / max(1.0, float(np.abs(want).max()))
        if not err <= RTOL:  # NaN fails too
            problems.append(f"{what}: relative error {err:.2g} > {RTOL}")

    if "prefill" in eng._models:
        res = eng.prefill([prompt])
        compare("prefill logits", eng.host(res.logits)[0], expected["logits"])
        compare("prefill states", eng.host(res.states), expected["states"])
        if int(res.next_ids[0]) != int(tokens[0]):
            problems.append(f"prefill: next token {int(res.next_ids[0])}, expected {int(tokens[0])}")
    if "sample" in eng._models:  # greedy and top-k 1 draws from the expected logits are their argmax
        logits = eng.to_device(np.stack([expected["logits"]] * 2).astype(np.float32))
        drawn = eng.draw(logits, [0, 1, 1], SamplingArrays(np.array([0, 1, 0.5], np.float32), np.array([0, 1, 1]),
                                                            np.ones(3, np.float32), np.arange(3, dtype=np.uint64)),
                         [len(prompt)] * 3)
        if drawn.tolist() != [int(tokens[0])] * 3:
            problems.append(f"sample: tokens {drawn.tolist()}, expected {[int(tokens[0])] * 3}")
    if "regroup" in eng._models:  # a gather: rows of the known states, forked and reordered
        pool, fresh = expected["states"], expected["decode_states"]
        got = eng.host(eng.regroup(eng.to_device(pool), eng.to_device(fresh), [1, 0, 1]))
        compare("regroup", got, np.concatenate([pool, fresh], axis=1)[:, [1, 0, 1]])
    if "prefill" in eng._models:  # the last position's log-probabilities are the known logits' log-softmax
        logits = np.asarray(expected["logits"], np.float64)
        log_softmax = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
        scored = eng.score([prompt], [prompt[1:] + [int(tokens[0])]], top_n=1)
        compare("score log-probability", scored.logprobs[0][-1:], log_softmax[int(tokens[0])][None])
        if int(scored.top_ids[0][-1, 0]) != int(tokens[0]):
            problems.append(f"score: top token {int(scored.top_ids[0][-1, 0])}, expected {int(tokens[0])}")
    steps = len(tokens) - 1
    for kind in ("decode", "decode_steps"):
        if kind not in eng._models:
            continue
        eng.one_op = kind == "decode_steps"
        res = eng.decode([int(tokens[0])], [len(prompt)], eng.to_device(expected["states"]),
                         SamplingArrays.greedy(1), steps=steps)
        if res.tokens[0].tolist() != tokens[1:].tolist():
            problems.append(f"{kind}: tokens {res.tokens[0].tolist()}, expected {tokens[1:].tolist()}")
        compare(f"{kind} states", eng.host(res.states), expected["decode_states"])
    return "; ".join(problems) or None


__all__ = ["DEFAULT_TARGETS", "KINDS", "KNOWN_ANSWER", "SHIPPED_DIR", "check", "embedded_jobs", "install",
           "shipped_file", "shipped_targets", "usable_targets", "version_dir"]
