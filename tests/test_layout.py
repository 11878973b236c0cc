"""The layout the README promises: five files at the top beside folders, a core that imports and names no
extension, a train.py within its budget, and no top-level name that hides a package of the same name from
transformers or a user's own script run in this folder.

    python -m pytest tests/test_layout.py -q
"""
import ast
import importlib.util
import io
import os
import re
import subprocess
import sys
import tokenize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORE = ("loss.py", "model.py", "parallel.py", "data.py")
# the import roots the core may use: the standard library, these packages, and each other
CORE_IMPORTS = {"torch", "numpy", "tokenizers", "safetensors", "huggingface_hub", "pyarrow", "__future__",
                "loss", "model", "parallel", "data"}
# identifiers of the extensions, which the core must not name (checked on names, not on strings or comments)
EXTENSION = re.compile(r"moe|lora|chat|packing|packed|retriev|quantiz|nf4|expert|router|adapter|surviv|deltanet"
                       r"|million", re.I)
# import names of packages that transformers, peft, accelerate, torch, torchao, datasets and trl import
TAKEN = {"kernels", "evaluate", "datasets", "accelerate", "peft", "trl", "torchao", "transformers", "tokenizers",
         "safetensors", "huggingface_hub", "numpy", "torch", "triton", "fsspec", "jinja2", "tqdm", "regex",
         "packaging", "yaml", "psutil", "requests", "filelock", "sentencepiece", "bitsandbytes", "deepspeed"}


def top_level():
    return [n for n in os.listdir(ROOT) if not n.startswith(".") and n not in ("__pycache__", "runs", "out")]


def test_the_top_level_is_the_card_s():
    files = {n for n in top_level() if os.path.isfile(os.path.join(ROOT, n))}
    folders = {n for n in top_level() if os.path.isdir(os.path.join(ROOT, n))}
    assert files == {"README.md", "requirements.txt", "train.py", *CORE}, files
    assert folders <= {"million", "tests", "bench", "examples"}, folders


def test_no_top_level_name_hides_another_package():
    """A top-level name equal to an installed package's (or one the libraries above import) would be found first
    whenever this folder is on sys.path, as `kernels.py` once was by transformers' hub_kernels."""
    names = sorted({n[:-3] if n.endswith(".py") else n for n in top_level()} - {"README.md", "requirements.txt"})
    assert not set(names) & TAKEN, set(names) & TAKEN
    probe = ("import importlib.util, sys; names = sys.argv[1:]; "
             "print([n for n in names if importlib.util.find_spec(n) is not None])")
    p = subprocess.run([sys.executable, "-c", probe, *names], capture_output=True, text=True, cwd="/",
                       env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]", f"installed packages share a top-level name of this repository: {p.stdout}"


def test_the_core_imports_only_the_standard_library_its_packages_and_itself():
    allowed = CORE_IMPORTS | set(sys.stdlib_module_names)
    bad = []
    for f in CORE:
        for node in ast.walk(ast.parse(open(os.path.join(ROOT, f)).read())):
            if isinstance(node, ast.Import):
                roots = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                roots = [node.module.split(".")[0]]
            else:
                continue
            bad += [f"{f}:{node.lineno} imports {r}" for r in roots if r not in allowed]
    assert not bad, bad


def test_the_core_names_no_extension():
    bad = []
    for f in CORE:
        src = open(os.path.join(ROOT, f)).read()
        for tok in tokenize.generate_tokens(io.StringIO(src).readline):
            if tok.type == tokenize.NAME and EXTENSION.search(tok.string):
                bad.append(f"{f}:{tok.start[0]} {tok.string}")
    assert not bad, bad


def test_train_py_is_at_most_400_lines_and_no_function_over_60():
    src = open(os.path.join(ROOT, "train.py")).read()
    assert len(src.splitlines()) <= 400
    long = [(n.name, n.end_lineno - n.lineno + 1) for n in ast.walk(ast.parse(src))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > 60]
    assert not long, long


def test_train_py_imports_extensions_only_where_their_flags_are_read():
    """At the top, train.py imports the core and the run's infrastructure; every extension module is imported
    inside the function, at the line that reads its flag."""
    infrastructure = {"config", "evaluate", "hf", "kernels", "profiling", "resume", "metrics", "survival"}
    tree = ast.parse(open(os.path.join(ROOT, "train.py")).read())
    top = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "million":
            top |= {node.module.split(".")[1]} if "." in node.module else {a.name for a in node.names}
    assert top <= infrastructure, top - infrastructure
    assert importlib.util.find_spec("million") is not None
