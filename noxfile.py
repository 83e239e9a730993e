"""Developer tasks: ``nox -s tests``, ``integration``, ``bench_check``, ``stress``, ``lint``,
``typecheck``, ``docs``, ``bench``, ``demo``.

CI (``.ci/run``) runs ``tests``, then ``integration`` and ``bench_check``: what the tests leave
out to stay short is checked there. ``tests`` is the README's test command: every guarantee
(exactly once, aligned tops, resume, lifecycle, faults, no leaks) on the whole pipeline, a few
dozen examples per property test. ``integration``: the whole jobs in processes of their own
(torchrun, the examples) and the optional clients (Lightning, Keras, JAX). ``bench_check``: every
benchmark at its ``--quick`` size. ``stress``: thousands of examples per property test.

Every session runs on the interpreter nox itself runs on (no ``python=`` pin), so the one
command ``python3 -m pip install "nox[uv]" && python3 -m nox -s tests`` works on any machine that
has Python 3.10+ and pip. Environments are made and filled by uv where it is installed (the
``nox[uv]`` extra brings it: the same wheels in seconds instead of minutes), by virtualenv and
pip otherwise. They live under ``.nox/`` and are reused between runs; the install step runs
every time, so a changed ``pyproject.toml`` is picked up.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

import nox
import nox.command

nox.needs_version = ">=2024.4.15"
nox.options.sessions = ["tests", "integration", "bench_check", "lint", "typecheck", "docs"]
nox.options.reuse_venv = "yes"
# uv creates environments and installs much faster where it is present; plain virtualenv
# (which ships with nox) everywhere else, so a machine with only pip needs nothing more.
nox.options.default_venv_backend = "uv|virtualenv"
# A tool that is not installed in the session's environment is an error, never a silent
# fallback to whatever happens to be on PATH.
nox.options.error_on_external_run = True

# Sessions marked "pip" stay on virtualenv and pip, uv or not: pip compiles every module it
# installs, and these sessions start many fresh interpreters (each benchmark, each job) under
# time limits of their own, where compiling numpy or anndata at the first import counts; only
# ``tests`` is held to a time budget, and there uv's speed pays (see ``test_env``).

# PyPI's newest torch pulls several GB of CUDA wheels; the bench compares against the CPU
# build that this project's machines keep as a local file, in a folder that pip's configuration
# names (find-links), which uv is told about (``uv_options``).
TORCH = "torch==2.13.0"


def _pip_find_links() -> list[str]:
    """The ``find-links`` locations of pip's configuration (its files and ``PIP_FIND_LINKS``), as
    pip itself reports them; none where nox's interpreter has no pip."""
    try:
        listed = subprocess.run(
            [sys.executable, "-m", "pip", "config", "list"],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    links: list[str] = []
    for line in listed.splitlines():
        key, _, value = line.partition("=")
        if key.endswith(".find-links"):
            links += [v for v in shlex.split(value.strip().strip("'\"")) if v not in links]
    return links


def uv_options(session: nox.Session) -> list[str]:
    """The ``--find-links`` of pip's configuration for uv, which does not read it, so that a uv
    session installs the wheels pip would find there (the local CPU build of torch); none for
    pip."""
    if session.venv_backend != "uv":
        return []
    return [arg for link in _pip_find_links() for arg in ("--find-links", link)]


def test_env(session: nox.Session) -> dict[str, str]:
    """The environment of a pytest run: faulthandler on (a hung test prints every thread's
    stack), and the compiled code of every module kept under the session's environment.

    uv, unlike pip, does not compile the packages it installs, and where
    ``PYTHONDONTWRITEBYTECODE`` is set Python does not save what it compiles either: every
    interpreter the tests start (pytest's workers, helper processes, scripts) would compile
    numpy, torch, h5py, ... again at each import. ``PYTHONPYCACHEPREFIX`` keeps the compiled
    code out of the checkout, in ``.nox``; each module is compiled once, when first imported
    (compiling all at install would compile much that the tests never import). pip's
    environments come compiled: there, nothing is changed."""
    env = {"PYTHONFAULTHANDLER": "1"}
    if session.venv_backend == "uv":
        env["PYTHONDONTWRITEBYTECODE"] = ""
        env["PYTHONPYCACHEPREFIX"] = os.path.join(session.virtualenv.location, "pycache")
    return env


def install_torch(session: nox.Session) -> None:
    """Install PyTorch (``TORCH``, see there) and torchdata (its ``StatefulDataLoader``)."""
    session.install(*uv_options(session), TORCH, "torchdata")


def install(session: nox.Session, *extras: str) -> None:
    """Install the project in development mode, with ``extras``, into the session's environment.

    Parameters
    ----------
    session
        The running nox session.
    *extras
        Names of ``[project.optional-dependencies]`` groups to install with it.
    """
    session.install(*uv_options(session), "-e", f".[{','.join(extras)}]" if extras else ".")


@nox.session
def tests(session: nox.Session) -> None:
    """Run the test suite (``nox -s tests -- -k shuffle`` passes arguments to pytest).

    On Linux the ``cuda12`` extra (CuPy) is installed too, GPU or not: without a GPU the tests
    then check asynchdf5 against the real CuPy that users install (its API, its error when no
    GPU is usable, that importing asynchdf5 does not import it); the ``gpu``-marked ones skip.
    Where CuPy cannot be installed (offline, no wheel for this Python), those tests skip too.

    The tests run in as many pytest-xdist workers as there are cores, four at most (each test
    runs a pipeline of threads of its own, so more workers than cores only wait); ``nox -s
    tests -- -n 0`` runs them in this one process. ``worksteal``: a worker that is done takes
    tests queued for the other, whose share may hold the long ones.
    """
    # PyTorch first, pinned: the CPU build on this project's machines (see TORCH); then the
    # torch extra is satisfied by it, and torchdata (StatefulDataLoader) comes on top. The
    # clients (Lightning, Keras 3, JAX) are tested in ``integration``, which installs them.
    install_torch(session)
    extras = ("test", "codecs", "remote", "torch", "pack", "sparse")
    if sys.platform != "linux":
        install(session, *extras)
    else:
        try:
            install(session, *extras, "cuda12")
        except nox.command.CommandFailed:
            session.warn("CuPy could not be installed: the tests against the real CuPy skip")
            install(session, *extras)
    session.install(*uv_options(session), "pytest-xdist")
    workers = ("-n", "auto", "--maxprocesses", "4", "--dist", "worksteal")
    session.run("pytest", *workers, *session.posargs, env=test_env(session))


@nox.session(venv_backend="virtualenv")  # pip: see above TORCH
def integration(session: nox.Session) -> None:
    """The tests marked ``integration`` (``pytest -m integration``), which ``tests`` leaves out:
    each starts interpreters of its own that import torch, Lightning or JAX, or a client's
    training loop. Data-parallel jobs under real ``torchrun`` (one and two streams) killed
    mid-epoch and resumed on as many and on more processes; DataLoader workers started by
    "spawn"; the examples as a user runs them; Lightning (a ``Trainer`` resumed mid-epoch, DDP
    on two processes), Keras 3 (on JAX and PyTorch) and JAX (four virtual devices, two
    processes), with their documentation pages. CI runs it after ``tests``."""
    install_torch(session)
    install(session, "test", "remote", "pack", "torch", "sparse", "lightning", "keras", "jax")
    session.run("pytest", "-m", "integration", *session.posargs, env=test_env(session))


@nox.session(venv_backend="virtualenv")  # pip: see above TORCH
def bench_check(session: nox.Session) -> None:
    """Every benchmark at its ``--quick`` size, each checked to write a well-formed result
    (the ``quick_benchmarks`` tests of ``tests/test_benchmarks.py``; their figures mean nothing
    at these sizes). CI runs it after ``tests``, which leaves it out to stay short."""
    install_torch(session)
    install(session, "test", "bench", "codecs", "remote", "torch", "sparse")
    session.run(
        "pytest",
        "tests/test_benchmarks.py",
        "-m",
        "quick_benchmarks",
        *session.posargs,
        env=test_env(session),
    )


@nox.session
def stress(session: nox.Session) -> None:
    """The property tests with thousands of examples (nightly-style).

    In ``nox -s tests`` they draw a few dozen (``tests/_helpers.examples``); here
    ``ASYNCHDF5_STRESS_EXAMPLES`` (default 2000): the whole-pipeline ones per backend, each
    under a deadline, so a configuration that hangs fails instead of freezing, the pure
    planner's, and the double Ctrl-C trials of the sync facade. ``nox -s stress -- -x`` stops at
    the first failure.
    """
    install(session, "test", "codecs")
    examples = os.environ.get("ASYNCHDF5_STRESS_EXAMPLES", "2000")
    session.run(
        "pytest",
        "tests/test_invariants.py",
        "tests/test_streams_invariants.py",
        "tests/test_plan.py",
        "tests/test_replan.py",
        "tests/test_sync.py",
        *session.posargs,
        env={**test_env(session), "ASYNCHDF5_STRESS_EXAMPLES": examples},
    )


@nox.session
def lint(session: nox.Session) -> None:
    """Check lint and formatting with ruff (``nox -s lint -- --fix`` fixes what it can), and the
    import contract: the pipeline's stages import only downward (``[tool.importlinter]``)."""
    session.install("ruff", "import-linter")
    session.install("--no-deps", "-e", ".")
    session.run("ruff", "check", *session.posargs, ".")
    session.run("ruff", "format", "--check", ".")
    session.run("lint-imports")


@nox.session(venv_backend="virtualenv")  # pip: see above TORCH
def typecheck(session: nox.Session) -> None:
    """Type-check the package, the tests and this file with ``mypy --strict``."""
    install_torch(session)
    install(
        session, "test", "codecs", "remote", "torch", "pack", "lightning", "keras", "jax", "sparse"
    )
    session.install("mypy", "nox")
    session.run("mypy", *session.posargs)


@nox.session
def docs(session: nox.Session) -> None:
    """Build the HTML documentation; any Sphinx warning fails the build."""
    install(session, "docs")
    # The table of keyword properties is generated from asynchdf5._config (HDF5_PROPERTIES).
    session.run(
        "python",
        "-c",
        "from asynchdf5._config import write_property_table as w; w('docs/properties.md')",
    )
    out = os.path.join("docs", "_build", "html")
    session.run("sphinx-build", "-W", "--keep-going", "-b", "html", "docs", out, *session.posargs)
    session.log(f"open {os.path.join(out, 'index.html')}")


@nox.session(venv_backend="virtualenv")  # pip: see above TORCH
def bench(session: nox.Session) -> None:
    """Run every benchmark (``python -m benchmarks run all``), one JSON file each under
    ``bench-results/``, and print their markdown; ``nox -s bench -- --quick`` runs toy sizes,
    other arguments go to ``run`` too (``nox -s bench -- --out DIR``)."""
    install(session, "bench", "codecs", "remote", "sparse")
    session.install(*uv_options(session), TORCH)
    session.run("python", "-m", "benchmarks", "run", "all", *session.posargs)


@nox.session
def demo(session: nox.Session) -> None:
    """Write a sample data set and stream shuffled epochs from it (``python -m asynchdf5 demo``)."""
    install(session, "cli")
    session.run("python", "-m", "asynchdf5", "demo", *session.posargs)
