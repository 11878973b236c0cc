"""The README's "Your own data" section holds a demo command per example file (the commands themselves run, as
written, in tests/e2e/test_readme.py); every relative link of the docs, with its #anchor, lands on a file and a
heading."""
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def own_data_commands():
    """The shell commands in the README's "## Your own data" section (```bash blocks, continuation lines joined)."""
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    section = text.split("## Your own data", 1)[1].split("\n## ", 1)[0]
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", section, flags=re.S):
        for cmd in block.replace("\\\n", " ").splitlines():
            if cmd.strip() and "/path/to/" not in cmd:  # the 8-GPU example names a folder of the reader's
                commands.append(" ".join(cmd.split()))
    return commands


COMMANDS = own_data_commands()


def test_the_section_has_a_demo_command_per_example_file():
    for name in sorted(os.listdir(os.path.join(ROOT, "examples"))):
        if name.endswith(".jsonl"):
            assert any(c.startswith("torchrun --standalone --nproc_per_node 2 train.py --config demo")
                       and f"--data examples/{name}" in c for c in COMMANDS), name


DOCS = ("README.md", "million/README.md", "bench/RESULTS.md", "bench/NOTES.md")


def anchors(path):
    """The anchors GitHub gives a Markdown file's headings: lower case, punctuation dropped, spaces as hyphens,
    a repeated heading numbered (-1, -2, ...); code blocks skipped."""
    seen, out = {}, set()
    text = re.sub(r"```.*?```", "", open(path, encoding="utf-8").read(), flags=re.S)
    for heading in re.findall(r"^#{1,6} +(.+?) *$", text, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower().replace("`", "")).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


@pytest.mark.parametrize("doc", DOCS)
def test_every_relative_link_and_anchor_resolves(doc):
    """Each [text](target) in the docs that is not a web address names a file of the repository, and its #anchor,
    if any, a heading of that file."""
    path = os.path.join(ROOT, doc)
    text = re.sub(r"```.*?```", "", open(path, encoding="utf-8").read(), flags=re.S)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        dest = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
        if not os.path.exists(dest):
            broken.append(f"{target}: no file")
        elif anchor and dest.endswith(".md") and anchor not in anchors(dest):
            broken.append(f"{target}: no heading")
    assert not broken, broken
