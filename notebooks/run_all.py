#!/usr/bin/env python3
"""Execute every notebook of this folder top to bottom, the way CI does.

Each notebook is stored as a jupytext "percent" script (NN_name.py) so its diff stays readable.
This runner converts each script to an in-memory notebook (jupytext), executes it in a fresh
python3 kernel (nbclient, 300 s per cell), writes the executed notebook (outputs and plots
included) to --out, prints its wall time, and exits non-zero if any cell of any notebook failed.

    python notebooks/run_all.py                       # all notebooks, executed copies in build-notebooks/
    python notebooks/run_all.py --out /tmp/nb 03 05   # only the notebooks whose names contain 03 or 05

Requirements: notebooks/requirements.txt (jupytext, nbclient, ipykernel, matplotlib) and an
installed `deltacp` package (pip install --no-build-isolation -e . from the repository root).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import pathlib
import sys
import time
import traceback

NOTEBOOK_DIR = pathlib.Path(__file__).resolve().parent


def notebook_scripts(selectors: list[str]) -> list[pathlib.Path]:
    """The NN_*.py notebook scripts in order, filtered by substrings when given."""
    scripts = sorted(p for p in NOTEBOOK_DIR.glob("[0-9][0-9]_*.py"))
    if selectors:
        scripts = [p for p in scripts if any(s in p.name for s in selectors)]
    return scripts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="build-notebooks", help="folder for the executed .ipynb files")
    parser.add_argument("--timeout", type=int, default=300, help="seconds allowed per cell")
    parser.add_argument("--kernel", default="python3", help="Jupyter kernel name")
    parser.add_argument("only", nargs="*", help="run only notebooks whose file names contain one of these")
    args = parser.parse_args(argv)

    try:
        import jupytext
        import nbformat
        from nbclient import NotebookClient
        from nbclient.exceptions import CellExecutionError
    except ImportError as exc:  # say what to install rather than a bare traceback
        print(f"run_all.py: missing requirement ({exc}); pip install -r notebooks/requirements.txt", file=sys.stderr)
        return 2

    # The kernel runs with this interpreter's environment: fail early, and clearly, without the package.
    if importlib.util.find_spec("deltacp") is None:
        print("run_all.py: the deltacp package is not importable; from the repository root run "
              "`pip install --no-build-isolation -e .` first", file=sys.stderr)
        return 2

    scripts = notebook_scripts(args.only)
    if not scripts:
        print(f"run_all.py: no notebook matched {args.only!r} in {NOTEBOOK_DIR}", file=sys.stderr)
        return 2

    out_dir = pathlib.Path(args.out).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    # The kernel inherits this environment. Keep BLAS single-threaded: the matrices are tiny and
    # CI machines are small and shared.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

    failures: list[str] = []
    total_start = time.perf_counter()
    for script in scripts:
        notebook = jupytext.read(script)
        client = NotebookClient(
            notebook,
            timeout=args.timeout,
            kernel_name=args.kernel,
            resources={"metadata": {"path": str(NOTEBOOK_DIR)}},  # cells run with cwd = notebooks/
        )
        start = time.perf_counter()
        status = "ok"
        try:
            client.execute()
        except CellExecutionError as exc:
            status = "FAILED"
            failures.append(script.name)
            print(str(exc), file=sys.stderr)
        except Exception:  # kernel died, timeout, ...: still a failure of this notebook, go on with the rest
            status = "FAILED"
            failures.append(script.name)
            traceback.print_exc()
        elapsed = time.perf_counter() - start
        target = out_dir / (script.stem + ".ipynb")
        nbformat.write(notebook, target)  # written even on failure: the failing cell's output is in it
        print(f"{script.name:40s} {status:6s} {elapsed:7.2f} s  -> {target}", flush=True)

    total = time.perf_counter() - total_start
    passed = len(scripts) - len(failures)
    print(f"total wall time {total:.2f} s")
    print(f"notebooks: {passed} passed, {len(failures)} failed")  # the plain closing line CI logs read
    if failures:
        print("failed: " + ", ".join(failures), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
