"""The README and the docs/ pages: a README that reads in minutes, links that lead somewhere, a layout
that names every module. Plain file reads: no torch, no fuyou import."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md")),
         *sorted((ROOT / "docs" / "history").glob("*.md"))]


def _prose(path):
    """(line number, line) outside fenced code blocks, inline code blanked unless it is a link's text."""
    fence = False
    for n, line in enumerate(path.read_text().split("\n"), 1):
        if line.lstrip().startswith("```"):
            fence = not fence
            continue
        if not fence:
            yield n, re.sub(r"`[^`]*`", lambda m: m.group() if "](" in m.group() else "``", line)


def _slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path):
    seen, found, fence = {}, set(), False
    for line in path.read_text().split("\n"):
        if line.lstrip().startswith("```"):
            fence = not fence
        m = None if fence else re.match(r"^#{1,6}\s+(.*?)\s*$", line)
        if m:
            s = _slug(m.group(1))
            n = seen.get(s, 0)
            found.add(s if n == 0 else f"{s}-{n}")
            seen[s] = n + 1
    return found


def test_every_relative_link_and_anchor_resolves():
    broken = []
    for page in PAGES:
        for n, line in _prose(page):
            for target in re.findall(r"!?\[[^\]]*\]\(([^)\s]+)\)", line):
                if re.match(r"^[a-z]+:", target):
                    continue
                file_part, _, anchor = target.partition("#")
                dest = (page.parent / file_part).resolve() if file_part else page
                where = f"{page.relative_to(ROOT)}:{n}: {target}"
                if not dest.exists():
                    broken.append(f"{where} (no such file)")
                elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                    broken.append(f"{where} (no such heading)")
    assert broken == []


def test_the_readme_is_short_and_starts_with_the_commands_ci_runs():
    readme = (ROOT / "README.md").read_text().split("\n")
    assert len(readme) <= 300, f"README.md has {len(readme)} lines; move reference material to docs/"
    assert readme[3:5] == ["", "```bash"] and readme[2].endswith("."), "one sentence says what the project is first"
    commands = [line for line in readme[5:readme.index("```", 5)] if not line.startswith("#")]
    assert len(commands) == 2 and commands[0].endswith("examples/lightning_finetune.py")
    ci = [line for line in (ROOT / ".ci" / "run").read_text().split("\n") if line.startswith("python3 -m venv")]
    assert ci == [commands[1]]


def test_the_readme_shows_a_first_run_of_each_example_and_links_every_docs_page():
    readme = (ROOT / "README.md").read_text()
    for example in ("examples/lightning_finetune.py", "examples/hf_trainer_finetune.py"):
        assert f".venv/bin/python {example}" in readme
        assert (ROOT / example).exists()
    unlinked = [p.name for p in sorted((ROOT / "docs").glob("*.md")) if f"(docs/{p.name}" not in readme]
    assert unlinked == []


def test_contributing_lists_every_module():
    text = (ROOT / "CONTRIBUTING.md").read_text()
    block = text[text.index("## Layout"):]
    block = block[block.index("```\n") + 4:]
    block = block[:block.index("```")]
    stack, listed = [], set()
    for line in block.split("\n"):
        m = re.match(r"^( *)(\S+)", line)
        if not m or len(m.group(1)) >= 25:  # blank, or a description's continuation
            continue
        stack = stack[:len(m.group(1)) // 2] + [m.group(2)]
        listed.add("".join(stack))
    modules = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "src" / "fuyou_strategy").rglob("*.py"))
    assert [m for m in modules if m not in listed] == []


def test_the_history_index_links_every_log_and_every_results_folder():
    history = ROOT / "docs" / "history"
    index = (history / "README.md").read_text()
    logs = [p.name for p in sorted(history.glob("*.md")) if p.name != "README.md"]
    results = [p.name + "/" if p.is_dir() else p.name for p in sorted((history / "results").iterdir())]
    unlisted = [n for n in logs if f"]({n})" not in index] + [n for n in results if f"](results/{n})" not in index]
    assert unlisted == []
    assert "(docs/history/README.md)" in (ROOT / "README.md").read_text()
    assert "(history/README.md)" in (ROOT / "docs" / "benchmarks.md").read_text()
