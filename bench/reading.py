"""What a reader of a run meets: the core's five files (wc -l) and, in the package, the functions the run calls
(traced while it runs: each function's whole definition, as a reader would open it; module-level code and
functions never called are not counted).

    python bench/reading.py                     # the demo with --fit auto planning for a GPU's capacities
    python bench/reading.py --out reading.json -- --config demo --max_steps 2     # any train.py flags after --

The default run is the 8-GPU recipe; on a CPU the nearest is the demo with --fit auto given a GPU's and a host's
capacities, so that plan.py and fit.py run as they do there. What a GPU run adds (kernels' FA4 and cuDNN paths,
the hub download) is not traced here.
"""
import argparse
import ast
import functools
import json
import os
import sys
import tempfile
import threading

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORE = ("loss.py", "model.py", "parallel.py", "data.py", "train.py")
DEFAULT_RUN = ["--config", "demo", "--max_steps", "2", "--fit", "auto", "--gpu_mem_gib", "0.05",
               "--host_mem_gib", "100"]


@functools.cache
def definitions(path: str) -> dict:
    """First line (of its decorators, if any) -> (first, last) line of every function defined in a file."""
    spans = {}
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            spans[node.lineno] = spans[first] = (first, node.end_lineno)
    return spans


def trace(argv: list) -> dict:
    """Run train.py's main on argv in this process -> {module file: sorted lines of the package functions called}."""
    package = os.path.join(ROOT, "million") + os.sep
    called = set()

    def hook(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(package):
            called.add((frame.f_code.co_filename, frame.f_code.co_firstlineno))
    sys.path.insert(0, ROOT)
    import train
    sys.setprofile(hook)
    threading.setprofile(hook)
    try:
        train.main(argv)
    except SystemExit as e:
        if e.code:
            raise
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    lines = {}
    for path, first in called:
        span = definitions(path).get(first)  # None: a lambda, a comprehension or module code (counted inside
        if span:                             # their function, or not at all)
            lines.setdefault(os.path.basename(path), set()).update(range(span[0], span[1] + 1))
    return {name: sorted(ls) for name, ls in sorted(lines.items())}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="write the counts here as JSON")
    ap.add_argument("train_args", nargs="*", help="train.py's flags (after --); default: " + " ".join(DEFAULT_RUN))
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        argv = a.train_args or DEFAULT_RUN
        per_module = {m: len(ls) for m, ls in trace([*argv, "--out_dir", os.path.join(tmp, "run")]).items()}
    core = {f: sum(1 for _ in open(os.path.join(ROOT, f))) for f in CORE}
    result = dict(argv=argv, core=core, core_lines=sum(core.values()), package=per_module,
                  package_lines=sum(per_module.values()))
    result["total_lines"] = result["core_lines"] + result["package_lines"]
    print(f"core: {result['core_lines']} lines in {len(core)} files; package: {result['package_lines']} lines of "
          f"the functions called, in {len(per_module)} modules: "
          + ", ".join(f"{m.removesuffix('.py')} {n}" for m, n in per_module.items())
          + f"; {result['total_lines']} in all")
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
